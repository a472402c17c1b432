"""A virtual clock for asyncio: simulated seconds pass instantly.

`VirtualTimeLoop` is a stock selector event loop whose ``time()`` is a virtual clock. Whenever the loop has
nothing ready to run and would sleep until its next timer, the clock jumps to that timer instead of
waiting. Every ``asyncio.sleep``, ``wait_for`` timeout and ``call_later`` in the code it runs — the
manager, the HTTP app, the network-delay middleware, the simulated engines' step times — therefore costs
no wall time, and unchanged serving code runs at cluster scale in seconds.

Real I/O still works (the selector is polled without waiting first). Work handed to an executor
(``run_in_executor``, ``asyncio.to_thread``) stops the clock until it is back: it counts as taking no
simulated time, and no timer fires early while a thread is still computing what comes next.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["SimulationStalledError", "VirtualTimeLoop", "run"]

T = TypeVar("T")

# How long the loop waits in real time, with no timer scheduled, for another thread to wake it before it
# declares the simulation stuck (every simulated wait is a timer, so only a deadlock waits this long).
_STALL_TIMEOUT_S = 30.0


class SimulationStalledError(RuntimeError):
    """Nothing is scheduled and nothing woke the loop: the simulated system waits for an event that will
    never come (a deadlock in the code under simulation)."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.in_executor = 0  # executor jobs not back yet: time stands still until they are


class _VirtualSelector(selectors.BaseSelector):
    """A real selector whose waits advance the virtual clock instead of blocking."""

    def __init__(self, clock: _Clock) -> None:
        self._real = selectors.DefaultSelector()
        self._clock = clock

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None or self._clock.in_executor:  # only another thread can make progress now
            events = self._real.select(_STALL_TIMEOUT_S)
            if not events:
                raise SimulationStalledError(
                    f"the simulation is stuck: no timer is scheduled and nothing happened for "
                    f"{_STALL_TIMEOUT_S:g} s of real time (something awaits an event that never comes)"
                )
            return events
        self._clock.now += timeout  # sleep until the next timer: instantly
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (see the module docstring). ``time()`` starts at 0."""

    def __init__(self) -> None:
        self._virtual = _Clock()
        super().__init__(_VirtualSelector(self._virtual))

    def time(self) -> float:
        return self._virtual.now

    def run_in_executor(  # type: ignore[override]  # the same call, with looser parameter types
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self._virtual.in_executor += 1
        future.add_done_callback(self._executor_done)
        return future

    def _executor_done(self, _: asyncio.Future[Any]) -> None:
        self._virtual.in_executor -= 1


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh `VirtualTimeLoop` (like ``asyncio.run``)."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
