"""A DAG of Parrot template calls, run by both clients of an application experiment.

A workload that is a DAG of LLM calls (`benchmarks.workloads.multi_agent`'s team of agents) describes every
call as a Parrot template whose inputs are earlier calls' outputs, grouped into stages of parallel calls
(`TemplateDag`). Both clients run that one description, so their outputs can be compared call by call:

* `parrot_dag` — the `parrot` frontend: every call queued in one session, one latency ``aget`` of the
  final output sends the DAG, which the server then sees whole (objective deduction, prefix sharing);
* `baseline_dag` — a request-centric client: a stage's prompts rendered client-side from the answers so
  far, sent as concurrent ``/v1/completions``, the next stage after all are in (one round trip per stage).

`longest_request` sizes the DAG's requests once its outputs are known. An experiment sweeping such a DAG
over a size runs it with `benchmarks.harness.dag_sweeps`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import httpx
import parrot as P

from benchmarks.harness.clients import complete, greedy
from benchmarks.harness.measure import Job
from benchmarks.harness.systems import Served

__all__ = ["TemplateCall", "TemplateDag", "baseline_dag", "job", "longest_request", "parrot_dag"]


class TemplateCall(Protocol):
    """One call of the DAG: a template with one output variable, whose inputs are earlier calls' outputs."""

    @property
    def output(self) -> str: ...  # the output variable's name: also names the call

    @property
    def template(self) -> str: ...

    @property
    def inputs(self) -> Sequence[str]: ...  # the template's input names: earlier calls' outputs

    @property
    def max_tokens(self) -> int: ...


class TemplateDag(Protocol):
    """Every call in a topological order, the stages of parallel calls (by output), the final output."""

    @property
    def calls(self) -> Sequence[TemplateCall]: ...

    @property
    def stages(self) -> Sequence[Sequence[str]]: ...

    @property
    def final(self) -> str: ...  # the output the client waits for

    def call(self, output: str) -> TemplateCall: ...

    def prompt(self, output: str, values: Mapping[str, str]) -> str:
        """The rendered prompt of the call producing ``output``, given the input ``values``."""
        ...


async def parrot_dag(
    client: httpx.AsyncClient, dag: TemplateDag, done: Callable[[], None], everything: bool = False
) -> dict[str, str]:
    """The DAG through the `parrot` frontend: every call queued in one session, sent with the latency
    ``aget`` of the final output; ``done()`` when it is in hand. The final output by name, or with
    ``everything`` every call's (fetched after ``done``)."""
    async with P.Session(str(client.base_url), client=client, timeout=600.0):
        made: dict[str, P.Variable] = {}
        for c in dag.calls:
            sampling = P.SamplingConfig(**greedy(c.max_tokens))
            fn = P.SemanticFunction.from_template(c.template, name=c.output, sampling=sampling)
            out = fn(**{name: made[name] for name in c.inputs})
            assert isinstance(out, P.Variable)
            made[c.output] = out
        values = {dag.final: await made[dag.final].aget(criteria="latency")}
        done()
        if everything:
            values.update({name: await var.aget() for name, var in made.items()})
    return values


async def baseline_dag(
    client: httpx.AsyncClient,
    dag: TemplateDag,
    done: Callable[[], None],
    everything: bool = False,
    model: str | None = None,
) -> dict[str, str]:
    """The DAG as a request-centric client runs it: a stage's prompts rendered from the answers so far,
    sent as concurrent ``/v1/completions``, the next stage after all are in (outputs as Parrot's)."""
    values: dict[str, str] = {}
    for stage in dag.stages:
        prompts = [(dag.prompt(out, values), dag.call(out).max_tokens) for out in stage]
        answers = await asyncio.gather(*(complete(client, p, n, model=model) for p, n in prompts))
        values.update(zip(stage, answers, strict=True))
    done()
    return values if everything else {dag.final: values[dag.final]}


def job(served: Served, dag: TemplateDag, baseline: str, everything: bool = False) -> Job:
    """The DAG on ``served`` as a harness job: the request-centric client's on the system named
    ``baseline``, Parrot's on any other."""
    if served.system.name == baseline:
        model = served.model_name
        return lambda done: baseline_dag(served.http, dag, done, everything, model)
    return lambda done: parrot_dag(served.http, dag, done, everything)


def longest_request(dag: TemplateDag, tokenizer: Any, values: Mapping[str, str], max_model_len: int) -> int:
    """The longest request (prompt tokens + ``max_tokens``) given every call's output ``values``;
    ValueError when it exceeds ``max_model_len``."""
    longest = max(len(tokenizer.encode(dag.prompt(c.output, values))) + c.max_tokens for c in dag.calls)
    if longest > max_model_len:
        raise ValueError(
            f"the longest request needs {longest} positions, the model has {max_model_len}: use fewer "
            "calls, shorter prompts or smaller output budgets"
        )
    return longest
