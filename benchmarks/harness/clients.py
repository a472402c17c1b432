"""The request-centric client every baseline runs: OpenAI-style requests with prompts rendered client-side.

Parrot's side of an experiment is the `parrot` frontend itself (a session over `Served.http`); the
baseline is what a LangChain app does against vLLM: render, ``POST /v1/completions``, wait, repeat.
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["complete", "greedy"]


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
