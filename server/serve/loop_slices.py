"""Spreads many tasks' CPU-bound starts over event-loop iterations, so a burst cannot hold the loop.

A batch of thousands of calls makes thousands of steps ready at once; each step's start (tokenizing its
prompt, matching prefixes, queueing for an engine) is short, but all of them in one loop iteration hold
every other request — ``/health`` included — for seconds. `LoopSlices.turn` lets at most ``per_slice``
tasks through per iteration; the rest wait on a future each and go in later iterations, with the loop
polling its sockets between slices. Waiters of different keys (tenants) take turns, each key's in arrival
order: one tenant's burst does not hold another's next step behind it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque

__all__ = ["LoopSlices"]


class LoopSlices:
    """At most ``per_slice`` `turn` calls pass per event-loop iteration; keys take turns, each first come
    first served."""

    def __init__(self, per_slice: int) -> None:
        if per_slice < 1:
            raise ValueError(f"per_slice must be at least 1, not {per_slice}")
        self.per_slice = per_slice
        self._passed = 0  # turns taken in the current slice
        # key -> its waiters; the key served longest ago first
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._slice_ends = False  # a new slice is scheduled for the next iteration

    async def turn(self, key: str = "") -> None:
        """Return at once while this iteration's slice has room, else in a later iteration's (``key``'s
        waiters taking turns with other keys')."""
        if self._passed < self.per_slice and not self._waiting:
            self._passed += 1
            self._end_slice_soon()
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(future)
        self._end_slice_soon()
        await future  # cancelled while waiting: the slice's count is not taken

    def _end_slice_soon(self) -> None:
        if not self._slice_ends:
            self._slice_ends = True
            asyncio.get_running_loop().call_soon(self._next_slice)

    def _next_slice(self) -> None:
        """Start a new slice: wake the next ``per_slice`` waiters, one per key in turn (they run in the
        next iteration)."""
        self._slice_ends = False
        self._passed = 0
        while self._waiting and self._passed < self.per_slice:
            key, futures = next(iter(self._waiting.items()))
            future = futures.popleft()
            if futures:
                self._waiting.move_to_end(key)  # its next waiter after the other keys' next
            else:
                del self._waiting[key]
            if not future.done():  # a cancelled waiter takes no place
                future.set_result(None)
                self._passed += 1
        if self._waiting or self._passed:
            self._end_slice_soon()
