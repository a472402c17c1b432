"""engine_throughput and its harness (`benchmarks.harness`: `vllm_generate`, `process_groups`,
`vllm_settings`, `hf_generate`, `generators`, `decode_ceiling`): the vLLM worker's protocol, the worker
driven through a pipe, its process group stopped with it (closed, SIGTERM, SIGINT), the HF export of the
engine's weights, the model record, and a tiny run with vLLM's side played by a fake worker (no vLLM needed).

A test against the real vLLM runs only where ``VLLM_PYTHON`` names an interpreter that has vLLM.
"""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from benchmarks import engine_throughput as et, vllm_worker as vw
from benchmarks.harness import (
    batch_timing,
    decode_ceiling,
    generators,
    hf_generate,
    prefill_ceiling,
    process_groups,
    vllm_generate,
    vllm_settings,
)
from benchmarks.harness.engine_models import engine_model, export_hf_folder, hf_config_dict
from benchmarks.harness.machine import CPU_FEATURES, REPO_ROOT
from server.engine import EngineConfig, LLMEngine
from server.engine.config import ModelConfig

# A stand-in for vLLM in the worker protocol: each request's tokens are its last prompt token repeated,
# and its time grows with the tokens made (so decode rates are finite and positive). With FAKE_CHILD_PIDFILE
# set it first starts a child that outlives it unless killed (as vLLM's EngineCore would) and writes its pid.
FAKE_WORKER = f"""
import os, subprocess, sys, time
sys.path.insert(0, {str(REPO_ROOT)!r})
from benchmarks import vllm_worker as w

if os.environ.get("FAKE_CHILD_PIDFILE"):
    child = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    with open(os.environ["FAKE_CHILD_PIDFILE"], "w") as f:
        f.write(str(child.pid))

def generate(prompts, n):
    time.sleep(0.001 * n)
    return 0.001 * n + 0.0005 * len(prompts), [[p[-1]] * n for p in prompts]

out = w.protocol_stdout()
print("a log line on stdout must not reach the protocol", flush=True)
if "--fail" in sys.argv:
    w.send(out, {{"ready": False, "error": "no such model"}})
    sys.exit(1)
w.serve(generate, {{"vllm": "fake", "dtype": "bfloat16"}}, sys.stdin, out)
"""


def fake_generate(prompts: Sequence[list[int]], n: int) -> tuple[float, list[list[int]]]:
    return 0.5, [[p[0]] * n for p in prompts]


# ----------------------------------------------------------------------------------------------- worker side
def test_worker_arguments_turn_prefix_caching_off_and_pass_engine_args() -> None:
    args = vw.parse_args(
        [
            "--model",
            "/m",
            "--max-model-len",
            "640",
            "--max-num-seqs",
            "64",
            "--engine-args",
            '{"enforce_eager": true}',
        ]
    )
    assert args.dtype == "bfloat16"
    kwargs = vw.llm_kwargs(args)
    assert kwargs == {
        "model": "/m",
        "dtype": "bfloat16",
        "seed": 0,
        "enable_prefix_caching": False,
        "max_model_len": 640,
        "max_num_seqs": 64,
        "enforce_eager": True,
    }
    assert "max_model_len" not in vw.llm_kwargs(vw.parse_args(["--model", "/m"]))
    with pytest.raises(SystemExit):
        vw.parse_args(["--model", "/m", "--engine-args", "[1]"])


def test_worker_answers_generate_quit_and_errors() -> None:
    reply, stop = vw.handle({"op": "generate", "prompts": [[5, 6], [7]], "max_tokens": 3}, fake_generate)
    assert (reply, stop) == ({"ok": True, "seconds": 0.5, "token_ids": [[5, 5, 5], [7, 7, 7]]}, False)
    assert vw.handle({"op": "quit"}, fake_generate) == ({"ok": True}, True)
    for bad in (
        [1],
        {"op": "nope"},
        {"op": "generate", "prompts": [], "max_tokens": 1},
        {"op": "generate", "prompts": [[]], "max_tokens": 1},
        {"op": "generate", "prompts": [["a"]], "max_tokens": 1},
        {"op": "generate", "prompts": [[1]], "max_tokens": 0},
        {"op": "generate", "prompts": [[1]], "max_tokens": True},
    ):
        reply, stop = vw.handle(bad, fake_generate)
        assert reply["ok"] is False and reply["error"] and not stop


