"""Map-reduce summary of a long document (the Parrot paper's Fig. 14 app), written for both clients.

The job: a long document (stdlib docstrings, `benchmarks.workloads.text.document_chunks`) cut into parts;
one *map* call per part writes its summary, then one *reduce* call reads every summary and writes the whole
document's. Greedy, EOS ignored: every call writes exactly its budget (`clients.greedy`).

* `parrot_map_reduce` — the `parrot` frontend: the map calls and the reduce call queued in one session and
  sent with the ``aget`` of the reduce output (one DAG; deduction groups the map calls).
* `baseline_map_reduce` — what a LangChain app does against an OpenAI-style service: concurrent
  ``/v1/completions`` of the map prompts it renders, then the reduce.

Both render the same templates, so on one server they give the same summary (the experiments check it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import parrot as P
from parrot.protocol import Criteria

from benchmarks.harness.clients import complete, greedy
from benchmarks.workloads.text import document_chunks, render_template

__all__ = [
    "MAP_TEMPLATE",
    "REDUCE_HEAD",
    "REDUCE_TAIL",
    "MapReduceDoc",
    "OnResult",
    "baseline_map_reduce",
    "make_doc",
    "parrot_map_reduce",
]

MAP_TEMPLATE = """Summarize this part of a long document in a few sentences.
Part of the document:
{{input:chunk}}
Summary of this part: {{output:summary}}"""
REDUCE_HEAD = "Summaries of the parts of a long document, in order:"
REDUCE_TAIL = "Summary of the whole document: {{output:summary}}"

OnResult = Callable[[str], None]


@dataclass(frozen=True)
class MapReduceDoc:
    """One map-reduce job: the document's parts and the token budgets of the map and reduce calls."""

    chunks: tuple[str, ...]
    map_tokens: int
    reduce_tokens: int

    @property
    def reduce_template(self) -> str:
        """The reduce call's template: one input per part's summary, in order."""
        parts = [f"{{{{input:part{i}}}}}" for i in range(len(self.chunks))]
        return "\n".join([REDUCE_HEAD, *parts, REDUCE_TAIL])

    def map_prompt(self, chunk: str) -> str:
        return render_template(MAP_TEMPLATE, {"chunk": chunk})

    def reduce_prompt(self, summaries: Sequence[str]) -> str:
        return render_template(self.reduce_template, {f"part{i}": s for i, s in enumerate(summaries)})


def make_doc(
    tokenizer: Any, chunks: int, chunk_tokens: int, map_tokens: int, reduce_tokens: int
) -> MapReduceDoc:
    """The job over ``chunks`` consecutive parts of the stdlib text, ``chunk_tokens`` tokens each."""
    return MapReduceDoc(tuple(document_chunks(tokenizer, chunks, chunk_tokens)), map_tokens, reduce_tokens)


async def parrot_map_reduce(
    client: httpx.AsyncClient,
    doc: MapReduceDoc,
    *,
    criteria: Criteria = "latency",
    timeout: float = 300.0,
    on_result: OnResult | None = None,
) -> str:
    """The job through the `parrot` frontend: map and reduce calls queued in one session, sent with the
    ``aget`` of the reduce output; ``on_result`` gets the summary as soon as it is in hand (for timing)."""
    summarize = P.SemanticFunction.from_template(
        MAP_TEMPLATE, name="summarize_part", sampling=P.SamplingConfig(**greedy(doc.map_tokens))
    )
    combine = P.SemanticFunction.from_template(
        doc.reduce_template, name="combine", sampling=P.SamplingConfig(**greedy(doc.reduce_tokens))
    )
    async with P.Session(str(client.base_url), client=client, timeout=timeout):
        summaries = [summarize(chunk=chunk) for chunk in doc.chunks]
        final = combine(**{f"part{i}": s for i, s in enumerate(summaries)})
        assert isinstance(final, P.Variable)
        value = await final.aget(criteria=criteria)
        if on_result is not None:
            on_result(value)
    return value


async def baseline_map_reduce(
    client: httpx.AsyncClient,
    doc: MapReduceDoc,
    *,
    model: str | None = None,
    on_result: OnResult | None = None,
) -> str:
    """The job as a request-centric client runs it: concurrent map completions, then the reduce."""
    maps = (complete(client, doc.map_prompt(c), doc.map_tokens, model=model) for c in doc.chunks)
    summaries = await asyncio.gather(*maps)
    value = await complete(client, doc.reduce_prompt(summaries), doc.reduce_tokens, model=model)
    if on_result is not None:
        on_result(value)
    return value
