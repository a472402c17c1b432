"""Simulated client network delay: an opt-in ASGI middleware (off unless added to the app).

The paper's evaluation adds a random 200–300 ms delay to every LLM request to emulate clients on the other
side of the Internet (DESIGN.md, "How performance is measured"). `NetworkDelayMiddleware` does the same on
the server side: each HTTP request waits a uniformly random delay in ``[low, high]`` seconds before it is
handled, so the Parrot client and the request-centric baseline pay the same cost per request they make,
and a client that makes fewer round trips pays less. Concurrent requests wait concurrently
(``asyncio.sleep``), as requests in flight on a real network do.

Health checks and metrics scrapes (``/health``, ``/metrics``) are not delayed, and neither are lifespan
or websocket events. The random numbers come from the instance's own ``random.Random`` (seeded, or passed
in): no global state, reproducible delays.

    app.add_middleware(NetworkDelayMiddleware, low=0.2, high=0.3, seed=0)
    # or: asgi = NetworkDelayMiddleware(app, low=0.2, high=0.3, seed=0)
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_LOW_S = 0.2
DEFAULT_HIGH_S = 0.3
DEFAULT_EXCLUDED = ("/health", "/metrics")


class NetworkDelayMiddleware:
    """Delay every HTTP request by ``U(low, high)`` seconds before handing it to ``app``.

    ``seed`` seeds this instance's own generator; pass ``rng`` instead to share one you own (``seed`` is
    then ignored). Paths in ``exclude`` (exact matches) are never delayed. ``enabled`` can be switched at
    run time (a benchmark measuring with and without delay on one server). ``requests_delayed`` and
    ``total_delay_s`` count what was applied, for tests and benchmarks.
    """

    def __init__(
        self,
        app: ASGIApp,
        low: float = DEFAULT_LOW_S,
        high: float = DEFAULT_HIGH_S,
        seed: int | None = 0,
        *,
        rng: random.Random | None = None,
        exclude: Iterable[str] = DEFAULT_EXCLUDED,
        enabled: bool = True,
    ) -> None:
        if not (0.0 <= low <= high):
            raise ValueError(f"the delay bounds must satisfy 0 <= low <= high, got low={low}, high={high}")
        self.app = app
        self.low = low
        self.high = high
        self.rng = rng if rng is not None else random.Random(seed)
        self.exclude = frozenset(exclude)
        self.enabled = enabled
        self.requests_delayed = 0
        self.total_delay_s = 0.0

    def next_delay(self) -> float:
        """The next delay in seconds, uniform in ``[low, high]``."""
        return self.rng.uniform(self.low, self.high)

    def applies_to(self, scope: Scope) -> bool:
        """Whether a request with this ASGI scope is delayed (HTTP, enabled, path not excluded)."""
        return self.enabled and scope["type"] == "http" and scope.get("path", "") not in self.exclude

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.applies_to(scope):
            delay = self.next_delay()
            self.requests_delayed += 1
            self.total_delay_s += delay
            await asyncio.sleep(delay)
        await self.app(scope, receive, send)
