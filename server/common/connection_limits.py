"""Connection hygiene: how long a client may take to send a request's head, and how many connections one
client address may hold open at once.

uvicorn closes idle kept-alive connections (``timeout_keep_alive``) but waits forever for a request line and
headers that trickle in a byte at a time (slowloris): thousands of such connections hold memory and file
descriptors. `guarded_h11` makes uvicorn's h11 protocol close a connection whose request head is not complete
within ``head_timeout_s`` of its first byte being awaited, and refuse (503, then close) a connection beyond
``max_per_client`` from one address. The counts live in the protocol class `guarded_h11` makes, one per
server: nothing is shared between servers in one process.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ConnectionLimits", "guarded_h11"]

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    b"Content-Length: 52\r\n\r\ntoo many connections from this address: reuse them\n"
)


@dataclass(frozen=True)
class ConnectionLimits:
    """Per-connection bounds of a server (`server.cli.serve`)."""

    head_timeout_s: float = 30.0  # from awaiting a request to its complete request line and headers
    max_per_client: int = 1024  # connections open at once from one client address

    def __post_init__(self) -> None:
        if not (self.head_timeout_s > 0 and self.max_per_client >= 1):
            raise ValueError(f"connection limits must be positive: {self}")


def guarded_h11(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``limits`` (give it as ``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol  # the server extra: imported only to serve

    open_by_address: Counter[str] = Counter()

    class GuardedH11Protocol(H11Protocol):
        _address = ""
        _head_timer: asyncio.TimerHandle | None = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer: Any = transport.get_extra_info("peername")
            self._address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            if open_by_address[self._address] >= limits.max_per_client:
                self._refused = True
                transport.write(_BUSY)
                transport.close()
                return
            open_by_address[self._address] += 1
            super().connection_made(transport)
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            self._stop_head_timer()
            open_by_address[self._address] -= 1
            if open_by_address[self._address] <= 0:
                del open_by_address[self._address]
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._stop_head_timer()  # a request's head arrived: the app and the body timeouts take over
            elif self._head_timer is None:
                self._await_head()

        def _await_head(self) -> None:
            self._stop_head_timer()
            self._head_timer = self.loop.call_later(limits.head_timeout_s, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            in_request = self.cycle is not None and not self.cycle.response_complete
            if not in_request and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
