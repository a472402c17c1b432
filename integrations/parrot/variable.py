"""`Variable`: a Semantic Variable of a session, as a future on the client."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol

from parrot.errors import ConflictError, ParrotError, VariableFailedError
from parrot.protocol import Criteria, GetVariableResponse

__all__ = ["LATENCY", "THROUGHPUT", "Variable", "VariableOwner"]

LATENCY: Criteria = "latency"
THROUGHPUT: Criteria = "throughput"


class VariableOwner(Protocol):
    """What a variable needs of the session that made it; `parrot.Session` is the implementation.

    Declared here, not imported, so that the dependency points one way: `parrot.session` imports this
    module (a session makes variables), never the reverse.
    """

    def flush(self) -> None:
        """Send every queued operation now (`parrot.Session.flush`)."""
        ...

    async def aflush(self) -> None:
        """``await`` form of `flush`."""
        ...

    def _get(self, var: Variable, criteria: Criteria | None, timeout: float | None) -> Any: ...

    async def _aget(self, var: Variable, criteria: Criteria | None, timeout: float | None) -> Any: ...

    def _text(self, var: Variable, criteria: Criteria | None, timeout: float | None) -> Iterator[str]: ...

    def _atext(
        self, var: Variable, criteria: Criteria | None, timeout: float | None
    ) -> AsyncIterator[str]: ...

    def _enqueue_set(self, var: Variable, value: str) -> None: ...


class Variable:
    """A Semantic Variable: an input you give, or a future output of a semantic function call.

    Made by `Session.variable` or returned by calling a semantic function; never constructed by hand.
    Creating and calling are lazy: the session sends them to the server, in order, on the next ``get``
    (or `Session.flush`), in one request with that get.
    """

    def __init__(
        self, session: VariableOwner, *, name: str | None = None, producer: str | None = None
    ) -> None:
        self._session = session
        self._name = name
        self._producer = producer  # the semantic function producing it, for an output
        # Chosen here (the server accepts client ids): later calls can name it before it is sent.
        self._var_id = uuid.uuid4().hex
        self._sent = False  # the server has it
        self._has_value = False  # a value was given (at creation or by `set`)
        self._settled: GetVariableResponse | None = None  # the server's final answer, ready or failed
        self._error: ParrotError | None = None  # why the session could not submit what makes it

    @property
    def var_id(self) -> str:
        """The variable's id in its session (chosen by the client; the server has it once sent)."""
        return self._var_id

    @property
    def name(self) -> str | None:
        """The name given to `Session.variable`, or the output placeholder's name for a call's output."""
        return self._name

    @property
    def session(self) -> VariableOwner:
        """The session the variable belongs to (the `parrot.Session` that made it)."""
        return self._session

    def get(self, criteria: Criteria | None = None, timeout: float | None = None) -> Any:
        """Wait for the value (long poll) and return it: text, or the parsed value of a JSON transform.

        ``criteria`` (`LATENCY` or `THROUGHPUT`) tells the server what the application wants from this
        variable, which drives how its producers are scheduled. ``timeout`` is in seconds (None: wait
        as long as it takes). Raises `VariableFailedError` with the server's message if the variable
        failed (its ``error_type``, and its ``llm_output`` when a transform refused the model's text),
        `GetTimeoutError` if it is still pending after ``timeout``. For sync sessions.
        """
        return self._session._get(self, criteria, timeout)

    async def aget(self, criteria: Criteria | None = None, timeout: float | None = None) -> Any:
        """``await`` form of `get` (in a sync session it runs the blocking call in a worker thread)."""
        return await self._session._aget(self, criteria, timeout)

    def stream(self, criteria: Criteria | None = None, timeout: float | None = None) -> Iterator[str]:
        """The producing step's text as it is written: chunks that join to the model's output (before any
        transform), from the beginning whenever this is called; `get` gives the value after it.

        Sends the session's queued operations first. Raises what `get` raises at the end (a failed
        variable, ``timeout`` passed) and `parrot.text_stream.StreamRestartedError` if the step ran again
        on another engine and wrote a different text. For sync sessions.
        """
        return self._session._text(self, criteria, timeout)

    def astream(self, criteria: Criteria | None = None, timeout: float | None = None) -> AsyncIterator[str]:
        """``async for`` form of `stream` (async sessions)."""
        return self._session._atext(self, criteria, timeout)

    def set(self, value: str) -> None:
        """Give a pending input variable its value (sent with the next flush; a variable is set once)."""
        if not isinstance(value, str):
            raise TypeError(f"a variable's value is text: got {type(value).__name__}; pass str(value)")
        if self._producer is not None:
            raise ConflictError(
                f"{self._describe()} is an output of {self._producer}(): only the call sets it"
            )
        if self._has_value:
            raise ConflictError(f"{self._describe()} already has a value: a variable is set once")
        self._has_value = True
        self._session._enqueue_set(self, value)

    # ------------------------------------------------------------------------------------------ internal
    def _settle(self, response: GetVariableResponse) -> None:
        self._settled = response

    def _result(self) -> Any:
        """The value of a settled variable, or its failure raised."""
        settled = self._settled
        assert settled is not None
        if settled.status == "failed":
            reason = settled.error or "no reason given"
            raise VariableFailedError(
                f"{self._describe()} failed: {reason}",
                var_id=self._var_id,
                reason=reason,
                error_type=settled.error_type,
                llm_output=settled.llm_output,
            )
        value = settled.value or ""
        return json.loads(value) if settled.kind == "json" else value

    def _describe(self) -> str:
        return f"variable {self._var_id!r}" + (f" ({self._name!r})" if self._name else "")

    def __repr__(self) -> str:
        state = self._settled.status if self._settled else ("pending" if self._sent else "unsent")
        return f"<parrot.Variable {self._var_id} name={self._name!r} {state}>"
