"""A fill chunk after cached tokens, one layer's attention two ways: the context gathered out of the paged
cache then SDPA (the engine's default), and read in place by the shared-prefix kernel
(`server.engine.paged_prefill`, ``PARROT_PAGED_PREFILL=1``). Same inputs, outputs checked close, medians of
device time (CUDA events; wall time on CPU)."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from server.engine import paged_prefill
from server.engine.attention import PrefillChunk, gathered_prefill
from server.engine.config import ModelConfig

__all__ = ["paged_prefill_ab"]

BLOCK = 16


def _median_ms(fn: Callable[[], torch.Tensor], repeats: int, cuda: bool) -> float:
    fn()  # warm-up (kernel compilation, allocator)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def _in_place(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    out = paged_prefill.attend(q, k, v, chunk.block_table, chunk.num_cached, scale)
    assert out is not None, "the case caches at least one whole block"
    return out


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
    scale, cuda, rows = dim**-0.5, device.type == "cuda", []
    for num_cached in cached:
        for n in chunks:
            blocks = -(-(num_cached + n) // BLOCK)
            k_cache = torch.randn(blocks + 8, BLOCK, kv_heads, dim, dtype=dtype, device=device)
            table = torch.randperm(blocks + 8, device=device)[:blocks]
            args = (
                torch.randn(n, heads, dim, dtype=dtype, device=device),
                k_cache,
                torch.randn_like(k_cache),
                PrefillChunk(0, n, num_cached, table),
                scale,
            )
            in_place, gathered = (
                functools.partial(_in_place, *args),
                functools.partial(gathered_prefill, *args),
            )
            error = (in_place().float() - gathered().float()).abs().max().item()
            g_ms, p_ms = _median_ms(gathered, repeats, cuda), _median_ms(in_place, repeats, cuda)
            rows.append(
                {"cached": num_cached, "chunk": n, "gathered_ms": g_ms, "in_place_ms": p_ms,
                 "gathered_over_in_place": g_ms / p_ms, "max_abs_error": error}
            )  # fmt: skip
    return rows
