"""`Placement`: the asyncio edge of the cluster scheduler — steps wait here until `schedule` gives them an
engine.

A step calls `acquire` with its `QueuedRequest` and waits; a scheduling pass runs the pure
`server.serve.scheduler.schedule` over every waiting step whenever steps arrive (coalesced: all steps made
runnable in one loop iteration — a task group, a burst sharing a prefix — are placed by one pass) or one
finishes (`release` frees its tokens) or the engines in service change (`engines_changed`: one failed,
drains or joined). The running tokens per engine are this object's own accounting of what it placed, not the
engines' (possibly stale) stats, so caps hold exactly.

A waiting request that no engine in service could ever take fails at once rather than waiting: pinned to an
engine that left (`PinnedEngineGoneError`: the caller places it again, unpinned) or of a model no engine in
service serves (`NoServingEngineError`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from parrot.protocol import Criteria

from server.serve.scheduler import EngineState, QueuedRequest, Reason, SchedulerConfig, schedule

__all__ = ["NoServingEngineError", "PinnedEngineGoneError", "Placement", "RequestTooLargeError"]


class RequestTooLargeError(Exception):
    """A step needs more tokens than any engine may run at once (its prompt + max_tokens): it would wait
    forever, so it fails (HTTP 413)."""

    http_status = 413
    error_type = "request_too_large"


class NoServingEngineError(Exception):
    """No engine in service serves the request's model (all failed, drained or left): HTTP 503."""

    http_status = 503
    error_type = "no_engine"


class PinnedEngineGoneError(Exception):
    """The engine a request was pinned to left service while the request waited; nothing of it ran, so the
    caller may place it again without the pin."""

    def __init__(self, engine_id: int) -> None:
        super().__init__(f"engine {engine_id} left service before the request was placed there")
        self.engine_id = engine_id


@dataclass
class _Waiting:
    request: QueuedRequest
    future: asyncio.Future[int]


class Placement:
    """Steps waiting for an engine, and what runs where. ``engines()`` gives the engines in service with
    their caps (``running`` is filled in here)."""

    def __init__(
        self, engines: Callable[[], list[EngineState]], config: SchedulerConfig | None = None
    ) -> None:
        self._engines = engines
        self._config = config or SchedulerConfig()
        self._waiting: dict[str, _Waiting] = {}
        # What each placed request was when placed (a reprioritised one differs from its caller's copy).
        self._placed: dict[str, QueuedRequest] = {}
        self._running: Counter[int] = Counter()  # engine -> tokens placed there and not released
        self._latency: Counter[int] = Counter()  # engine -> latency-bound steps running there
        self._steps: Counter[int] = Counter()  # engine -> requests placed there and not released
        # engine -> shared-prefix key -> requests of that prefix placed there and not released
        self._prefixes: dict[int, Counter[str]] = {}
        self._seq = itertools.count()
        self._pass_pending = False
        self.placed: Counter[tuple[int, Reason]] = Counter()  # (engine, branch) -> steps, for metrics

    def next_seq(self) -> int:
        """Arrival order for a new request."""
        return next(self._seq)

    async def acquire(self, request: QueuedRequest) -> int:
        """Wait until the scheduler places ``request``; returns its engine id. Pair with `release`."""
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting[request.key] = _Waiting(request, future)
        self._request_pass()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result(), request)  # placed just as the waiter went away
            raise
        finally:
            self._waiting.pop(request.key, None)

    def reprioritise(self, key: str, *, criteria: Criteria | None, task_group: str | None) -> bool:
        """A request still waiting gets a new objective (a later ``get`` reached it); returns whether it
        was waiting. A placed request keeps its engine."""
        waiting = self._waiting.get(key)
        if waiting is None or waiting.future.done():
            return False
        waiting.request = replace(waiting.request, criteria=criteria, task_group=task_group)
        self._request_pass()
        return True

    def release(self, engine_id: int, request: QueuedRequest) -> None:
        """``request`` finished (or failed) on ``engine_id``: its tokens are free for others."""
        request = self._placed.pop(request.key, request)
        self._running[engine_id] -= request.tokens
        self._steps[engine_id] -= 1
        if request.shared_prefix is not None:
            keys = self._prefixes.get(engine_id)
            if keys is not None:
                keys[request.shared_prefix] -= 1
                if keys[request.shared_prefix] <= 0:
                    del keys[request.shared_prefix]
        if request.latency_bound:
            self._latency[engine_id] -= 1
        self._request_pass()

    def running_tokens(self, engine_id: int) -> int:
        """Tokens placed on ``engine_id`` and not released yet."""
        return self._running[engine_id]

    def running_steps(self, engine_id: int) -> int:
        """Requests placed on ``engine_id`` and not released yet (a draining engine waits for 0)."""
        return self._steps[engine_id]

    def engines_changed(self) -> None:
        """The engines in service changed (one failed, started draining or joined): place again now, so that
        nothing waits for an engine that went or misses one that came."""
        self._request_pass()

    def _request_pass(self) -> None:
        if not self._pass_pending:
            self._pass_pending = True
            asyncio.get_running_loop().call_soon(self._pass)

    def _pass(self) -> None:
        self._pass_pending = False
        waiting = [w for w in self._waiting.values() if not w.future.done()]
        if not waiting:
            return
        engines = [
            replace(
                e,
                running=self._running[e.engine_id],
                steps=self._steps[e.engine_id],
                latency_running=self._latency[e.engine_id] > 0,
                prefixes=frozenset(self._prefixes.get(e.engine_id, ())),
            )
            for e in self._engines()
        ]
        placeable = []
        for w in waiting:
            error = _stranded(w.request, engines)
            if error is None:
                placeable.append(w)
            else:
                w.future.set_exception(error)
        waiting = placeable
        if not waiting:
            return
        decision = schedule([w.request for w in waiting], engines, self._config)
        unfit = set(decision.unfit)
        for w in waiting:
            key = w.request.key
            if key in decision.assignments:
                engine_id = decision.assignments[key]
                self._running[engine_id] += w.request.tokens
                self._steps[engine_id] += 1
                if w.request.shared_prefix is not None:
                    self._prefixes.setdefault(engine_id, Counter())[w.request.shared_prefix] += 1
                if w.request.latency_bound:
                    self._latency[engine_id] += 1
                self.placed[engine_id, decision.reasons[key]] += 1
                self._placed[key] = w.request
                w.future.set_result(engine_id)
            elif key in unfit:
                caps = ", ".join(f"engine {e.engine_id}: {e.cap_for(w.request.criteria)}" for e in engines)
                w.future.set_exception(
                    RequestTooLargeError(
                        f"the step needs {w.request.tokens} tokens (prompt + max_tokens) but engines run at "
                        f"most {caps or 'nothing (no engine serves its model)'}: shorten the prompt or "
                        "lower max_tokens"
                    )
                )
            elif w.request.waited < self._config.aging_rounds:  # its age counts toward the aging rule
                w.request = replace(w.request, waited=w.request.waited + 1)  # (beyond it nothing changes)


def _stranded(request: QueuedRequest, engines: list[EngineState]) -> Exception | None:
    """Why no engine in service could ever take ``request`` (waiting would not help), or None."""
    if request.pinned is not None:
        if any(e.engine_id == request.pinned for e in engines):
            return None
        return PinnedEngineGoneError(request.pinned)
    if any(e.serves(request.model) for e in engines):
        return None
    what = "any model" if request.model is None else f"the model {request.model!r}"
    return NoServingEngineError(
        f"no engine in service serves {what} (engines failed, are draining or left): start one "
        "(python -m server.engine --manager URL) or retry once one has registered"
    )
