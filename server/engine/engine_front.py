"""The engine's async front: the commands the event loop posts to the engine thread, and the sinks that carry
each answer back (`Sink`), token by token for a streamed generate (`GenerationStream`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from server.engine.guided import CompiledGrammar
from server.engine.remote_kv import RemotePrefix
from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams, TokenLogprob


def mark_retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class Sink:
    """Delivers a request's tokens and outcome from the engine thread into the caller's event loop."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.queue: asyncio.Queue[object] | None = asyncio.Queue() if stream else None
        self.logprobs: list[TokenLogprob] = []  # the streamed tokens', when the sampling asked for them

    def token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        if self.queue is not None:
            self._post(self._push, token_id, logprob)

    def _push(self, token_id: int, logprob: TokenLogprob | None) -> None:
        assert self.queue is not None
        if logprob is not None:
            self.logprobs.append(logprob)  # before its token: a reader of the token finds it here
        self.queue.put_nowait(token_id)

    def finish(self, result: object, error: BaseException | None = None) -> None:
        self._post(self._settle, result, error)

    def _settle(self, result: object, error: BaseException | None) -> None:
        if not self.future.done():
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        if self.queue is not None:
            self.queue.put_nowait(self._END)

    def _post(self, fn: Any, *args: Any) -> None:
        # RuntimeError: the caller's loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(fn, *args)


@dataclass
class Submit:
    sink: Sink
    context_id: int
    parent_id: int | None
    token_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None  # None: a fill
    latency_cap: int | None = None  # a generate's latency cap (`Scheduler`); None: none
    parent_len: int | None = None  # fork from the parent's first this many tokens; None: all of them
    priority: float | None = None  # its place in the waiting queue under "sjf" (lower: sooner)
    tenant: str | None = None  # who sent it: tenants take turns in the waiting queue
    remote: RemotePrefix | None = None  # a new context's leading KV, held by another engine
    grammar: CompiledGrammar | None = None  # a guided generate's grammar, once compiled
    # A scoring fill's top alternatives per token (`LLMEngine.score`); None: a plain fill
    prompt_logprobs: int | None = None


@dataclass
class Compiled:
    """A guided generate's grammar came back from the compiler thread (or failed to compile)."""

    submit: Submit
    error: BaseException | None


@dataclass
class Call:
    """Run ``fn`` on the engine thread and answer its result (or its `EngineError`)."""

    sink: Sink
    fn: Callable[[], object]


@dataclass
class Free:
    sink: Sink
    context_id: int


@dataclass
class Abort:
    sink: Sink


class GenerationStream:
    """A generate in flight: iterate it for token ids as they are sampled, then await `result()`.

    Iteration raises the request's error, if it failed. Cancelling the consuming task, or `cancel()`,
    aborts the request in the engine.
    """

    def __init__(
        self, sink: Sink, abort: Callable[[Sink], None], wait: Callable[[Sink], Awaitable[Any]]
    ) -> None:
        self._sink = sink
        self._abort = abort  # the engine's: stop the request if it still runs
        self._wait = wait  # the engine's: its result, or its error

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> int:
        assert self._sink.queue is not None, "submitted with stream=False"
        try:
            item = await self._sink.queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if item is Sink._END:
            self._sink.queue.put_nowait(item)  # stay exhausted
            error = self._sink.future.exception()
            if error is not None:
                raise error
            raise StopAsyncIteration
        return item  # type: ignore[return-value]

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens iterated so far (at least those), when the sampling asked
        for them; else empty."""
        return self._sink.logprobs

    def cancel(self) -> None:
        """Abort the request if it is still running."""
        self._abort(self._sink)

    async def result(self) -> GenerateResult:
        return await self._wait(self._sink)
