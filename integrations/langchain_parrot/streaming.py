"""Streaming a compiled chain: the final model step's text as the server writes it (``Variable.stream``).

A chain streams when its last step is a model step whose output is text (``| StrOutputParser()``) or a
chat message (no parser): chunks are ``str`` or ``AIMessageChunk`` and join to what ``invoke`` returns. Any
other ending (a parser making JSON, a client-side step) has nothing to stream token by token: the chain
yields its ``invoke`` result as its one chunk, as LangChain does for a Runnable without a streaming form.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Literal

import parrot as P
from langchain_core.messages import AIMessageChunk

from langchain_parrot._http import ServerConnection
from langchain_parrot.runner import in_session, in_session_async
from langchain_parrot.steps import ModelStep, SequenceStep, Step

__all__ = ["astream_text", "stream_kind", "stream_text"]

StreamKind = Literal["text", "message"]
_END = object()


def stream_kind(step: Step) -> StreamKind | None:
    """What the chain's last step streams: text, a chat message, or nothing token by token (None)."""
    while isinstance(step, SequenceStep) and step.steps:
        step = step.steps[-1]
    if isinstance(step, ModelStep) and step.plan.kind in ("text", "message") and not step.plan.transforms:
        return step.plan.kind
    return None


def _chunk(kind: StreamKind, text: str) -> Any:
    return AIMessageChunk(content=text) if kind == "message" else text


def stream_text(
    connection: ServerConnection | None,
    submit: Callable[[], dict[str, P.Variable]],
    kind: StreamKind,
    criteria: P.protocol.Criteria,
    timeout: float | None,
) -> Iterator[Any]:
    """Run ``submit`` in a session (on a worker thread, where the session lives) and yield its output's
    text as it comes; the worker's error, if any, is raised here once the chunks before it were yielded."""
    chunks: queue.Queue[Any] = queue.Queue()
    failure: list[BaseException] = []

    def work() -> None:
        (variable,) = submit().values()
        for text in variable.stream(criteria, timeout):
            chunks.put(_chunk(kind, text))

    def run() -> None:
        try:
            in_session(connection, work)
        except BaseException as e:  # handed to the reader
            failure.append(e)
        finally:
            chunks.put(_END)

    threading.Thread(
        target=contextvars.copy_context().run, args=(run,), name="parrot-stream", daemon=True
    ).start()
    while (item := chunks.get()) is not _END:
        yield item
    if failure:
        raise failure[0]


async def astream_text(
    connection: ServerConnection | None,
    asubmit: Callable[[], Awaitable[dict[str, P.Variable]]],
    kind: StreamKind,
    criteria: P.protocol.Criteria,
    timeout: float | None,
) -> AsyncIterator[Any]:
    """``async`` form of `stream_text`: the session lives in a task."""
    chunks: asyncio.Queue[Any] = asyncio.Queue()

    async def work() -> None:
        (variable,) = (await asubmit()).values()
        async for text in variable.astream(criteria, timeout):
            chunks.put_nowait(_chunk(kind, text))

    async def run() -> None:
        try:
            await in_session_async(connection, work)
        finally:
            chunks.put_nowait(_END)

    task = asyncio.create_task(run())
    try:
        while (item := await chunks.get()) is not _END:
            yield item
        await task  # its error, if any
    finally:
        if not task.done():
            task.cancel()
