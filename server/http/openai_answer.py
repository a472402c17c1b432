"""How an OpenAI request is served once parsed: a context per prompt and choice, filled through the backend
(`OpenAIBackend`), generated, answered whole or streamed as server-sent events in OpenAI's chunk format
(ending with ``data: [DONE]``); the contexts are always handed back, also on error or a client that leaves.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

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
    OpenAIChatLogprobs,
    OpenAICompletionChoice,
    OpenAICompletionLogprobs,
    OpenAICompletionRequest,
    OpenAICompletionResponse,
    OpenAIUsage,
    PromptLogprobs,
)
from parrot.protocol import ErrorBody, ErrorResponse
from pydantic import BaseModel

from server.engine.detokenize import IncrementalDetokenizer
from server.engine.engine_front import GenerationStream
from server.engine.errors import EngineError
from server.engine.interface import Engine
from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams, TokenLogprob
from server.http.openai_backends import OpenAIBackend
from server.http.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from server.http.openai_requests import (
    ChatTools,
    QuotaError,
)
from server.http.openai_tools import parse_tool_calls
from server.serve.openai_serving import Routed
from server.serve.output_lengths import LengthEstimate

_T = TypeVar("_T")


@dataclass(frozen=True)
class PromptEcho:
    """What an answer says of its prompts. ``texts`` (completions' ``echo``): each prompt's text leads its
    choices' text and, with ``top`` (the request's ``logprobs``), its tokens' log-probabilities lead
    theirs. ``prompt_logprobs`` (vLLM's extension): each prompt token's log-probability, rank and this many
    alternatives. Both come from the prompt's own prefill (`Engine.score`). ``generate`` False
    (``max_tokens=0``): the prompt is the whole answer."""

    texts: list[str] | None = None
    top: int | None = None
    prompt_logprobs: int | None = None
    generate: bool = True

    @property
    def score_top(self) -> int | None:
        """The alternatives per prompt token to score with (None: the prompt is not scored)."""
        tops = [t for t in (self.top, self.prompt_logprobs) if t is not None]
        return max(tops) if tops else None


class _NoGeneration:
    """The generate of a ``max_tokens=0`` request: none, over at once with no tokens."""

    def __init__(self, prompt_tokens: int, logprobs: bool) -> None:
        self._result = GenerateResult([], "", "length", prompt_tokens, [] if logprobs else None)
        self.logprobs: list[TokenLogprob] = []

    def __aiter__(self) -> _NoGeneration:
        return self

    async def __anext__(self) -> int:
        raise StopAsyncIteration

    async def result(self) -> GenerateResult:
        return self._result

    def cancel(self) -> None:
        """Nothing runs to cancel."""


@dataclass
class _Job:
    """One choice of one prompt in flight: its engine context and its generate."""

    context_id: int
    prompt: list[int]
    length: LengthEstimate | None  # its predicted output length, if the backend predicts
    sampling: SamplingParams
    choice: int = 0  # which of its prompt's ``n`` choices (usage counts a prompt once, at choice 0)
    prompt_no: int = 0  # which of the request's prompts
    stream: GenerationStream | _NoGeneration | None = None
    output: list[int] | None = None  # its generated tokens, once it completed
    scored: list[TokenLogprob] | None = None  # its prompt's tokens' log-probabilities, when echoed with them

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)


async def serve(
    backend: OpenAIBackend,
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    req: OpenAICompletionRequest | OpenAIChatCompletionRequest,
    tenant: str,
    chat: bool,
    tools: ChatTools | None = None,
    echo: PromptEcho | None = None,
) -> JSONResponse | StreamingResponse:
    """Fill a fresh context per prompt and choice (``n`` per prompt), generate from each, answer (or
    stream); contexts are always freed. ``tenant`` (who sent it) takes turns with other tenants in the
    engine's waiting queue. ``echo``: a completion's prompts in its answer.

    A streaming answer starts only once every generate has produced its first token, so that bad input
    still answers with a status code rather than an error event inside a 200 stream. Until then nothing
    was sent, so a failed engine costs nothing: the request runs again where the backend says
    (`OpenAIBackend.retry_elsewhere`); a stream that already started ends with an error event instead.
    """
    for attempt in itertools.count(1):
        try:
            return await _serve_on(backend, engine, prompts, sampling, req, tenant, chat, tools, echo)
        except _EngineFailed as e:
            if not await backend.retry_elsewhere(e.engine, e.cause, attempt):
                raise e.cause from None
            engine = backend.engine_for(req.model)  # engines of one model share the tokenizer: same prompts
    raise AssertionError("unreachable")


class _EngineFailed(Exception):
    """A request's try failed with ``cause`` on ``engine`` (the one it was routed to) before it streamed."""

    def __init__(self, engine: Engine, cause: EngineError) -> None:
        super().__init__(str(cause))
        self.engine = engine
        self.cause = cause


async def _serve_on(
    backend: OpenAIBackend,
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    req: OpenAICompletionRequest | OpenAIChatCompletionRequest,
    tenant: str,
    chat: bool,
    tools: ChatTools | None,
    echo: PromptEcho | None,
) -> JSONResponse | StreamingResponse:
    """`serve` on one engine: the one the backend routes the request to."""
    n = req.n or 1
    tokens = sum(len(p) + sampling.max_tokens for p in prompts) * n
    refusal = backend.hold_tokens(tenant, tokens)
    if refusal is not None:
        raise QuotaError(refusal)
    lengths = [backend.estimate_length(engine, p, sampling) for p in prompts]
    first = min((e.priority for e in lengths if e is not None), default=None)  # its shortest prompt's
    priority = req.priority if req.priority is not None else first
    try:
        routed = await backend.route(
            engine, prompts, sampling.max_tokens, n, tenant, req.cache_salt, priority
        )
    except BaseException:
        backend.release_tokens(tenant, tokens)
        raise
    engine = routed.engine
    jobs = [
        _Job(backend.open_context(engine), p, length, _nth(sampling, k), k, i)
        for i, (p, length) in enumerate(zip(prompts, lengths, strict=True))
        for k in range(n)
    ]
    release = _Release(backend, routed, jobs, req.cache_salt, lambda: backend.release_tokens(tenant, tokens))
    handed_off = False
    try:
        score = None if echo is None else echo.score_top
        scores = await _gather_all(
            [
                backend.fill_prompt(
                    routed,
                    j.context_id,
                    j.prompt,
                    req.cache_salt,
                    _priority(req, j),
                    tenant=tenant,
                    score=score,
                )
                for j in jobs
            ]
        )
        for j, scored in zip(jobs, scores, strict=True):
            j.scored = scored
            if echo is not None and not echo.generate:
                j.stream = _NoGeneration(j.prompt_tokens, sampling.logprobs is not None)
                continue
            j.stream = engine.submit_generate(
                j.context_id, j.sampling, stream=bool(req.stream), priority=_priority(req, j), tenant=tenant
            )
        include_usage = bool(
            req.stream and req.stream_options is not None and req.stream_options.include_usage
        )
        meta = _Meta(
            id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=engine.model_name,
            include_usage=include_usage,
        )
        if not req.stream:
            results = await _gather_all([j.stream.result() for j in jobs if j.stream is not None])
            for j, r in zip(jobs, results, strict=True):
                j.output = r.token_ids
            usage = _usage(jobs, results)
            tokenizer = engine.tokenizer
            body: BaseModel = (
                _chat_response(
                    meta, results, usage, tokenizer, tools, _prompt_logprobs(tokenizer, jobs[0], echo)
                )
                if chat
                else _text_response(meta, results, usage, tokenizer, jobs, _with_ids(req), echo)
            )
            return JSONResponse(body.model_dump())
        firsts = [await _first_token(j.stream) for j in jobs if j.stream is not None]
        events = _stream_events(release, firsts, sampling, meta, chat, _with_ids(req), tools, echo)
        handed_off = True
        # Started here, so that its `finally` (which frees the contexts) runs even if the client is gone
        # before the response begins: asyncio closes a started async generator when it is collected.
        head = await anext(events)
        return StreamingResponse(_prepend(head, events), media_type="text/event-stream")
    except EngineError as e:
        raise _EngineFailed(engine, e) from e
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
    routed: Routed
    jobs: list[_Job]
    cache_salt: str | None
    release_tokens: Callable[[], None]  # the tenant's tokens in flight (`OpenAIBackend.hold_tokens`)
    released: bool = False

    @property
    def engine(self) -> Engine:
        return self.routed.engine

    async def __call__(self) -> None:
        if self.released:
            return
        self.released = True  # released once, whoever calls first
        jobs = list(self.jobs)
        self.jobs.clear()
        self.release_tokens()
        for j in jobs:
            if j.stream is not None and j.output is None:
                j.stream.cancel()
            elif j.output is not None and j.length is not None:
                self.backend.observe_length(j.length, len(j.output))
        backs = [
            self.backend.finish_context(
                self.routed,
                j.context_id,
                None if j.output is None else j.prompt + j.output,
                self.cache_salt,
            )
            for j in jobs
        ]
        error = None if all(j.output is not None for j in jobs) else "it did not complete"
        await asyncio.shield(_gather_quietly(backs, lambda: self.backend.unroute(self.routed, error)))


async def _gather_quietly(aws: Sequence[Any], then: Callable[[], None]) -> None:
    """Await all (engine errors ignored: the context is gone with its engine), then ``then()``."""
    try:
        for r in await asyncio.gather(*aws, return_exceptions=True):
            if isinstance(r, BaseException) and not isinstance(r, EngineError):
                raise r
    finally:
        then()


async def _first_token(stream: GenerationStream | _NoGeneration) -> int | None:
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
    # A stream whose client asked for usage: every chunk before the usage chunk says ``"usage": null``, as
    # OpenAI's spec has it; else chunks carry no usage field.
    include_usage: bool = False

    @property
    def chunk_exclude(self) -> set[str]:
        """The fields a streamed chunk leaves out."""
        return set() if self.include_usage else {"usage"}


def _usage(jobs: list[_Job], results: list[GenerateResult]) -> OpenAIUsage:
    """Token counts as OpenAI's and vLLM's: each prompt once, however many choices (``n``) it has."""
    prompt = sum(j.prompt_tokens for j in jobs if j.choice == 0)
    completion = sum(len(r.token_ids) for r in results)
    return OpenAIUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _text_response(
    meta: _Meta,
    results: list[GenerateResult],
    usage: OpenAIUsage,
    tokenizer: Any,
    jobs: list[_Job],
    with_ids: bool,
    echo: PromptEcho | None,
) -> OpenAICompletionResponse:
    """The answer; ``with_ids`` (return_token_ids): each choice carries its prompt's and answer's ids;
    ``echo``: each choice's prompt leads its text (and its log-probabilities, when scored)."""
    choices = [
        OpenAICompletionChoice(
            index=i,
            text=r.text if echo is None or echo.texts is None else echo.texts[j.prompt_no] + r.text,
            finish_reason=r.finish_reason,
            logprobs=_completion_logprobs(tokenizer, j, r, echo),
            token_ids=r.token_ids if with_ids else None,
            prompt_token_ids=j.prompt if with_ids else None,
            prompt_logprobs=_prompt_logprobs(tokenizer, j, echo),
        )
        for i, (j, r) in enumerate(zip(jobs, results, strict=True))
    ]
    return OpenAICompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=usage
    )


