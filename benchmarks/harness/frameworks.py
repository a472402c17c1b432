"""Framework apps on one server: LangChain and LlamaIndex clients timed as harness jobs.

The framework experiments (`benchmarks.langchain_apps`, `benchmarks.llamaindex_synth`) compare clients
that are blocking framework calls — a compiled chain's ``invoke``, a synthesizer's ``get_response`` — on
one server: Parrot's integration against the framework driving the LLM call by call. Each client runs on a
worker thread (the framework's own thread pools and event loops work as they do for a user); per app, the
clients' answers must agree (the warm-up), then they are timed interleaved without and with the network
delay, each against a reference client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.harness import measure, record, systems
from benchmarks.harness.measure import Ratio, Samples
from benchmarks.harness.output import log
from benchmarks.harness.systems import Served
from server.engine import EngineConfig

__all__ = ["SERVER", "AppSetting", "Apps", "Run", "compare", "find", "job", "one_server", "table"]

SERVER = "server"  # one server for every client: the baseline's configuration (no OpenAI-route cache)

Run = Callable[[], Any]  # one blocking run of an app by one client; returns its answer
Apps = Mapping[str, Mapping[str, Run]]  # by app, each client's run


@contextlib.contextmanager
def one_server(model: str, engine: EngineConfig, seed: int = 0) -> Iterator[Served]:
    """The single server every client of a framework experiment shares, its network delay off."""
    with systems.serve(model, [systems.baseline(SERVER, engine)], seed=seed) as servers:
        yield servers[SERVER]


def job(run: Run) -> measure.Job:
    """A blocking run as a harness job, on a worker thread; timed to its return."""
    return lambda done: asyncio.to_thread(run)


@dataclass(frozen=True)
class AppSetting:
    """One app in one network-delay setting: each client's repeats, and each client's median latency
    over the reference client's (with the range of the per-repeat ratios)."""

    app: str
    delay: bool
    samples: dict[str, Samples]
    ratios: dict[str, Ratio]

    def median(self, client: str) -> float:
        return self.samples[client].spread.median

    def as_dict(self) -> dict[str, Any]:
        return {
            "app": self.app,
            "network_delay": self.delay,
            "speedup": {name: r.as_dict() for name, r in self.ratios.items()},
            "clients": measure.as_dicts(self.samples),
        }


def compare(
    served: Served, apps: Apps, repeats: int, reference: str, delays: Sequence[bool] = (False, True)
) -> list[AppSetting]:
    """Per app: every client's answer checked equal (also the warm-up), then ``repeats`` interleaved runs
    per client and setting of ``delays``; ratios against ``reference``."""

    async def measured() -> list[AppSetting]:
        out = []
        for app, clients in apps.items():
            jobs = {name: (lambda run=run: measure.timed(served, job(run))) for name, run in clients.items()}
            log(f"{app}: verifying answers and warming up ...")
            expected = await measure.agree(jobs)
            by_delay = await measure.per_delay([served], jobs, repeats, expected, delays, label=f"{app} ")
            for delay, samples in by_delay.items():
                ratios = {
                    n: measure.ratio(s, samples[reference]) for n, s in samples.items() if n != reference
                }
                out.append(AppSetting(app, delay, samples, ratios))
        return out

    return asyncio.run(measured())


def find(settings: Sequence[AppSetting], app: str, delay: bool) -> AppSetting:
    """The setting of ``app`` with or without the delay."""
    for s in settings:
        if s.app == app and s.delay == delay:
            return s
    raise KeyError(f"no measurement of {app!r} {'with' if delay else 'without'} the network delay")


def table(settings: Sequence[AppSetting]) -> str:
    """`record.latency_table` with one setting per app and delay; each client's ratio on its row."""
    rows = [(f"{s.app}, {systems.delay_label(s.delay)}", s.samples, s.ratios) for s in settings]
    return record.latency_table(rows, "app, network delay")
