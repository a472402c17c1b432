"""Triton kernel: causal attention of a fill chunk over its context read in place from the paged KV cache.

A chunk of ``n`` new tokens after ``num_cached`` cached ones (their K/V already written to the cache) attends
to keys ``[0, num_cached + i]`` for its row ``i``. Instead of gathering the whole context out of the cache
every layer (`server.engine.attention.gathered_prefill`), each program reads it through the block table,
tiled as FlashAttention tiles a prefill: a program owns one KV head and a tile of rows, the rows being
(token, query head of that KV head) pairs, so one pass over the keys serves every query head of the KV head
(GQA) and every token of the tile. Keys go by ``BLOCK_N`` through the decode kernels' online-softmax loop
(`triton_kernels._attend_tile`, base 2) with a causal bound per row.

This replaces the first in-place form, which ran the shared-prefix *decode* kernel with every row a decode
query over its own suffix: measured on an H100 3-8x slower than the gather (the rows did not share their
reads of the chunk's own keys). Plain pointer arithmetic (no block pointers), so it runs in the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_kernels import LOG2E, _attend_tile, _check, _dot_precision, _dot_width

__all__ = ["paged_prefill_attention"]

ROWS = 64  # (token, head) rows per program
BLOCK_N = 64  # keys per loop iteration


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    out_ptr,
    num_cached,
    num_tokens,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Program (tile of TOKENS tokens, KV head): its rows are the tile's tokens x that head's GROUP heads."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    token = tile * TOKENS + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    m_mask = (offs_m < TOKENS * GROUP) & (token < num_tokens)
    d_mask = offs_d < HEAD_DIM
    io_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    visible = num_cached + token + 1  # row i sees keys [0, num_cached + i]
    end = num_cached + tl.minimum((tile + 1) * TOKENS, num_tokens)  # the tile's last row's bound

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no inf - inf in a fully masked row
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tile(
        q, acc, m_i, l_i, k_ptr, v_ptr, table_ptr, kv_head, 0, end,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
        PAGE, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PREC, visible, CAUSAL=True,
    )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_cached: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[n, H, D]`` at positions ``num_cached..`` over the context that
    ``block_table`` holds in the cache (see `kernels.paged_prefill_attention`)."""
    n, num_heads, head_dim, page, group = _check(q, k_cache, v_cache)
    if block_table.dim() != 1 or block_table.shape[0] * page < num_cached + n:
        raise ValueError(
            f"a block table of shape {tuple(block_table.shape)} (blocks of {page}) cannot hold "
            f"{num_cached} + {n} tokens"
        )
    q = q if q.stride(2) == 1 else q.contiguous()
    table = block_table if block_table.is_contiguous() else block_table.contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    tokens = max(1, ROWS // group)
    rows = max(16, triton.next_power_of_2(tokens * group))
    grid = (triton.cdiv(n, tokens), num_heads // group)
    _prefill_kernel[grid](
        q, k_cache, v_cache, table, out, num_cached, n,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        scale * LOG2E,
        GROUP=group, TOKENS=tokens, PAGE=page, HEAD_DIM=head_dim, BLOCK_M=rows, BLOCK_N=BLOCK_N,
        BLOCK_D=_dot_width(head_dim), DOT_PREC=_dot_precision(q), num_warps=4,
    )  # fmt: skip
    return out
