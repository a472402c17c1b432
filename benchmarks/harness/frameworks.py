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
from typing import Any

from benchmarks.harness import measure, record, systems
from benchmarks.harness.first_jobs import Compared
from benchmarks.harness.output import log
from benchmarks.harness.systems import Served
from server.engine import EngineConfig

__all__ = ["SERVER", "Apps", "Run", "compare", "job", "one_server", "payload", "table"]

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


def compare(
    served: Served, apps: Apps, repeats: int, reference: str, delays: Sequence[bool] = (False, True)
) -> dict[str, Compared]:
    """Per app: every client's answer checked equal (also the warm-up), then ``repeats`` interleaved runs
    per client and setting of ``delays``; ratios to ``reference``'s time (no first jobs: one server)."""

    async def measured() -> dict[str, Compared]:
        out = {}
        for app, clients in apps.items():
            jobs = {name: (lambda run=run: measure.timed(served, job(run))) for name, run in clients.items()}
            log(f"{app}: verifying answers and warming up ...")
            expected = await measure.agree(jobs)
            by_delay = await measure.per_delay([served], jobs, repeats, expected, delays, label=f"{app} ")
            out[app] = Compared(reference, cold={}, settings=by_delay)
        return out

    return asyncio.run(measured())


def table(runs: Mapping[str, Compared]) -> str:
    """`record.latency_table` with one setting per app and delay; each client's ratio on its row."""
    return record.latency_table(
        [row for app, c in runs.items() for row in c.latency_rows(f"{app}, ")], "app, network delay"
    )


def payload(runs: Mapping[str, Compared]) -> list[dict[str, Any]]:
    """Every app's settings for the JSON payload, each naming its app."""
    return [{"app": app, **setting} for app, c in runs.items() for setting in c.payload()["settings"]]
