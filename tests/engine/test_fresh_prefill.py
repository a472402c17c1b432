"""Fill chunks with nothing cached are attended in length groups, one batched causal call per group
(`server.engine.fresh_prefill`): the same outputs as one call per chunk, padding never seen."""

from __future__ import annotations

import pytest
import torch

from server.engine import fresh_prefill
from server.engine.attention import AttentionMetadata, PagedAttentionBackend, PrefillChunk
from server.engine.fresh_prefill import attend_causal, fresh_groups


def _chunks(lengths: list[int]) -> list[PrefillChunk]:
    out, start = [], 0
    for n in lengths:
        out.append(PrefillChunk(start, n, 0, torch.zeros(1, dtype=torch.int64)))
        start += n
    return out


def test_groups_by_length() -> None:
    chunks = _chunks([10, 40, 32, 31, 9, 12])
    assert [g.size for g in fresh_groups(chunks, torch.device("cpu"))] == [1] * 6  # CPU: one call each
    groups = fresh_groups(chunks, torch.device("cpu"), min_share=0.75)  # a GPU's grouping
    # Longest first; a chunk joins while it is >= 75% of its group's longest (31 >= 30, 9 >= 9).
    assert [(g.size, g.length) for g in groups] == [(3, 40), (3, 12)]
    first = groups[0]
    assert first.start == 10  # the 40-token chunk starts after the 10-token one
    rows = first.rows.tolist()
    assert rows[:40] == list(range(10, 50))
    assert rows[40:80] == list(range(50, 82)) + [50] * 8  # the 32-token chunk, padded with its first row
    assert rows[80:] == list(range(82, 113)) + [82] * 9
    assert first.valid.tolist() == list(range(72)) + list(range(80, 111))
    assert fresh_groups([], torch.device("cpu")) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_groups_equal_one_call_per_chunk(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fresh_prefill.MIN_SHARE_BY_DEVICE, "cpu", 0.75)  # group here as on a GPU
    lengths = [5, 17, 16, 3, 30, 29, 1]
    total, heads, kv_heads, dim = sum(lengths), 6, 2, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    chunks = _chunks(lengths)
    meta = AttentionMetadata(slot_mapping=torch.zeros(total, dtype=torch.int64), decode=None, prefills=chunks)
    cache = torch.zeros(1, 16, kv_heads, dim, dtype=dtype)
    out = PagedAttentionBackend()(q, k, v, cache, cache, meta, dim**-0.5, layer=0)
    assert meta.fresh is not None and any(g.size > 1 for g in meta.fresh)  # planned once, batched
    for c in chunks:
        rows = slice(c.token_start, c.token_start + c.num_tokens)
        expected = attend_causal(q[rows], k[rows], v[rows], 0, dim**-0.5)
        tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(out[rows], expected, **tol)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Bottom-right causal attention in float64, written out: q [B, H, n, D], k/v [B, KVH, ctx, D]."""
    n, ctx, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = qd @ kd.transpose(-1, -2) * scale
    allowed = torch.arange(ctx, device=q.device)[None] <= torch.arange(n, device=q.device)[:, None] + ctx - n
    return (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vd).to(q.dtype)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "ctx"), [(19, 19), (7, 40), (1, 33)])
@pytest.mark.parametrize("kv_heads", [2, 6])
def test_causal_attention_is_bottom_right(
    device: str, dtype: torch.dtype, n: int, ctx: int, kv_heads: int
) -> None:
    """Fresh chunks (n == ctx) and chunks after cached tokens, with and without GQA: on CUDA through
    FlashAttention where it applies, elsewhere through SDPA; both against the written-out attention."""
    gen = torch.Generator().manual_seed(n * 100 + ctx)
    q = torch.randn(3, 6, n, 64, generator=gen).to(device, dtype)
    k, v = (torch.randn(3, kv_heads, ctx, 64, generator=gen).to(device, dtype) for _ in range(2))
    out = fresh_prefill.causal_attention(q, k, v, 0.125)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, _reference(q, k, v, 0.125), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_flash_taken_only_on_cuda_half_types(device: str) -> None:
    """The fill's causal calls reach FlashAttention on CUDA in half types (never SDPA's per-shape cuDNN
    plans there); float32 and CPU keep SDPA."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        q = torch.zeros(2, 9, 5, 64, device=device, dtype=dtype)
        kv = torch.zeros(2, 3, 8, 64, device=device, dtype=dtype)
        expected = device == "cuda" and dtype != torch.float32
        assert fresh_prefill._flash_applies(q, kv, kv, gqa=True) is expected


def test_a_check_case_that_disagrees_with_sdpa_answers_false_and_says_what_runs_instead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    close = torch.ones(2, 3)
    assert fresh_prefill.agrees_with_sdpa("op", lambda: [(close, close + 1e-3)], "fills use X")
    with caplog.at_level("WARNING", logger="server.engine.fresh_prefill"):
        assert not fresh_prefill.agrees_with_sdpa(
            "op", lambda: [(close, close), (close, close + 1)], "fills use X"
        )
    assert "op differs from SDPA here: fills use X" in caplog.text
