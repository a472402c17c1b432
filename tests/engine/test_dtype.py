"""Which dtype an engine runs in: the device's default (`default_dtype`), except the random "tiny" model,
which stays float32 unless a dtype is asked for (bf16 would break its near-tied greedy picks per batch)."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.harness.engine_models import engine_model
from server.engine import EngineConfig, LLMEngine
from server.engine.config import default_dtype


def _weights_dtype(engine: LLMEngine) -> torch.dtype:
    return next(engine_model(engine).parameters()).dtype


def test_tiny_runs_in_float32_unless_a_dtype_is_given() -> None:
    with LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=16)) as engine:
        assert engine.config.dtype == "float32" and _weights_dtype(engine) == torch.float32
    asked = EngineConfig(num_kv_blocks=16, dtype="bfloat16")
    with LLMEngine.from_pretrained("tiny", asked) as engine:
        assert _weights_dtype(engine) == torch.bfloat16


def test_other_models_take_the_device_default(gqa_model: Path) -> None:
    with LLMEngine.from_pretrained(gqa_model, EngineConfig(num_kv_blocks=16)) as engine:
        assert engine.config.dtype is None
        assert _weights_dtype(engine) == default_dtype(torch.device("cpu"))
