"""Graceful shutdown of a server process (an engine, or the manager): drain first, then stop.

uvicorn's own SIGTERM handling stops accepting connections and waits for in-flight requests. That alone
is not enough here: a manager would keep placing work on a stopping engine until its connections were
refused (then re-run that work elsewhere), and a stopping manager would take new sessions and calls it
could not finish. `DrainingServer` runs a ``drain`` coroutine on the first SIGTERM/SIGINT — an engine
announces ``draining`` to its manager (no new work is placed there); the manager refuses new work with 503
and waits for its running steps — then hands over to uvicorn's shutdown (in-flight requests finish within
``timeout_graceful_shutdown``). A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

__all__ = ["DrainingServer"]


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT awaits ``drain`` (if any) before shutting down."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[], Awaitable[object]] | None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._draining: asyncio.Future[None] | None = None
        self._on_started = on_started  # once the app has started and its sockets accept

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._on_started is not None:
            self._on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain is None or self._draining is not None:
            super().handle_exit(sig, frame)  # nothing to drain, or a second signal: uvicorn's way
            return
        # A signal handler interrupts the loop between bytecodes: schedule the drain through the loop's
        # thread-safe entry rather than touching its task set here.
        asyncio.get_event_loop().call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_exit(sig))

    async def _drain_then_exit(self, sig: int) -> None:
        assert self._drain is not None
        try:
            await self._drain()
        finally:
            super().handle_exit(sig, None)
