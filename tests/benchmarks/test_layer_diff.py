"""`benchmarks.layer_diff` on CPU: our float32 layers against HF's in float64 err about as HF's own float32
does, in the fill and the decode steps; a layer whose output is off is the one it names; the GPU command's
``layer_diff`` step runs it and gathers its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import layer_diff
from benchmarks.harness import random_models
from benchmarks.harness.engine_models import engine_model

ROOT = Path(__file__).resolve().parents[2]
LAYERS = random_models.SHAPES["smollm2-135m"]["num_hidden_layers"]


def test_float32_layers_err_as_hf_s_own_and_a_wrong_one_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    errors = layer_diff.measure("smollm2-135m", "cpu", "float32", prompt_len=12, new=3)
    assert {(e.layer, e.sublayer, e.phase) for e in errors} == {
        (i, s, p) for i in range(LAYERS) for s in ("attn", "mlp") for p in ("fill", "decode")
    }
    assert all(0 < e.hf_own < 1e-5 and e.ours < 1e-5 for e in errors), max(errors, key=lambda e: e.ours)
    table, metrics = layer_diff.report(errors, ratio=1e3)
    assert metrics["first_over_layer"] == -1
    assert [line.split("|")[1].strip() for line in table.splitlines()[2:]] == [str(i) for i in range(LAYERS)]

    load_pair = random_models.load_pair

    def with_layer_7_off(*args: Any, **kwargs: Any) -> Any:
        pair = load_pair(*args, **kwargs)
        mlp = engine_model(pair.engine).model.decoder_layers[7].mlp
        mlp.register_forward_hook(lambda _m, _i, out: out * 1.001)  # ours only: HF's module is its own
        return pair

    monkeypatch.setattr(random_models, "load_pair", with_layer_7_off)
    errors = layer_diff.measure("smollm2-135m", "cpu", "float32", prompt_len=12, new=3)
    _, metrics = layer_diff.report(errors, ratio=1e3)
    assert metrics["first_over_layer"] == 7
    assert all(e.ratio < 1e3 for e in errors if e.layer < 7)


def test_the_gpu_command_runs_it_as_a_step(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    command = [sys.executable, "-m", "benchmarks.gpu", "--out", str(out), "--tiny", "--only", "layer_diff"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((out / "gpu.json").read_text())
    assert record["steps"]["layer_diff"]["status"] == "ok"
    assert {"layer_diff_fill_ratio_max", "layer_diff_first_over_layer"} <= set(record["metrics"])
    assert len(record["payloads"]["layer_diff"]["errors"]) == LAYERS * 2 * 2
