"""What a `parrot.Session` queues until its next batch (variables created or set, calls submitted), and the
time limit of one ``get``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from parrot.errors import GetTimeoutError
from parrot.protocol import SubmitCallRequest
from parrot.variable import Variable

__all__ = ["CreateVariable", "Deadline", "QueuedOp", "SetVariable", "SubmitCall"]


@dataclass
class CreateVariable:
    var: Variable
    value: str | None


@dataclass
class SetVariable:
    var: Variable
    value: str


@dataclass
class SubmitCall:
    func_name: str
    request: SubmitCallRequest  # inputs bound to variables have var_id None here: filled in when sent
    inputs: dict[str, Variable]
    outputs: dict[str, Variable]


QueuedOp = CreateVariable | SetVariable | SubmitCall


@dataclass(frozen=True)
class Deadline:
    """The time limit of one ``get``: ``timeout`` seconds (None: none) from ``started`` (monotonic)."""

    timeout: float | None
    started: float = field(default_factory=time.monotonic)

    def left(self, default: float) -> float:
        """How long the next long poll may ask the server to wait (``default`` when there is no timeout)."""
        if self.timeout is None:
            return default
        return max(0.0, self.started + self.timeout - time.monotonic())

    def passed(self) -> bool:
        return self.timeout is not None and time.monotonic() >= self.started + self.timeout

    def error(self, var: Variable) -> GetTimeoutError:
        waited = time.monotonic() - self.started
        return GetTimeoutError(
            f"{var._describe()} is still pending after {waited:.2f}s (get's timeout: {self.timeout:g}s): "
            "its producer has not finished, or an input it needs was never set; get it again (with a "
            "longer timeout) or set the missing input",
            status=504,
        )
