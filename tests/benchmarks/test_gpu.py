"""The GPU measurement command (`benchmarks.gpu`) and its parts, checked where they can be on CPU: the steps'
orchestration and record, the random real-shape models, the tuning sweep's decisions and the page's GPU
section (from the committed H100 record)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from benchmarks import gpu, gpu_report, kernel_tuning
from benchmarks.harness import gpu_record, random_models
from benchmarks.report import render_page

ROOT = Path(__file__).resolve().parents[2]


def _run_gpu(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.gpu --out OUT --tiny ARGS`` on this machine."""
    command = [sys.executable, "-m", "benchmarks.gpu", "--out", str(out), "--tiny", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_two_steps_run_end_to_end_on_cpu(tmp_path: Path) -> None:
    out, archive = tmp_path / "gpu", tmp_path / "gpu.tgz"
    done = _run_gpu(out, "--only", "env", "kernels_bf16", "--archive", str(archive))
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / "gpu.json").read_text())
    assert set(record["steps"]) == {"env", "kernels_bf16"}
    assert all(s["status"] == "ok" for s in record["steps"].values())
    assert "kernel_speedup_b2_p256" in record["metrics"]  # the tiny shapes' figures, gathered
    assert record["env"]["torch"] == torch.__version__
    with tarfile.open(archive) as tar:
        assert "gpu/kernels_bf16.json" in tar.getnames()
    assert "kernels_bf16" in done.stdout  # the summary table, printed last


def test_the_steps_step_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    """`benchmarks.gpu_steps` at tiny sizes, with the torch-ops and paged-prefill comparisons: its payload and
    metrics land in the record, and the page renders its tables from a record's re-measurement section."""
    out = tmp_path / "gpu"
    done = _run_gpu(out, "--only", "steps")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / "gpu.json").read_text())
    steps = record["payloads"]["steps"]
    assert [(a["batch"], a["ops"]) for a in steps["anatomy"]] == [
        (1, "fused"),
        (4, "fused"),
        (1, "torch"),
        (4, "torch"),
    ]
    for a in steps["anatomy"]:
        assert a["step_ms"] > 0 and a["fill_ms"] > 0
        assert "server/engine/model.py" in a["python"]  # the engine thread's forward passes, profiled
    (group,) = steps["grouping"]
    assert group["grouped_steps"]["always"] > 0 and group["grouped_steps"]["never"] == 0
    assert {"steps_b1_step_ms", "steps_grouped_vs_graphed_b4_p64"} <= set(record["metrics"])
    # A fill after cached tokens both ways: gathered + SDPA and read in place agree.
    (prefill,) = steps["paged_prefill"]
    assert (prefill["cached"], prefill["chunk"]) == (64, 32) and prefill["max_abs_error"] < 1e-4
    assert prefill["gathered_ms"] > 0 and prefill["in_place_ms"] > 0
    assert "steps_prefill_gathered_over_in_place_c64_n32" in record["metrics"]
    # A step of fresh fills: on CPU the length groups alone, the row says why.
    (fill,) = steps["fresh_fill"]
    assert fill["shape"] == "smollm2-135m" and fill["batch"] == 4 and fill["groups_step_ms"] > 0
    assert fill["varlen"].startswith("not taken on cpu")
    section = "\n".join(gpu_report.section({"after_layer_kernels": {"payloads": {"steps": steps}}}))
    assert "| batch | layer ops | fill ms | step ms | device ms |" in section
    assert "auto grouped steps" in section
    assert "varlen FlashAttention call" in section and "| smollm2-135m |       4 |     48 |" in section


def test_the_engine_step_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    """`benchmarks.gpu_engine` at tiny sizes (float32 on CPU): every row holds the rates, and our tokens, HF
    teacher-forced over them, are its own argmax at every position (in float32 no near-tie parts them)."""
    out = tmp_path / "gpu"
    done = _run_gpu(out, "--only", "engine")
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / "gpu.json").read_text())
    (shape,) = record["payloads"]["engine"]["shapes"]
    assert [r["batch"] for r in shape["rows"]] == [1, 4]
    for r in shape["rows"]:
        assert r["ours"]["decode_tps"] > 0 and r["hf"]["decode_tps"] > 0
        assert r["forced_token_agree"] == r["forced_token_agree_hf_self"] == 1.0
        assert r["forced_margin_max_ulps"] == 0 and r["forced_requests_off"] == 0
    assert record["metrics"]["forced_token_agree_b4_smollm2-135m"] == 1.0
    section = "\n".join(gpu_report.section(record))
    assert "| forced tok (HF self) |" in section and "100.0% (100.0%)" in section


def test_a_step_over_its_time_is_stopped_and_recorded(tmp_path: Path) -> None:
    step = gpu.Step("sleepy", [sys.executable, "-c", "import time; time.sleep(30)"], limit_s=1)
    status = gpu.run_step(step, tmp_path, deadline=float("inf"))
    assert status["status"] == "timed out after 1 s"


