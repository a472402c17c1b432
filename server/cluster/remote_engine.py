"""`RemoteEngine`: an engine in another process (``python -m server.engine --manager URL``), over HTTP.

It offers the manager and the OpenAI layer the same interface as an in-process `LLMEngine` — ``fill``,
``generate``, ``submit_generate`` (a stream of token ids), ``free_context``, ``stats()``, ``tokenizer``,
``model_name``, ``max_model_len``, ``block_size`` — by calling the engine's HTTP API (`server.engine.api`).
The tokenizer is the engine's own, fetched once (``GET /tokenizer``), so prompts are tokenized exactly as
the engine would. ``stats()`` answers from the last heartbeat the engine sent
(``POST /v1/engines/{id}/heartbeat``) without I/O, since the scheduler reads it synchronously.

Every generate is streamed from the engine, even when the caller wants only the result: if the caller goes
away, closing the stream aborts the request on the engine (a plain request would keep generating there).
Errors keep their engine type and status (`RemoteEngineError`); an engine that cannot be reached is an
`EngineDeadError` naming its URL.

Every call carries the cluster token (``Authorization: Bearer``). Registration is a request from outside,
so `connect` fetches only ``/info`` and ``/tokenizer`` from the URL it is given, within a time and a size
limit, follows no redirect, and never quotes what the URL answered in its errors (no SSRF read-back).
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import httpx
from parrot.protocol import ErrorResponse, SamplingConfig, TokenLogprobConfig
from pydantic import BaseModel, ValidationError
from transformers import AutoTokenizer  # at import: its lazy import in threads can race

from server.cluster.task_stream import Emit, TaskStream
from server.engine.errors import ContextBusyError, EngineDeadError, EngineError
from server.engine.interface import Engine
from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams, TokenLogprob
from server.engine.wire import (
    EngineFillRequest,
    EngineFillResponse,
    EngineFreeContextRequest,
    EngineGenerateRequest,
    EngineGenerateResponse,
    EngineInfo,
    EngineStats,
    EngineStreamChunk,
    EngineTokenizerFiles,
)

__all__ = ["RemoteEngine", "RemoteEngineError", "RemoteGenerationStream"]

log = logging.getLogger(__name__)

# A context is busy for a moment after its generate was aborted; its free is retried this long.
_FREE_RETRY_S = 5.0
# What a registering engine's URL may answer: an engine's /info is a few hundred bytes; the largest
# tokenizers' files (tokenizer.json of 150k-token vocabularies) are tens of MB.
MAX_INFO_BYTES = 64 * 1024
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024


class RemoteEngineError(EngineError):
    """An error the remote engine answered, with its status and type (e.g. 413 ``prompt_too_long``)."""

    def __init__(self, message: str, http_status: int, error_type: str) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.error_type = error_type


class RemoteEngine(Engine):
    """A remote engine's HTTP API behind the `LLMEngine` interface the manager uses. Make one with
    `connect`; `aclose` closes its HTTP client."""

    name: str
    url: str

    def __init__(
        self, url: str, name: str, info: EngineInfo, tokenizer: Any, client: httpx.AsyncClient
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.model_name = info.model
        self.max_model_len = info.max_model_len
        self.block_size = info.block_size
        self.vocab_size = info.vocab_size
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.tokenizer = tokenizer
        self._client = client
        self._stats = EngineStats(
            model=info.model,
            block_size=info.block_size,
            blocks_total=info.blocks_total,
            blocks_used=0,
            blocks_free=info.blocks_total,
            contexts=0,
            running=0,
            waiting=0,
            tokens_in_last_step=0,
            prefill_tokens_computed=0,
            decode_tokens_computed=0,
            steps=0,
            preemptions=0,
            evictions=0,
            grouped_decode_steps=0,
            max_model_len=info.max_model_len,
        )

    @classmethod
    async def connect(
        cls, url: str, name: str, timeout: float = 30.0, *, token: str | None = None
    ) -> RemoteEngine:
        """Read the engine's model and tokenizer from ``url`` (within ``timeout`` seconds in all), sending
        the cluster ``token`` then and on every later call; `EngineDeadError` if it cannot be reached or
        does not answer as an engine."""
        headers = {"Authorization": f"Bearer {token}"} if token is not None else None
        client = httpx.AsyncClient(
            base_url=url.rstrip("/"), timeout=httpx.Timeout(timeout, read=None), headers=headers
        )
        try:
            async with asyncio.timeout(timeout):
                info = await _fetch(client, url, "/info", EngineInfo, MAX_INFO_BYTES)
                files = await _fetch(client, url, "/tokenizer", EngineTokenizerFiles, MAX_TOKENIZER_BYTES)
            tokenizer = await asyncio.to_thread(_load_tokenizer, files.files)
        except TimeoutError:
            await client.aclose()
            raise EngineDeadError(f"the engine at {url} did not answer within {timeout:g}s") from None
        except BaseException:
            await client.aclose()
            raise
        return cls(url, name, info, tokenizer, client)

    # ---------------------------------------------------------------------------- the engine interface
    async def fill(
        self,
        context_id: int,
        token_ids: list[int],
        parent_context_id: int | None = None,
        *,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> int:
        """As `LLMEngine.fill`: ``parent_len`` forks from the parent's first ``parent_len`` tokens;
        ``priority`` and ``tenant`` order it in the engine's waiting queue."""
        body = EngineFillRequest(
            context_id=context_id,
            token_ids=token_ids,
            parent_context_id=parent_context_id,
            parent_len=parent_len,
            priority=priority,
            tenant=tenant,
        )
        data = await _call(self._client, self.url, "POST", "/fill", body.model_dump(exclude_none=True))
        return EngineFillResponse.model_validate(data).num_tokens

    async def score(
        self,
        context_id: int,
        token_ids: list[int],
        top: int = 0,
        *,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> list[TokenLogprob]:
        """As `LLMEngine.score`, by the engine API's scoring fill."""
        body = EngineFillRequest(
            context_id=context_id, token_ids=token_ids, priority=priority, tenant=tenant, prompt_logprobs=top
        )
        data = await _call(self._client, self.url, "POST", "/fill", body.model_dump(exclude_none=True))
        scored = EngineFillResponse.model_validate(data).prompt_logprobs
        if scored is None:
            raise RemoteEngineError(
                f"engine {self.url} answered a scoring fill without prompt_logprobs: it predates scoring; "
                "upgrade it",
                502,
                "bad_gateway",
            )
        return logprobs_of(scored)

    def submit_generate(
        self,
        context_id: int,
        sampling: SamplingParams | None = None,
        parent_context_id: int | None = None,
        stream: bool = True,
        *,
        latency_cap: int | None = None,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> RemoteGenerationStream:
        """Start a generate; iterate the answer for token ids (``stream=True``), then await `result()`.
        ``latency_cap``, ``parent_len``, ``priority``, ``tenant``: as `LLMEngine.submit_generate`'s."""
        body = EngineGenerateRequest(
            context_id=context_id,
            parent_context_id=parent_context_id,
            parent_len=parent_len,
            sampling=SamplingConfig(**_sampling_fields(sampling or SamplingParams())),
            stream=True,
            latency_cap=latency_cap,
            priority=priority,
            tenant=tenant,
        )
        return RemoteGenerationStream(self, body.model_dump(exclude_none=True), stream)

    async def free_context(self, context_id: int) -> None:
        body = EngineFreeContextRequest(context_id=context_id).model_dump()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _FREE_RETRY_S
        while True:
            try:
                await _call(self._client, self.url, "POST", "/free_context", body)
                return
            except RemoteEngineError as e:
                if e.error_type != ContextBusyError.error_type or loop.time() > deadline:
                    raise
            await asyncio.sleep(0.02)

    def stats(self) -> EngineStats:
        """The engine's load as of its last heartbeat."""
        return self._stats

    def update_stats(self, stats: EngineStats) -> None:
        self._stats = stats

    async def aclose(self) -> None:
        await self._client.aclose()

    def __repr__(self) -> str:
        return f"<RemoteEngine {self.name} {self.url} model={self.model_name}>"


class RemoteGenerationStream(TaskStream):
    """A remote generate in flight, like `server.engine.GenerationStream`: token ids as they arrive
    (when made with ``stream=True``), then `result()`. `cancel()` closes the connection, which aborts the
    request on the engine."""

    def __init__(self, engine: RemoteEngine, body: dict[str, Any], stream: bool) -> None:
        self._engine = engine
        self._body = body
        super().__init__(self._generate, stream)

    async def _generate(self, emit: Emit) -> GenerateResult:
        engine = self._engine
        try:
            if engine._client.is_closed:
                raise EngineDeadError(f"the engine at {engine.url} is out of service")
            async with engine._client.stream("POST", "/generate", json=self._body) as response:
                if not response.is_success:
                    await response.aread()
                    raise _error(response)
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = ErrorResponse.model_validate(event).error
                        raise RemoteEngineError(error.message, _status_of(error.type), error.type)
                    if "finish_reason" in event:
                        final = EngineGenerateResponse.model_validate(event)
                        return result_of(final)
                    chunk = EngineStreamChunk.model_validate(event)
                    emit(chunk.token_id, None if chunk.logprob is None else logprobs_of([chunk.logprob])[0])
            raise EngineDeadError(f"engine {engine.name} at {engine.url} ended a generate without a result")
        except httpx.TransportError as e:
            raise _dead(engine.url, e) from e


def _sampling_fields(sampling: SamplingParams) -> dict[str, Any]:
    fields = {name: getattr(sampling, name) for name in SamplingConfig.model_fields}
    if sampling.guided is not None:
        fields["guided"] = asdict(sampling.guided)
    return fields


def result_of(response: EngineGenerateResponse) -> GenerateResult:
    """An engine API's generate answer as the engine's own result."""
    logprobs = None if response.logprobs is None else logprobs_of(response.logprobs)
    return GenerateResult(
        response.token_ids, response.text, response.finish_reason, response.prompt_tokens, logprobs
    )


def logprobs_of(configs: list[TokenLogprobConfig]) -> list[TokenLogprob]:
    """The engine API's per-token log-probabilities as the engine's own."""
    return [TokenLogprob(lp.token_id, lp.logprob, tuple(lp.top), lp.rank) for lp in configs]


async def _call(
    client: httpx.AsyncClient, url: str, method: str, path: str, body: dict[str, Any] | None = None
) -> Any:
    if client.is_closed:
        raise EngineDeadError(f"the engine at {url} is out of service")
    try:
        response = await client.request(method, path, json=body)
    except httpx.TransportError as e:
        raise _dead(url, e) from e
    if not response.is_success:
        raise _error(response)
    return response.json()


_M = TypeVar("_M", bound=BaseModel)


async def _fetch(client: httpx.AsyncClient, url: str, path: str, model: type[_M], max_bytes: int) -> _M:
    """``GET path`` of a registering engine as ``model``, read up to ``max_bytes``. Errors say what was
    wrong with the answer (status, size, shape), never what it said: the URL is the registrant's choice."""
    what = f"GET {url.rstrip('/')}{path}"
    body = bytearray()
    try:
        async with client.stream("GET", path) as response:
            if response.status_code in (401, 403):
                raise EngineDeadError(_refused_token(url, response.status_code))
            if not response.is_success:
                raise EngineDeadError(f"{what} answered HTTP {response.status_code}, not an engine's answer")
            async for chunk in response.aiter_bytes():  # decoded: a compressed answer counts in full
                body += chunk
                if len(body) > max_bytes:
                    raise EngineDeadError(f"{what} answered more than {max_bytes} bytes")
    except httpx.TransportError as e:
        raise _dead(url, e) from e
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as e:
        # Only the top-level field names (ours): deeper locations may be the answer's own keys.
        fields = sorted({str(err["loc"][0]) if err["loc"] else "(not JSON)" for err in e.errors()})
        raise EngineDeadError(
            f"{what} did not answer an engine's {path} ({len(body)} bytes; wrong or missing: "
            f"{', '.join(fields[:8])})"
        ) from None


def _refused_token(url: str, status: int) -> str:
    return (
        f"the engine at {url} refused the manager's cluster token (HTTP {status}): start the engine with "
        "the manager's token ($PARROT_CLUSTER_TOKEN or --cluster-token-file)"
    )


def _error(response: httpx.Response) -> RemoteEngineError:
    if response.status_code in (401, 403):  # not the request's fault: the cluster is misconfigured
        return RemoteEngineError(
            _refused_token(str(response.request.url.copy_with(path="/")), response.status_code),
            502,
            "engine_refused_token",
        )
    try:
        error = ErrorResponse.model_validate_json(response.content).error
        return RemoteEngineError(error.message, response.status_code, error.type)
    except ValueError:
        what = f"{response.request.method} {response.request.url} answered {response.status_code}"
        return RemoteEngineError(f"{what}: {response.text[:200]}", response.status_code, "engine_error")


def _dead(url: str, e: httpx.TransportError) -> EngineDeadError:
    return EngineDeadError(f"the engine at {url} cannot be reached ({type(e).__name__}: {e})")


def _load_tokenizer(files: dict[str, str]) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            if Path(name).name != name or name in ("", ".", ".."):  # never write outside the folder
                raise EngineDeadError("the engine sent a tokenizer file name with a path")
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        try:
            return AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        except Exception as e:  # whatever transformers raises for files it cannot use
            # The reason may quote the files (the registrant's choice): in the log, not in the answer.
            log.warning("a registering engine's tokenizer files do not load: %.300s", e)
            raise EngineDeadError(
                f"the engine's tokenizer files do not load as a tokenizer ({type(e).__name__})"
            ) from None


def _status_of(error_type: str) -> int:
    """The status code of the engine error class with this type (500 for a type we do not know)."""
    pending: list[type[EngineError]] = [EngineError]
    while pending:
        cls = pending.pop()
        if cls.error_type == error_type:
            return cls.http_status
        pending.extend(cls.__subclasses__())
    return 500
