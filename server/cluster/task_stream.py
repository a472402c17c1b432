"""A generate that runs as a task of the caller's event loop, behind `server.engine.GenerationStream`'s
interface: token ids as they come (when made with ``stream=True``), then `result()`; `cancel()` cancels the
task (the stream then ends with `RequestAbortedError`, as an engine's does). What the task does — talk to a
remote engine, drive a prefill + decode pair — is its ``produce``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from server.engine.errors import RequestAbortedError
from server.engine.request import GenerateResult
from server.engine.sampling import TokenLogprob

Emit = Callable[[int, TokenLogprob | None], None]  # a token id and, when asked for, its logprob


class TaskStream:
    """Runs ``produce(emit)``, which calls ``emit`` with each token id and returns the result."""

    _END = object()

    def __init__(self, produce: Callable[[Emit], Awaitable[GenerateResult]], stream: bool) -> None:
        self._queue: asyncio.Queue[Any] | None = asyncio.Queue() if stream else None
        # The streamed tokens' log-probabilities, when the sampling asked for them (`GenerationStream`'s).
        self.logprobs: list[TokenLogprob] = []
        self._task = asyncio.get_running_loop().create_task(self._run(produce))

    def __aiter__(self) -> TaskStream:
        return self

    async def __anext__(self) -> int:
        assert self._queue is not None, "submitted with stream=False"
        item = await self._queue.get()
        if item is self._END:
            self._queue.put_nowait(item)  # stay exhausted
            await self.result()  # raises the request's error, if any
            raise StopAsyncIteration
        return int(item)

    def cancel(self) -> None:
        self._task.cancel()

    async def result(self) -> GenerateResult:
        """The generate's result; `RequestAbortedError` once it was cancelled (as an engine's stream)."""
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            caller = asyncio.current_task()
            if self._task.cancelled() and (caller is None or not caller.cancelling()):
                raise RequestAbortedError("the request was cancelled") from None
            raise  # the caller itself is cancelled

    def _emit(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        if self._queue is not None:
            if logprob is not None:
                self.logprobs.append(logprob)
            self._queue.put_nowait(token_id)

    async def _run(self, produce: Callable[[Emit], Awaitable[GenerateResult]]) -> GenerateResult:
        try:
            return await produce(self._emit)
        finally:
            if self._queue is not None:
                self._queue.put_nowait(self._END)
