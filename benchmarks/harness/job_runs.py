"""Two shapes of comparing systems on one client job that application experiments share: interleaved
repeats on real servers per network-delay setting, as a `first_jobs.Compared` without first jobs (ratios to
a reference system, as for a DAG sweep: `delay_settings`), and every system once on a fresh simulated
cluster (`simulated_once`).

On real engines a shared machine is noisy, so a job is repeated and the systems interleaved
(`measure.per_delay`); on the simulator time is virtual and a run deterministic, so one run per system is
the figure. Either way the systems' outputs must agree (greedy decoding), or the run stops.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

from benchmarks.harness import first_jobs, measure, systems
from benchmarks.harness.measure import Job, Run
from benchmarks.harness.systems import Served, System

__all__ = ["delay_settings", "simulated_once"]


async def delay_settings(
    servers: Mapping[str, Served],
    job: Callable[[Served], Job],
    repeats: int,
    reference: str,
    delays: Sequence[bool] = (False, True),
) -> first_jobs.Compared:
    """Each server's ``job``: the outputs checked equal (the warm-up, `measure.agree`), then ``repeats``
    interleaved runs per setting of ``delays`` (`measure.per_delay`); ratios to ``reference``'s time."""
    jobs = {name: (lambda s=s: measure.timed(s, job(s))) for name, s in servers.items()}
    async with systems.connected(servers):
        expected = await measure.agree(jobs)
        by_delay = await measure.per_delay(servers, jobs, repeats, expected, delays)
    return first_jobs.Compared(reference, cold={}, settings=by_delay)


def simulated_once(
    setup: Sequence[System],
    profile: str,
    job: Callable[[Served], Job],
    *,
    delay: tuple[float, float] | None = systems.DELAY_S,
    seed: int = 0,
) -> dict[str, Run]:
    """Each system of ``setup`` on its own simulated cluster (`systems.simulate`, latency ``profile``, the
    client network delay on), its ``job`` timed once in virtual seconds; stops when the outputs differ."""
    from server.sim import run

    return run(_simulated_once(setup, profile, job, delay, seed))


async def _simulated_once(
    setup: Sequence[System],
    profile: str,
    job: Callable[[Served], Job],
    delay: tuple[float, float] | None,
    seed: int,
) -> dict[str, Run]:
    runs = {}
    for system in setup:
        async with systems.simulate(system, profile, delay=delay, seed=seed) as served:
            loop = asyncio.get_running_loop()
            runs[system.name] = await measure.timed(served, job(served), clock=loop.time)
    first, *_ = runs.values()
    if any(r.output != first.output for r in runs.values()):
        raise SystemExit(f"simulator ({profile}): the systems' outputs differ")
    return runs
