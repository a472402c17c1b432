"""Applications as harness jobs (`measure.Job`) on a served system: an app's client from
`benchmarks.workloads` bound to `systems.Served` (its HTTP client and model name) and to the ``done``
callback `measure.timed` times it by.

Which client runs is the caller's explicit choice (``parrot=True``: the `parrot` frontend, else the
request-centric baseline; for the chain summary a `ChainClient`, which also says when Parrot learns the
outputs' criteria), never read off a system's name: an experiment may name its systems as it likes, and may
run the baseline's client on any server (`benchmarks.vllm_backends` runs it straight against vLLM).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import parrot as P
from parrot.protocol import Criteria

from benchmarks.harness import measure
from benchmarks.harness.clients import complete, greedy, parrot_users
from benchmarks.harness.systems import Served
from benchmarks.workloads.copilot import CopilotWorkload
from benchmarks.workloads.map_reduce_app import MapReduceDoc, baseline_map_reduce, parrot_map_reduce
from benchmarks.workloads.summary_chain import TEMPLATE, baseline_chain, parrot_chain

__all__ = [
    "CHAIN_CLIENTS",
    "ChainClient",
    "copilot_batch",
    "map_reduce",
    "summary_chain",
    "summary_chains",
    "timed_jobs",
    "verify_summary_chain",
]

TimedJobs = dict[str, Callable[[], Awaitable[measure.Run]]]


def timed_jobs(served: Served, jobs: Mapping[str, measure.Job]) -> TimedJobs:
    """Each job timed on ``served`` (`measure.timed`) when called, by name: what `measure.agree` and
    `measure.interleave` run."""
    return {name: functools.partial(measure.timed, served, job) for name, job in jobs.items()}


@dataclass(frozen=True)
class ChainClient:
    """How a client runs the chain summary: through the `parrot` frontend (``submit_criteria``: the
    outputs' criteria given at submit too, so the server starts each step as soon as its input exists;
    None: only at the ``aget`` of the last summary), or as the request-centric baseline."""

    parrot: bool
    submit_criteria: Criteria | None = None


def summary_chain(
    served: Served, client: ChainClient, chunks: Sequence[str], max_tokens: int, every_step: bool = False
) -> measure.Job:
    """``client``'s chain summary (`benchmarks.workloads.summary_chain`) over ``chunks`` on ``served``.
    Its output: the last summary, or with ``every_step`` every summary (a tuple)."""
    sampling = P.SamplingConfig(**greedy(max_tokens))
    fn = P.SemanticFunction.from_template(
        TEMPLATE, name="summarize", sampling=sampling, criteria=client.submit_criteria
    )

    async def run(done: Callable[[], None]) -> str | tuple[str, ...]:
        if client.parrot:
            outputs = await parrot_chain(served.http, fn, chunks, every_step=every_step, on_result=done)
        else:
            outputs = await baseline_chain(served.http, chunks, max_tokens, model=served.model_name)
        return tuple(outputs) if every_step else outputs[-1]

    return run


def summary_chains(
    served: Served,
    clients: Mapping[str, ChainClient],
    chunks: Sequence[str],
    max_tokens: int,
    every_step: bool = False,
) -> TimedJobs:
    """Each client's chain on ``served`` (`summary_chain`), timed, by the client's name."""
    return timed_jobs(
        served, {n: summary_chain(served, c, chunks, max_tokens, every_step) for n, c in clients.items()}
    )


# Every client of the chain, by the name `verify_summary_chain` reports a difference under.
CHAIN_CLIENTS = {
    "parrot": ChainClient(parrot=True),
    "parrot, criteria at submit": ChainClient(parrot=True, submit_criteria=P.LATENCY),
    "baseline": ChainClient(parrot=False),
}


async def verify_summary_chain(served: Served, chunks: Sequence[str], max_tokens: int) -> tuple[str, ...]:
    """Every step's output equal between every client of the chain (`CHAIN_CLIENTS`) on ``served``
    (greedy; a difference stops the run): the common summaries. Untimed; also every client's warm-up."""
    return await measure.agree(summary_chains(served, CHAIN_CLIENTS, chunks, max_tokens, every_step=True))


def map_reduce(served: Served, doc: MapReduceDoc, *, parrot: bool) -> measure.Job:
    """The map-reduce summary of ``doc`` (`benchmarks.workloads.map_reduce_app`) through the `parrot`
    frontend or the baseline, timed to the final summary in hand."""
    if parrot:
        return lambda done: parrot_map_reduce(served.http, doc, on_result=lambda _: done())
    return lambda done: baseline_map_reduce(
        served.http, doc, model=served.model_name, on_result=lambda _: done()
    )


def copilot_batch(
    served: Served, workload: CopilotWorkload, batch: int, max_tokens: int, *, parrot: bool
) -> measure.Job:
    """The first ``batch`` users of the copilot app (`benchmarks.workloads.copilot`) at once: one `parrot`
    session each, or ``batch`` completions of the rendered prompts (baseline); timed to the last answer in
    hand (the sessions' ``DELETE`` is not)."""
    if not parrot:
        prompts = workload.prompts(batch)
        model = served.model_name
        return lambda _: asyncio.gather(*(complete(served.http, p, max_tokens, model=model) for p in prompts))
    queries = [{"query": q} for q in workload.queries[:batch]]
    return parrot_users(served.http, workload.template, queries, max_tokens, name="copilot")
