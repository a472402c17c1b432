"""Fit a latency model to the real engine, and check the simulated engine against it.

`calibrate` runs a sweep of batch shapes (batch sizes x prompt lengths, each prefilled then decoded) on a
real `LLMEngine` built with ``EngineConfig(trace_steps=...)`` and returns its step trace;
`fit_latency_model` turns that into a `LatencyModel`. `validation_workload` is a different, small
application-shaped workload (a shared prefix forked by parallel calls, then a dependent call over their
outputs) that runs on any engine — real or `SimEngine` — so the simulated time can be compared with the
measured one (`benchmarks/sim_validation.py`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from server.engine import LLMEngine, SamplingParams
from server.engine.step_features import StepRecord

__all__ = ["WorkloadResult", "calibrate", "validation_workload"]


async def calibrate(
    engine: LLMEngine,
    batch_sizes: Sequence[int] = (1, 2, 4, 8, 16),
    prompt_lens: Sequence[int] = (32, 128, 384),
    new_tokens: int = 12,
    warmup: bool = True,
) -> list[StepRecord]:
    """Run every (batch size, prompt length) shape on ``engine`` and return the steps it traced.

    The engine must trace steps (``EngineConfig.trace_steps`` at least the number of steps this runs).
    ``warmup``: first run the sweep untraced (other prompts, two new tokens each), so one-time costs of a new
    shape (kernel compiles, attention plans, graph captures) stay out of the steps the latency model is fitted
    to: the simulator models steady-state steps. In the fifth H100 run's sweep the only step of its shape (a
    7,808-token fill after a cached chunk) took 936 ms where 8,192-token fills took 213.
    """
    if engine.step_trace is None:
        raise ValueError("calibrate needs an engine built with EngineConfig(trace_steps=N)")
    ids = itertools.count(1 << 30)  # context ids of their own, clear of anything the caller made
    shapes = list(itertools.product(batch_sizes, prompt_lens))
    if warmup:
        await _sweep(engine, shapes, ids, min(new_tokens, 2), salt=1)
    engine.step_trace.clear()
    await _sweep(engine, shapes, ids, new_tokens, salt=0)
    return list(engine.step_trace)


async def _sweep(
    engine: LLMEngine, shapes: Sequence[tuple[int, int]], ids: Iterator[int], new_tokens: int, salt: int
) -> None:
    """Each (batch, prompt length) shape in turn: its prompts filled together, then decoded together."""
    vocab = engine.vocab_size
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for batch, length in shapes:
        contexts = [next(ids) for _ in range(batch)]
        prompts = [
            [(7 * i + 13 * j + 5 * salt) % (vocab - 3) + 3 for j in range(length)] for i in range(batch)
        ]
        await asyncio.gather(*(engine.fill(c, p) for c, p in zip(contexts, prompts, strict=True)))
        await asyncio.gather(*(engine.generate(c, sampling) for c in contexts))
        for c in contexts:
            await engine.free_context(c)


@dataclass(frozen=True)
class WorkloadResult:
    """What `validation_workload` did: its duration on the engine's clock, and the exact work done."""

    seconds: float
    output_tokens: int
    prefill_tokens: int
    decode_tokens: int


async def validation_workload(
    engine: LLMEngine,
    *,
    prefix_len: int = 256,
    calls: int = 8,
    call_len: int = 96,
    new_tokens: int = 24,
    first_id: int = 1 << 31,
) -> WorkloadResult:
    """A small application on one engine: a shared prefix context, ``calls`` parallel calls forking it
    (each its own text, ``new_tokens`` generated), then one call over all their outputs. Timed with the
    running loop's clock (wall time on a real loop, virtual time under `server.sim.run`)."""
    loop = asyncio.get_running_loop()
    vocab = engine.vocab_size
    ids = itertools.count(first_id)
    before = engine.stats()
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    start = loop.time()
    prefix = next(ids)
    await engine.fill(prefix, [(5 * j) % (vocab - 3) + 3 for j in range(prefix_len)])

    async def call(i: int) -> list[int]:
        ctx = next(ids)
        await engine.fill(ctx, [(11 * i + 3 * j) % (vocab - 3) + 3 for j in range(call_len)], prefix)
        result = await engine.generate(ctx, sampling)
        await engine.free_context(ctx)
        return result.token_ids

    outputs = await asyncio.gather(*(call(i) for i in range(calls)))
    final = next(ids)
    await engine.fill(final, [t for out in outputs for t in out])
    last = await engine.generate(final, sampling)
    seconds = loop.time() - start
    for ctx in (final, prefix):
        await engine.free_context(ctx)
    after = engine.stats()
    return WorkloadResult(
        seconds,
        sum(len(o) for o in outputs) + len(last.token_ids),
        after.prefill_tokens_computed - before.prefill_tokens_computed,
        after.decode_tokens_computed - before.decode_tokens_computed,
    )
