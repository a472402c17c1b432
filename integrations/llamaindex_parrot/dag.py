"""Run a synthesizer's plan in one Parrot session: submit its whole DAG, then get the final answer.

A *plan* is a generator that submits semantic calls (in the current session) and returns the final answer:
a `parrot.Variable`, or text it already knows. Where a packing decision needs a value the server has not
produced yet, the plan yields that variable and receives its text (`llamaindex_parrot.packing` says when);
the driver gets it — sync with ``get``, async with ``await aget`` — which is the one place the two differ.
Everything queued until then goes to the server with that ``get``; otherwise with the final one.

`stream_plan` / `astream_plan` give the final answer as its text is written instead: they return once the
whole DAG is submitted, and the session stays open until the stream is read to its end, closed, or
garbage-collected. The final call of a plan has no transform, so its streamed text is its value.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncGenerator, Callable, Generator
from typing import Protocol

import parrot as P

__all__ = ["Plan", "arun_plan", "astream_plan", "run_plan", "stream_plan"]

Plan = Generator[P.Variable, str, "P.Variable | str | None"]


class ParrotServer(Protocol):
    """What running a plan needs of the LLM (`llamaindex_parrot.ParrotLLM`): where the server is, the HTTP
    timeout, and how long to wait for a value."""

    @property
    def base_url(self) -> str: ...
    @property
    def timeout(self) -> float: ...
    @property
    def get_timeout(self) -> float | None: ...
    @property
    def api_key(self) -> str | None: ...


class _End:
    """The end of a stream's chunks (the producer's error, if any, is its task's)."""


_END = _End()


def _session(llm: ParrotServer) -> P.Session:
    return P.Session(llm.base_url, timeout=llm.timeout, api_key=llm.api_key)


def _settle(llm: ParrotServer, plan: Plan) -> P.Variable | str | None:
    """Run ``plan`` to its end, getting each value it waits for; its final answer."""
    try:
        needed = next(plan)
        while True:
            needed = plan.send(str(needed.get(criteria=P.LATENCY, timeout=llm.get_timeout)))
    except StopIteration as done:
        return done.value


async def _asettle(llm: ParrotServer, plan: Plan) -> P.Variable | str | None:
    """``async`` form of `_settle`."""
    try:
        needed = next(plan)
        while True:
            needed = plan.send(str(await needed.aget(criteria=P.LATENCY, timeout=llm.get_timeout)))
    except StopIteration as done:
        return done.value


def run_plan(llm: ParrotServer, make_plan: Callable[[], Plan]) -> str | None:
    """Run the plan in a new session of ``llm``'s server; the answer's text (None: the plan made none).

    Values are awaited with ``criteria=latency`` (the final answer is what the user waits for, and every
    call feeding it is on its critical path) and at most ``llm.get_timeout`` seconds.
    """
    with _session(llm):
        answer = _settle(llm, make_plan())
        if isinstance(answer, P.Variable):
            return str(answer.get(criteria=P.LATENCY, timeout=llm.get_timeout))
        return answer


async def arun_plan(llm: ParrotServer, make_plan: Callable[[], Plan]) -> str | None:
    """``async`` form of `run_plan` (an ``async with`` session; nothing blocks the event loop)."""
    async with _session(llm):
        answer = await _asettle(llm, make_plan())
        if isinstance(answer, P.Variable):
            return str(await answer.aget(criteria=P.LATENCY, timeout=llm.get_timeout))
        return answer


def stream_plan(llm: ParrotServer, make_plan: Callable[[], Plan]) -> Generator[str, None, None]:
    """`run_plan` streaming the answer: chunks of its text as the server writes them, joining to the text
    `run_plan` returns (a plan ending in known text yields it whole; no answer yields nothing).

    Returns once the DAG is submitted (and accepted): what fails before — a template without a value, an
    unreachable server, a rejected call — raises here. A failed answer (``parrot.VariableFailedError``) or a
    passed ``llm.get_timeout`` raises from the generator. The session is deleted when the generator ends,
    raises, or is closed or collected before its end.
    """
    # The session is entered and left in a context of its own, whichever thread or context reads the
    # stream: it never becomes the reader's current session, and leaving it always resets its own context.
    context = contextvars.copy_context()
    steps = _stream_in_session(llm, make_plan)
    context.run(next, steps)  # up to the submission
    chunks = _follow(context, steps)
    next(chunks)  # suspended inside its `try`: closing or collecting it closes the session
    return chunks


def _stream_in_session(llm: ParrotServer, make_plan: Callable[[], Plan]) -> Generator[str, None, None]:
    """Submit the plan (yielding ``""`` once it is accepted), then its answer's chunks, in one session."""
    with _session(llm) as session:
        answer = _settle(llm, make_plan())
        session.flush()
        yield ""
        if isinstance(answer, P.Variable):
            yield from answer.stream(criteria=P.LATENCY, timeout=llm.get_timeout)
        elif answer:
            yield answer


def _follow(context: contextvars.Context, steps: Generator[str, None, None]) -> Generator[str, None, None]:
    """``steps``'s chunks, each read in ``context``; closes ``steps`` there however it ends."""
    try:
        yield ""  # the primer `stream_plan` takes
        while not isinstance(chunk := context.run(next, steps, _END), _End):
            yield chunk
    finally:
        context.run(steps.close)


async def astream_plan(llm: ParrotServer, make_plan: Callable[[], Plan]) -> AsyncGenerator[str, None]:
    """``async`` form of `stream_plan`: an async generator, nothing blocking the event loop.

    The session lives in a task of its own (its own context, as in `stream_plan`) that queues the chunks;
    closing the generator early cancels the task and waits until the session is deleted.
    """
    chunks: asyncio.Queue[str | _End] = asyncio.Queue()
    submitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def produce() -> None:
        try:
            async with _session(llm) as session:
                answer = await _asettle(llm, make_plan())
                await session.aflush()
                submitted.set_result(None)
                if isinstance(answer, P.Variable):
                    async for text in answer.astream(criteria=P.LATENCY, timeout=llm.get_timeout):
                        chunks.put_nowait(text)
                elif answer:
                    chunks.put_nowait(answer)
        finally:
            chunks.put_nowait(_END)

    task = asyncio.create_task(produce())
    try:
        await asyncio.wait({submitted, task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the caller was cancelled: so is the submission
        await _stop(task)
        raise
    if not submitted.done():
        await task  # it ended before the submission: its error
    follow = _afollow(chunks, task)
    await follow.__anext__()  # suspended inside its `try`: closing or collecting it ends the task
    return follow


async def _afollow(chunks: asyncio.Queue[str | _End], task: asyncio.Task[None]) -> AsyncGenerator[str, None]:
    """The chunks ``task`` queues, then its error if any; stops the task however the reading ends."""
    try:
        yield ""  # the primer `astream_plan` takes
        while not isinstance(chunk := await chunks.get(), _End):
            yield chunk
        await task
    finally:
        await _stop(task)


async def _stop(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` unless it is done, and wait until it is (its session deleted)."""
    if not task.done():
        task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: a reader that stopped early does not want it, nor a log line about it
