"""Plain torch implementations of the attention kernels: the specification the fast paths are tested against.

Everything here loops over sequences and computes in float64, so it is slow but obviously correct. The
KV cache layout (per layer) is ``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``t`` of a
sequence lives in block ``block_table[t // block_size]`` at slot ``t % block_size``. Query head ``h`` reads
KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).

An empty key set gives output 0 and log-sum-exp ``-inf``, so an empty partial vanishes in a merge.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "attend",
    "gather_tokens",
    "merge_attention_states",
    "paged_decode_attention",
    "paged_prefill_attention",
    "shared_prefix_decode_attention",
]


def gather_tokens(cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` tokens of one sequence: ``[num_tokens, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    pos = torch.arange(num_tokens, device=cache.device)
    blocks = block_table.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query token over ``k``/``v`` ``[n, num_kv_heads, D]``.

    ``q`` is ``[H, D]``. Returns ``(out [H, D] float64, lse [H] float64)`` with the natural-log log-sum-exp
    of the scaled scores; ``n == 0`` gives zeros and ``-inf``.
    """
    num_heads, head_dim = q.shape
    n, num_kv_heads, _ = k.shape
    if n == 0:
        return (
            torch.zeros(num_heads, head_dim, dtype=torch.float64, device=q.device),
            torch.full((num_heads,), -math.inf, dtype=torch.float64, device=q.device),
        )
    group = num_heads // num_kv_heads
    k64 = k.double().repeat_interleave(group, dim=1)  # [n, H, D]
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k64) * scale
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[:, None])
    return torch.einsum("hn,nhd->hd", probs, v64), lse


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its paged KV. ``q``/result ``[B, H, D]``."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        o, _ = attend(
            q[b],
            gather_tokens(k_cache, block_tables[b], n),
            gather_tokens(v_cache, block_tables[b], n),
            scale,
        )
        out[b] = o.to(q.dtype)
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_cached: int,
    scale: float,
) -> torch.Tensor:
    """Row ``i`` of the chunk ``q`` ``[n, H, D]`` attends to the first ``num_cached + i + 1`` tokens of
    ``block_table`` (causal, its own K/V already in the cache)."""
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = num_cached + i + 1
        o, _ = attend(
            q[i], gather_tokens(k_cache, block_table, n), gather_tokens(v_cache, block_table, n), scale
        )
        out[i] = o.to(q.dtype)
    return out


def shared_prefix_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    group_of: torch.Tensor,
    suffix_block_tables: torch.Tensor,
    suffix_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sequence ``b`` attends to its group's prefix tokens followed by its own suffix tokens.

    ``group_of[b] == -1`` means no shared prefix: the suffix table holds the whole context.
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        g = int(group_of[b])
        ks, vs = [], []
        if g >= 0:
            n = int(prefix_lens[g])
            ks.append(gather_tokens(k_cache, prefix_block_tables[g], n))
            vs.append(gather_tokens(v_cache, prefix_block_tables[g], n))
        n = int(suffix_lens[b])
        ks.append(gather_tokens(k_cache, suffix_block_tables[b], n))
        vs.append(gather_tokens(v_cache, suffix_block_tables[b], n))
        o, _ = attend(q[b], torch.cat(ks), torch.cat(vs), scale)
        out[b] = o.to(q.dtype)
    return out


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attention partials over disjoint key sets.

    ``out_*`` are ``[..., D]``, ``lse_*`` the matching ``[...]`` natural-log log-sum-exps. Returns the
    output in ``out_a``'s dtype and the float32 log-sum-exp of the union; two empty partials give 0, ``-inf``.
    """
    la, lb = lse_a.double(), lse_b.double()
    m = torch.maximum(la, lb)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    total = wa + wb
    denom = torch.where(total > 0, total, torch.ones_like(total))
    # An empty partial's output is ignored whatever it holds (it may be uninitialised memory).
    part_a = torch.where(wa[..., None] > 0, out_a.double() * wa[..., None], 0.0)
    part_b = torch.where(wb[..., None] > 0, out_b.double() * wb[..., None], 0.0)
    out = (part_a + part_b) / denom[..., None]
    lse = torch.where(total > 0, m_safe + torch.log(denom), torch.full_like(m, -math.inf))
    return out.to(out_a.dtype), lse.float()
