"""Open-loop runs on the simulator: requests sent at their arrival times, on virtual time, to a cluster.

An application experiment times one job (`measure`); a cluster experiment offers a stream of requests at
a rate and asks how the system copes: each request is sent at its arrival time whether or not the earlier
ones are done (open loop), and is timed from then to its answer. Here are the parts such experiments
share, all on `server.sim` (virtual seconds of a latency model):

* `simulated`: a `System` on simulated engines with a given latency model, as a `SimServed` that also
  reports what its cluster did (`Work`: the engines' counters and busy time, where the scheduler placed
  steps and why);
* `open_loop`: calls started at their arrival times, each one's latency;
* `arrival_times`: Poisson arrivals at any rate from one list of unit-rate gaps (request *i* arrives at
  the same point of the stream at every rate: common random numbers across rates and systems);
* `at_rate` and `max_sustained_rate`: one rate's normalized latencies (a `RatePoint`), and the search for
  the highest rate a system sustains within a latency bound (a doubling grid, then bisection in log space);
* `MemoTokenizer`: the engines' tokenizer with its answers remembered across runs (wall time only).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.common import log, markdown_table, percentile, safe_ratio
from benchmarks.harness.systems import Served, System

__all__ = [
    "MemoTokenizer",
    "RateGrid",
    "RatePoint",
    "Search",
    "SimServed",
    "Work",
    "arrival_times",
    "at_rate",
    "engines_table",
    "max_sustained_rate",
    "open_loop",
    "rates_table",
    "report",
    "simulated",
    "summary_table",
]

Call = Callable[[], Awaitable[Any]]


@dataclass
class Work:
    """What a simulated cluster did in one run: seconds (simulated, and wall for the report), each
    engine's counters (`EngineStats` plus ``busy_s``) and Parrot's placements ("engine/branch": steps)."""

    virtual_s: float
    wall_s: float
    engines: list[dict[str, Any]] = field(default_factory=list)
    placements: dict[str, int] = field(default_factory=dict)

    def placed_by(self) -> Counter[str]:
        """Steps placed per scheduler branch, over all engines."""
        out: Counter[str] = Counter()
        for key, n in self.placements.items():
            out[key.split("/", 1)[1]] += n
        return out


@dataclass
class SimServed(Served):
    """A `Served` on the simulator that also knows its manager and when it started."""

    manager: Any = None
    started: float = 0.0  # virtual seconds
    wall_started: float = 0.0

    def now(self) -> float:
        """Simulated seconds on the running virtual-time loop."""
        return asyncio.get_running_loop().time()

    def work(self) -> Work:
        """The cluster's work since it started."""
        engines = [e.stats().model_dump() | {"busy_s": e.busy_seconds} for e in self.engines]
        placed = sorted(self.manager.placement.placed.items())
        return Work(
            virtual_s=self.now() - self.started,
            wall_s=time.perf_counter() - self.wall_started,
            engines=engines,
            placements={f"{e}/{reason}": n for (e, reason), n in placed},
        )


@contextlib.asynccontextmanager
async def simulated(system: System, latency: Any, *, memo: bool = False) -> AsyncIterator[SimServed]:
    """``system`` on simulated engines timed by the `server.sim.LatencyModel` ``latency`` (run inside
    `server.sim.run`); ``memo``: the engines share this process's `MemoTokenizer`."""
    from server.sim import sim_cluster

    async with sim_cluster(
        system.engines, latency, engine_config=system.engine, manager_config=system.manager
    ) as cluster:
        if memo:
            for engine in cluster.engines:
                engine.tokenizer = memo_tokenizer(engine.tokenizer)
        yield SimServed(
            system,
            cluster.url,
            cluster.engines,
            client=cluster.client,
            manager=cluster.manager,
            started=cluster.now(),
            wall_started=time.perf_counter(),
        )


async def open_loop(
    served: SimServed,
    calls: Iterable[tuple[float, Call]],
    on_error: Callable[[Exception], None] | None = None,
) -> list[float | None]:
    """Each ``(arrival, call)`` started ``arrival`` simulated seconds after ``served`` started, all
    concurrently; each one's seconds from its start to its return. A call that raises stops the run,
    unless ``on_error`` is given: it gets the error and the call's latency is None."""

    async def one(at: float, call: Call) -> float | None:
        await asyncio.sleep(max(0.0, served.started + at - served.now()))
        start = served.now()
        try:
            await call()
        except Exception as e:
            if on_error is None:
                raise
            on_error(e)
            return None
        return served.now() - start

    return list(await asyncio.gather(*(one(at, call) for at, call in calls)))


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


