"""A fill chunk after cached tokens, one layer's attention two ways: the context gathered out of the paged
cache then causal attention over the copy (the engine's default), and read in place by the paged prefill
kernel (`server.engine.paged_prefill`, ``PARROT_PAGED_PREFILL=1``). Same inputs, outputs checked close,
calls interleaved (`kernel_timing.interleaved`: device time with the L2 flushed on CUDA, wall time on CPU),
medians. Off CUDA the in-place side is the kernels' reference (float64 loops): a harness check only."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.harness.kernel_timing import interleaved
from server.engine import paged_prefill
from server.engine.attention import PrefillChunk, gathered_prefill
from server.engine.config import ModelConfig

__all__ = ["paged_prefill_ab"]

BLOCK = 16


def paged_prefill_ab(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    cached: Sequence[int],
    chunks: Sequence[int],
    repeats: int = 20,
) -> list[dict[str, Any]]:
    """Per (cached tokens, chunk tokens): both ways' median ms and gathered / in place."""
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    scale, rows = dim**-0.5, []
    for num_cached in cached:
        for n in chunks:
            blocks = -(-(num_cached + n) // BLOCK)
            k_cache = torch.randn(blocks + 8, BLOCK, kv_heads, dim, dtype=dtype, device=device)
            table = torch.randperm(blocks + 8, device=device)[:blocks]
            q, v_cache = torch.randn(n, heads, dim, dtype=dtype, device=device), torch.randn_like(k_cache)
            chunk = PrefillChunk(0, n, num_cached, table)
            in_place = functools.partial(paged_prefill.attend, q, k_cache, v_cache, chunk, scale)
            gathered = functools.partial(gathered_prefill, q, k_cache, v_cache, chunk, scale)
            error = (in_place().float() - gathered().float()).abs().max().item()  # (also the warm-up)
            timed = interleaved([gathered, in_place], repeats, device).ms
            g_ms, p_ms = (statistics.median(ms) for ms in timed)
            rows.append(
                {"cached": num_cached, "chunk": n, "gathered_ms": g_ms, "in_place_ms": p_ms,
                 "gathered_over_in_place": g_ms / p_ms, "max_abs_error": error}
            )  # fmt: skip
    return rows
