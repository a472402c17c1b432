"""OpenAI-compatible endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

Any OpenAI client works against them, and they are the request-centric baseline of the benchmarks. Here a
request is checked and parsed (its prompt tokenized with the engine's tokenizer, its sampling built); the
manager runs it (`server.serve.request_run`: placement, kept contexts, priorities, quotas, retries, through
the manager's `OpenAIServing`) and it is answered whole (`openai_answer`) or streamed (`openai_stream`); its
contexts go back to the manager always, also on error or a client that goes away.

Errors answer ``{"error": {"type", "message"}}``: engine errors with their own status, unsupported options
with 400.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from parrot.openai_types import (
    OpenAIChatCompletionRequest,
    OpenAIChatCompletionResponse,
    OpenAICompletionRequest,
    OpenAICompletionResponse,
    OpenAIDetokenizeRequest,
    OpenAIDetokenizeResponse,
    OpenAIModelCard,
    OpenAIModelList,
    OpenAITokenizeRequest,
    OpenAITokenizeResponse,
)
from parrot.protocol import ErrorResponse

from server.common.security import requester
from server.engine.api import error_response
from server.engine.errors import EngineError
from server.engine.interface import Engine
from server.engine.sampling import SamplingParams
from server.http.openai_answer import AnswerForm, AnswerMeta, PromptEcho, whole_answer
from server.http.openai_requests import (
    ChatTools,
    InvalidPromptError,
    OpenAIAPIError,
    QuotaError,
    chat_prompt,
    chat_tools,
    completion_prompts,
    guided_of,
    prompt_texts,
    reject_unsupported,
    sampling_for,
)
from server.http.openai_stream import streamed_answer
from server.serve.openai_serving import OpenAIServing
from server.serve.quotas import QuotaExceededError
from server.serve.request_run import RequestSpec, run_request


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


def create_openai_router(backend: OpenAIServing) -> APIRouter:
    """The router with the OpenAI-compatible endpoints over the manager's ``backend`` (paths start with
    ``/v1``)."""
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
            echo = _echo(engine, req, prompts)
            max_tokens = 1 if req.max_tokens == 0 else req.max_tokens  # (0: sized as the one it would be)
            sampling = sampling_for(req, max_tokens, engine, prompts, guided, req.logprobs)
            served = _serve(
                backend, engine, prompts, sampling, req, requester(request), chat=False, echo=echo
            )
            return await _unless_client_leaves(request, served)
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
            echo = None if req.prompt_logprobs is None else PromptEcho(prompt_logprobs=req.prompt_logprobs)
            served = _serve(
                backend, engine, prompts, sampling, req, tenant, chat=True, tools=tools, echo=echo
            )
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
async def _serve(
    backend: OpenAIServing,
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    req: OpenAICompletionRequest | OpenAIChatCompletionRequest,
    tenant: str,
    chat: bool,
    tools: ChatTools | None = None,
    echo: PromptEcho | None = None,
) -> JSONResponse | StreamingResponse:
    """Run ``n`` generations from each of ``prompts`` and answer them (or stream them). ``tenant`` (who sent
    it) takes turns with other tenants; ``echo``: a completion's prompts in its answer.

    A streaming answer starts only once every generate has produced its first token, so that bad input
    still answers with a status code rather than an error event inside a 200 stream (and a failed engine
    costs nothing: the request runs again elsewhere)."""
    spec = RequestSpec(
        prompts,
        sampling,
        n=req.n or 1,
        tenant=tenant,
        cache_salt=req.cache_salt,
        priority=req.priority,
        stream=bool(req.stream),
        score=None if echo is None else echo.score_top,
        generate=echo is None or echo.generate,
    )
    try:
        run = await run_request(backend, engine, spec)
    except QuotaExceededError as e:
        raise QuotaError(str(e)) from None
    meta = AnswerMeta(
        id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=run.engine.model_name,
        include_usage=bool(
            req.stream and req.stream_options is not None and req.stream_options.include_usage
        ),
    )
    with_ids = bool(getattr(req, "return_token_ids", False))
    form = AnswerForm(meta, chat, sampling, with_ids, tools, echo)
    if not req.stream:
        return JSONResponse(whole_answer(run, form).model_dump())
    return await streamed_answer(run, form)


def _echo(engine: Engine, req: OpenAICompletionRequest, prompts: list[list[int]]) -> PromptEcho | None:
    """What the answer says of the prompts: with ``echo``, their text (and, with ``logprobs``, their tokens'
    log-probabilities) before each choice's; with ``prompt_logprobs``, vLLM's; ``max_tokens=0`` answers
    the prompt alone."""
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise OpenAIAPIError(
            "max_tokens=0 generates nothing, which only echo=true or prompt_logprobs make an answer (the "
            "prompt, or its tokens' logprobs): send max_tokens >= 1, echo=true or prompt_logprobs",
            "max_tokens",
        )
    if not req.echo and req.prompt_logprobs is None:
        return None
    texts = prompt_texts(engine, req.prompt, prompts) if req.echo else None
    top = req.logprobs if req.echo else None
    return PromptEcho(texts, top, req.prompt_logprobs, req.max_tokens != 0)


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
