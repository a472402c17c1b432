"""Open-loop arrivals: when requests arrive, and each one started at its time whatever the others do.

A cluster or scheduling experiment offers a stream of requests rather than one job: each request is sent at
its arrival time whether or not the earlier ones are done (open loop), so a system that falls behind
builds a queue instead of slowing the stream down. The same driver (`paced`) runs on the simulator's
virtual clock (`sim_runs.open_loop`) and on the wall clock of real engines (`wall_clock`).

* `arrival_times`: Poisson arrivals at any rate from one list of unit-rate gaps (request *i* arrives at
  the same point of the stream at every rate: common random numbers across rates and systems);
* `poisson_arrivals`: a given number of Poisson arrivals from a seed, the first at time 0;
* `enough_requests`: how many requests a stream needs so that `arrival_times` does not run out.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

__all__ = ["arrival_times", "enough_requests", "paced", "poisson_arrivals", "wall_clock"]

T = TypeVar("T")


def arrival_times(gaps: Iterable[float], rate: float, duration_s: float) -> list[float]:
    """Arrival times within ``duration_s`` at ``rate`` per second from unit-rate gaps (exponential(1) for
    Poisson arrivals): gap *i* scaled by 1/rate. Too few gaps for the duration: ValueError."""
    out: list[float] = []
    t = 0.0
    for gap in gaps:
        t += gap / rate
        if t > duration_s:
            return out
        out.append(t)
    raise ValueError(f"the gaps ran out after {len(out)} arrivals, short of {duration_s:g} s at {rate:g}/s")


def enough_requests(rate: float, duration_s: float) -> int:
    """Requests enough for Poisson arrivals at ``rate`` per second over ``duration_s``: the mean count,
    six standard deviations over it and 64 more (a margin the count of arrivals hardly ever exceeds)."""
    mean = rate * duration_s
    return int(mean + 6 * math.sqrt(mean) + 64)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times of a Poisson process at ``rate`` per second, the first at 0 (deterministic
    from ``seed``)."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def paced(
    calls: Iterable[tuple[float, Callable[[], Awaitable[T]]]], start: float, clock: Callable[[], float]
) -> list[T]:
    """Each ``(arrival, call)`` started at ``start + arrival`` on ``clock`` (the running loop's time, or
    the wall clock its sleeps follow), all concurrently; their results in order."""

    async def one(at: float, call: Callable[[], Awaitable[T]]) -> T:
        await asyncio.sleep(max(0.0, start + at - clock()))
        return await call()

    return list(await asyncio.gather(*(one(at, call) for at, call in calls)))


async def wall_clock(calls: Iterable[tuple[float, Callable[[], Awaitable[T]]]]) -> tuple[list[T], float]:
    """`paced` on the wall clock from now (arrivals in seconds from the call): the results in order and
    the makespan, from the start to the last result."""
    start = time.perf_counter()
    results = await paced(calls, start, time.perf_counter)
    return results, time.perf_counter() - start
