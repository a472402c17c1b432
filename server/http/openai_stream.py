"""An OpenAI request's answer streamed as server-sent events in OpenAI's chunk format, ending with
``data: [DONE]``: every choice's deltas as they come, interleaved as vLLM sends them. The run's contexts are
handed back however the stream ends (`RequestRun.release`), also when its client leaves.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from parrot.openai_types import (
    OpenAIAssistantMessage,
    OpenAIChatChunkChoice,
    OpenAIChatCompletionChunk,
    OpenAIChatDelta,
    OpenAIChatLogprobs,
    OpenAICompletionChoice,
    OpenAICompletionLogprobs,
    OpenAICompletionResponse,
)
from parrot.protocol import ErrorBody, ErrorResponse
from pydantic import BaseModel

from server.engine.detokenize import IncrementalDetokenizer
from server.engine.errors import EngineError
from server.engine.sampling import TokenLogprob
from server.http.openai_answer import AnswerForm, AnswerMeta, assistant_message, echoed_logprobs, usage
from server.http.openai_logprobs import chat_logprobs, completion_logprobs
from server.serve.request_run import RequestChoice, RequestRun

_T = TypeVar("_T")


async def streamed_answer(run: RequestRun, form: AnswerForm) -> StreamingResponse:
    """The streamed answer of a started run (each choice's first token read); from here the stream owns
    the run and releases it."""
    try:
        events = _stream_events(run, form)
        # Started here, so that its `finally` (which releases the run) runs even if the client is gone
        # before the response begins: asyncio closes a started async generator when it is collected.
        head = await anext(events)
    except BaseException:
        await run.release()
        raise
    return StreamingResponse(_prepend(head, events), media_type="text/event-stream")


async def _prepend(head: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    yield head
    async for item in rest:
        yield item


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


async def _stream_events(run: RequestRun, form: AnswerForm) -> AsyncIterator[str]:
    """The SSE body: every choice's deltas as they come, interleaved as vLLM sends them (all generates run
    concurrently in the engine), each choice's in its own order; then the usage chunk (when asked for)
    and ``[DONE]``. The contexts are freed however the stream ends; an engine error ends it with an error
    event."""
    tokenizer = run.engine.tokenizer
    meta, chat = form.meta, form.chat
    choices = [_choice_events(tokenizer, form, i, choice) for i, choice in enumerate(run.choices)]
    try:
        async for event in choices[0] if len(choices) == 1 else _interleave(choices):
            yield event
        if meta.include_usage:
            counts = usage(run.choices)
            body: BaseModel = (
                OpenAIChatCompletionChunk(
                    id=meta.id, created=meta.created, model=meta.model, choices=[], usage=counts
                )
                if chat
                else OpenAICompletionResponse(
                    id=meta.id, created=meta.created, model=meta.model, choices=[], usage=counts
                )
            )
            yield _sse(body.model_dump_json())
        await run.release()  # before [DONE]: a client that saw the end sees the contexts handed back
        yield _sse("[DONE]")
    except EngineError as e:
        yield _sse(ErrorResponse(error=ErrorBody(type=e.error_type, message=str(e))).model_dump_json())
    finally:
        await run.release()


async def _choice_events(
    tokenizer: Any, form: AnswerForm, index: int, choice: RequestChoice
) -> AsyncIterator[str]:
    """One choice's chunks; the choice completes once its generate ends. With tools, the choice is sent
    whole once complete: only then is it known to be calls or text.

    Deltas come from `IncrementalDetokenizer`, so a stop string is never sent; the last chunk carries the
    ``finish_reason``. With logprobs, each chunk carries those of the tokens it completes. With
    ``with_ids`` (completions' return_token_ids), each chunk carries the token ids pushed since the last
    one, and the first chunk the prompt's. With ``echo``, the first chunk is the prompt's text (and its
    tokens' logprobs, when scored).
    """
    meta, sampling, chat, with_ids, tools, echo = (
        form.meta,
        form.sampling,
        form.chat,
        form.with_ids,
        form.tools,
        form.echo,
    )
    stream = choice.stream
    assert stream is not None
    pending: list[int] = []  # ids not sent yet
    prompt_ids: list[int] | None = choice.prompt
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
        text = echo.texts[choice.prompt_no]
        if echo.top is not None and choice.scored is not None and sampling.logprobs is not None:
            prompt = echoed_logprobs(choice, echo)
            ids, prompt_ids = (choice.prompt, None) if with_ids else (None, None)
            echoed = completion_logprobs(tokenizer, prompt, first=choice.prompt[0])
            yield _text_chunk(meta, index, text, None, [] if with_ids else None, ids, echoed)
            at = _end_offset(echoed, at)
        else:
            yield chunk(text, None, [])
    if tools is not None:
        result = await stream.result()
        choice.result = result
        lps = None if result.logprobs is None else chat_logprobs(tokenizer, result.logprobs)
        yield _sse(_chat_whole_chunk(meta, index, *assistant_message(result, tools), lps))
        return
    detok = IncrementalDetokenizer(tokenizer, sampling.stop)
    if choice.first is not None:
        tokens = _prepend(choice.first, stream)
        async for token_id in tokens:
            pending.append(token_id)
            read += 1
            if delta := detok.push(token_id):
                yield chunk(delta, None, stream.logprobs[sent:read])
    result = await stream.result()
    choice.result = result
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
    meta: AnswerMeta,
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
    meta: AnswerMeta,
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


def _chat_role_chunk(meta: AnswerMeta, index: int) -> str:
    choice = OpenAIChatChunkChoice(index=index, delta=OpenAIChatDelta(role="assistant", content=""))
    body = OpenAIChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
    return body.model_dump_json(exclude=meta.chunk_exclude)


def _chat_chunk(
    meta: AnswerMeta,
    index: int,
    text: str | None,
    finish: str | None,
    logprobs: OpenAIChatLogprobs | None = None,
) -> str:
    delta = OpenAIChatDelta(content=text)
    choice = OpenAIChatChunkChoice.model_validate(
        {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    )
    body = OpenAIChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice])
    data = body.model_dump(exclude=meta.chunk_exclude)
    data["choices"][0]["delta"] = delta.model_dump(exclude_none=True)  # the last delta is {}
    return _sse(json.dumps(data))
