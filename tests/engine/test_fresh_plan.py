"""A step's fill chunks with nothing cached in one variable-length FlashAttention call on CUDA
(`server.engine.fresh_plan`), length groups elsewhere: the same outputs as one call per chunk."""

from __future__ import annotations

import itertools

import pytest
import torch

from server.engine import fresh_plan
from server.engine.attention import AttentionMetadata, PagedAttentionBackend, PrefillChunk
from server.engine.fresh_plan import FreshVarlen, attend_fresh, fresh_varlen, plan_fresh
from server.engine.fresh_prefill import attend_causal


def _chunks(spans: list[tuple[int, int]]) -> list[PrefillChunk]:
    return [PrefillChunk(start, n, 0, torch.zeros(1, dtype=torch.int64)) for start, n in spans]


def _step(total: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: str) -> tuple:
    """q, k, v as the engine passes them: strided column views of one projection output."""
    gen = torch.Generator().manual_seed(total)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    q = qkv[:, : heads * dim].view(total, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(total, kv_heads, dim)
    return q, k, qkv[:, (heads + kv_heads) * dim :].view(total, kv_heads, dim)


def test_back_to_back_chunks_are_one_slice_of_rows() -> None:
    batch = fresh_varlen(_chunks([(13, 5), (3, 10), (18, 1)]), torch.device("cpu"))
    assert batch.rows == slice(3, 19)  # step-row order, whatever order the chunks came in
    assert batch.offsets.tolist() == [0, 10, 15, 16] and batch.offsets.dtype == torch.int32
    assert batch.longest == 10


def test_chunks_with_gaps_between_are_indexed_row_by_row() -> None:
    batch = fresh_varlen(_chunks([(0, 2), (5, 3)]), torch.device("cpu"))
    assert isinstance(batch.rows, torch.Tensor) and batch.rows.tolist() == [0, 1, 5, 6, 7]
    assert batch.offsets.tolist() == [0, 2, 5] and batch.longest == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_keeps_length_groups(dtype: torch.dtype) -> None:
    q, k, _ = _step(8, 4, 2, 16, dtype, "cpu")
    assert isinstance(plan_fresh(_chunks([(0, 3), (3, 5)]), q, k), list)
    assert not fresh_plan._varlen_applies(q, k)


def _per_chunk_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, longest: int, scale: float
) -> torch.Tensor:
    """What the varlen call computes, one SDPA call per run of rows: stands in for it off CUDA."""
    bounds = offsets.tolist()
    assert longest == max(b - a for a, b in itertools.pairwise(bounds))
    parts = [attend_causal(q[a:b], k[a:b], v[a:b], 0, scale) for a, b in itertools.pairwise(bounds)]
    return torch.cat(parts)


@pytest.mark.parametrize("spans", [[(0, 4), (4, 9), (13, 1)], [(2, 4), (9, 6), (6, 3)], [(1, 3), (8, 5)]])
def test_a_varlen_plan_writes_each_chunks_rows(
    spans: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's fill through a varlen plan (its kernel stood in for by per-chunk SDPA off CUDA): every
    chunk's rows equal its own causal attention, contiguous or not."""
    monkeypatch.setattr(fresh_plan, "_varlen_applies", lambda q, k: True)
    monkeypatch.setattr(fresh_plan, "_varlen_flash", _per_chunk_flash)
    total, heads, kv_heads, dim = 16, 6, 2, 16
    q, k, v = _step(total, heads, kv_heads, dim, torch.float32, "cpu")
    chunks = _chunks(spans)
    meta = AttentionMetadata(slot_mapping=torch.zeros(total, dtype=torch.int64), decode=None, prefills=chunks)
    cache = torch.zeros(1, 16, kv_heads, dim)
    out = PagedAttentionBackend()(q, k, v, cache, cache, meta, dim**-0.5, layer=0)
    assert isinstance(meta.fresh, FreshVarlen)
    for c in chunks:
        rows = slice(c.token_start, c.token_start + c.num_tokens)
        torch.testing.assert_close(out[rows], attend_causal(q[rows], k[rows], v[rows], 0, dim**-0.5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 3, 9])
def test_cuda_half_types_take_one_varlen_call_equal_to_one_call_per_chunk(
    dtype: torch.dtype, kv_heads: int
) -> None:
    heads, dim, spans = 9, 64, [(0, 37), (37, 1), (38, 200), (238, 64)]
    q, k, v = _step(302, heads, kv_heads, dim, dtype, "cuda")
    plan = plan_fresh(_chunks(spans), q, k)
    assert isinstance(plan, FreshVarlen) and plan.rows == slice(0, 302)
    out = torch.full_like(q, float("nan"))
    attend_fresh(q, k, v, plan, dim**-0.5, out)
    for start, n in spans:
        rows = slice(start, start + n)
        expected = attend_causal(q[rows], k[rows], v[rows], 0, dim**-0.5)
        torch.testing.assert_close(out[rows], expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("error", [RuntimeError("no kernel image"), TypeError("unexpected argument")])
def test_a_varlen_call_that_refuses_leaves_the_groups(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-time check answers False (and logs) when the op raises, as another torch's schema would."""

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise error

    monkeypatch.setattr(fresh_plan, "_varlen_flash", refuse)
    assert fresh_plan._varlen_checked.__wrapped__(torch.device("cpu"), torch.float32, 3, 16) is False
