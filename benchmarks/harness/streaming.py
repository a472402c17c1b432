"""A streamed completion timed by its client: job completion time and time to first token.

`clients.complete` waits for a whole answer; a scheduling experiment also needs when the first token came
(how long a request waited before it ran) and how many tokens the engine wrote (its true output length,
EOS not ignored). `streamed` sends ``POST /v1/completions`` with ``stream: true`` and the usage chunk, and
times both ends on the wall clock; `open_loop` sends many at their arrival times (`arrivals.wall_clock`).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.harness.arrivals import wall_clock

__all__ = ["Answer", "open_loop", "streamed"]


@dataclass(frozen=True)
class Answer:
    """One streamed answer: seconds from the request to its last and first chunk, text, output tokens."""

    jct_s: float
    ttft_s: float
    text: str
    tokens: int


async def streamed(
    http: httpx.AsyncClient, prompt: str, max_tokens: int, priority: float | None = None
) -> Answer:
    """One streamed greedy completion of ``prompt`` (EOS ends it; ``priority``, if given, is sent for an
    SJF engine to order by); times from the request to its first and last chunk."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    body["stream_options"] = {"include_usage": True}
    if priority is not None:
        body["priority"] = priority
    start = time.perf_counter()
    first, parts, tokens = None, [], 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices", []):
                if first is None:
                    first = time.perf_counter()
                parts.append(choice.get("text", ""))
    end = time.perf_counter()
    return Answer(end - start, (first or end) - start, "".join(parts), tokens)


async def open_loop(
    http: httpx.AsyncClient,
    prompts: Sequence[str],
    max_tokens: int,
    arrivals: Sequence[float] | None = None,
    priorities: Sequence[float] | None = None,
) -> tuple[list[Answer], float]:
    """Each prompt `streamed` at its arrival time (seconds from now; None: all at once), with its priority
    if given; the answers in order and the makespan."""
    at = arrivals or [0.0] * len(prompts)
    each = priorities or [None] * len(prompts)
    return await wall_clock(
        (t, functools.partial(streamed, http, prompt, max_tokens, priority))
        for t, prompt, priority in zip(at, prompts, each, strict=True)
    )
