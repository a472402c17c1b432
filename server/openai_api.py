"""OpenAI-compatible endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

Any OpenAI client works against them, and they are the request-centric baseline of the benchmarks: each
request tokenizes its prompt with the engine's tokenizer, fills a fresh engine context, generates from it and
hands the context back to the backend (always, also on error or a client that goes away). The manager's
backend fills from the longest cached token prefix and keeps a finished context as a prefix for later
requests — turn 2 of a chat prefills only its new tokens, as vLLM's automatic prefix caching does — within
the request's ``cache_salt``; `StaticBackend` fills whole and frees.

The router is built over an `OpenAIBackend` — anything that picks an engine by model name and hands out
unique context ids — so the manager and the tests plug in their own. Errors answer
``{"error": {"type", "message"}}``: engine errors with their own status, unsupported options with 400.
Streaming uses server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from parrot.openai_types import (
    ChatFinishReason,
    OpenAIAssistantMessage,
    OpenAIChatChoice,
    OpenAIChatChunkChoice,
    OpenAIChatCompletionChunk,
    OpenAIChatCompletionRequest,
    OpenAIChatCompletionResponse,
    OpenAIChatDelta,
    OpenAICompletionChoice,
    OpenAICompletionRequest,
    OpenAICompletionResponse,
    OpenAIDetokenizeRequest,
    OpenAIDetokenizeResponse,
    OpenAIModelCard,
    OpenAIModelList,
    OpenAITokenizeRequest,
    OpenAITokenizeResponse,
    OpenAIUsage,
)
from parrot.protocol import ErrorBody, ErrorResponse
from pydantic import BaseModel

from server.engine.api import error_response
from server.engine.detokenize import IncrementalDetokenizer
from server.engine.engine import GenerationStream
from server.engine.errors import EngineError
from server.engine.interface import Engine
from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams
from server.openai_logprobs import chat_logprobs, completion_logprobs
from server.openai_requests import (
    ChatTools,
    InvalidPromptError,
    OpenAIAPIError,
    QuotaError,
    chat_prompt,
    chat_tools,
    completion_prompts,
    guided_of,
    reject_unsupported,
    sampling_for,
)
from server.openai_tools import parse_tool_calls
from server.security import requester
from server.serve.errors import ModelNotFoundError
from server.serve.output_lengths import LengthEstimate


class OpenAIBackend(Protocol):
    """What the router needs from the server: engines by model name and fresh context ids."""

    def engine_for(self, model: str | None) -> Engine:
        """The engine serving ``model`` (None: the default one); raises `ModelNotFoundError`."""
        ...

    def models(self) -> list[str]:
        """The names of the models served, for ``GET /v1/models`` and error messages."""
        ...

    def open_context(self, engine: Engine) -> int:
        """A context id no other user of any engine holds, for a request routed to ``engine``: it counts
        there until `finish_context` (the router always hands it back)."""
        ...

    async def fill_prompt(
        self,
        engine: Engine,
        context_id: int,
        token_ids: list[int],
        cache_salt: str | None,
        priority: float | None = None,
        *,
        tenant: str | None = None,
    ) -> None:
        """Create ``context_id`` holding ``token_ids`` (from a cached prefix where the backend has one);
        ``priority`` and ``tenant`` order it in the engine's waiting queue."""
        ...

    def estimate_length(
        self, engine: Engine, token_ids: list[int], sampling: SamplingParams
    ) -> LengthEstimate | None:
        """The request's predicted output length (its engine priority), or None where the backend predicts
        none."""
        ...

    def observe_length(self, estimate: LengthEstimate, length: int) -> None:
        """A request `estimate_length` predicted wrote ``length`` tokens (the backend learns from it)."""
        ...

    async def finish_context(
        self, engine: Engine, context_id: int, token_ids: list[int] | None, cache_salt: str | None
    ) -> None:
        """The request is over: ``token_ids`` is what its context holds (prompt and output) when it
        completed — the backend may keep it as a cached prefix — or None (failed or aborted: free it)."""
        ...

    def hold_tokens(self, tenant: str, tokens: int) -> str | None:
        """Count a request's ``tokens`` (each generation's prompt and max_tokens) as ``tenant``'s in flight
        until `release_tokens`, or refuse them: the reason (a tenant's quota), answered 429."""
        ...

    def release_tokens(self, tenant: str, tokens: int) -> None:
        """The request `hold_tokens` counted is over."""
        ...

    async def retry_elsewhere(self, engine: Engine, error: EngineError, attempt: int) -> bool:
        """The request failed with ``error`` on ``engine`` on its ``attempt``-th try (1 first) before it
        streamed anything: whether to run it again from its prompt on the engine `engine_for` picks next
        (the backend takes a failed engine out of its choice first)."""
        ...


