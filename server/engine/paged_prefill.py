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
from dataclasses import dataclass

import torch

import kernels

__all__ = ["ENABLE_ENV", "InPlaceTables", "attend", "enabled", "tables"]

ENABLE_ENV = "PARROT_PAGED_PREFILL"


def enabled(device: torch.device) -> bool:
    """Whether fills after cached tokens on ``device`` take this path (CUDA, switched on)."""
    return device.type == "cuda" and os.environ.get(ENABLE_ENV) == "1"


@dataclass(frozen=True)
class InPlaceTables:
    """One chunk's operands of `kernels.shared_prefix_decode_attention`, the same in every layer."""

    prefix_block_tables: torch.Tensor  # [1, whole cached blocks] int32
    prefix_lens: torch.Tensor  # [1] int32: those blocks' tokens
    group_of: torch.Tensor  # [n] int32, all 0
    suffix_block_tables: torch.Tensor  # [n, rest] int32: the blocks from the boundary on
    suffix_lens: torch.Tensor  # [n] int32: row i sees the tail up to and including itself


def tables(block_table: torch.Tensor, num_cached: int, n: int, block_size: int) -> InPlaceTables | None:
    """The operands for a chunk of ``n`` tokens after ``num_cached`` (``block_table`` covers both); None
    when no whole block is cached: nothing to read once for all rows (the caller gathers)."""
    whole = num_cached // block_size
    if whole == 0:
        return None
    boundary, table, device = whole * block_size, block_table.to(torch.int32), block_table.device
    tail = num_cached - boundary
    return InPlaceTables(
        table[:whole].unsqueeze(0),
        torch.full((1,), boundary, dtype=torch.int32, device=device),
        torch.zeros(n, dtype=torch.int32, device=device),
        table[whole:].unsqueeze(0).expand(n, -1).contiguous(),
        torch.arange(tail + 1, tail + n + 1, dtype=torch.int32, device=device),
    )


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunk: InPlaceTables,
    scale: float,
    *,
    backend: kernels.Backend = "auto",
) -> torch.Tensor:
    """Causal attention of the chunk ``q`` ``[n, H, D]`` over its context in the cache (its own K/V already
    written), through the operands `tables` built."""
    return kernels.shared_prefix_decode_attention(
        q,
        k_cache,
        v_cache,
        chunk.prefix_block_tables,
        chunk.prefix_lens,
        chunk.group_of,
        chunk.suffix_block_tables,
        chunk.suffix_lens,
        scale,
        backend=backend,
    )
