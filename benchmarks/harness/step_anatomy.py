"""Measurements of our engine's decode steps for `benchmarks.gpu_steps`: a batch's step anatomy (wall time,
device time, the engine thread's Python) and the decode step of forks of one prefix per
``shared_prefix_decode`` mode."""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

import torch

from benchmarks.harness.generators import OurEngine
from benchmarks.harness.output import log
from benchmarks.harness.step_tables import MODES
from server.engine import SamplingParams

T = TypeVar("T")


class StepSizes(Protocol):
    anatomy_prompt: int
    anatomy_new: int
    suffix: int
    group_new: int
    repeats: int


def _decode_step_s(ours: OurEngine, since: int) -> float:
    """Mean wall time of the pure decode steps traced since index ``since`` (a generate's first step
    samples a fill's stored hidden state and runs no model: left out)."""
    trace = ours.engine.step_trace
    assert trace is not None
    steps = list(trace)[since:]
    times = [r.seconds for r in steps if r.features.prefill_tokens == 0 and r.features.decode_seqs > 0]
    return statistics.mean(times) if times else float("nan")


async def _fill(ours: OurEngine, prompts: list[list[int]]) -> list[int]:
    ids = ours.context_ids(len(prompts))
    await asyncio.gather(*(ours.engine.fill(c, p) for c, p in zip(ids, prompts, strict=True)))
    return ids


async def _decode(ours: OurEngine, ids: list[int], new: int) -> None:
    sampling = SamplingParams(max_tokens=new, ignore_eos=True)
    await asyncio.gather(*(ours.engine.generate(c, sampling) for c in ids))
    await asyncio.gather(*(ours.engine.free_context(c) for c in ids))


def anatomy(ours: OurEngine, cfg: StepSizes, batch: int, vocab: int, cuda: bool) -> dict[str, Any]:
    """A batch's decode steps: wall time, device time, and the engine thread's Python by own time."""
    prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(cfg.anatomy_prompt)] for i in range(batch)]
    new = cfg.anatomy_new
    ours.call(_decode(ours, ours.call(_fill(ours, prompts)), new))  # warm-up
    trace = ours.engine.step_trace
    assert trace is not None
    started = time.perf_counter()
    ids = ours.call(_fill(ours, prompts))
    if cuda:  # a fill answers once its kernels are queued (nothing is read back): wait for them
        torch.cuda.synchronize()
    fill_ms = 1000 * (time.perf_counter() - started)
    since = len(trace)
    ours.call(_decode(ours, ids, new))
    out: dict[str, Any] = {"batch": batch, "step_ms": 1000 * _decode_step_s(ours, since), "fill_ms": fill_ms}
    if cuda:
        ids = ours.call(_fill(ours, prompts))
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            ours.call(_decode(ours, ids, new))
        # Every kernel of the generate, over the steps that ran the model (all but the first).
        total_us = sum(e.self_device_time_total for e in prof.key_averages())
        out["device_ms"] = total_us / 1000 / max(1, new - 1)
        out["kernels"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
    ids, out["fill_python"] = _profiled(ours, _fill(ours, prompts))
    _, out["python"] = _profiled(ours, _decode(ours, ids, new))
    device_ms = out.get("device_ms", float("nan"))
    log(f"batch {batch}: fill {fill_ms:.1f} ms, step {out['step_ms']:.2f} ms, device {device_ms:.2f} ms")
    return out


def _profiled(ours: OurEngine, work: Coroutine[Any, Any, T]) -> tuple[T, str]:
    """``work``'s result, and the engine thread's Python functions meanwhile by own time (top 25)."""
    profiler = cProfile.Profile()
    # The engine runs its steps on its own thread; cProfile sees only the thread that enabled it.
    ours.call(ours.engine._run_on_thread(profiler.enable))
    try:
        result = ours.call(work)
    finally:
        ours.call(ours.engine._run_on_thread(profiler.disable))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return result, text.getvalue()


def grouping(ours: OurEngine, cfg: StepSizes, batch: int, prefix_len: int, vocab: int) -> dict[str, Any]:
    """Mean decode step of ``batch`` forks of one prefix, per ``shared_prefix_decode`` mode (interleaved)."""
    engine = ours.engine  # the mode is switched between runs: same weights and KV
    prefix = [(5 * j + 11) % (vocab - 3) + 3 for j in range(prefix_len)]
    suffixes = [[(3 * i + 7 * j) % (vocab - 3) + 3 for j in range(cfg.suffix)] for i in range(batch)]
    sampling = SamplingParams(max_tokens=cfg.group_new, ignore_eos=True)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    grouped: dict[str, int] = {}

    async def once() -> None:
        root, *ids = ours.context_ids(batch + 1)
        await ours.engine.fill(root, prefix)
        await asyncio.gather(*(ours.engine.fill(c, s, root) for c, s in zip(ids, suffixes, strict=True)))
        await asyncio.gather(*(ours.engine.generate(c, sampling) for c in ids))
        await asyncio.gather(*(ours.engine.free_context(c) for c in [root, *ids]))

    shipped = ours.call(engine.set_shared_prefix_decode(MODES[0]))
    try:
        for repeat in range(cfg.repeats + 1):  # the first round warms up (Triton compiles)
            for mode in MODES:
                ours.call(engine.set_shared_prefix_decode(mode))
                trace = engine.step_trace
                assert trace is not None
                since, before = len(trace), engine.stats().grouped_decode_steps
                ours.call(once())
                if repeat:
                    times[mode].append(_decode_step_s(ours, since))
                grouped[mode] = engine.stats().grouped_decode_steps - before
    finally:
        ours.call(engine.set_shared_prefix_decode(shipped))
    ms = {m: 1000 * statistics.median(t) for m, t in times.items()}
    row = {"batch": batch, "prefix": prefix_len, "step_ms": ms, "grouped_steps": grouped}
    row["grouped_vs_graphed"] = ms["never"] / ms["always"]
    log(f"b{batch} p{prefix_len}: " + ", ".join(f"{m} {v:.2f} ms" for m, v in ms.items()))
    return row