# ----------------------------------------------------------------------------------------------- rates
@dataclass
class RatePoint:
    """One system at one rate: the measured requests' normalized latencies (seconds per output token,
    arrival order), every request of the run (warm-up included), failures and the cluster's work."""

    system: str
    rate: float
    norm_latency: list[float]
    requests: int
    last_arrival_s: float
    work: Work
    failures: int = 0

    @property
    def mean(self) -> float:
        return statistics.fmean(self.norm_latency) if self.norm_latency else math.nan

    @property
    def p50(self) -> float:
        return percentile(self.norm_latency, 50)

    @property
    def p90(self) -> float:
        return percentile(self.norm_latency, 90)

    @property
    def drain_s(self) -> float:
        """How long the run went on after the last arrival: a queue that grew through the run shows here."""
        return self.work.virtual_s - self.last_arrival_s

    def sustained(self, bound: float) -> bool:
        """No request failed and the mean normalized latency is within ``bound``."""
        return self.failures == 0 and bool(self.norm_latency) and self.mean <= bound

    def line(self, bound: float) -> str:
        """One line of progress."""
        w, verdict = self.work, "ok" if self.sustained(bound) else "over"
        return (
            f"  {self.system:<18} {self.rate:8.2f} req/s: mean {self.mean * 1e3:6.1f} ms/token, p90 "
            f"{self.p90 * 1e3:6.1f}, drain {self.drain_s:5.1f} s: {verdict} ({self.requests} requests, "
            f"{w.virtual_s:.1f} simulated s in {w.wall_s:.1f} wall s)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "rate": self.rate,
            "requests": self.requests,
            "measured": len(self.norm_latency),
            "failures": self.failures,
            "mean_s_per_token": self.mean,
            "p50_s_per_token": self.p50,
            "p90_s_per_token": self.p90,
            "drain_s": self.drain_s,
            "virtual_s": self.work.virtual_s,
            "wall_s": self.work.wall_s,
            "engines": self.work.engines,
            "placements": self.work.placements,
        }


async def at_rate(
    served: SimServed, rate: float, calls: Sequence[tuple[float, int, Call]], warmup_s: float = 0.0
) -> RatePoint:
    """An open-loop run of ``(arrival, output tokens, call)`` offered at ``rate``: every call's normalized
    latency (seconds per output token) but those arriving before ``warmup_s``; a call that fails is logged
    and counted (the rate is then not sustained)."""
    name = served.system.name
    got = await open_loop(
        served, [(at, call) for at, _, call in calls], lambda e: log(f"  {name} @ {rate:g}/s failed: {e!r}")
    )
    norm = [x / n for (at, n, _), x in zip(calls, got, strict=True) if at >= warmup_s and x is not None]
    last = calls[-1][0] if calls else 0.0
    return RatePoint(name, rate, norm, len(calls), last, served.work(), sum(x is None for x in got))


@dataclass(frozen=True)
class RateGrid:
    """Where the search looks: doubling from ``start`` (halving if it fails already) within ``[lo, hi]``,
    then ``bisect_steps`` bisections; ``fixed``: that one rate only."""

    start: float = 4.0
    hi: float = 256.0
    lo: float = 0.25
    bisect_steps: int = 3
    fixed: float | None = None


@dataclass
class Search:
    """Every rate tried for one system, the highest sustained (0: none) and the lowest not (inf: none)."""

    system: str
    points: list[RatePoint]
    best: float
    first_failed: float

    def point_at(self, rate: float) -> RatePoint | None:
        return next((p for p in self.points if p.rate == rate), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_sustained_rate": self.best,
            "first_failed_rate": self.first_failed,
            "runs": [p.as_dict() for p in self.points],
        }


def max_sustained_rate(
    system: str, measure: Callable[[float], RatePoint], grid: RateGrid, bound: float
) -> Search:
    """The highest rate ``system`` sustains within ``bound`` (`RatePoint.sustained`), ``measure`` giving
    one run per rate tried; the points come back sorted by rate. The answer is good to the last bracket
    (``first_failed / best``)."""
    points: list[RatePoint] = []

    def ok(rate: float) -> bool:
        points.append(measure(rate))
        return points[-1].sustained(bound)

    good, bad = 0.0, math.inf
    if grid.fixed is not None:
        good, bad = (grid.fixed, bad) if ok(grid.fixed) else (good, grid.fixed)
    elif ok(grid.start):
        good = grid.start
        while good * 2 <= grid.hi and ok(good * 2):
            good *= 2
        bad = good * 2 if good * 2 <= grid.hi else math.inf
    else:
        bad = grid.start
        while bad / 2 >= grid.lo and not ok(bad / 2):
            bad /= 2
        good = bad / 2 if bad / 2 >= grid.lo else 0.0
    if grid.fixed is None and good > 0 and math.isfinite(bad):
        for _ in range(grid.bisect_steps):
            mid = math.sqrt(good * bad)
            good, bad = (mid, bad) if ok(mid) else (good, mid)
    return Search(system, sorted(points, key=lambda p: p.rate), good, bad)