class StaticBackend:
    """An `OpenAIBackend` over fixed engines keyed by model name (the first one is the default).

    Context ids come from one counter starting at ``first_context_id``, chosen high so that they do not
    collide with ids another component hands out on the same engines.
    """

    def __init__(self, engines: Mapping[str, Engine], first_context_id: int = 1 << 40) -> None:
        if not engines:
            raise ValueError("StaticBackend needs at least one engine")
        self._engines = dict(engines)
        self._ids = itertools.count(first_context_id)

    def engine_for(self, model: str | None) -> Engine:
        if model is None:
            return next(iter(self._engines.values()))
        try:
            return self._engines[model]
        except KeyError:
            raise ModelNotFoundError(model, self.models()) from None

    def models(self) -> list[str]:
        return list(self._engines)

    def open_context(self, engine: Engine) -> int:
        return next(self._ids)

    async def fill_prompt(
        self,
        engine: Engine,
        context_id: int,
        token_ids: list[int],
        cache_salt: str | None,
        priority: float | None = None,
        *,
        tenant: str | None = None,
    ) -> None:
        await engine.fill(context_id, token_ids, priority=priority, tenant=tenant)

    def estimate_length(
        self, engine: Engine, token_ids: list[int], sampling: SamplingParams
    ) -> LengthEstimate | None:
        return None  # fixed engines keep no history to predict from

    def observe_length(self, estimate: LengthEstimate, length: int) -> None:
        pass

    async def finish_context(
        self, engine: Engine, context_id: int, token_ids: list[int] | None, cache_salt: str | None
    ) -> None:
        await _free_quietly(engine, context_id)

    def hold_tokens(self, tenant: str, tokens: int) -> str | None:
        return None  # fixed engines keep no quotas

    def release_tokens(self, tenant: str, tokens: int) -> None:
        pass

    async def retry_elsewhere(self, engine: Engine, error: EngineError, attempt: int) -> bool:
        return False  # fixed engines: there is nowhere else to go


def model_card(name: str, engine: Engine, created: int) -> OpenAIModelCard:
    """The ``/v1/models`` card of ``engine``'s model, with what a client needs to render chat prompts."""
    tok = engine.tokenizer
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # tokenizers with named templates: the one chat completions use
        template = template.get("default")
    bos_id = getattr(tok, "bos_token_id", None)
    probe = tok.encode("a")
    return OpenAIModelCard(
        id=name,
        created=created,
        max_model_len=engine.max_model_len,
        chat_template=template if isinstance(template, str) else None,
        bos_token=getattr(tok, "bos_token", None),
        adds_bos_token=bos_id is not None and bool(probe) and probe[0] == bos_id,
        eos_tokens=[tok.convert_ids_to_tokens(i) for i in sorted(engine.eos_token_ids)],
    )


