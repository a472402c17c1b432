"""Fill attention on CPU as rows of the paged decode kernel: token i of a chunk is a query over its context's
first ``num_cached + i + 1`` cached tokens.

By the time attention runs, the step's K/V are in the cache, so a fill chunk needs nothing but its block
table: each of its tokens is one more "sequence" for `kernels.cpu_kernels.paged_decode_kernel`, with the
chunk's table and its own causal length. One kernel call then covers every short fill chunk of the
step, however many prompts it holds: torch's fused attention costs ~120 us per call at a 48-token prompt of
SmolLM2's shape (64 prompts: 30 layers x 64 calls per step), reads the cached part of a chunk only after
gathering it into a workspace, and computes the masked half of every causal block; the kernel reads each
row's keys in place and only up to its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from server.engine.fresh_prefill import step_rows


class FillChunk(Protocol):
    """A fill chunk as the attention metadata holds it (`server.engine.attention.PrefillChunk`)."""

    @property
    def token_start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_cached(self) -> int: ...

    @property
    def block_table(self) -> torch.Tensor: ...


# A chunk goes through the kernel while its context is at most this long: a row's keys are read one by one,
# so the work grows with the square of the chunk, where torch's fused attention runs GEMM tiles. SmolLM2,
# 2 cores, time to the first token, kernel for every chunk over torch above 160 tokens: bf16 64 prompts of
# 32-64 tokens 1.00x, 16 of 100-300 1.22x, 4 of 200-500 1.24x, 8 of 300-400 1.22x, 2 of 900-1,000 1.07x,
# 4 of 1,000-1,500 1.00x, one of ~2k 0.72x; fp32 1.05x at 100-500, 0.98x at 900-1,000, 0.69x at ~2k.
MAX_CONTEXT = 512
EVERY_CHUNK = 1 << 62  # `max_context` that takes every chunk (`EngineConfig.batch_invariant`)


@dataclass(frozen=True)
class PrefillRows:
    """Short fill chunks' tokens as decode-kernel rows; made once per step, read by every layer."""

    chunks: frozenset[int]  # which of the step's fill chunks are here (the others take torch's path)
    rows: slice | torch.Tensor  # their step rows: one slice where they follow each other, else [R] int64
    block_tables: torch.Tensor  # [R, W] int32: each row's chunk's table, padded with block 0 (never read)
    context_lens: torch.Tensor  # [R] int32: num_cached + i + 1 for the chunk's token i


def prefill_rows(chunks: Sequence[FillChunk], max_context: int = MAX_CONTEXT) -> PrefillRows | None:
    """The tokens of the chunks whose context is at most ``max_context`` as kernel rows; None if none is."""
    short = [i for i, c in enumerate(chunks) if c.num_cached + c.num_tokens <= max_context]
    if not short:
        return None
    picked = [chunks[i] for i in short]
    width = max(int(c.block_table.numel()) for c in picked)
    tables = torch.cat(
        [
            torch.nn.functional.pad(c.block_table.to(torch.int32), (0, width - c.block_table.numel()))
            .unsqueeze(0)
            .expand(c.num_tokens, width)
            for c in picked
        ]
    )
    lens = torch.cat(
        [torch.arange(c.num_cached + 1, c.num_cached + c.num_tokens + 1, dtype=torch.int32) for c in picked]
    )
    return PrefillRows(frozenset(short), step_rows(picked, tables.device), tables, lens)
