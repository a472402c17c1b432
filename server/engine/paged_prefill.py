"""Attention of a fill chunk after cached tokens, read in place from the paged KV cache (for CUDA).

`attention._prefill` gathers the chunk's whole context out of the cache into one tensor, every layer, then
runs causal attention over the copy. `attend` reads it in place instead, through
`kernels.paged_prefill_attention` (a FlashAttention-style Triton kernel over the block table: each program
a tile of the chunk's rows and one KV head, the keys read once for all its rows). The result equals the
gather's up to rounding.

Off unless ``PARROT_PAGED_PREFILL=1``: the first in-place form (the shared-prefix decode kernel, every row a
decode query) was 3-8x slower than the gather on an H100; this kernel is not measured on a GPU yet (issue
23: `benchmarks.gpu_steps --compare-paged-prefill` compares the two).
"""

from __future__ import annotations

from typing import Protocol

import torch

import kernels
from server.common.settings import PAGED_PREFILL

__all__ = ["attend", "enabled"]


class CachedChunk(Protocol):
    """A fill chunk after cached tokens (`server.engine.attention.PrefillChunk` is one)."""

    @property
    def num_cached(self) -> int: ...

    @property
    def block_table(self) -> torch.Tensor: ...


def enabled(device: torch.device) -> bool:
    """Whether fills after cached tokens on ``device`` take this path (CUDA, switched on)."""
    return device.type == "cuda" and PAGED_PREFILL.get()


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: CachedChunk,
    scale: float,
    *,
    backend: kernels.Backend = "auto",
) -> torch.Tensor:
    """Causal attention of the chunk ``q`` ``[n, H, D]`` over its context in the cache (its own K/V already
    written), read through its block table."""
    return kernels.paged_prefill_attention(
        q, k_cache, v_cache, chunk.block_table, chunk.num_cached, scale, backend=backend
    )