def create_openai_router(backend: OpenAIBackend) -> APIRouter:
    """The router with the OpenAI-compatible endpoints over ``backend`` (paths start with ``/v1``)."""
    router = APIRouter(tags=["openai"])
    started = int(time.time())

    @router.get("/v1/models")
    async def list_models() -> OpenAIModelList:
        return OpenAIModelList(data=[model_card(m, backend.engine_for(m), started) for m in backend.models()])

    @router.get("/v1/models/{model:path}", response_model=None)
    async def retrieve_model(model: str) -> OpenAIModelCard | JSONResponse:
        try:
            return model_card(model, backend.engine_for(model), started)
        except (EngineError, OpenAIAPIError) as e:  # ModelNotFoundError is an EngineError
            return _error(e)

    @router.post(
        "/v1/completions",
        response_model=None,
        responses={200: {"model": OpenAICompletionResponse}, 400: {"model": ErrorResponse}},
    )
    async def completions(request: Request, req: OpenAICompletionRequest) -> JSONResponse | StreamingResponse:
        try:
            reject_unsupported(req)
            req = _salted(request, req)
            engine = backend.engine_for(req.model)
            prompts = await _off_loop_if_large(request, completion_prompts, engine, req.prompt)
            guided = guided_of(req.response_format, req.structured_outputs)
            sampling = sampling_for(req, req.max_tokens, engine, prompts, guided, req.logprobs)
            return await _unless_client_leaves(
                request, _serve(backend, engine, prompts, sampling, req, requester(request), chat=False)
            )
        except (EngineError, OpenAIAPIError) as e:
            return _error(e)

    @router.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": OpenAIChatCompletionResponse}, 400: {"model": ErrorResponse}},
    )
    async def chat_completions(
        request: Request, req: OpenAIChatCompletionRequest
    ) -> JSONResponse | StreamingResponse:
        try:
            reject_unsupported(req)
            req = _salted(request, req)
            engine = backend.engine_for(req.model)
            tools = chat_tools(req)
            prompts = [await _off_loop_if_large(request, chat_prompt, engine, req, tools)]
            max_tokens = (
                req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            )
            guided = guided_of(req.response_format, req.structured_outputs)
            if tools is not None and tools.guide is not None:
                if guided is not None:
                    raise OpenAIAPIError(
                        "a required tool call and response_format both constrain the answer: send one",
                        "tool_choice",
                    )
                guided = tools.guide
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            sampling = sampling_for(req, max_tokens, engine, prompts, guided, logprobs)
            tenant = requester(request)
            served = _serve(backend, engine, prompts, sampling, req, tenant, chat=True, tools=tools)
            return await _unless_client_leaves(request, served)
        except (EngineError, OpenAIAPIError) as e:
            return _error(e)

    # vLLM's tokenizer routes: what lets a client (another Parrot using this server as an engine) check
    # that it tokenizes exactly as this server does.
    @router.post("/tokenize", response_model=None)
    async def tokenize(req: OpenAITokenizeRequest) -> OpenAITokenizeResponse | JSONResponse:
        try:
            engine = backend.engine_for(req.model)
        except (EngineError, OpenAIAPIError) as e:
            return _error(e)
        ids = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return OpenAITokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @router.post("/detokenize", response_model=None)
    async def detokenize(req: OpenAIDetokenizeRequest) -> OpenAIDetokenizeResponse | JSONResponse:
        try:
            engine = backend.engine_for(req.model)
            bad = next((t for t in req.tokens if not 0 <= t < engine.vocab_size), None)
            if bad is not None:
                raise InvalidPromptError(f"token id {bad} is outside the vocabulary of {engine.vocab_size}")
        except (EngineError, OpenAIAPIError) as e:
            return _error(e)
        return OpenAIDetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))

    return router


# ------------------------------------------------------------------------------------------ requests
def _error(e: EngineError | OpenAIAPIError) -> JSONResponse:
    param = e.param if isinstance(e, OpenAIAPIError) else None
    return error_response(e.http_status, e.error_type, str(e), param=param, code=e.error_type)


# A request body over this many bytes has its prompt rendered and tokenized on a worker thread: a 1 MB prompt
# takes ~1.5 s to encode, which on the event loop would stall every other request and /health.
OFF_LOOP_BODY_BYTES = 32 * 1024
_R = TypeVar("_R")


