"""A DAG application swept over a size: per size, each system's first job on a fresh server, then timed runs.

Each point of the sweep (`Point`) is a `template_dags.TemplateDag` built for that size, on which the systems
of a `Comparison` are compared as `first_jobs` describes. On fresh real servers (`Comparison.sweep`; fresh,
so that the KV peaks are the job's): each system's first job — the warm-up, the exact KV peak, and the
output check, every call's output equal to the baseline's, whose outputs also size every request against
the model's window and the latency cap — then ``repeats`` interleaved jobs timed to the final output per
network-delay setting. On the simulator (`Comparison.simulated`: virtual time, deterministic): the first
jobs alone, each system on its own cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from benchmarks.harness import first_jobs, measure, systems
from benchmarks.harness.measure import Job, Run
from benchmarks.harness.output import log
from benchmarks.harness.systems import Served, System
from benchmarks.harness.template_dags import TemplateDag, job, longest_request

__all__ = ["Comparison", "Point", "timed_jobs"]

Dag = TypeVar("Dag", bound=TemplateDag)


@dataclass
class Point(Generic[Dag]):
    """One size of the sweep: its DAG, the longest request, each system's first job and timed runs."""

    size: int
    dag: Dag
    longest: int  # prompt + max_tokens tokens
    runs: first_jobs.Compared


def timed_jobs(
    servers: Mapping[str, Served], dag: TemplateDag, baseline: str
) -> dict[str, Callable[[], Awaitable[Run]]]:
    """Each server's job, timed to the final output (`measure.timed`), by system name."""
    return {name: (lambda s=s: measure.timed(s, job(s, dag, baseline))) for name, s in servers.items()}


@dataclass(frozen=True)
class Comparison:
    """The systems compared on the DAG in the order of the tables, the one that runs the request-centric
    client (its first job runs first: its outputs are the check), the one the ratios are to, and what the
    sweep's size counts (for the log)."""

    names: tuple[str, ...]
    baseline: str
    reference: str
    unit: str

    def sweep(
        self,
        model: str,
        setup: Sequence[System],
        sizes: Sequence[int],
        dag_of: Callable[[Any, int], Dag],
        cap: int,
        *,
        repeats: int,
        delays: Sequence[bool],
        seed: int,
    ) -> list[Point[Dag]]:
        """Per size, on fresh servers of ``setup`` with ``model``: the DAG ``dag_of(tokenizer, size)``, each
        system's first job (`first_jobs`), then ``repeats`` interleaved timed jobs per setting of ``delays``
        (`measure.per_delay`), every answer equal to the baseline's."""
        points = []
        for size in sizes:
            log(f"starting {len(setup)} servers ({model}) for {size} {self.unit} ...")
            with systems.serve(model, setup, seed=seed) as servers:  # fresh: clean KV peaks
                dag = dag_of(servers[self.reference].tokenizer, size)
                log(f"{size} {self.unit}: {len(dag.calls)} calls; first jobs (memory, output check) ...")
                label = f"{size} {self.unit}, "
                longest, runs = asyncio.run(self._measured(servers, dag, cap, repeats, delays, label))
            points.append(Point(size, dag, longest, runs))
        return points

    def simulated(
        self,
        setup: Sequence[System],
        profile: str,
        sizes: Sequence[int],
        dag_of: Callable[[int], Dag],
        cap: int,
        seed: int,
    ) -> list[Point[Dag]]:
        """Per size, the DAG ``dag_of(size)``: each system's one job on its own fresh simulated cluster
        (`first_jobs.on_simulator`: latency ``profile``, the network delay on), compared as on real
        servers."""
        from server.sim import run

        points = []
        for size in sizes:
            dag = dag_of(size)
            log(f"simulator ({profile}): {size} {self.unit}, {len(dag.calls)} calls ...")
            _, longest, runs = run(
                self.compare_first_jobs(first_jobs.on_simulator(setup, profile, seed), dag, cap)
            )
            points.append(Point(size, dag, longest, runs))
        return points

    async def compare_first_jobs(
        self, open_system: first_jobs.OpenSystem, dag: TemplateDag, cap: int
    ) -> tuple[str, int, first_jobs.Compared]:
        """Each system's first job (`first_jobs.compare`), the baseline's first, then the others in table
        order: the baseline's outputs size every request, which the model's window and the latency ``cap``
        must admit; every other system's outputs (every call's) must equal them. The final output, the
        longest request, and the first jobs."""

        def longest(served: Served, values: Mapping[str, str]) -> int:
            tokens = longest_request(dag, served.tokenizer, values, served.engines[0].max_model_len)
            if tokens > cap:
                raise SystemExit(f"the latency cap ({cap}) must admit the longest request ({tokens})")
            return tokens

        def everything(served: Served) -> Job:
            return job(served, dag, self.baseline, everything=True)

        order = [self.baseline, *(name for name in self.names if name != self.baseline)]
        values, tokens, cold = await first_jobs.compare(open_system, order, everything, longest)
        return (
            values[dag.final],
            tokens,
            first_jobs.Compared(self.reference, {n: cold[n] for n in self.names}),
        )

    async def _measured(
        self,
        servers: Mapping[str, Served],
        dag: TemplateDag,
        cap: int,
        repeats: int,
        delays: Sequence[bool],
        label: str,
    ) -> tuple[int, first_jobs.Compared]:
        async with systems.connected(servers, timeout=600):
            final, longest, runs = await self.compare_first_jobs(first_jobs.running(servers), dag, cap)
            jobs, expected = timed_jobs(servers, dag, self.baseline), {dag.final: final}
            runs.settings.update(await measure.per_delay(servers, jobs, repeats, expected, delays, label))
        return longest, runs
