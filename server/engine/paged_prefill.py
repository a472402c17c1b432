"""Attention of a fill chunk after cached tokens, read in place from the paged KV cache (for CUDA).

`attention._prefill` gathers the chunk's whole context out of the cache into one tensor, every layer, then
runs SDPA with a causal mask over the copy. `attend` reads it in place through the shared-prefix decode
kernel instead: the chunk's rows form one group whose shared prefix is the context's whole cached blocks
(read once for all rows, tiled like a GEMM), and each row's own suffix is the rest, from that block boundary
up to and including itself (causal). The result equals the gather's up to rounding.

Off unless ``PARROT_PAGED_PREFILL=1``: whether it beats SDPA over the gathered copy on a GPU is not measured
yet (issue 23: the next GPU run compares the two).
"""

from __future__ import annotations

import os

import torch

import kernels

__all__ = ["ENABLE_ENV", "attend", "enabled"]

ENABLE_ENV = "PARROT_PAGED_PREFILL"


def enabled(device: torch.device) -> bool:
    """Whether fills after cached tokens on ``device`` take this path (CUDA, switched on)."""
    return device.type == "cuda" and os.environ.get(ENABLE_ENV) == "1"


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_cached: int,
    scale: float,
    *,
    backend: kernels.Backend = "auto",
) -> torch.Tensor | None:
    """Causal attention of the chunk ``q`` ``[n, H, D]`` at positions ``num_cached..`` over its context in
    the cache (``block_table`` covers ``num_cached + n`` positions, the chunk's own K/V already written).
    None when no whole block is cached: nothing to read once for all rows (the caller gathers)."""
    n, block_size = q.shape[0], k_cache.shape[1]
    whole = num_cached // block_size
    if whole == 0:
        return None
    boundary = whole * block_size
    table = block_table.to(torch.int32)
    device = q.device
    return kernels.shared_prefix_decode_attention(
        q,
        k_cache,
        v_cache,
        table[:whole].unsqueeze(0),
        torch.full((1,), boundary, dtype=torch.int32, device=device),
        torch.zeros(n, dtype=torch.int32, device=device),
        table[whole:].unsqueeze(0).expand(n, -1).contiguous(),
        torch.arange(
            num_cached - boundary + 1, num_cached - boundary + n + 1, dtype=torch.int32, device=device
        ),
        scale,
        backend=backend,
    )
