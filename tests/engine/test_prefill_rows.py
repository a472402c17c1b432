"""Fill attention on CPU as rows of our decode kernel (`server.engine.prefill_rows`): the same outputs as
torch's causal attention for fresh and cached chunks beside decode rows, long chunks left to torch."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels
from server.engine import attention
from server.engine.attention import AttentionMetadata, DecodeBatch, PagedAttentionBackend, PrefillChunk
from server.engine.prefill_rows import MAX_CONTEXT, prefill_rows

BLOCK, HEADS, KV_HEADS, DIM = 16, 6, 2, 64


def _chunk(start: int, n: int, cached: int, first_block: int) -> PrefillChunk:
    blocks = -(-(cached + n) // BLOCK)
    return PrefillChunk(start, n, cached, torch.arange(first_block, first_block + blocks, dtype=torch.int64))


def test_rows_tables_and_lengths() -> None:
    chunks = [_chunk(2, 3, 0, 0), _chunk(5, 2, 16, 1), _chunk(7, 4, MAX_CONTEXT, 20)]  # the last is long
    rows = prefill_rows(chunks)
    assert rows is not None and rows.chunks == {0, 1}
    assert rows.rows == slice(2, 7)
    assert rows.context_lens.tolist() == [1, 2, 3, 17, 18]
    assert rows.block_tables.tolist() == [[0, 0]] * 3 + [[1, 2]] * 2  # padded with block 0, never read
    apart = prefill_rows([_chunk(0, 2, 0, 0), _chunk(2, 4, MAX_CONTEXT, 5), _chunk(6, 1, 3, 30)])
    assert apart is not None and apart.chunks == {0, 2}
    assert isinstance(apart.rows, torch.Tensor) and apart.rows.tolist() == [0, 1, 6]
    assert prefill_rows([_chunk(0, 4, MAX_CONTEXT, 0)]) is None


@pytest.mark.skipif(cpu_kernels.paged_decode_kernel() is None, reason="the CPU kernels could not be built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_rows_equal_torchs_causal_attention(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(40, BLOCK, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    # Two decode rows, a fresh chunk, a chunk after 30 cached tokens, a long one (torch), another fresh one.
    chunks = [
        _chunk(2, 20, 0, 0),
        _chunk(22, 10, 30, 2),
        _chunk(32, 12, MAX_CONTEXT, 6),
        _chunk(44, 5, 0, 30),
    ]
    total = 49
    q = torch.randn(total, HEADS, DIM, generator=gen).to(dtype)
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=gen).to(dtype) for _ in range(2))
    for c in chunks:  # the step's own K/V, as the model writes them before attention
        pos = torch.arange(c.num_cached, c.num_cached + c.num_tokens)
        rows = slice(c.token_start, c.token_start + c.num_tokens)
        slots = c.block_table[pos // BLOCK] * BLOCK + pos % BLOCK
        k_cache.view(-1, KV_HEADS, DIM)[slots] = k[rows]
        v_cache.view(-1, KV_HEADS, DIM)[slots] = v[rows]
    decode = DecodeBatch(
        torch.tensor([[32, 33], [34, 0]], dtype=torch.int32), torch.tensor([20, 9], dtype=torch.int32)
    )

    def run() -> tuple[torch.Tensor, AttentionMetadata]:
        meta = AttentionMetadata(torch.zeros(total, dtype=torch.int64), decode=decode, prefills=list(chunks))
        return PagedAttentionBackend()(q, k, v, k_cache, v_cache, meta, DIM**-0.5, layer=0), meta

    fused, meta = run()
    assert meta.fill_rows is not None and meta.fill_rows.chunks == {0, 1, 3}  # type: ignore[union-attr]
    monkeypatch.setattr(attention, "_fill_by_rows", lambda *args: frozenset())
    reference, _ = run()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(fused, reference, **tol)
