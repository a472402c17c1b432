"""Semantic Variables of one session: pure data, no I/O, no clock, no locks.

A variable is *pending* until it gets a value (*ready*) or fails (*failed*, with a message saying why, the
type of its cause and, when a transform refused the model's text, that text); either way it is settled once
and for all. Its value is text; a structured value (from a transform such as ``json``) is its JSON text
tagged ``kind == "json"`` (see `server.serve.transforms.TransformResult`).

`VariableTable` holds a session's variables until the session dies. It enforces the "settled once" rule and
raises typed errors whose messages say what to fix; the HTTP layer maps them to status codes through
``http_status`` (404 unknown, 409 conflict). Who may set what (a client may not set a variable a call
produces) is the graph's business (`server.serve.graph.SessionGraph.set_variable`), not the table's.

`Variable` objects are immutable snapshots: the table replaces a variable on every change, so a snapshot
handed to a waiter never changes under it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple

if TYPE_CHECKING:
    # Type-only: importing transforms at run time would pull in langchain-core for a pure-data module.
    from server.serve.transforms import ValueKind

__all__ = [
    "STEP_FAILED",
    "VALUE_KINDS",
    "StepId",
    "UnknownVariableError",
    "Variable",
    "VariableConflictError",
    "VariableError",
    "VariableStatus",
    "VariableTable",
]

VariableStatus = Literal["pending", "ready", "failed"]

# The run-time check of `transforms.ValueKind` (a test keeps the two equal).
VALUE_KINDS: tuple[str, ...] = ("text", "json")

# The error type of a failure whose cause has no more precise one.
STEP_FAILED = "step_failed"


class StepId(NamedTuple):
    """A step of a call: the call's id and the step's index in it (one step per output, from 0)."""

    call_id: str
    index: int  # type: ignore[assignment]  # a field named as tuple.index, which it shadows on purpose

    def __str__(self) -> str:
        return f"step {self.index} of call {self.call_id!r}"


@dataclass(frozen=True)
class Variable:
    """One Semantic Variable (a snapshot).

    ``value`` is set exactly when ``status == "ready"``; ``error`` (the message) and ``error_type`` exactly
    when ``status == "failed"``. ``llm_output`` is the model's text a transform refused to parse, when that
    is why it failed (see `server.serve.transforms.TransformError.text`). A variable that failed because an
    input did carries its root cause's ``error_type`` and ``llm_output`` (see
    `server.serve.graph.SessionGraph.fail_step`). ``producer`` is the step that generates it, or None for a
    variable the client sets.
    """

    var_id: str
    name: str | None = None
    status: VariableStatus = "pending"
    value: str | None = None
    kind: ValueKind = "text"
    error: str | None = None
    producer: StepId | None = None
    error_type: str | None = None
    llm_output: str | None = None

    @property
    def settled(self) -> bool:
        """True once the variable is ready or failed: it never changes again."""
        return self.status != "pending"

    def describe(self) -> str:
        """``variable 'id'`` or ``variable 'id' ('name')``, for messages."""
        return f"variable {self.var_id!r}" + (f" ({self.name!r})" if self.name else "")


class VariableError(Exception):
    """Base of the variable errors; ``http_status`` is the status code the HTTP layer answers with."""

    http_status: ClassVar[int] = 400
    error_type: ClassVar[str] = "variable_error"

    def __init__(self, message: str, var_id: str) -> None:
        super().__init__(message)
        self.message = message
        self.var_id = var_id


class UnknownVariableError(VariableError, LookupError):
    """No variable with this id in the session (HTTP 404)."""

    http_status: ClassVar[int] = 404
    error_type: ClassVar[str] = "unknown_variable"


class VariableConflictError(VariableError):
    """The variable cannot change that way: it is already settled, or a call produces it (HTTP 409)."""

    http_status: ClassVar[int] = 409
    error_type: ClassVar[str] = "variable_conflict"


def _check_kind(kind: str) -> None:
    if kind not in VALUE_KINDS:
        # A caller bug rather than a user error: the wire never carries a kind the server did not make.
        raise ValueError(f"value kind must be one of {VALUE_KINDS}, got {kind!r}")


class VariableTable:
    """The variables of one session, by id. Every operation is O(1)."""

    def __init__(self) -> None:
        self._vars: dict[str, Variable] = {}

    # ------------------------------------------------------------------------------------------ reading
    def get(self, var_id: str) -> Variable:
        """The variable ``var_id``; `UnknownVariableError` if this session has none by that id."""
        try:
            return self._vars[var_id]
        except KeyError:
            raise UnknownVariableError(
                f"variable {var_id!r} does not exist in this session: use an id returned by "
                "POST /variables or by a call's 'outputs' in this same session",
                var_id,
            ) from None

    def __contains__(self, var_id: object) -> bool:
        return var_id in self._vars

    def __len__(self) -> int:
        return len(self._vars)

    def __iter__(self) -> Iterator[Variable]:
        return iter(list(self._vars.values()))

    @staticmethod
    def new_id() -> str:
        """A fresh random variable id (32 hex digits); nothing is created."""
        return uuid.uuid4().hex

    # ------------------------------------------------------------------------------------------ writing
    def create(
        self,
        name: str | None = None,
        value: str | None = None,
        *,
        kind: ValueKind = "text",
        var_id: str | None = None,
        producer: StepId | None = None,
    ) -> Variable:
        """Create a variable: ready with ``value`` when given, else pending. ``var_id`` defaults to a fresh
        id; an id already in use is a `VariableConflictError`. A produced variable starts pending."""
        _check_kind(kind)
        var_id = var_id if var_id is not None else self.new_id()
        if not var_id:
            raise ValueError("a variable id must be non-empty")
        if var_id in self._vars:
            raise VariableConflictError(f"variable {var_id!r} already exists in this session", var_id)
        if value is not None and producer is not None:
            raise ValueError(f"variable {var_id!r}: a produced variable starts pending, without a value")
        status: VariableStatus = "ready" if value is not None else "pending"
        var = Variable(var_id, name, status, value, kind, None, producer)
        self._vars[var_id] = var
        return var

    def set(self, var_id: str, value: str, kind: ValueKind = "text") -> Variable:
        """Give a pending variable its value (once). Setting a settled variable is a
        `VariableConflictError` (409): a variable's value never changes once readers may have seen it."""
        _check_kind(kind)
        var = self.get(var_id)
        self._check_pending(var, "set")
        new = replace(var, status="ready", value=value, kind=kind)
        self._vars[var_id] = new
        return new

    def fail(
        self, var_id: str, message: str, *, error_type: str = STEP_FAILED, llm_output: str | None = None
    ) -> Variable:
        """Mark a pending variable failed with ``message`` (what went wrong, for whoever reads it), the
        cause's ``error_type`` and, for a transform that refused the model's text, ``llm_output`` (that
        text). A settled variable cannot fail: `VariableConflictError`."""
        var = self.get(var_id)
        self._check_pending(var, "fail")
        new = replace(var, status="failed", error=message, error_type=error_type, llm_output=llm_output)
        self._vars[var_id] = new
        return new

    def set_producer(self, var_id: str, producer: StepId) -> Variable:
        """Record that ``producer`` generates the pending, client-owned variable ``var_id``."""
        var = self.get(var_id)
        self._check_pending(var, "be produced by a call")
        if var.producer is not None and var.producer != producer:
            raise VariableConflictError(
                f"{var.describe()} is already the output of {var.producer}: a variable has one producer; "
                "give the call a fresh output variable",
                var_id,
            )
        new = replace(var, producer=producer)
        self._vars[var_id] = new
        return new

    def _check_pending(self, var: Variable, action: str) -> None:
        if var.status == "ready":
            raise VariableConflictError(
                f"{var.describe()} already has a value and cannot {action}: a variable is set once; "
                "create a new variable for a new value",
                var.var_id,
            )
        if var.status == "failed":
            raise VariableConflictError(
                f"{var.describe()} has failed ({var.error}) and cannot {action}: create a new variable",
                var.var_id,
            )
