"""A pending step as the session graph tracks it (`StepNode`), and the graph's errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from parrot.protocol import Criteria

from server.serve.ir import CallIR, Step
from server.serve.variables import StepId

StepStatus = Literal["waiting", "ready", "dispatched", "done", "failed", "cancelled"]


@dataclass(eq=False)
class StepNode:
    """One step of a submitted call, as the graph tracks it. Owned by the graph: read it, never write it.

    ``inputs`` are the variables the step waits for (`server.serve.ir.input_vars`); ``missing`` counts those
    still pending, plus one while the previous step of the call is not done. ``depth`` is the step's
    topological depth at submit time: 0 when nothing pending produces its inputs, else one more than the
    deepest pending step it depends on (the app-level priority of the scheduler: lower runs first).

    ``criteria`` and ``task_group`` are the step's deduced objective (`server.serve.deduction`): the
    strongest criteria a get asked of it (it only ever strengthens), and the consumer step whose parallel
    inputs it is one of (set once, when that consumer or the step arrives).
    """

    id: StepId
    call: CallIR = field(repr=False)
    inputs: tuple[str, ...]
    depth: int = 0
    status: StepStatus = "waiting"
    activated: bool = False
    missing: int = 0
    criteria: Criteria | None = None
    task_group: StepId | None = None
    error: str | None = field(default=None, repr=False)

    @property
    def step(self) -> Step:
        """The IR of this step (its fills and its output)."""
        return self.call.steps[self.id.index]

    @property
    def output(self) -> str:
        """The id of the variable this step generates."""
        return self.call.steps[self.id.index].gen.var_id

    @property
    def runnable(self) -> bool:
        """Ready, activated and not dispatched: the executor may dispatch it now."""
        return self.status == "ready" and self.activated

    def describe(self) -> str:
        """``step 0 of call 'c' (output 'code')``, for messages."""
        return f"{self.id} (output {self.step.gen.name!r})"


StepRef = StepId | StepNode


class GraphError(Exception):
    """Base of the graph's errors; ``http_status`` is the status code the HTTP layer answers with."""

    http_status: ClassVar[int] = 400
    error_type: ClassVar[str] = "graph_error"


class CycleError(GraphError):
    """A submitted call would make the session's graph cyclic (HTTP 400). ``path`` lists the variable ids
    of the cycle, from the call's output to the input that depends on it."""

    error_type: ClassVar[str] = "cycle"

    def __init__(self, message: str, path: list[str]) -> None:
        super().__init__(message)
        self.path = path


class DuplicateCallError(GraphError):
    """A call id that is still pending in the session was submitted again (HTTP 409)."""

    http_status: ClassVar[int] = 409
    error_type: ClassVar[str] = "duplicate_call"


class UnknownStepError(GraphError, LookupError):
    """No pending step by that id: it finished, failed or was cancelled, or never existed."""

    http_status: ClassVar[int] = 404
    error_type: ClassVar[str] = "unknown_step"


class StepStateError(GraphError):
    """A step was driven out of order (completed before dispatch, dispatched before ready): a bug in the
    caller, never a user error."""

    http_status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
