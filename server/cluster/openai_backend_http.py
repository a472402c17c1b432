"""The HTTP side of an OpenAI-compatible server used as an engine (`server.cluster.openai_backend`): its
configuration, what is read from it when it joins (served model, tokenizer check), one streamed completion
with token ids, and its errors as engine errors."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import httpx

from server.cluster.remote_engine import RemoteEngineError
from server.cluster.task_stream import Emit
from server.common.settings import BACKEND_API_KEY
from server.engine.errors import EngineDeadError, EngineDrainingError
from server.engine.loader import load_tokenizer
from server.engine.request import FinishReason, GenerateResult

__all__ = [
    "BACKEND_KEY_ENV",
    "OpenAIBackendConfig",
    "check_tokenizer",
    "local_tokenizer",
    "served_model",
    "stream_completion",
]

log = logging.getLogger(__name__)

# The backends' API key (sent as a bearer token), unless a configuration gives its own.
BACKEND_KEY_ENV = BACKEND_API_KEY.name

# Text whose tokens the local tokenizer must give exactly as the backend's /tokenize does.
_PROBE = "Parrot checks its tokenizer: 3.14 naïve café — 你好 <|im_start|> done.\n\n  end"
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class OpenAIBackendConfig:
    """One OpenAI-compatible server serving as an engine.

    ``model``: the served model's id (None: the server's first model); the manager routes by it.
    ``tokenizer``: a model name or path whose tokenizer is the backend's (None: the served model's id, when
    it names a model here). ``capacity_tokens``: tokens the backend runs at once (its KV cache), the
    scheduler's capacity; ``latency_cap_tokens``: at most this many while it runs latency-critical work.
    ``priority``: forward priorities (only for a backend that schedules by priority). ``timeout_s``: the
    longest a backend may stay silent (connecting, or between two tokens of an answer).
    ``warm_min_tokens``: a shared prefix at least this long is computed on the backend once, before the
    requests that fork from it go out (`OpenAIBackendEngine._warmed`). ``api_key``: sent as a bearer token
    (default: ``$PARROT_BACKEND_API_KEY``, if set).
    """

    url: str
    model: str | None = None
    tokenizer: str | None = None
    api_key: str | None = field(default_factory=BACKEND_API_KEY.get, repr=False)
    capacity_tokens: int = 16384
    latency_cap_tokens: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    priority: bool = False
    timeout_s: float = 60.0
    warm_min_tokens: int = 64

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"an OpenAI backend's URL starts with http:// or https://, got {self.url!r}")
        if self.capacity_tokens < self.block_size or self.block_size < 1:
            raise ValueError(
                f"capacity_tokens ({self.capacity_tokens}) must hold at least one block of {self.block_size}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], emit: Emit, timeout_s: float
) -> GenerateResult:
    """``POST /v1/completions`` of ``body`` (streamed, with ``return_token_ids``): each chunk's token ids to
    ``emit``; the answer's ids, text and finish reason at the end."""
    token_ids: list[int] = []
    text: list[str] = []
    finish: str | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if not response.is_success:
                await response.aread()
                raise _error(url, response)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise _answered_error(url, event["error"], 502)
                for choice in event.get("choices") or []:
                    ids = choice.get("token_ids")
                    if ids is None and (choice.get("text") or choice.get("finish_reason") is None):
                        raise RemoteEngineError(
                            f"the OpenAI backend at {url} does not return token ids (return_token_ids): "
                            "it cannot serve as an engine",
                            502,
                            "backend_unsupported",
                        )
                    for t in ids or []:
                        token_ids.append(int(t))
                        emit(int(t), None)  # logprobs are not relayed (refused at submit)
                    text.append(choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
    except httpx.TimeoutException as e:
        raise EngineDeadError(
            f"the OpenAI backend at {url} was silent for {timeout_s:g}s ({type(e).__name__})"
        ) from e
    except httpx.TransportError as e:
        raise _unreachable(url, e) from e
    if finish is None:
        raise EngineDeadError(f"the OpenAI backend at {url} ended an answer without a finish reason")
    reason = _WHOLE_ANSWER.get(finish)
    if reason is None:  # e.g. vLLM's "abort": the answer is not whole
        raise RemoteEngineError(
            f"the OpenAI backend at {url} ended an answer with {finish!r}", 502, "backend_error"
        )
    return GenerateResult(token_ids, "".join(text), reason, len(body["prompt"]))


# -------------------------------------------------------------------------------------------- connecting
# The finish reasons of a whole answer, as ours.
_WHOLE_ANSWER: dict[str, FinishReason] = {"stop": "stop", "length": "length"}


def served_model(client: httpx.Client, url: str, model: str | None) -> dict[str, Any]:
    try:
        response = client.get("/v1/models")
    except httpx.TransportError as e:
        raise _unreachable(url, e) from e
    if not response.is_success:
        raise _error(url, response)
    try:
        cards = [c for c in response.json()["data"] if isinstance(c, dict) and isinstance(c.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise EngineDeadError(f"GET {url}/v1/models did not answer an OpenAI model list") from None
    if not cards:
        raise EngineDeadError(f"the OpenAI backend at {url} serves no model")
    if model is None:
        return cards[0]
    for card in cards:
        if card["id"] == model:
            return card
    served = ", ".join(repr(c["id"]) for c in cards[:8])
    raise ValueError(f"the OpenAI backend at {url} does not serve {model!r} (it serves {served})")


def local_tokenizer(name: str, url: str, explicit: bool) -> Any:
    try:
        return load_tokenizer(name)
    except (OSError, ValueError) as e:
        hint = "" if explicit else f" (the served model's id, {name!r}, names no model here)"
        raise ValueError(
            f"no tokenizer for the OpenAI backend at {url}{hint}: configure its tokenizer as a model name "
            f"or path (--openai-backend-tokenizer): {e}"
        ) from e


def check_tokenizer(client: httpx.Client, url: str, model: str, tokenizer: Any) -> None:
    """The local tokenizer must encode as the backend does (its ``/tokenize``, where it has one)."""
    try:
        response = client.post(
            "/tokenize", json={"model": model, "prompt": _PROBE, "add_special_tokens": False}
        )
    except httpx.TransportError as e:
        raise _unreachable(url, e) from e
    if response.status_code in (404, 405):
        log.warning("the OpenAI backend at %s has no /tokenize: its tokenizer is assumed, not checked", url)
        return
    if not response.is_success:
        raise _error(url, response)
    theirs = response.json().get("tokens")
    ours = tokenizer.encode(_PROBE, add_special_tokens=False)
    if theirs != ours:
        raise ValueError(
            f"the tokenizer configured for the OpenAI backend at {url} encodes differently from the "
            "backend's own (/tokenize): configure the backend model's tokenizer"
        )


# ------------------------------------------------------------------------------------------------ errors
def _unreachable(url: str, e: httpx.TransportError) -> EngineDeadError:
    return EngineDeadError(f"the OpenAI backend at {url} cannot be reached ({type(e).__name__}: {e})")


def _error(url: str, response: httpx.Response) -> RemoteEngineError:
    try:
        data = response.json()
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return _answered_error(url, data["error"], response.status_code)
    detail = response.text[:_MAX_ERROR_CHARS]
    return _typed(
        f"the OpenAI backend at {url} answered HTTP {response.status_code}: {detail}",
        response.status_code,
        "backend_error",
    )


def _answered_error(url: str, error: Any, status: int) -> RemoteEngineError:
    """An ``{"error": ...}`` the backend answered: its message, its status and type where it gives them."""
    if not isinstance(error, dict):
        return _typed(f"the OpenAI backend at {url} answered: {str(error)[:_MAX_ERROR_CHARS]}", status, "")
    message = str(error.get("message", ""))[:_MAX_ERROR_CHARS]
    code = error.get("code")
    if isinstance(code, int) and 400 <= code < 600:
        status = code
    kind = error.get("type")
    if not isinstance(kind, str):
        kind = ""
    return _typed(f"the OpenAI backend at {url} answered: {message}", status, kind)


def _typed(message: str, status: int, kind: str) -> RemoteEngineError:
    """The backend's error with an engine error type: one that says the backend cannot serve now (502, 503,
    504: dead, overloaded, a gateway's timeout) is ``engine_dead`` — the manager then runs the work
    elsewhere and checks the backend until it serves again — unless the backend said it is draining."""
    if status in (502, 503, 504) and kind != EngineDrainingError.error_type:
        kind = EngineDeadError.error_type
    return RemoteEngineError(message, status, kind or "backend_error")