def _completion_logprobs(
    tokenizer: Any, job: _Job, result: GenerateResult, echo: PromptEcho | None
) -> OpenAICompletionLogprobs | None:
    """A completion choice's log-probabilities, its echoed prompt's first where they were asked for."""
    if result.logprobs is None:
        return None
    if echo is None or echo.texts is None or job.scored is None:
        return completion_logprobs(tokenizer, result.logprobs)
    top = echo.top or 0
    prompt = [replace(lp, top=lp.top[:top], rank=None) for lp in job.scored]  # scored with the larger top
    return completion_logprobs(tokenizer, prompt + result.logprobs, first=job.prompt[0])


def _prompt_logprobs(tokenizer: Any, job: _Job, echo: PromptEcho | None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a job's prompt, where the request asked for them."""
    if echo is None or echo.prompt_logprobs is None or job.scored is None:
        return None
    return prompt_logprobs(tokenizer, job.scored, echo.prompt_logprobs)


def _chat_response(
    meta: _Meta,
    results: list[GenerateResult],
    usage: OpenAIUsage,
    tokenizer: Any,
    tools: ChatTools | None,
    prompt_lps: PromptLogprobs | None,
) -> OpenAIChatCompletionResponse:
    choices = []
    for i, r in enumerate(results):
        message, finish = _assistant_message(r, tools)
        logprobs = None if r.logprobs is None else chat_logprobs(tokenizer, r.logprobs)
        choices.append(OpenAIChatChoice(index=i, message=message, finish_reason=finish, logprobs=logprobs))
    return OpenAIChatCompletionResponse(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        choices=choices,
        usage=usage,
        prompt_logprobs=prompt_lps,
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


async def _prepend(head: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
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
    with_ids: bool = False,
    tools: ChatTools | None = None,
    echo: PromptEcho | None = None,
) -> AsyncIterator[str]:
    """The SSE body: every choice's deltas as they come, interleaved as vLLM sends them (all generates run
    concurrently in the engine), each choice's in its own order; then the usage chunk (when asked for)
    and ``[DONE]``. The contexts are freed however the stream ends; an engine error ends it with an error
    event."""
    jobs = list(release.jobs)
    results: list[GenerateResult] = []
    choices = [
        _choice_events(release.engine, meta, i, job, first, sampling, chat, with_ids, tools, echo, results)
        for i, (job, first) in enumerate(zip(jobs, firsts, strict=True))
    ]
    try:
        async for event in choices[0] if len(choices) == 1 else _interleave(choices):
            yield event
        if meta.include_usage:
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


async def _choice_events(
    engine: Engine,
    meta: _Meta,
    index: int,
    job: _Job,
    first: int | None,
    sampling: SamplingParams,
    chat: bool,
    with_ids: bool,
    tools: ChatTools | None,
    echo: PromptEcho | None,
    results: list[GenerateResult],
) -> AsyncIterator[str]:
    """One choice's chunks; its result goes to ``results`` once it ends. With tools, the choice is sent
    whole once complete: only then is it known to be calls or text.

    Deltas come from `IncrementalDetokenizer`, so a stop string is never sent; the last chunk carries the
    ``finish_reason``. With logprobs, each chunk carries those of the tokens it completes. With
    ``with_ids`` (completions' return_token_ids), each chunk carries the token ids pushed since the last
    one, and the first chunk the prompt's. With ``echo``, the first chunk is the prompt's text (and its
    tokens' logprobs, when scored).
    """
    stream = job.stream
    assert stream is not None
    tokenizer = engine.tokenizer
    pending: list[int] = []  # ids not sent yet
    prompt_ids: list[int] | None = job.prompt
    read = sent = 0  # tokens read from the stream; tokens whose logprobs went out
    at = 0  # where the next chunk's logprob offsets start (after the tokens' texts sent so far)

    def chunk(text: str | None, finish: str | None, logprobs: list[TokenLogprob]) -> str:
        nonlocal prompt_ids, at, sent
        lps = None if sampling.logprobs is None else _chunk_logprobs(tokenizer, logprobs, chat, at)
        sent += len(logprobs)
        at = _end_offset(lps, at)
        if chat:
            return _chat_chunk(meta, index, text, finish, lps)  # type: ignore[arg-type]
        ids, prompt = (list(pending), prompt_ids) if with_ids else (None, None)
        pending.clear()
        prompt_ids = None
        return _text_chunk(meta, index, text or "", finish, ids, prompt, lps)  # type: ignore[arg-type]

    if chat:
        yield _sse(_chat_role_chunk(meta, index))
    if echo is not None and echo.texts is not None:
        text = echo.texts[job.prompt_no]
        if echo.top is not None and job.scored is not None and sampling.logprobs is not None:
            prompt = [replace(lp, top=lp.top[: echo.top], rank=None) for lp in job.scored]
            ids, prompt_ids = (job.prompt, None) if with_ids else (None, None)
            echoed = completion_logprobs(tokenizer, prompt, first=job.prompt[0])
            yield _text_chunk(meta, index, text, None, [] if with_ids else None, ids, echoed)
            at = _end_offset(echoed, at)
        else:
            yield chunk(text, None, [])
    if tools is not None:
        result = await stream.result()
        job.output = result.token_ids
        results.append(result)
        lps = None if result.logprobs is None else chat_logprobs(tokenizer, result.logprobs)
        yield _sse(_chat_whole_chunk(meta, index, *_assistant_message(result, tools), lps))
        return
    detok = IncrementalDetokenizer(tokenizer, sampling.stop)
    if first is not None:
        tokens = _prepend(first, stream)
        async for token_id in tokens:
            pending.append(token_id)
            read += 1
            if delta := detok.push(token_id):
                yield chunk(delta, None, stream.logprobs[sent:read])
    result = await stream.result()
    job.output = result.token_ids
    results.append(result)
    # The last chunk: the text held back (a stop string's start) and the rest of the logprobs.
    yield chunk(detok.finish(result.text) or None, result.finish_reason, (result.logprobs or [])[sent:])


def _end_offset(logprobs: OpenAIChatLogprobs | OpenAICompletionLogprobs | None, at: int) -> int:
    """Where the offsets of the chunk after one carrying ``logprobs`` start."""
    if isinstance(logprobs, OpenAICompletionLogprobs) and logprobs.tokens:
        return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
    return at


def _chunk_logprobs(
    tokenizer: Any, logprobs: list[TokenLogprob], chat: bool, offset: int
) -> OpenAIChatLogprobs | OpenAICompletionLogprobs:
    """A streamed chunk's tokens' log-probabilities in its route's shape."""
    if chat:
        return chat_logprobs(tokenizer, logprobs)
    return completion_logprobs(tokenizer, logprobs, offset=offset)


async def _interleave(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The items of all ``streams`` as each comes, each stream's in its own order; the first error of any
    ends it (the rest are cancelled)."""
    queue: asyncio.Queue[tuple[str | None, Exception | None]] = asyncio.Queue()

    async def pump(stream: AsyncIterator[str]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((item, None))
            queue.put_nowait((None, None))
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait((None, e))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    live = len(tasks)
    try:
        while live:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                live -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _text_chunk(
    meta: _Meta,
    index: int,
    text: str,
    finish: str | None,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    logprobs: OpenAICompletionLogprobs | None = None,
) -> str:
    choice = {"index": index, "text": text, "finish_reason": finish, "token_ids": token_ids}
    choice["prompt_token_ids"] = prompt_token_ids
    choice["logprobs"] = logprobs
    body = OpenAICompletionResponse(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        choices=[OpenAICompletionChoice.model_validate(choice)],
    )
    return _sse(body.model_dump_json(exclude=meta.chunk_exclude))


def _chat_whole_chunk(
    meta: _Meta,
    index: int,
    message: OpenAIAssistantMessage,
    finish: str,
    logprobs: OpenAIChatLogprobs | None = None,
) -> str:
    """A whole streamed answer in one chunk: its content or its tool calls (each with its index)."""
    calls = None
    if message.tool_calls:
        calls = [{"index": k, **c.model_dump()} for k, c in enumerate(message.tool_calls)]
    delta = OpenAIChatDelta(content=message.content, tool_calls=calls)
    choice = OpenAIChatChunkChoice.model_validate(
        {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    )
    body = OpenAIChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
    data = body.model_dump(exclude=meta.chunk_exclude)
    data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
    return json.dumps(data)


def _chat_role_chunk(meta: _Meta, index: int) -> str:
    choice = OpenAIChatChunkChoice(index=index, delta=OpenAIChatDelta(role="assistant", content=""))
    body = OpenAIChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
    return body.model_dump_json(exclude=meta.chunk_exclude)


def _chat_chunk(
    meta: _Meta, index: int, text: str | None, finish: str | None, logprobs: OpenAIChatLogprobs | None = None
) -> str:
    delta = OpenAIChatDelta(content=text)
    choice = OpenAIChatChunkChoice.model_validate(
        {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    )
    body = OpenAIChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
    data = body.model_dump(exclude=meta.chunk_exclude)
    data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # the last delta is {}
    return _sse(json.dumps(data))