def test_worker_serves_json_lines_until_quit() -> None:
    requests = [
        json.dumps({"op": "generate", "prompts": [[1, 2]], "max_tokens": 2}),
        "",
        "not json",
        json.dumps({"op": "quit"}),
        json.dumps({"op": "generate", "prompts": [[3]], "max_tokens": 1}),  # after quit: never read
    ]
    out = io.StringIO()
    vw.serve(fake_generate, {"vllm": "x"}, io.StringIO("\n".join(requests) + "\n"), out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"ready": True, "protocol": vw.PROTOCOL, "vllm": "x"}
    assert replies[1] == {"ok": True, "seconds": 0.5, "token_ids": [[1, 1]]}
    assert replies[2]["ok"] is False and "JSONDecodeError" in replies[2]["error"]
    assert replies[3] == {"ok": True}
    assert len(replies) == 4


def test_worker_imports_only_the_standard_library() -> None:
    """The worker runs in vLLM's virtualenv, which has none of this repository's dependencies."""
    code = (
        "import sys; before = set(sys.modules); import benchmarks.vllm_worker; "
        "extra = {m.split('.')[0] for m in set(sys.modules) - before} - {'benchmarks'}; "
        "bad = sorted(m for m in extra if m not in sys.stdlib_module_names); print(bad); sys.exit(bool(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ----------------------------------------------------------------------------------------------- parent side
@pytest.fixture
def fake_worker(tmp_path: Path) -> Path:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    return script


def test_worker_process_round_trip(fake_worker: Path, tmp_path: Path) -> None:
    worker = vllm_generate.VLLMWorker(
        sys.executable, tmp_path, dtype="bfloat16", max_model_len=64, max_num_seqs=4, script=fake_worker
    )
    try:
        assert worker.info["ready"] and worker.info["vllm"] == "fake"
        seconds, ids = worker.run([[4, 5], [6]], 3)
        assert ids == [[5, 5, 5], [6, 6, 6]] and seconds == pytest.approx(0.004)
        with pytest.raises(RuntimeError, match="unknown op"):
            worker.request({"op": "nope"})
        assert worker.run([[9]], 1)[1] == [[9]]  # still serving after an error
    finally:
        worker.close()
    assert worker._proc.returncode == 0
    worker.close()  # idempotent


def test_worker_that_cannot_load_is_an_error(fake_worker: Path, tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAKE_WORKER.replace('if "--fail" in sys.argv:', "if True:"))
    with pytest.raises(RuntimeError, match="no such model"):
        vllm_generate.VLLMWorker(
            sys.executable, tmp_path, dtype="bfloat16", max_model_len=8, max_num_seqs=1, script=script
        )


def test_worker_that_dies_is_an_error(tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    script.write_text("import sys; sys.exit(3)\n")
    with pytest.raises(RuntimeError, match="exited"):
        vllm_generate.VLLMWorker(
            sys.executable, tmp_path, dtype="bfloat16", max_model_len=8, max_num_seqs=1, script=script
        )


def gone(pid: int) -> bool:
    """The process has exited (a zombie that no one reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_closing_the_worker_stops_what_it_started(
    fake_worker: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pidfile = tmp_path / "child.pid"
    monkeypatch.setenv("FAKE_CHILD_PIDFILE", str(pidfile))
    worker = vllm_generate.VLLMWorker(
        sys.executable, tmp_path, dtype="bfloat16", max_model_len=8, max_num_seqs=1, script=fake_worker
    )
    child = int(pidfile.read_text())
    assert not gone(child)
    worker.close()  # the worker quits cleanly; its child would live on without the group stop
    assert wait_gone(child)
    assert signal.getsignal(signal.SIGTERM) is not process_groups._on_signal  # handlers restored


# The benchmark's side, as a separate process: a worker (with a child) started, then it waits to be killed.
# SIGINT as an interactive run has it: a suite started as a background job inherits it ignored.
PARENT = f"""
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {str(REPO_ROOT)!r})
from benchmarks.harness.vllm_generate import VLLMWorker

VLLMWorker(sys.executable, Path(sys.argv[2]), dtype="bfloat16", max_model_len=8, max_num_seqs=1,
           script=Path(sys.argv[1]))
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_benchmark_leaves_no_worker_processes_behind(
    signum: int, fake_worker: Path, tmp_path: Path
) -> None:
    pidfile = tmp_path / "child.pid"
    env = {**os.environ, "FAKE_CHILD_PIDFILE": str(pidfile)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(fake_worker), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        child = int(pidfile.read_text())
        worker = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
        parent.send_signal(signum)
        assert parent.wait(timeout=30) != 0
        assert wait_gone(child), "the worker's child (vLLM's EngineCore) outlived the benchmark"
        assert wait_gone(worker)
    finally:
        parent.kill()
        parent.wait()


def test_model_record_names_the_weights_without_a_path(tiny_engine: LLMEngine, tmp_path: Path) -> None:
    gguf = tmp_path / "SomeModel.Q4.gguf"
    gguf.write_bytes(b"\0" * 1234)  # resolved by name only: the record reads the file's size, not its content
    record = generators.model_record(str(gguf), tiny_engine)
    assert record["name"] == "SomeModel.Q4" and record["file"] == gguf.name and record["file_bytes"] == 1234
    assert str(tmp_path) not in json.dumps(record)
    assert record["parameters"] == sum(p.numel() for p in engine_model(tiny_engine).parameters())
    tiny = generators.model_record("tiny", tiny_engine)
    assert (tiny["name"], tiny["file"], tiny["file_bytes"]) == ("tiny", None, None)


def test_cpu_lists_and_worker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert vllm_settings.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert vllm_settings.cpu_list([3]) == "3"
    cfg = ModelConfig(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
    )
    # 64 x 656 tokens of 30 layers x 3 heads x 64 x K and V x 2 bytes: ~0.96 GiB, 1.25x room -> 2.
    assert vllm_settings.kv_cache_gib(cfg, "bfloat16", 64 * 656) == 2
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")  # the user's own setting wins over the default
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    env = vllm_settings.vllm_env(cfg, "bfloat16", 656, 64, ["LD_PRELOAD=/x.so", "VLLM_LOGGING_LEVEL=INFO"])
    assert "PYTHONPATH" not in env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "7" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["LD_PRELOAD"] == "/x.so" and env["VLLM_LOGGING_LEVEL"] == "INFO"
    assert env["VLLM_USE_AOT_COMPILE"] == "0"  # its artifacts do not load under torch 2.13
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # nothing polls beside the model's threads
    cores = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vllm_settings.cpu_list(cores)
    with pytest.raises(SystemExit):
        vllm_settings.vllm_env(cfg, "bfloat16", 656, 64, ["NOEQUALS"])


# ----------------------------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def tiny_engine() -> Iterator[LLMEngine]:
    with LLMEngine.from_pretrained("tiny", config=EngineConfig(device="cpu", num_kv_blocks=64)) as engine:
        yield engine


def test_export_writes_the_engines_weights_as_a_hf_folder(tiny_engine: LLMEngine, tmp_path: Path) -> None:
    folder = export_hf_folder(tiny_engine, tmp_path / "hf")
    assert ModelConfig.from_pretrained(folder) == tiny_engine.model_config
    hf = hf_generate.load_hf(folder, torch.float32)  # raises if any weight is missing
    ours = dict(engine_model(tiny_engine).named_parameters())
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer("hello world").input_ids == tiny_engine.tokenizer("hello world").input_ids


def test_hf_config_keeps_rope_scaling_in_both_forms() -> None:
    cfg = ModelConfig.from_hf_dict(
        {
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
            "eos_token_id": [1, 2],
        }
    )
    out = hf_config_dict(cfg, "bfloat16", pad_token_id=0)
    assert out["rope_parameters"] == {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}
    assert out["eos_token_id"] == [1, 2] and out["pad_token_id"] == 0
    assert ModelConfig.from_hf_dict(out) == cfg


def test_hf_folder_exports_only_when_the_model_is_not_a_folder(
    tiny_engine: LLMEngine, tmp_path: Path
) -> None:
    folder = tmp_path / "given"
    folder.mkdir()
    assert hf_generate.hf_folder(str(folder), tiny_engine, tmp_path, 0) == folder
    assert not (tmp_path / "hf-export").exists()
    exported = hf_generate.hf_folder(str(tmp_path / "model.gguf"), tiny_engine, tmp_path, 0)
    assert exported == tmp_path / "hf-export" and (exported / "model.safetensors").is_file()


def test_decode_weight_bytes_counts_a_tied_embedding_once(tiny_engine: LLMEngine) -> None:
    model = engine_model(tiny_engine)
    cfg = tiny_engine.model_config
    per_param = 4  # fp32
    total = sum(p.numel() for p in model.parameters()) * per_param
    # "tiny" is untied: of its embedding table a decode step reads one row.
    assert not cfg.tie_word_embeddings
    assert (
        decode_ceiling.decode_weight_bytes(model)
        == total - (cfg.vocab_size - 1) * cfg.hidden_size * per_param
    )


def test_the_prefill_ceiling_times_every_layers_projections(tiny_engine: LLMEngine) -> None:
    model = engine_model(tiny_engine)
    pairs = prefill_ceiling.layer_linears(model)
    assert len(pairs) == 4 * len(model.model.layers)
    ours = batch_timing.Rates.of([1.0], [2.0], prompt_tokens=1000, batch=1, new_tokens=2)
    c = prefill_ceiling.prefill_ceiling(model, ours, rows=16, repeats=1)
    assert c.flops_per_token == 2 * sum(w.numel() for w, _ in pairs)
    assert c.ceiling_tps == pytest.approx(c.linear_flops_per_s / c.flops_per_token)
    assert c.prefill_tps == 1000.0 and c.share == pytest.approx(1000.0 / c.ceiling_tps)


# ----------------------------------------------------------------------------------------------- whole run
def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, dict[str, str]]:
    et.main(argv)
    out = capsys.readouterr().out
    result = out.strip().splitlines()[-1]
    assert result.startswith("RESULT engine_throughput ")
    return out, dict(kv.split("=", 1) for kv in result.split()[2:])


def test_tiny_run_without_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, metrics = run_main(["--tiny", "--json", str(tmp_path / "r.json")], capsys)
    assert "ours/vLLM" not in out and not any("vllm" in k for k in metrics)
    assert float(metrics["mem_bw_gbs"]) > 0 and float(metrics["decode_b1_ceiling_tps"]) > 0
    assert "decode_ratio_b1" in metrics and "decode_b1_pct_ceiling" in metrics
    assert float(metrics["linear_tflops"]) > 0 and float(metrics["prefill_pct_ceiling_b4"]) > 0
    assert "Prefill ceiling: the model's linears run at" in out and "HF " in out
    payload = json.loads((tmp_path / "r.json").read_text())
    assert payload["vllm"] is None and payload["dtypes"] == {"ours": "float32", "hf": "float32"}
    # the OpenAI route (Parrot's /v1, its own engine) is timed beside the engine API: same greedy tokens
    assert set(payload["throughput"][0]["systems"]) == {"ours", "hf", "ours_v1"}
    assert payload["throughput"][0]["same_tokens"].keys() == {"hf", "ours_v1"}
    assert "ours /v1" in out
    for kind in ("decode", "prefill", "e2e"):  # a tiny run's decode may vanish in the noise: no rate then
        ratio = float(metrics[f"{kind}_v1_vs_engine_b4"])
        assert ratio > 0 or math.isnan(ratio)
    # achieved FLOP/s and bytes/s beside the machine's, and the CPU features they depend on
    assert float(metrics["peak_gflops"]) > 0 and float(metrics["decode_gflops_b4"]) > 0
    assert float(metrics["decode_gbs_b1"]) > 0 and float(metrics["prefill_gflops_b4"]) > 0
    assert "library peak" in out and "of bandwidth" in out
    roofline = payload["roofline"]
    assert [r["batch"] for r in roofline["rows"]] == list(et.TINY.batches)
    assert roofline["decode_flops_per_token"] > roofline["prefill_flops_per_token"] > 0
    features = payload["machine"]["cpu_features"]
    assert set(features["flags"]) <= set(CPU_FEATURES) and features["torch_capability"]
    assert payload["decode_ceiling"]["weight_bytes"] > 0 and payload["prefill_ceiling"]["rows"] == 2048
    assert payload["model"]["name"] == "tiny" and payload["model"]["parameters"] > 0
    kv = payload["kv_memory"]
    assert kv["fork"]["blocks_used"] == kv["fork"]["blocks_expected"] == int(metrics["kv_blocks_fork"])
    assert (
        kv["no_fork"]["blocks_used"] == kv["no_fork"]["blocks_expected"] == int(metrics["kv_blocks_nofork"])
    )


def test_tiny_run_with_a_fake_vllm_worker(
    fake_worker: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_generate, "WORKER_SCRIPT", fake_worker)
    argv = [
        "--tiny",
        "--dtype",
        "bfloat16",
        "--vllm-python",
        sys.executable,
        "--no-openai",  # the fake worker has no api_server
        "--json",
        str(tmp_path / "r.json"),
    ]
    out, metrics = run_main(argv, capsys)
    assert "ours/vLLM" in out and "vLLM fake bfloat16" in out and "ours /v1" not in out
    for kind in ("decode", "prefill", "e2e"):
        for batch in et.TINY.batches:
            assert f"{kind}_vs_vllm_b{batch}" in metrics
    payload = json.loads((tmp_path / "r.json").read_text())
    assert payload["dtypes"] == {"ours": "bfloat16", "hf": "bfloat16", "vllm": "bfloat16"}
    assert payload["vllm"]["vllm"] == "fake"
    row = payload["throughput"][0]
    assert row["systems"]["vllm"]["decode_tps"]["value"] > 0 and 0 <= row["same_tokens"]["vllm"] <= 1
    assert payload["vllm"]["llm_kwargs"]["model"] == "tiny"  # the folder's name, not a path of this machine


# ----------------------------------------------------------------------------------------------- real vLLM
@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(not os.environ.get("VLLM_PYTHON"), reason="VLLM_PYTHON (a python with vllm) not set")
def test_real_vllm_generates_exactly_n_tokens_on_the_tiny_weights(
    tiny_engine: LLMEngine, tmp_path: Path
) -> None:
    folder = export_hf_folder(tiny_engine, tmp_path / "hf")
    worker = vllm_generate.VLLMWorker(
        os.environ["VLLM_PYTHON"],
        folder,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=2,
        engine_args={"enforce_eager": True},
        env=vllm_settings.vllm_env(tiny_engine.model_config, "float32", 64, 2),
        cwd=tmp_path,
    )
    try:
        assert worker.info["dtype"] == "float32"
        seconds, ids = worker.run([[5, 6, 7], [8, 9]], 4)
        assert seconds > 0 and [len(t) for t in ids] == [4, 4]
    finally:
        worker.close()