def rates_table(searches: Mapping[str, Search], bound: float) -> str:
    """Every rate tried, per system: normalized latency (mean, p50, p90 in ms/token), drain, sustained."""
    rows = [
        [
            name,
            f"{p.rate:.2f}",
            f"{len(p.norm_latency)}/{p.requests}",
            *(f"{x * 1e3:.1f}" for x in (p.mean, p.p50, p.p90)),
            f"{p.drain_s:.1f}",
            f"{p.work.virtual_s:.1f}",
            f"{p.work.wall_s:.1f}",
            ("yes" if p.sustained(bound) else "no") + (f" ({p.failures} failed)" if p.failures else ""),
        ]
        for name, s in searches.items()
        for p in s.points
    ]
    headers = ["system", "rate req/s", "measured/all", "mean ms/token", "p50", "p90", "drain s"]
    headers += ["simulated s", "wall s", "sustained"]
    return markdown_table(headers, rows, [False, *([True] * 8), False])


def summary_table(searches: Mapping[str, Search], reference: str, anchors: Mapping[str, float]) -> str:
    """The highest sustained rate per system, its latency there, ``reference``'s rate over it, and the
    paper's ratio (``anchors`` by system)."""
    rows = []
    for name, s in searches.items():
        p, anchor = s.point_at(s.best), anchors.get(name)
        there = ["n/a", "n/a"] if p is None else [f"{p.mean * 1e3:.1f}", f"{p.p90 * 1e3:.1f}"]
        ratio = "" if name == reference else f"{safe_ratio(searches[reference].best, s.best):.2f}x"
        paper = "" if anchor is None else f"{anchor:g}x"
        rows.append([name, f"{s.best:.2f}", f"{s.first_failed:.2f}", *there, ratio, paper])
    headers = ["system", "max sustained req/s", "first failed", "mean ms/token there", "p90"]
    return markdown_table([*headers, f"{reference} / this", "paper"], rows, [False, *([True] * 6)])


def engines_table(works: Mapping[str, Work]) -> str:
    """Per system and engine: steps, busy time, prefill and decode tokens, decodes and milliseconds per
    step, preemptions and evictions; and per system the scheduler branches that placed its steps."""
    rows = []
    for name, w in works.items():
        placed = " ".join(f"{r}:{n}" for r, n in sorted(w.placed_by().items())) or "-"
        for i, e in enumerate(w.engines):
            rows.append(
                [
                    name if i == 0 else "",
                    str(i),
                    f"{e['steps']:,}",
                    f"{e['busy_s']:.1f} ({safe_ratio(e['busy_s'], w.virtual_s):.0%})",
                    f"{e['prefill_tokens_computed']:,}",
                    f"{e['decode_tokens_computed']:,}",
                    f"{safe_ratio(e['decode_tokens_computed'], e['steps']):.1f}",
                    f"{safe_ratio(e['busy_s'], e['steps']) * 1e3:.1f}",
                    f"{e['preemptions']}/{e['evictions']}",
                    placed if i == 0 else "",
                ]
            )
    headers = ["system", "engine", "steps", "busy s", "prefill tokens", "decode tokens", "decodes/step"]
    headers += ["ms/step", "preempt/evict", "placed by (steps)"]
    return markdown_table(headers, rows, [False, *([True] * 8), False])


def report(searches: Mapping[str, Search], reference: str, anchors: Mapping[str, float], bound: float) -> str:
    """A search per system as tables: every rate tried, the highest sustained (`summary_table`), the
    engines' work there, and the simulated time against the wall time it took."""
    at_best = {n: p.work for n, s in searches.items() if (p := s.point_at(s.best)) is not None}
    works = [p.work for s in searches.values() for p in s.points]
    virtual, wall = sum(w.virtual_s for w in works), sum(w.wall_s for w in works)
    return (
        f"{rates_table(searches, bound)}\n\n{summary_table(searches, reference, anchors)}\n\n"
        f"At each system's highest sustained rate:\n\n{engines_table(at_best)}\n\n"
        f"{len(works)} simulated runs: {virtual:.0f} simulated s in {wall:.0f} wall s"
    )


# ----------------------------------------------------------------------------------------------- tokenizer
class MemoTokenizer:
    """A tokenizer whose ``encode`` remembers its answers (the same ids; all else passes through).

    Tokenizing takes no simulated time, but wall time it does: the manager encodes every prompt whole,
    and a shared prefix again for every call. Where the same prompts recur run after run (one workload at
    several rates), one memo per process encodes each text once. Ids are kept as int32 arrays.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._memo: dict[tuple[str, bool], array[int]] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        ids = self._memo.get(key)
        if ids is None:
            ids = self._memo[key] = array(
                "i", self._inner.encode(text, add_special_tokens=add_special_tokens)
            )
        return ids.tolist()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_MEMOS: dict[int, MemoTokenizer] = {}


def memo_tokenizer(inner: Any) -> MemoTokenizer:
    """The one `MemoTokenizer` of ``inner`` in this process."""
    if id(inner) not in _MEMOS:
        _MEMOS[id(inner)] = MemoTokenizer(inner)
    return _MEMOS[id(inner)]
