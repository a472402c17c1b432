"""Measurement: one timed run with the engine's exact counters, interleaved repeats, checked outputs.

Every application experiment times the same thing: a client's job on its system, from the first request
to the answer in the client's hands, starting from no KV an earlier run kept, with the work the engines
did meanwhile (steps, prefill and decode tokens — exact counts) and the HTTP requests it took. Repeats
alternate which system goes first, so a slow moment of a shared machine hits both; the output of every run
must equal the first one's (greedy decoding is deterministic), and the systems must agree with each other,
or the run stops.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness.output import log
from benchmarks.harness.stats import Spread, safe_ratio
from benchmarks.harness.systems import ENGINE_COUNTERS, Served, delayed

__all__ = [
    "FIRST_RUN",
    "Job",
    "Ratio",
    "Run",
    "Samples",
    "agree",
    "as_dicts",
    "interleave",
    "per_delay",
    "ratio",
    "timed",
]

# A client's job: called with ``done``, which it calls the moment the answer is in hand (work after that,
# such as closing a session, is not timed); returns the output. A job that never calls ``done`` is timed
# to its return.
Job = Callable[[Callable[[], None]], Awaitable[Any]]


@dataclass(frozen=True)
class Run:
    """One timed job: seconds to the answer, the answer, HTTP requests made, the engines' work."""

    seconds: float
    output: Any
    requests: int
    engine: dict[str, int]


async def timed(
    served: Served, job: Job, clock: Callable[[], float] = time.perf_counter, *, cold: bool = True
) -> Run:
    """Run ``job`` on ``served`` once. ``clock``: the simulator's virtual clock where it runs there.
    Requests count every method but ``DELETE`` up to the answer (`done`, else the job's return). ``cold``:
    the contexts the server keeps from earlier runs are dropped first (`Served.drop_kept_contexts`), so
    repeats of one job each compute what a first run does; sharing inside the run is the system's own."""
    if cold:
        await served.drop_kept_contexts()
    requests_before = served.requests()
    engine_before = served.counters()
    done: list[tuple[float, Counter[tuple[str, str]]]] = []
    start = clock()
    output = await job(lambda: done.append((clock(), served.requests())))
    end, requests_then = done[0] if done else (clock(), served.requests())
    made = requests_then - requests_before  # up to the answer: fetches after it are not the job's
    after = served.counters()
    return Run(
        seconds=end - start,
        output=output,
        requests=sum(n for (method, _), n in made.items() if method != "DELETE"),
        engine={k: after[k] - engine_before[k] for k in ENGINE_COUNTERS},
    )


@dataclass
class Samples:
    """One system's repeats in one setting."""

    runs: list[Run] = field(default_factory=list)

    @property
    def seconds(self) -> list[float]:
        return [r.seconds for r in self.runs]

    @property
    def spread(self) -> Spread:
        return Spread.of(self.seconds)

    @property
    def requests(self) -> int | None:
        """HTTP requests of one job (the same every repeat)."""
        return self.runs[0].requests if self.runs else None

    def engine_median(self, name: str) -> float:
        values = [r.engine[name] for r in self.runs]
        return statistics.median(values) if values else float("nan")

    @property
    def decode_per_step(self) -> float:
        """Decode tokens per engine step (prefill steps included): a lower bound on the decode batch."""
        return safe_ratio(self.engine_median("decode_tokens_computed"), self.engine_median("steps"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "latency": self.spread.as_dict(),
            "requests": self.requests,
            "engine": [r.engine for r in self.runs],
            "decode_per_step": self.decode_per_step,
        }


def as_dicts(samples: Mapping[str, Samples]) -> dict[str, dict[str, Any]]:
    """Every system's samples for the JSON payload."""
    return {name: s.as_dict() for name, s in samples.items()}


@dataclass(frozen=True)
class Ratio:
    """``slow`` over ``fast``: the ratio of medians and the range of the per-repeat ratios."""

    median: float
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.lo:.2f}-{self.hi:.2f})"

    def as_dict(self) -> dict[str, float]:
        return {"median": self.median, "min": self.lo, "max": self.hi}


def ratio(slow: Samples, fast: Samples) -> Ratio:
    """How many times longer ``slow`` took than ``fast`` (repeat i against repeat i for the range)."""
    per_repeat = Spread.of(safe_ratio(s, f) for s, f in zip(slow.seconds, fast.seconds, strict=False))
    return Ratio(safe_ratio(slow.spread.median, fast.spread.median), per_repeat.lo, per_repeat.hi)


async def agree(jobs: Mapping[str, Callable[[], Awaitable[Run]]]) -> Any:
    """Run each system's job once (also the warm-up) and return the common output; stops the experiment
    when the systems' outputs differ."""
    got = {name: (await job()).output for name, job in jobs.items()}
    first, *_ = got.values()
    if any(out != first for out in got.values()):
        lines = "\n".join(f"  {name}: {out!r}"[:2000] for name, out in got.items())
        raise SystemExit(f"the systems' outputs differ:\n{lines}")
    return first


FIRST_RUN: Any = object()  # `interleave`'s ``expected`` when no warm-up gave it: the first run's output


async def interleave(
    jobs: Mapping[str, Callable[[], Awaitable[Run]]], repeats: int, expected: Any, label: str = ""
) -> dict[str, Samples]:
    """``repeats`` runs per system, alternating which goes first; every output must equal ``expected``
    (`FIRST_RUN`: the first run's, so the systems are still checked against each other)."""
    out = {name: Samples() for name in jobs}
    names = list(jobs)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            run = await jobs[name]()
            if expected is FIRST_RUN:
                expected = run.output
            elif run.output != expected:
                raise SystemExit(
                    f"{name}: the output differs from the other runs' (systems differ, or not deterministic?)"
                )
            out[name].runs.append(run)
        times = " | ".join(f"{n} {s.runs[-1].seconds:.3f}s" for n, s in out.items())
        log(f"  {label}repeat {rep + 1}: {times}")
    return out


async def per_delay(
    servers: Mapping[str, Served] | Sequence[Served],
    jobs: Mapping[str, Callable[[], Awaitable[Run]]],
    repeats: int,
    expected: Any,
    delays: Sequence[bool] = (False, True),
    label: str = "",
) -> dict[bool, dict[str, Samples]]:
    """`interleave` once per setting of ``delays``, the network delay switched to it on every server."""
    out: dict[bool, dict[str, Samples]] = {}
    for delay in delays:
        with delayed(servers, delay):
            out[delay] = await interleave(jobs, repeats, expected, label + ("delay " if delay else ""))
    return out
