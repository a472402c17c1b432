"""The fresh-fill A/B of the GPU command (`benchmarks.harness.fill_ab`): both ways timed over the same step,
their outputs compared; off CUDA the groups alone, saying why."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import random_models
from benchmarks.harness.fill_ab import fresh_fill_ab, step_chunks
from server.engine import fresh_plan
from server.engine.config import ModelConfig
from tests.engine.test_fresh_plan import _per_chunk_flash

SMOLLM2 = ModelConfig.from_hf_dict(random_models.hf_config("smollm2-135m"))


def test_a_step_of_chunks_lies_back_to_back_within_its_lengths() -> None:
    chunks = step_chunks(6, 5, 9)
    assert all(5 <= c.num_tokens <= 9 and c.num_cached == 0 for c in chunks)
    assert [c.token_start for c in chunks] == [sum(c.num_tokens for c in chunks[:i]) for i in range(6)]
    assert [c.num_tokens for c in step_chunks(6, 5, 9)] == [c.num_tokens for c in chunks]  # seeded


def test_on_cpu_the_groups_are_timed_alone_and_the_row_says_why() -> None:
    (row,) = fresh_fill_ab(SMOLLM2, torch.float32, torch.device("cpu"), [3], (4, 8), repeats=2)
    assert row["varlen"] == "not taken on cpu in torch.float32"
    assert row["groups_wall_ms"] > 0 and "groups_over_varlen" not in row
    assert row["groups_step_ms"] == pytest.approx(row["groups_plan_ms"] + 30 * row["groups_wall_ms"])


def test_both_ways_agree_and_are_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the varlen call stood in for by per-chunk SDPA (as the engine's tests do off CUDA)."""
    monkeypatch.setattr(fresh_plan, "_varlen_applies", lambda q, k: True)
    monkeypatch.setattr(fresh_plan, "_varlen_flash", _per_chunk_flash)
    rows = fresh_fill_ab(SMOLLM2, torch.float32, torch.device("cpu"), [2, 5], (3, 7), repeats=2)
    assert [r["batch"] for r in rows] == [2, 5]
    for r in rows:
        assert r["max_abs_error"] < 1e-5
        assert r["groups_over_varlen"] == pytest.approx(r["groups_step_ms"] / r["varlen_step_ms"])
