"""Each system's first job on a fresh server: the output check, the exact KV peak, the requests to the answer.

A fresh server holds nothing, so a system's first job shows what the job itself costs in memory: its exact
KV high-water mark (`peaks.peaked`; Parrot's includes the contexts it keeps cached), with the engine's work,
its evictions and, on the simulator, its busy seconds (`Cold`). On the simulator, where a run is
deterministic, that first job is the figure; on real engines it is also the warm-up before the timed runs
(`Compared` holds both). It is the output check too: the reference system runs first, and every other
system's outputs (every call's, not just the answer) must equal the reference's, or the run stops
(`compare`). Requests are counted client-side (the simulator's server keeps no count), up to the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import httpx

from benchmarks.harness import peaks, record, systems
from benchmarks.harness.measure import Job, Ratio, Samples, ratio
from benchmarks.harness.output import fmt_num, markdown_table
from benchmarks.harness.stats import safe_ratio
from benchmarks.harness.systems import Served, System

__all__ = ["Cold", "Compared", "OpenSystem", "compare", "first_job", "on_simulator", "running", "table"]

Checked = TypeVar("Checked")
# A system by name, started (or reached) for one first job and closed after it.
OpenSystem = Callable[[str], contextlib.AbstractAsyncContextManager[Served]]


@dataclass(frozen=True)
class Cold:
    """A system's first job on a fresh server: seconds and requests until the answer, the engines' work,
    the exact KV peak, evictions, and on the simulator the engines' busy seconds (summed over engines)."""

    seconds: float
    requests: int
    engine: dict[str, int]
    peak_blocks: int
    evictions: int
    busy_s: float


@dataclass
class Compared:
    """Systems compared on one job: each one's first job (none where the comparison has no fresh server per
    system: ``cold`` empty), then (on real engines) its timed runs per network-delay setting. Ratios are to
    the ``reference`` system (a system's figure over its)."""

    reference: str
    cold: dict[str, Cold]
    settings: dict[bool, dict[str, Samples]] = field(default_factory=dict)  # by network delay

    def over(self, name: str, figure: str) -> float:
        """``name``'s first-job ``figure`` (a field of `Cold`) over the reference's."""
        return safe_ratio(getattr(self.cold[name], figure), getattr(self.cold[self.reference], figure))

    def speedups(self, delay: bool) -> dict[str, Ratio]:
        """Each other system's latency over the reference's in the setting."""
        samples = self.settings[delay]
        return {n: ratio(s, samples[self.reference]) for n, s in samples.items() if n != self.reference}

    def speedup(self, delay: bool, name: str) -> float:
        """``name``'s median ratio in the setting; NaN where it was not measured."""
        return self.speedups(delay)[name].median if delay in self.settings else math.nan

    def median_s(self, delay: bool, name: str) -> float:
        """``name``'s median seconds in the setting; NaN where it was not measured."""
        return self.settings[delay][name].spread.median if delay in self.settings else math.nan

    def latency_rows(self, label: str) -> list[record.LatencyRow]:
        """The settings as `record.latency_table` rows, each labelled ``label`` and its network delay."""
        return [(f"{label}{systems.delay_label(d)}", s, self.speedups(d)) for d, s in self.settings.items()]

    def payload(self) -> dict[str, Any]:
        """The first jobs and the timed settings for the JSON payload."""
        return {
            "first_jobs": {name: asdict(c) for name, c in self.cold.items()},
            "settings": [record.setting_payload(d, s, self.speedups(d)) for d, s in self.settings.items()],
        }


def running(servers: Mapping[str, Served]) -> OpenSystem:
    """Servers already running (fresh, and `systems.connected`), by name; left running."""
    return lambda name: contextlib.nullcontext(servers[name])


def on_simulator(setup: Sequence[System], profile: str, seed: int) -> OpenSystem:
    """Each system of ``setup`` by name on its own fresh simulated cluster (latency ``profile``), the client
    network delay on (run inside `server.sim.run`: virtual time)."""
    by_name = {s.name: s for s in setup}
    return lambda name: systems.simulate(by_name[name], profile, delay=systems.DELAY_S, seed=seed)


async def first_job(served: Served, job: Job) -> tuple[Any, Cold]:
    """``job`` as the system's first: its output and `Cold` (the clock is the event loop's: virtual on the
    simulator). The requests are those sent up to the job's ``done`` (fetches after the answer are not)."""
    sent: list[str] = []
    at_answer: list[int] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request.method)

    def answered(done: Callable[[], None]) -> None:
        at_answer.append(len(sent))
        done()

    served.http.event_hooks = {"request": [count]}
    try:
        clock = asyncio.get_running_loop().time
        run, peak = await peaks.peaked(served, lambda done: job(lambda: answered(done)), clock)
    finally:
        served.http.event_hooks = {"request": []}
    evictions = sum(int(e.stats().evictions) for e in served.engines)
    busy_s = sum(getattr(e, "busy_seconds", math.nan) for e in served.engines)  # NaN: real engines keep none
    return run.output, Cold(run.seconds, at_answer[0], run.engine, peak, evictions, busy_s)


async def compare(
    open_system: OpenSystem,
    names: Sequence[str],
    job: Callable[[Served], Job],
    check: Callable[[Served, Mapping[str, Any]], Checked],
) -> tuple[Mapping[str, Any], Checked, dict[str, Cold]]:
    """Each system's first job (`first_job`) in the order of ``names``, each opened by ``open_system``;
    ``job`` returns every output by name. The first system is the reference: ``check`` sees its server and
    outputs at once (it stops the run if they do not fit); every other system's outputs must equal them,
    else the run stops. The reference's outputs, what ``check`` returned, and each system's `Cold`."""
    cold: dict[str, Cold] = {}
    reference, *_ = names
    for name in names:
        async with open_system(name) as served:
            got, cold[name] = await first_job(served, job(served))
            if name == reference:
                values, checked = got, check(served, got)
            elif diff := [k for k, v in values.items() if got.get(k) != v]:
                raise SystemExit(
                    f"outputs differ ({name} vs {reference}) at {diff[0]} and {len(diff) - 1} more\n"
                    f"  {name}: {got.get(diff[0])!r}\n  {reference}: {values[diff[0]]!r}"
                )
    return values, checked, cold


def table(groups: Sequence[tuple[str, Compared]], group_header: str) -> str:
    """Per group (a size, a backend) and system, its first job: latency (on the simulator: the figure),
    requests until the answer, the exact KV peak, the engine's work; both ratios to the group's reference."""
    rows = [
        [
            label,
            name,
            f"{c.seconds:.2f} ({runs.over(name, 'seconds'):.2f}x)",
            str(c.requests),
            f"{c.peak_blocks:,} ({runs.over(name, 'peak_blocks'):.2f}x)",
            f"{c.engine['prefill_tokens_computed']:,}",
            f"{c.engine['steps']:,}",
            str(c.evictions),
            fmt_num(c.busy_s, 2),
        ]
        for label, runs in groups
        for name, c in runs.cold.items()
    ]
    reference = f"(/ {groups[0][1].reference})" if groups else ""
    headers = [group_header, "system", f"latency s {reference}", "requests", f"peak KV blocks {reference}"]
    headers += ["prefill tokens", "engine steps", "evictions", "engine busy s"]
    return markdown_table(headers, rows, [False, False, *([True] * 7)])
