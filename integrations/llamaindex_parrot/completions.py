"""The server's OpenAI-compatible endpoints (``/v1/completions``, ``/v1/chat/completions``), sync and async.

`ParrotLLM.complete` / ``chat`` and their streams are plain requests on rendered text: LlamaIndex hands
them a finished prompt or a message list, so there is no template to send unrendered. Bodies are built
from the same `parrot.protocol.SamplingConfig` the semantic calls use, so both paths sample alike; errors
become the parrot client's typed errors (`parrot.ConnectionError` names the URL). Streams are server-sent
events; an error event inside a stream raises.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from parrot.errors import ParrotError, error_from_response, error_from_transport
from parrot.protocol import ErrorResponse, SamplingConfig
from parrot.sampling import openai_sampling

__all__ = ["OpenAIEndpoint", "chat_body", "choice_text", "completion_body", "delta_text"]

# LlamaIndex roles the server's chat endpoint takes (it reads "developer" as "system"); by value, since
# older llama-index-core releases have no DEVELOPER member.
_ROLES = frozenset({"system", "developer", "user", "assistant"})


def completion_body(model: str | None, prompt: str, sampling: SamplingConfig, stream: bool) -> dict[str, Any]:
    """The ``POST /v1/completions`` body for one prompt."""
    body = {"prompt": prompt, "stream": stream, **openai_sampling(sampling)}
    if model is not None:
        body["model"] = model
    return body


def chat_body(
    model: str | None, messages: Sequence[ChatMessage], sampling: SamplingConfig, stream: bool
) -> dict[str, Any]:
    """The ``POST /v1/chat/completions`` body; raises `ValueError` for a role the endpoint has no use for."""
    wire = []
    for i, m in enumerate(messages):
        role = MessageRole(m.role).value
        if role not in _ROLES:
            raise ValueError(
                f"message {i} has role {role!r}: the Parrot chat endpoint takes system, developer, "
                "user and assistant messages (tool and function messages need a tool-calling model)"
            )
        wire.append({"role": role, "content": m.content or ""})
    body = {"messages": wire, "stream": stream, **openai_sampling(sampling)}
    if model is not None:
        body["model"] = model
    return body


def choice_text(data: dict[str, Any], chat: bool) -> str:
    """The text of the first choice of a (non-streamed) answer."""
    choice = data["choices"][0]
    return str(choice["message"]["content"] if chat else choice["text"])


def delta_text(chunk: dict[str, Any], chat: bool) -> str:
    """The new text in one streamed chunk (empty for the role chunk and the usage chunk)."""
    if not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    return str((choice["delta"].get("content") if chat else choice["text"]) or "")


def _event(line: str, url: str) -> dict[str, Any] | None:
    """The JSON payload of one SSE line (None for other lines and for the final ``[DONE]``)."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == "[DONE]":
        return None
    data = json.loads(payload)
    if "error" in data:
        error = ErrorResponse.model_validate(data).error
        raise ParrotError(f"the stream from {url} failed: {error.message}", type=error.type)
    return data


class OpenAIEndpoint:
    """``POST`` requests to one Parrot server's OpenAI-compatible API, each with its own httpx client
    (so that a sync call and an async one on any event loop never share a connection pool)."""

    def __init__(self, base_url: str, timeout: float, api_key: str | None = None) -> None:
        self.base_url = base_url
        self.timeout = timeout
        # Sent on every request: a server started with --api-key refuses the OpenAI routes without it.
        self.headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.base_url + path
        try:
            with httpx.Client(timeout=self.timeout, headers=self.headers) as client:
                response = client.post(url, json=body)
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e
        if not response.is_success:
            raise error_from_response(response)
        return dict(response.json())

    async def apost(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.base_url + path
        try:
            async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
                response = await client.post(url, json=body)
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e
        if not response.is_success:
            raise error_from_response(response)
        return dict(response.json())

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed answer, in order (the request starts at the first ``next``)."""
        url = self.base_url + path
        try:
            with (
                httpx.Client(timeout=self.timeout, headers=self.headers) as client,
                client.stream("POST", url, json=body) as response,
            ):
                if not response.is_success:
                    response.read()
                    raise error_from_response(response)
                for line in response.iter_lines():
                    if (data := _event(line, url)) is not None:
                        yield data
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e

    async def astream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """``async`` form of `stream`."""
        url = self.base_url + path
        try:
            async with (
                httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client,
                client.stream("POST", url, json=body) as response,
            ):
                if not response.is_success:
                    await response.aread()
                    raise error_from_response(response)
                async for line in response.aiter_lines():
                    if (data := _event(line, url)) is not None:
                        yield data
        except httpx.TransportError as e:
            raise error_from_transport(e, url) from e
