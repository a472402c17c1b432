"""Symbolic values: what flows between the steps of a compiled chain before the server has produced it.

While a compiled chain runs on the client, a model step does not wait for its output: it queues a semantic
function call (a `PendingCall`) and passes on a `Pending` — the future output, possibly with a key path into
it (a JSON value's ``"topic"``) — so the next step can bind it as a variable of its own call. `Concat` is text
made of constant pieces and pending texts (``"\\n\\n".join`` over a ``.map()`` of model outputs). Dicts and
lists of a chain (a `RunnableParallel`'s output) may hold them anywhere; everything else is a plain value.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import parrot as P
from parrot.protocol import SamplingConfig, TransformSpec

from langchain_parrot.parsers import OutputPlan, ValueKind

__all__ = [
    "Concat",
    "PathStep",
    "Pending",
    "PendingCall",
    "apply_path",
    "contains_symbolic",
    "is_symbolic",
    "iter_symbolic",
    "replace_symbolic",
]

# One step of a key path: ("item", k) is ``value[k]`` (itemgetter), ("pick", k) is ``value.get(k)``
# (RunnablePick, which also requires a dict) — each with the exact semantics of the LangChain step.
PathStep = tuple[Literal["item", "pick"], Hashable]


@dataclass(frozen=True, eq=False)
class Pending:
    """The future output of a queued call (``call``), or a variable given from outside (``variable``),
    looked up along ``path``."""

    call: PendingCall | None = None
    variable: P.Variable | None = None
    path: tuple[PathStep, ...] = ()

    @property
    def kind(self) -> ValueKind:
        """What the value is: the call's output kind; a looked-up part or an outside variable renders as
        the server stores it (text, or JSON rendered with ``str()``)."""
        if self.call is None:
            return "text"
        return self.call.plan.kind if not self.path else "json"

    @property
    def renderable(self) -> bool:
        """Whether the server can insert the value into a prompt exactly as LangChain would (``str()``)."""
        if self.call is None:
            return True
        if self.path:
            return self.call.plan.post is None
        return self.kind in ("text", "json")

    @property
    def is_text(self) -> bool:
        """Whether the value is known to be a ``str`` (a text output, or an outside variable's text)."""
        return self.call is None or (not self.path and self.kind == "text")

    def project(self, step: PathStep) -> Pending:
        """The value looked up one step further."""
        return Pending(self.call, self.variable, (*self.path, step))

    def __repr__(self) -> str:
        where = f"step {self.call.name}" if self.call is not None else f"variable {self.variable!r}"
        path = "".join(f"[{k!r}]" for _, k in self.path)
        return f"<pending output of {where}{path}>"


@dataclass(eq=False)
class PendingCall:
    """A semantic function call of one run of a compiled chain (queued in a
    `langchain_parrot.submission.Submission`): its template, what its inputs are bound to, its output."""

    name: str  # the function's name in the server's logs
    template: str  # with `{{output:<output>}}` last
    output: str
    inputs: dict[str, str | Pending]
    sampling: SamplingConfig
    model: str | None
    plan: OutputPlan
    demands: set[tuple[PathStep, ...]] = field(default_factory=set)  # how consumers use the output
    variable: P.Variable | None = None  # once queued in the session
    fused: tuple[PathStep, ...] = ()  # the key path folded into the output's transforms
    fetched: bool = False
    raw: Any = None  # the variable's value, once fetched

    @property
    def emitted(self) -> bool:
        return self.variable is not None

    def fusable_path(self) -> tuple[PathStep, ...]:
        """The key path to fold into the transforms: the one path every consumer uses, if foldable."""
        if len(self.demands) != 1 or not self.plan.keyable:
            return ()
        (path,) = self.demands
        # Only string keys: the server's key path reads digits as list indices, Python's itemgetter does not
        # on dicts, and a "." would split the key.
        if all(isinstance(k, str) and k and "." not in k and not k.lstrip("-").isdigit() for _, k in path):
            return path
        return ()

    def transforms(self) -> list[TransformSpec]:
        if not self.fused:
            return list(self.plan.transforms)
        return self.plan.with_key([str(k) for _, k in self.fused])


@dataclass(frozen=True)
class Concat:
    """Text made of constant strings and pending texts, in order."""

    parts: tuple[str | Pending, ...] = field(default_factory=tuple)

    def __repr__(self) -> str:
        return f"<pending text of {len(self.parts)} parts>"


def is_symbolic(value: Any) -> bool:
    """Whether ``value`` itself is a `Pending` or a `Concat`."""
    return isinstance(value, (Pending, Concat))


def iter_symbolic(value: Any) -> Iterator[Pending]:
    """Every `Pending` in ``value`` (through dicts, lists, tuples and `Concat`s)."""
    if isinstance(value, Pending):
        yield value
    elif isinstance(value, Concat):
        for part in value.parts:
            if isinstance(part, Pending):
                yield part
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_symbolic(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_symbolic(item)


def contains_symbolic(value: Any) -> bool:
    """Whether a `Pending` or `Concat` is anywhere in ``value``."""
    return next(iter_symbolic(value), None) is not None or isinstance(value, Concat)


def replace_symbolic(value: Any, resolve: Callable[[Pending], Any]) -> Any:
    """``value`` with each `Pending` replaced by ``resolve(pending)`` and each `Concat` joined.

    Containers are rebuilt with their own type (a dict subclass such as LangChain's ``AddableDict`` stays
    one); joining a part that is not a ``str`` raises the ``TypeError`` ``str.join`` would.
    """
    if isinstance(value, Pending):
        return resolve(value)
    if isinstance(value, Concat):
        return "".join(part if isinstance(part, str) else resolve(part) for part in value.parts)
    if isinstance(value, dict) and contains_symbolic(value):
        return type(value)({k: replace_symbolic(v, resolve) for k, v in value.items()})
    if isinstance(value, (list, tuple)) and contains_symbolic(value):
        items = [replace_symbolic(v, resolve) for v in value]
        return items if type(value) is list else type(value)(items)
    return value


def apply_path(value: Any, path: tuple[PathStep, ...]) -> Any:
    """Look ``path`` up in a concrete value, with the semantics of the steps that made it."""
    for how, key in path:
        if how == "item":
            value = value[key]
        else:
            if not isinstance(value, dict):
                raise ValueError("The input to RunnablePassthrough.assign() must be a dict.")
            value = value.get(key)
    return value
