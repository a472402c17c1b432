"""The steps of a compiled chain: what each kind of LCEL runnable does with a (possibly pending) value.

`compile_chain` turns an LCEL tree into these steps once; each run walks them with one `Submission`.
``run`` is a generator (see `langchain_parrot.submission`): it yields the I/O it needs (`Fetch`,
`RunClient`) and returns the step's output, which may hold `Pending` values — outputs of model steps not
produced yet, which later steps bind as variables of their own calls instead of waiting for them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import convert_to_messages
from langchain_core.prompt_values import ChatPromptValue, PromptValue, StringPromptValue
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable
from parrot.template import escape_text

from langchain_parrot._base import CallParams, ParrotModelBase
from langchain_parrot.chat_format import ChatFormat
from langchain_parrot.errors import ClientSideStepWarning, CompileError
from langchain_parrot.parsers import OutputPlan
from langchain_parrot.prompts import (
    NotExpressibleError,
    Rendered,
    identity_prompt,
    plain_variables,
    prompt_inputs,
    prompt_value_text,
    render_prompt,
)
from langchain_parrot.submission import PendingCall, Program, RunClient, Submission, placeholder_name
from langchain_parrot.values import Concat, Pending, contains_symbolic, is_symbolic

__all__ = [
    "AssignStep",
    "ClientStep",
    "EachStep",
    "ItemStep",
    "JoinStep",
    "ModelStep",
    "ParallelStep",
    "PassthroughStep",
    "PickStep",
    "SequenceStep",
    "Step",
]


class Step:
    """A step of a compiled chain."""

    label: str

    def run(self, value: Any, sub: Submission) -> Program:
        """Run on ``value`` within ``sub``; returns the output (a generator: see the module docstring)."""
        raise NotImplementedError

    def describe(self, indent: str = "") -> list[str]:
        """Lines for `CompiledChain.explain`."""
        return [f"{indent}{self.label}"]

    def fetch(self, value: Any, sub: Submission, why: str) -> Program:
        """``value`` made concrete: its server-produced parts are fetched first (warned once per step)."""
        if not contains_symbolic(value):
            return value
        if not self.__dict__.get("_fetch_warned"):
            self.__dict__["_fetch_warned"] = True
            warnings.warn(
                f"compiled step {self.label}: {why}, so it is fetched to the client first (a round trip)",
                ClientSideStepWarning,
                stacklevel=2,
            )
        return (yield from sub.resolve(value))


@dataclass
class SequenceStep(Step):
    steps: list[Step]
    label: str = "sequence"

    def run(self, value: Any, sub: Submission) -> Program:
        for step in self.steps:
            value = yield from step.run(value, sub)
        return value

    def describe(self, indent: str = "") -> list[str]:
        return [line for step in self.steps for line in step.describe(indent)]


@dataclass
class ParallelStep(Step):
    branches: dict[str, Step]
    label: str = "parallel"

    def run(self, value: Any, sub: Submission) -> Program:
        out: dict[str, Any] = {}
        for key, step in self.branches.items():
            out[key] = yield from step.run(value, sub)
        return out

    def describe(self, indent: str = "") -> list[str]:
        lines = [f"{indent}parallel:"]
        for key, step in self.branches.items():
            lines.append(f"{indent}  {key!r}:")
            lines.extend(step.describe(indent + "    "))
        return lines


@dataclass
class AssignStep(Step):
    mapper: ParallelStep
    label: str = "assign"

    def run(self, value: Any, sub: Submission) -> Program:
        if is_symbolic(value):
            value = yield from self.fetch(value, sub, "it assigns to a dict a model step produces (its keys)")
        if not isinstance(value, dict):
            raise ValueError("The input to RunnablePassthrough.assign() must be a dict.")
        added = yield from self.mapper.run(value, sub)
        return {**value, **added}

    def describe(self, indent: str = "") -> list[str]:
        return [f"{indent}assign:", *self.mapper.describe(indent + "  ")[1:]]


@dataclass
class PassthroughStep(Step):
    label: str = "passthrough"

    def run(self, value: Any, sub: Submission) -> Program:
        return value
        yield  # a generator, like every step


@dataclass
class PickStep(Step):
    """`RunnablePick`: one key (``value.get(key)``) or several (a dict of those present, or None)."""

    keys: str | list[str]
    label: str = "pick"

    def run(self, value: Any, sub: Submission) -> Program:
        if isinstance(value, Pending) and isinstance(self.keys, str):
            return value.project(("pick", self.keys))
        if is_symbolic(value):
            value = yield from self.fetch(
                value, sub, "it picks several keys of a value a model step produces"
            )
        if not isinstance(value, dict):
            raise ValueError("The input to RunnablePassthrough.assign() must be a dict.")
        if isinstance(self.keys, str):
            return value.get(self.keys)
        picked = {k: value.get(k) for k in self.keys if k in value}
        return picked or None


@dataclass
class ItemStep(Step):
    """An ``itemgetter`` (as a function in a chain): one item, or a tuple of several."""

    items: tuple[Any, ...]
    label: str = "itemgetter"

    def run(self, value: Any, sub: Submission) -> Program:
        if isinstance(value, Pending) and len(self.items) == 1:
            return value.project(("item", self.items[0]))
        if is_symbolic(value):
            value = yield from self.fetch(value, sub, "it gets items of a value a model step produces")
        if len(self.items) == 1:
            return value[self.items[0]]
        return tuple(value[item] for item in self.items)


@dataclass
class JoinStep(Step):
    """``separator.join`` (the bound method, as a function in a chain): pending texts join server-side."""

    separator: str
    label: str = "join"

    def run(self, value: Any, sub: Submission) -> Program:
        if isinstance(value, list) and all(isinstance(v, str) or _text(v) for v in value):
            if not contains_symbolic(value):
                return self.separator.join(value)
            parts: list[str | Pending] = []
            for i, item in enumerate(value):
                if i:
                    parts.append(self.separator)
                parts.extend(item.parts if isinstance(item, Concat) else [item])
            return Concat(tuple(parts))
        value = yield from self.fetch(value, sub, "it joins values model steps produce that may not be text")
        return self.separator.join(value)  # raises what str.join raises for non-text items


def _text(value: Any) -> bool:
    if isinstance(value, Pending):
        return value.is_text
    return isinstance(value, Concat) and all(isinstance(p, str) or p.is_text for p in value.parts)


@dataclass
class EachStep(Step):
    """`RunnableEach` (``.map()``): the inner step on every item of a list, all queued at once."""

    inner: Step
    label: str = "map"

    def run(self, value: Any, sub: Submission) -> Program:
        if is_symbolic(value):
            value = yield from self.fetch(
                value, sub, "it maps over a list a model step produces (its length)"
            )
        out = []
        for item in value:
            out.append((yield from self.inner.run(item, sub)))
        return out

    def describe(self, indent: str = "") -> list[str]:
        return [f"{indent}map:", *self.inner.describe(indent + "  ")]


@dataclass
class ClientStep(Step):
    """A runnable run by LangChain on the client, on concrete values (pending inputs are fetched first)."""

    runnable: Runnable[Any, Any]
    label: str

    def run(self, value: Any, sub: Submission) -> Program:
        if contains_symbolic(value):
            value = yield from sub.resolve(value)
        return (yield RunClient(self.runnable, value, self.label))

    def describe(self, indent: str = "") -> list[str]:
        return [f"{indent}{self.label} (client-side)"]


@dataclass
class ModelStep(Step):
    """``prompt -> model -> parsers``: one semantic function call, its prompt sent unrendered."""

    label: str
    prompt: BasePromptTemplate[Any] | None
    model: ParrotModelBase
    kwargs: Mapping[str, Any]
    plan: OutputPlan
    chat_format: ChatFormat | None
    plain: frozenset[str] = field(init=False)
    params: CallParams = field(init=False)
    _warned: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.plain = plain_variables(self.prompt) if self.prompt is not None else frozenset({"input"})
        self.params = self.model.call_params(**self.kwargs)  # raises at compile time for bad kwargs
        if self.params.max_tokens is None:
            # Used directly, the model generates up to the context window; a semantic call has no such
            # setting (the server reserves prompt + max_tokens when it places a call), so ask for a bound.
            raise CompileError(
                f"{type(self.model).__name__} at step {self.label} has no max_tokens: a compiled model step "
                "needs one (set max_tokens on the model, or bind it: model.bind(max_tokens=256))"
            )

    def describe(self, indent: str = "") -> list[str]:
        return [f"{indent}{self.label} (server-side)"]

    def run(self, value: Any, sub: Submission) -> Program:
        prompt = self.prompt
        if prompt is None:
            if not (isinstance(value, str) or _text(value)):
                value = yield from self.fetch(
                    value, sub, "its input is a non-text value a model step produces"
                )
                rendered = Rendered(pieces=[prompt_value_text(_prompt_value(value), self.chat_format)])
                return sub.add_call(self._call(rendered))
            prompt = identity_prompt()
        elif isinstance(value, Pending) and not value.is_text:
            # A structured value the server is producing: whether it is a dict (the variables) or one value
            # is only known once it exists.
            value = yield from self.fetch(value, sub, "its input is a structured value a model step produces")
        variables = prompt_inputs(prompt, value, self.label)
        marked = {name: v for name, v in variables.items() if name in self.plain and _placeable(v)}
        rest = {n: v for n, v in variables.items() if n not in marked and contains_symbolic(v)}
        if rest:
            self._warn_client_render(rest)
            variables.update((yield from sub.resolve(rest)))
        try:
            rendered = render_prompt(prompt, variables, marked, self.chat_format)
        except NotExpressibleError:
            pending = {n: v for n, v in marked.items() if contains_symbolic(v)}
            if pending:
                self._warn_client_render(pending)
            variables.update((yield from sub.resolve(marked)))
            rendered = render_prompt(prompt, variables, {}, self.chat_format)
        return sub.add_call(self._call(rendered))

    def _warn_client_render(self, names: Iterable[str]) -> None:
        """Say once per step that earlier outputs are fetched to render this prompt on the client."""
        if self._warned:
            return
        self._warned = True
        listed = ", ".join(repr(n) for n in names)
        warnings.warn(
            f"compiled step {self.label}: {listed} come from earlier model steps, but the prompt does not "
            "insert them as plain text (a format spec or !r, an HTML-escaped mustache {{x}}, a jinja filter "
            "or test, a structured value in a chat message, a chat template that edits contents...), so they "
            "are fetched and the prompt is rendered on the client (a round trip). Insert them plainly — "
            "{x}, {{{x}}}, {{ x }} — to keep the chain on the server.",
            ClientSideStepWarning,
            stacklevel=2,
        )

    def _call(self, rendered: Rendered) -> PendingCall:
        parts: list[str] = []
        inputs: dict[str, str | Pending] = {}
        names: dict[tuple[int, int], str] = {}

        def placeholder(key: tuple[int, int], hint: str, source: str | Pending) -> str:
            if key not in names:
                names[key] = placeholder_name(hint, inputs)
                inputs[names[key]] = source
            return f"{{{{input:{names[key]}}}}}"

        for piece in rendered.pieces:
            if isinstance(piece, str):
                parts.append(escape_text(piece))
                continue
            item, hint = rendered.items[piece], rendered.names[piece]
            if isinstance(item, Concat):
                for j, part in enumerate(item.parts):
                    if isinstance(part, str):
                        parts.append(escape_text(part))
                    else:
                        parts.append(placeholder((piece, j), hint, part))
            else:
                parts.append(placeholder((piece, -1), hint, item))
        output = placeholder_name("output", inputs)
        return PendingCall(
            name=self.label,
            template="".join(parts) + f"{{{{output:{output}}}}}",
            output=output,
            inputs=inputs,
            sampling=self.params.sampling(),
            model=self.params.model,
            plan=self.plan,
        )


def _placeable(value: Any) -> bool:
    """Whether a value can be a placeholder: text known now, or a value the server renders as LangChain."""
    if isinstance(value, Pending):
        return value.renderable
    return type(value) is str or (isinstance(value, Concat) and _text(value))


def _prompt_value(value: Any) -> PromptValue:
    """What a model makes of a non-text input (as LangChain's models do): a prompt value or messages."""
    if isinstance(value, PromptValue):
        return value
    if isinstance(value, str):
        return StringPromptValue(text=value)
    if isinstance(value, Sequence):
        return ChatPromptValue(messages=convert_to_messages(value))
    raise ValueError(
        f"Invalid input type {type(value)}. Must be a PromptValue, str, or list of BaseMessages."
    )
