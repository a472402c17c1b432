"""KV memory: the exact high-water mark of the KV blocks a job used (DESIGN.md, "How performance is
measured").

Each engine counts the most blocks it has had in use (`EngineStats.blocks_peak`), not a sample; `peaked`
restarts that count before a job, after dropping what earlier runs kept (`measure.timed`'s cold start),
so the peak is the job's (plus whatever was still running when it began). Real engines and simulated ones
keep the same count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.harness.measure import Job, Run, timed
from benchmarks.harness.systems import Served

__all__ = ["peaked"]


async def peaked(served: Served, job: Job, clock: Callable[[], float] = time.perf_counter) -> tuple[Run, int]:
    """``job`` timed on ``served`` (`measure.timed`) and the most KV blocks in use meanwhile, summed over the
    system's engines (each engine's own peak: with several engines, an upper bound on their joint peak)."""
    await served.drop_kept_contexts()  # before the count restarts: what the job finds kept is not its peak
    for engine in served.engines:
        engine.reset_peak_blocks()
    run = await timed(served, job, clock, cold=False)
    return run, sum(int(engine.stats().blocks_peak) for engine in served.engines)
