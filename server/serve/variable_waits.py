"""Clients waiting on variables: long-poll gets, and readers of a generated variable's text as it is written.

A waiter wakes when its variable settles (`settled`: ready or failed); a text stream (`StepTextStream`,
one per generated variable, written by the step that produces it) ends then too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from parrot.protocol import GetVariableResponse

from server.serve.errors import GetTimeoutError
from server.serve.sessions import Session, SessionTable
from server.serve.streams import Delta, Restart, StepTextStream
from server.serve.variables import VariableTable


def variable_response(variables: VariableTable, var_id: str) -> GetVariableResponse:
    """``var_id``'s state as the API answers it."""
    var = variables.get(var_id)
    return GetVariableResponse(
        var_id=var_id,
        status=var.status,
        value=var.value,
        kind=var.kind,
        error=var.error,
        error_type=var.error_type,
        llm_output=var.llm_output,
    )


class VariableWaits:
    """The gets waiting on variables of ``sessions`` and the text streams of their generated variables."""

    def __init__(
        self,
        sessions: SessionTable,
        default_timeout: float,
        max_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sessions = sessions
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self._clock = clock
        self._waiters: dict[tuple[str, str], asyncio.Event] = {}
        # Each generated variable's text as it is written, by (session, variable).
        self._texts: dict[tuple[str, str], StepTextStream] = {}

    def timeout(self, asked: float | None) -> float:
        """How long a get may wait: what it asked (else the default), at most the server's bound."""
        return min(self.default_timeout if asked is None else asked, self.max_timeout)

    async def wait(self, session: Session, var_id: str, timeout: float | None) -> GetVariableResponse:
        """Wait until ``var_id`` is settled (`GetTimeoutError` once ``timeout`` passes first)."""
        if not session.graph.variables.get(var_id).settled:
            event = self._waiters.setdefault((session.session_id, var_id), asyncio.Event())
            try:
                with self.sessions.waiting(session, self._clock):  # not idle while a get waits on it
                    await asyncio.wait_for(event.wait(), self.timeout(timeout))
            except TimeoutError:
                wait = self.default_timeout if timeout is None else timeout
                raise GetTimeoutError(
                    f"variable {var_id!r} is still pending after {wait:g}s: its producer has not finished "
                    "(or an input it needs was never set); get it again or set the missing input"
                ) from None
        return variable_response(session.graph.variables, var_id)

    def text(self, session_id: str, var_id: str, live: bool = True) -> StepTextStream:
        """The text stream of a generated variable (created on first use). Not ``live`` (its session was
        deleted): a stream nobody else will see."""
        if not live:
            return StepTextStream()
        return self._texts.setdefault((session_id, var_id), StepTextStream())

    def follow(
        self, session: Session, var_id: str, wait: float, hold: bool
    ) -> AsyncIterator[Delta | Restart | GetVariableResponse]:
        """``var_id``'s text as it is written (from the beginning), then its answer; with ``hold`` the
        session is not idle while its client reads."""
        text = self.text(session.session_id, var_id)
        if session.graph.variables.get(var_id).settled:
            text.close()  # (a value set by the client, or a failure before any step ran: no text)
        return self._follow(session, var_id, text, wait, hold)

    async def _follow(
        self, session: Session, var_id: str, text: StepTextStream, wait: float, hold: bool
    ) -> AsyncIterator[Delta | Restart | GetVariableResponse]:
        var = session.graph.variables.get(var_id)
        if not text.started and var.status == "ready" and var.kind == "text" and var.value:
            yield Delta(var.value)  # a value the client set: no step wrote it, it is its own text
        deltas = text.deltas()
        deadline = time.monotonic() + wait
        busy = self.sessions.waiting(session, self._clock) if hold else contextlib.nullcontext()
        with busy:  # not idle while its client reads it
            try:
                while True:
                    yield await asyncio.wait_for(anext(deltas), max(0.0, deadline - time.monotonic()))
            except (StopAsyncIteration, TimeoutError):
                pass  # ended, or still pending at the deadline: the answer below says which
            finally:
                await deltas.aclose()
        yield variable_response(session.graph.variables, var_id)

    def settled(self, session: Session, var_id: str) -> None:
        """``var_id`` is ready or failed: wake its gets, end its text stream."""
        event = self._waiters.pop((session.session_id, var_id), None)
        if event is not None:
            event.set()
        text = self._texts.get((session.session_id, var_id))
        if text is not None:
            text.close()

    def drop_session(self, session_id: str) -> None:
        """The session was deleted: wake its gets and end its streams."""
        for key in [k for k in self._waiters if k[0] == session_id]:
            self._waiters.pop(key).set()
        for key in [k for k in self._texts if k[0] == session_id]:
            self._texts.pop(key).close()
