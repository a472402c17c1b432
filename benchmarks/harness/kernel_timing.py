"""Timing kernels against each other in one process: calls interleaved repeat after repeat, each timed as
an eager caller sees it (wall time) and, on CUDA, as device time with the L2 cache flushed before it.

Interleaved so that drift in machine state (frequency, other load) hits every kernel alike. Imports torch
only: the kernel benchmarks time the kernels alone, without the engine loaded beside them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Timings", "device_ms", "interleaved", "wall_ms"]

FLUSH_BYTES = 1 << 30  # more than any GPU's L2 cache (an H100 has 50 MiB)


@dataclass
class Timings:
    """Milliseconds per repeat of each call, in the order the calls were given."""

    ms: list[list[float]]  # CUDA: device time, the L2 flushed first; CPU: the wall times
    wall_ms: list[list[float]]  # wall time of a call as an eager caller sees it, launch overhead included


def wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call of ``fn`` in milliseconds (device work included)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def device_ms(fn: Callable[[], torch.Tensor], flush: torch.Tensor) -> float:
    """Device time of one call of ``fn`` in milliseconds, the L2 cache flushed first (as `triton.testing`'s
    ``do_bench`` does); the flush keeps the GPU busy while the host enqueues ``fn``, so launch overhead
    stays out of the figure."""
    flush.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def interleaved(fns: Sequence[Callable[[], torch.Tensor]], repeats: int, device: torch.device) -> Timings:
    """``repeats`` rounds of: the wall time of each call in turn, then (CUDA) the device time of each."""
    wall: list[list[float]] = [[] for _ in fns]
    on_device: list[list[float]] = [[] for _ in fns]
    cuda = device.type == "cuda"
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device=device) if cuda else None
    for _ in range(repeats):
        for fn, times in zip(fns, wall, strict=True):
            times.append(wall_ms(fn, device))
        if flush is not None:
            for fn, times in zip(fns, on_device, strict=True):
                times.append(device_ms(fn, flush))
    return Timings(wall if flush is None else on_device, wall)
