"""The request-centric client every baseline runs: OpenAI-style requests with prompts rendered client-side.

Parrot's side of an experiment is the `parrot` frontend itself (a session over `Served.http`); the
baseline is what a LangChain app does against vLLM: render, ``POST /v1/completions``, wait, repeat.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

__all__ = ["complete", "greedy", "parrot_users", "stream_chat"]


def greedy(max_tokens: int) -> dict[str, Any]:
    """Greedy sampling with EOS ignored: every call writes exactly ``max_tokens`` tokens (both clients), so
    outputs can be compared and work counted exactly."""
    return {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


async def complete(
    http: httpx.AsyncClient, prompt: str, max_tokens: int, *, model: str | None = None, **sampling: Any
) -> str:
    """One ``POST /v1/completions`` of a rendered ``prompt`` (greedy unless ``sampling`` says otherwise);
    the generated text."""
    body: dict[str, Any] = {"prompt": prompt, **greedy(max_tokens), **sampling}
    if model is not None:
        body["model"] = model
    response = await http.post("/v1/completions", json=body)
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def parrot_users(
    http: httpx.AsyncClient,
    template: str,
    inputs: list[dict[str, str]],
    max_tokens: int,
    *,
    name: str = "app",
    timeout: float = 600.0,
) -> Callable[[Callable[[], None]], Awaitable[list[str]]]:
    """Parrot's side of a one-call app used by many at once, as a harness job (`measure.Job`): one `parrot`
    session per user, each calling ``template``'s function (greedy) once with its ``inputs``, all at once;
    ``done`` is called when the last answer is in hand (the sessions' closing ``DELETE`` is not timed).
    Returns the answers in the users' order."""
    import parrot as P

    sampling = P.SamplingConfig(**greedy(max_tokens))
    fn = P.SemanticFunction.from_template(template, name=name, sampling=sampling)

    async def users(done: Callable[[], None]) -> list[str]:
        left = len(inputs)

        async def user(values: dict[str, str]) -> str:
            nonlocal left
            async with P.Session(str(http.base_url), client=http, timeout=timeout):
                answer = fn(**values)
                assert isinstance(answer, P.Variable)
                value = str(await answer.aget())
                left -= 1
                if not left:
                    done()
            return value

        return list(await asyncio.gather(*(user(values) for values in inputs)))

    return users


async def stream_chat(
    http: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int
) -> dict[str, Any]:
    """One streamed, greedy ``POST /v1/chat/completions`` of a whole conversation so far: its TTFT
    (``ttft_s``: seconds to the first chunk with content), the answer's ``text``, and the engine's own
    ``prompt_tokens`` and ``completion_tokens`` (the stream's usage chunk)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}  # the engine's token counts in the last chunk
    ttft, parts, usage = math.nan, [], {}
    start = time.perf_counter()
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the server streamed an error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if content := choice["delta"].get("content"):
                    ttft = time.perf_counter() - start if not parts else ttft
                    parts.append(content)
    return {"ttft_s": ttft, "text": "".join(parts)} | {
        k: usage[k] for k in ("prompt_tokens", "completion_tokens")
    }