def test_test_counts_from_a_cut_off_pytest_log(tmp_path: Path) -> None:
    (tmp_path / "tests.log").write_text(
        "tests/a.py::test_one PASSED [ 10%]\ntests/a.py::test_two FAILED [ 20%]\n"
        "tests/a.py::test_three SKIPPED (no) [ 30%]\nsome other line\n"
    )
    counts = gpu_record._log_counts(tmp_path / "tests.log")
    assert counts is not None
    assert (counts["tests"], counts["failures"], counts["skipped"]) == (3, 1, 1)
    assert counts["failed"] == ["tests/a.py::test_two"] and counts["incomplete"]
    (tmp_path / "x.log").write_text("RESULT kernels speedup_b8_p1024=0.6 ceiling=nan bad=x\n")
    assert gpu_record.result_metrics(tmp_path / "x.log") == {
        "speedup_b8_p1024": 0.6,
        "ceiling": pytest.approx(float("nan"), nan_ok=True),
    }


def test_random_model_shapes_and_shared_weights() -> None:
    # Parameter counts of the real models these shapes copy (from their configs).
    assert random_models.parameter_count("smollm2-135m") == 134_515_008
    assert round(random_models.parameter_count("llama-3.2-1b") / 1e9, 2) == 1.24
    assert round(random_models.parameter_count("llama-2-7b") / 1e9, 2) == 6.74
    assert random_models.kv_bytes_per_token("llama-2-7b", torch.bfloat16) == 512 * 1024
    with pytest.raises(ValueError, match="unknown model shape"):
        random_models.hf_config("llama-70b")


def test_tuning_decisions() -> None:
    rows = [
        {"setting": "BLOCK_N", "value": v, "plain_ms": p, "shared_ms": s}
        for v, p, s in ((32, 1.0, 1.0), (64, 0.8, 0.9), (128, 0.7, 1.5))
    ]
    assert kernel_tuning.best_values(rows) == {"BLOCK_N": 64}
    gate = [
        {"prefix": 1024, "batch": b, "speedup": x}
        for b, x in ((2, 0.5), (4, 1.1), (8, 0.9), (16, 1.2), (32, 1.5))
    ] + [{"prefix": 128, "batch": 2, "speedup": 0.4}]
    assert kernel_tuning.gate_crossover(gate) == {128: None, 1024: 16}


def test_page_has_the_gpu_section_from_the_committed_record() -> None:
    record = gpu_report.load(ROOT / "benchmarks" / "results")
    assert record is not None and "H100" in record["gpu"]
    for key in ("kernel_speedup_b32_p4096", "kernel_speedup_b64_p4096", "decode_ratio_vs_hf_b64"):
        assert key in record["metrics"]
    page = render_page({}, {}, record)
    section = page[page.index("## gpu") :]
    assert "| engine decode vs HF generate at batch 64 (7B shape)" in section
    assert f"{record['metrics']['decode_ratio_vs_hf_b64']:.2f}" in section
    assert "## gpu" not in render_page({}, {})
    assert gpu_report.load(ROOT / "tests") is None
    # Runs on other cards sit beside it, each goal's metric in its own column.
    (h200,) = [c for c in record["other_cards"] if c["gpu"] == "NVIDIA H200"]
    row = next(line for line in section.splitlines() if line.startswith("| `floor_ratio_b1_llama-2-7b`"))
    assert row.split("|")[3].strip() == f"{h200['metrics']['floor_ratio_b1_llama-2-7b']:.3g}" == "1.63"


def test_the_tests_step_runs_the_gpu_suites_without_the_moot_checks(tmp_path: Path) -> None:
    by_name = {s.name: s for s in gpu.steps(tmp_path, tiny=False, tests_k=gpu.DEFAULT_TESTS_K)}
    command = by_name["tests"].command
    assert command[command.index("-k") + 1] == "not compile_for_cuda and not import_does_not_load"
    assert "tests/engine/test_cuda_engine.py" in command and "tests/engine/test_cuda_graphs.py" in command
    assert "tests/kernels/test_layer_ops.py" in command
    assert by_name["tests"].env == {"PARROT_CPU_KERNELS": "0"}
    assert "--profile-shape" in by_name["engine"].command


def test_a_kernel_case_times_plain_decode_over_private_prefix_copies_too() -> None:
    """The baseline the traffic ceiling assumes (each sequence reading its own copy of the prefix) runs
    beside the shared-block one and gives the same attention; on CPU only when asked."""
    from benchmarks.harness.kernel_cases import run_case

    cpu = torch.device("cpu")
    row = run_case(3, 32, 16, 1, cpu, torch.float32, private=True)
    assert row.plain_private_ms > 0 and row.speedup_vs_private > 0
    assert row.max_abs_diff < 1e-4  # the copies hold the same keys and values
    plain = run_case(3, 32, 16, 1, cpu, torch.float32)
    assert plain.plain_private_ms != plain.plain_private_ms  # NaN: not measured on CPU by default