async def _off_loop_if_large(request: Request, work: Callable[..., _R], *args: Any) -> _R:
    """``work(*args)`` on a worker thread when ``request``'s body is large (or of unknown size), else here."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) <= OFF_LOOP_BODY_BYTES:
        return work(*args)
    return await asyncio.to_thread(work, *args)


_Request = TypeVar("_Request", OpenAICompletionRequest, OpenAIChatCompletionRequest)


def _salted(request: Request, req: _Request) -> _Request:
    """``req`` with its tenant's cache salt when it sends none and the server has API keys: prefixes are
    shared among one key's requests, never across keys unless a client sends the same salt."""
    tenant = getattr(request.state, "tenant", None)
    if req.cache_salt is None and tenant is not None:
        return req.model_copy(update={"cache_salt": tenant})
    return req


async def _unless_client_leaves(
    request: Request, answer: Coroutine[Any, Any, JSONResponse | StreamingResponse]
) -> JSONResponse | StreamingResponse:
    """``answer``'s response, unless the client disconnects first: then ``answer`` is cancelled (its
    generations aborted, their contexts freed) and nobody is answered. ``answer`` runs here, inline (it
    routes the request before anything else runs); a watcher cancels it. A streamed answer returns as soon
    as its first tokens exist; from then on the stream itself stops when the client leaves."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        await _disconnected(request)
        left = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await answer
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()  # our own cancellation, done: the client is gone
        return JSONResponse({}, status_code=499)  # never read
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    """Return once the client of ``request`` (whose body was read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# option name -> the values that mean "not used" (anything else is rejected with a 400)
# ------------------------------------------------------------------------------------------ serving
@dataclass
class _Job:
    """One choice of one prompt in flight: its engine context and its generate."""

    context_id: int
    prompt: list[int]
    length: LengthEstimate | None  # its predicted output length, if the backend predicts
    sampling: SamplingParams
    choice: int = 0  # which of its prompt's ``n`` choices (usage counts a prompt once, at choice 0)
    stream: GenerationStream | None = None
    output: list[int] | None = None  # its generated tokens, once it completed

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


async def _serve(
    backend: OpenAIBackend,
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    req: OpenAICompletionRequest | OpenAIChatCompletionRequest,
    tenant: str,
    chat: bool,
    tools: ChatTools | None = None,
) -> JSONResponse | StreamingResponse:
    """Fill a fresh context per prompt and choice (``n`` per prompt), generate from each, answer (or
    stream); contexts are always freed. ``tenant`` (who sent it) takes turns with other tenants in the
    engine's waiting queue.

    A streaming answer starts only once every generate has produced its first token, so that bad input
    still answers with a status code rather than an error event inside a 200 stream. Until then nothing
    was sent, so a failed engine costs nothing: the request runs again where the backend says
    (`OpenAIBackend.retry_elsewhere`); a stream that already started ends with an error event instead.
    """
    for attempt in itertools.count(1):
        try:
            return await _serve_on(backend, engine, prompts, sampling, req, tenant, chat, tools)
        except EngineError as e:
            if not await backend.retry_elsewhere(engine, e, attempt):
                raise
            engine = backend.engine_for(req.model)  # engines of one model share the tokenizer: same prompts
    raise AssertionError("unreachable")


async def _serve_on(
    backend: OpenAIBackend,
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    req: OpenAICompletionRequest | OpenAIChatCompletionRequest,
    tenant: str,
    chat: bool,
    tools: ChatTools | None,
) -> JSONResponse | StreamingResponse:
    """`_serve` on one engine."""
    tokens = sum(len(p) + sampling.max_tokens for p in prompts) * (req.n or 1)
    refusal = backend.hold_tokens(tenant, tokens)
    if refusal is not None:
        raise QuotaError(refusal)
    jobs = [
        _Job(
            backend.open_context(engine),
            p,
            backend.estimate_length(engine, p, sampling),
            _nth(sampling, k),
            k,
        )
        for p in prompts
        for k in range(req.n or 1)
    ]
    release = _Release(backend, engine, jobs, req.cache_salt, lambda: backend.release_tokens(tenant, tokens))
    handed_off = False
    try:
        await _gather_all(
            [
                backend.fill_prompt(
                    engine, j.context_id, j.prompt, req.cache_salt, _priority(req, j), tenant=tenant
                )
                for j in jobs
            ]
        )
        for j in jobs:
            j.stream = engine.submit_generate(
                j.context_id, j.sampling, stream=bool(req.stream), priority=_priority(req, j), tenant=tenant
            )
        meta = _Meta(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=engine.model_name,
        )
        if not req.stream:
            results = await _gather_all([j.stream.result() for j in jobs if j.stream is not None])
            for j, r in zip(jobs, results, strict=True):
                j.output = r.token_ids
            usage = _usage(jobs, results)
            tokenizer = engine.tokenizer
            body: BaseModel = (
                _chat_response(meta, results, usage, tokenizer, tools)
                if chat
                else _text_response(meta, results, usage, tokenizer, jobs if _with_ids(req) else None)
            )
            return JSONResponse(body.model_dump())
        firsts = [await _first_token(j.stream) for j in jobs if j.stream is not None]
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        events = _stream_events(release, firsts, sampling, meta, chat, include_usage, _with_ids(req), tools)
        handed_off = True
        # Started here, so that its `finally` (which frees the contexts) runs even if the client is gone
        # before the response begins: asyncio closes a started async generator when it is collected.
        head = await anext(events)
        return StreamingResponse(_prepend(head, events), media_type="text/event-stream")
    finally:
        if not handed_off:
            await release()


def _nth(sampling: SamplingParams, k: int) -> SamplingParams:
    """The sampling of a prompt's ``k``-th choice: a seeded request seeds each choice apart (seed + k), so
    that ``n`` seeded samples differ and still reproduce."""
    return sampling if k == 0 or sampling.seed is None else replace(sampling, seed=sampling.seed + k)


def _with_ids(req: OpenAICompletionRequest | OpenAIChatCompletionRequest) -> bool:
    return bool(getattr(req, "return_token_ids", False))


def _priority(req: OpenAICompletionRequest | OpenAIChatCompletionRequest, job: _Job) -> float | None:
    """The engine priority of a job: the request's own ``priority`` (vLLM's extension) when it sends one,
    else its predicted output length."""
    if req.priority is not None:
        return req.priority
    return None if job.length is None else job.length.priority


async def _gather_all(aws: Sequence[Any]) -> list[Any]:
    """Await all; if any failed, raise the first error only after every one has settled."""
    results = await asyncio.gather(*aws, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@dataclass
class _Release:
    """Hands a request's contexts back to the backend once: completed ones with their tokens (the backend
    may keep them as cached prefixes), the rest aborted and freed.

    The hand-backs run in a shielded task: a caller cancelled while waiting (a client that hung up) still
    hands back all of them, not only the first.
    """

    backend: OpenAIBackend
    engine: Engine
    jobs: list[_Job]
    cache_salt: str | None
    release_tokens: Callable[[], None]  # the tenant's tokens in flight (`OpenAIBackend.hold_tokens`)

    async def __call__(self) -> None:
        jobs = list(self.jobs)
        self.jobs.clear()  # released once, whoever calls first
        if jobs:
            self.release_tokens()
        for j in jobs:
            if j.stream is not None and j.output is None:
                j.stream.cancel()
            elif j.output is not None and j.length is not None:
                self.backend.observe_length(j.length, len(j.output))
        backs = [
            self.backend.finish_context(
                self.engine,
                j.context_id,
                None if j.output is None else j.prompt + j.output,
                self.cache_salt,
            )
            for j in jobs
        ]
        if backs:
            await asyncio.shield(_gather_quietly(backs))


async def _gather_quietly(aws: Sequence[Any]) -> None:
    for r in await asyncio.gather(*aws, return_exceptions=True):
        if isinstance(r, BaseException) and not isinstance(r, EngineError):
            raise r


async def _free_quietly(engine: Engine, context_id: int) -> None:
    with contextlib.suppress(EngineError):
        await engine.free_context(context_id)


async def _first_token(stream: GenerationStream) -> int | None:
    """The first token, or None when the generate ended without one; raises the request's error."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        await stream.result()
        return None


@dataclass(frozen=True)
class _Meta:
    id: str
    created: int
    model: str


def _usage(jobs: list[_Job], results: list[GenerateResult]) -> OpenAIUsage:
    """Token counts as OpenAI's and vLLM's: each prompt once, however many choices (``n``) it has."""
    prompt = sum(j.prompt_tokens for j in jobs if j.choice == 0)
    completion = sum(len(r.token_ids) for r in results)
    return OpenAIUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _text_response(
    meta: _Meta, results: list[GenerateResult], usage: OpenAIUsage, tokenizer: Any, jobs: list[_Job] | None
) -> OpenAICompletionResponse:
    """The answer; with ``jobs`` (return_token_ids), each choice carries its prompt's and answer's ids."""
    choices = [
        OpenAICompletionChoice(
            index=i,
            text=r.text,
            finish_reason=r.finish_reason,
            logprobs=None if r.logprobs is None else completion_logprobs(tokenizer, r.logprobs),
            token_ids=None if jobs is None else r.token_ids,
            prompt_token_ids=None if jobs is None else jobs[i].prompt,
        )
        for i, r in enumerate(results)
    ]
    return OpenAICompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage
    )


def _chat_response(
    meta: _Meta, results: list[GenerateResult], usage: OpenAIUsage, tokenizer: Any, tools: ChatTools | None
) -> OpenAIChatCompletionResponse:
    choices = []
    for i, r in enumerate(results):
        message, finish = _assistant_message(r, tools)
        logprobs = None if r.logprobs is None else chat_logprobs(tokenizer, r.logprobs)
        choices.append(OpenAIChatChoice(index=i, message=message, finish_reason=finish, logprobs=logprobs))
    return OpenAIChatCompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage
    )


def _assistant_message(
    result: GenerateResult, tools: ChatTools | None
) -> tuple[OpenAIAssistantMessage, ChatFinishReason]:
    """The assistant's message and finish reason: with tools, the calls it made are ``tool_calls``."""
    if tools is None:
        return OpenAIAssistantMessage(content=result.text), result.finish_reason
    content, calls = parse_tool_calls(result.text, tools.functions, constrained=tools.guide is not None)
    if not calls:  # e.g. a constrained list cut short by max_tokens: the text as it is
        return OpenAIAssistantMessage(content=result.text), result.finish_reason
    finish: ChatFinishReason = "tool_calls" if result.finish_reason == "stop" else result.finish_reason
    return OpenAIAssistantMessage(content=content, tool_calls=calls), finish


async def _prepend(head: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    yield head
    async for item in rest:
        yield item


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _stream_events(
    release: _Release,
    firsts: list[int | None],
    sampling: SamplingParams,
    meta: _Meta,
    chat: bool,
    include_usage: bool,
    with_ids: bool = False,
    tools: ChatTools | None = None,
) -> AsyncIterator[str]:
    """The SSE body: each choice's deltas in turn (all generates run concurrently in the engine).
    With tools, a choice is sent whole once complete: only then is it known to be calls or text.

    Deltas come from `IncrementalDetokenizer`, so a stop string is never sent; the last chunk of a choice
    carries its ``finish_reason``. With ``with_ids`` (completions' return_token_ids), each chunk carries
    the token ids pushed since the last one, and a choice's first chunk its prompt's. The contexts are freed
    however the stream ends.
    """
    pending: list[int] = []  # the current choice's ids not sent yet
    prompt_ids: list[int] | None = None

    def chunk(index: int, text: str | None, finish: str | None) -> str:
        nonlocal prompt_ids
        if chat:
            return _chat_chunk(meta, index, text, finish)
        if not with_ids:
            return _text_chunk(meta, index, text or "", finish)
        ids, prompt = list(pending), prompt_ids
        pending.clear()
        prompt_ids = None
        return _text_chunk(meta, index, text or "", finish, ids, prompt)

    engine, jobs = release.engine, list(release.jobs)
    results: list[GenerateResult] = []
    try:
        for index, (job, first) in enumerate(zip(jobs, firsts, strict=True)):
            assert job.stream is not None
            detok = IncrementalDetokenizer(engine.tokenizer, sampling.stop)
            pending.clear()
            prompt_ids = job.prompt
            if chat:
                yield _sse(_chat_role_chunk(meta, index))
            if tools is not None:
                result = await job.stream.result()
                job.output = result.token_ids
                results.append(result)
                yield _sse(_chat_whole_chunk(meta, index, *_assistant_message(result, tools)))
                continue
            if first is not None:
                pending.append(first)
                if delta := detok.push(first):
                    yield chunk(index, delta, None)
                async for token_id in job.stream:
                    pending.append(token_id)
                    if delta := detok.push(token_id):
                        yield chunk(index, delta, None)
            result = await job.stream.result()
            job.output = result.token_ids
            results.append(result)
            yield chunk(index, detok.finish(result.text) or None, result.finish_reason)
        if include_usage:
            usage = _usage(jobs, results)
            body: BaseModel = (
                OpenAIChatCompletionChunk(
                    id=meta.id, created=meta.created, model=meta.model, choices=[], usage=usage
                )
                if chat
                else OpenAICompletionResponse(
                    id=meta.id, created=meta.created, model=meta.model, choices=[], usage=usage
                )
            )
            yield _sse(body.model_dump_json())
        await release()  # before [DONE]: a client that saw the end sees the contexts handed back
        yield _sse("[DONE]")
    except EngineError as e:
        yield _sse(ErrorResponse(error=ErrorBody(type=e.error_type, message=str(e))).model_dump_json())
    finally:
        await release()


def _text_chunk(
    meta: _Meta,
    index: int,
    text: str,
    finish: str | None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> str:
    choice = {"index": index, "text": text, "finish_reason": finish, "token_ids": token_ids}
    choice["prompt_token_ids"] = prompt_token_ids
    body = OpenAICompletionResponse(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        choices=[OpenAICompletionChoice.model_validate(choice)],
    )
    return _sse(body.model_dump_json(exclude={"usage"}))


def _chat_whole_chunk(meta: _Meta, index: int, message: OpenAIAssistantMessage, finish: str) -> str:
    """A whole streamed answer in one chunk: its content or its tool calls (each with its index)."""
    calls = None
    if message.tool_calls:
        calls = [{"index": k, **c.model_dump()} for k, c in enumerate(message.tool_calls)]
    delta = OpenAIChatDelta(content=message.content, tool_calls=calls)
    choice = OpenAIChatChunkChoice.model_validate({"index": index, "delta": delta, "finish_reason": finish})
    body = OpenAIChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
    data = body.model_dump(exclude={"usage"})
    data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
    return json.dumps(data)


def _chat_role_chunk(meta: _Meta, index: int) -> str:
    choice = OpenAIChatChunkChoice(index=index, delta=OpenAIChatDelta(role="assistant", content=""))
    body = OpenAIChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
    return body.model_dump_json(exclude={"usage"})


def _chat_chunk(meta: _Meta, index: int, text: str | None, finish: str | None) -> str:
    delta = OpenAIChatDelta(content=text)
    choice = OpenAIChatChunkChoice.model_validate({"index": index, "delta": delta, "finish_reason": finish})
    body = OpenAIChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
    data = body.model_dump(exclude={"usage"})
    data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # the last delta is {}
    return _sse(json.dumps(data))
