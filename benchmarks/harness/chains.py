"""Load around a job: other users' requests kept in flight (`BackgroundLoad`), and several copies of a
job started at once on one system (`together`), as the chain-summary experiments (paper Fig. 12) need.

A lone job shows what a system does for one user; these two show what it does for one user among many:
a busy engine's queue, and apps contending for the same engine. Both are measured as `delayed_repeats`
does: the network delay on, every client's runs interleaved, their outputs checked equal.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.clients import complete
from benchmarks.harness.measure import FIRST_RUN, Job, Run, Samples, per_delay, timed
from benchmarks.harness.stats import Spread, percentile
from benchmarks.harness.systems import Served

__all__ = [
    "BackgroundLoad",
    "Together",
    "completions",
    "delayed_repeats",
    "per_job_difference",
    "per_job_median",
    "percentile_spread",
    "together",
]


class BackgroundLoad:
    """Keeps ``in_flight`` requests outstanding for the ``async with`` block: slot *i* awaits
    ``send(i)`` again the moment its last one is answered (a closed loop, as busy users would).

    Leaving the block stops the slots (each finishes the request it has in flight) and raises
    `RuntimeError` if a request failed: a load that silently stopped would flatter the system measured.
    """

    def __init__(self, send: Callable[[int], Awaitable[Any]], in_flight: int) -> None:
        if in_flight < 1:
            raise ValueError(f"a background load needs at least one slot, got in_flight={in_flight}")
        self.send = send
        self.in_flight = in_flight
        self.completed = 0
        self.outstanding = 0  # sent and not yet answered, now
        self.max_in_flight = 0  # the most outstanding at once
        self._stop = asyncio.Event()
        self._slots: list[asyncio.Task[None]] = []

    async def _slot(self, index: int) -> None:
        try:
            while not self._stop.is_set():
                self.outstanding += 1
                self.max_in_flight = max(self.max_in_flight, self.outstanding)
                try:
                    await self.send(index)
                finally:
                    self.outstanding -= 1
                self.completed += 1
        except Exception:
            self._stop.set()  # the others stop too: the load is no longer what was asked for
            raise

    async def __aenter__(self) -> BackgroundLoad:
        self._stop.clear()
        self._slots = [asyncio.create_task(self._slot(i)) for i in range(self.in_flight)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        results = await asyncio.gather(*self._slots, return_exceptions=True)
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise RuntimeError(f"a background request failed: {errors[0]!r}") from errors[0]

    def counts(self) -> dict[str, int]:
        """What the load did, for the JSON payload: requests answered, and the most outstanding at once."""
        return {"background_completed": self.completed, "background_max_in_flight": self.max_in_flight}


def completions(served: Served, prompts: Sequence[str], max_tokens: int) -> Callable[[int], Awaitable[str]]:
    """A `BackgroundLoad`'s ``send`` for plain requests of other users of ``served`` (no Parrot template):
    slot *i* sends ``prompts[i]`` as a ``/v1/completions`` request for ``max_tokens`` tokens."""

    async def send(slot: int) -> str:
        return await complete(served.http, prompts[slot], max_tokens, model=served.model_name)

    return send


@dataclass(frozen=True)
class Together(Run):
    """Jobs started at once on one system: ``seconds`` is the mean of their latencies, ``each`` every
    one's in job order, ``output`` their outputs (a tuple); requests and engine work are of them all."""

    each: tuple[float, ...] = ()


def _together(samples: Samples) -> list[Together]:
    runs = [r for r in samples.runs if isinstance(r, Together)]
    if len(runs) != len(samples.runs):
        raise TypeError("these samples hold runs not made by `together`")
    return runs


def percentile_spread(samples: Samples, q: float) -> Spread:
    """The spread over the runs of ``samples`` (made by `together`) of each run's ``q``-th percentile
    latency over its jobs (``q=90``: the p90 app)."""
    return Spread.of(percentile(r.each, q) for r in _together(samples))


def per_job_median(samples: Samples) -> list[float]:
    """Each job's median latency over the runs of ``samples`` (made by `together`), in job order."""
    return [statistics.median(job) for job in zip(*(r.each for r in _together(samples)), strict=True)]


def per_job_difference(slow: Samples, fast: Samples) -> list[float]:
    """Per job of runs made by `together`, ``slow``'s median latency minus ``fast``'s (positive: the job was
    answered first with ``fast``)."""
    return [s - f for s, f in zip(per_job_median(slow), per_job_median(fast), strict=True)]


async def together(
    served: Served, jobs: Sequence[Job], clock: Callable[[], float] = time.perf_counter
) -> Together:
    """Every job of ``jobs`` started at the same moment on ``served``, each timed from that moment to its
    answer (its ``done``, else its return)."""
    if not jobs:
        raise ValueError("together() needs at least one job")
    each: list[float] = []

    async def all_at_once(_: Callable[[], None]) -> tuple[Any, ...]:
        start = clock()

        async def one(job: Job) -> tuple[float, Any]:
            done: list[float] = []
            output = await job(lambda: done.append(clock()))
            return (done[0] if done else clock()) - start, output

        results = await asyncio.gather(*(one(job) for job in jobs))
        each.extend(seconds for seconds, _ in results)
        return tuple(output for _, output in results)

    run = await timed(served, all_at_once, clock)
    return Together(statistics.fmean(each), run.output, run.requests, run.engine, tuple(each))


async def delayed_repeats(
    served: Served, jobs: Mapping[str, Callable[[], Awaitable[Run]]], repeats: int, label: str
) -> dict[str, Samples]:
    """``repeats`` interleaved runs per job with the network delay on (`measure.per_delay`), every output
    equal to the first run's. No warm-up of its own: the caller warms the server once (its output check),
    and the points of a sweep follow one another on it (an untimed run per point cost ~10 s of the quick
    chain summary)."""
    return (await per_delay([served], jobs, repeats, FIRST_RUN, (True,), label))[True]
