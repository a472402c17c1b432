"""Chain summary of a long document (the Parrot paper's Fig. 11-13 app), written for both clients.

The job: ``steps`` document chunks (stdlib docstrings, `benchmarks.workloads.text.document_chunks`); step
*i* reads the summary written by step *i - 1* plus chunk *i* and writes the next summary. Greedy, EOS
ignored: every step writes exactly its budget (`clients.greedy`).

* `parrot_chain` — the `parrot` frontend: every step queued in one session (each call's input is the
  previous call's output variable), then one ``aget(criteria=P.LATENCY)`` of the last summary: the server
  runs the chain with no client round trip in between.
* `baseline_chain` — what a LangChain app does against an OpenAI-style service: render the prompt
  (`render_prompt`), ``POST /v1/completions``, wait, render the next one.

Both render the same `TEMPLATE`, so on one server they write the same summaries (the experiments check it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import parrot as P

from benchmarks.harness.clients import complete
from benchmarks.workloads.text import render_template

__all__ = ["FIRST_SUMMARY", "TEMPLATE", "baseline_chain", "parrot_chain", "render_prompt"]

TEMPLATE = """You are summarizing a long document one part at a time.
Summary of the document so far: {{input:previous}}
Next part of the document:
{{input:chunk}}
Updated summary of the document so far: {{output:summary}}"""
FIRST_SUMMARY = "(nothing yet)"


def render_prompt(previous: str, chunk: str) -> str:
    """The baseline's client-side rendering of a step (exactly what the Parrot server renders)."""
    return render_template(TEMPLATE, {"previous": previous, "chunk": chunk})


async def parrot_chain(
    client: httpx.AsyncClient,
    fn: P.SemanticFunction,
    chunks: Sequence[str],
    *,
    every_step: bool = False,
    on_result: Callable[[], None] | None = None,
) -> list[str]:
    """Every step queued in one session, then one ``aget`` of the last summary (``on_result`` is called
    the moment it is in hand); ``every_step`` then also fetches the other summaries."""
    async with P.Session(str(client.base_url), client=client, timeout=300.0):
        made: list[Any] = []
        previous: Any = FIRST_SUMMARY
        for chunk in chunks:
            previous = fn(previous=previous, chunk=chunk)
            made.append(previous)
        last = await made[-1].aget(criteria=P.LATENCY)
        if on_result is not None:
            on_result()
        earlier = await asyncio.gather(*(v.aget() for v in made[:-1])) if every_step else []
    return [*earlier, last]


async def baseline_chain(
    client: httpx.AsyncClient, chunks: Sequence[str], max_tokens: int, *, model: str | None = None
) -> list[str]:
    """Render, ``POST /v1/completions``, wait, repeat: one client round trip per step."""
    outputs, previous = [], FIRST_SUMMARY
    for chunk in chunks:
        previous = await complete(client, render_prompt(previous, chunk), max_tokens, model=model)
        outputs.append(previous)
    return outputs
