"""One run of a compiled chain: the semantic calls it makes, sent to the session as one submission.

Running a compiled chain on one input traces it: each model step adds a `PendingCall` and hands a
`Pending` to the next steps, without sending anything. At the end (`Submission.collect`) every call is
queued in the session at once — calls that consume each other's outputs bound to their variables — and
only the chain's outputs are fetched: the whole chain is one submission, run server-side.

Two things are decided only then, when every use of every output is known:

* a JSON/XML output used only through one key path (``json_step | itemgetter("topic")``) gets that path
  added to its transform, so its variable holds exactly what the consumers need;
* only the calls the outputs depend on are sent (a branch whose result was dropped costs nothing).

A step that needs a value on the client (an opaque Python step, or a prompt that must be rendered
locally) calls `Submission.resolve`: the calls that value depends on are sent first, as they are, and the
value is fetched (one round trip). A fetched value whose parser failed on the server raises
`ServerParserError` (LangChain's ``OutputParserException``, with the model's text). All I/O is left to
the driver (`langchain_parrot.runner`): this code yields `Fetch` requests and receives the values, so one
implementation serves sync and async runs.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

import parrot as P
from parrot.protocol import Criteria

from langchain_parrot.errors import server_parser_error
from langchain_parrot.values import (
    Pending,
    PendingCall,
    apply_path,
    iter_symbolic,
    replace_symbolic,
)

__all__ = ["Effect", "Fetch", "PendingCall", "RunClient", "Submission", "placeholder_name"]


@dataclass(frozen=True)
class Fetch:
    """Effect: wait for these variables' values (the driver answers with the list of values)."""

    variables: list[P.Variable]
    criteria: Criteria | None = None


@dataclass(frozen=True)
class RunClient:
    """Effect: run a LangChain runnable on the client (the driver answers with its output)."""

    runnable: Any
    input: Any
    label: str


Effect = Fetch | RunClient
Program = Generator[Effect, Any, Any]


def placeholder_name(hint: str, taken: Iterable[str]) -> str:
    """A placeholder name from ``hint`` (a LangChain variable name): an identifier, not a keyword, unique."""
    base = re.sub(r"\W", "_", hint) or "x"
    if base[0].isdigit() or keyword.iskeyword(base):
        base = f"v_{base}"
    used = set(taken)
    name, n = base, 1
    while name in used:
        name, n = f"{base}_{n}", n + 1
    return name


class Submission:
    """The calls of one run and how they reach the session (see the module docstring)."""

    def __init__(self, criteria: Criteria | None) -> None:
        self.criteria = criteria
        self.calls: list[PendingCall] = []

    def add_call(self, call: PendingCall) -> Pending:
        """Add a call; returns its future output."""
        for source in call.inputs.values():
            if isinstance(source, Pending) and source.call is not None:
                source.call.demands.add(source.path)
        self.calls.append(call)
        return Pending(call=call)

    # --------------------------------------------------------------------------------------- emission
    def _closure(self, targets: Iterable[PendingCall]) -> list[PendingCall]:
        """``targets`` and every unsent call they depend on, in the order they were made."""
        need: set[int] = set()
        stack = [t for t in targets if not t.emitted]
        while stack:
            call = stack.pop()
            if id(call) in need:
                continue
            need.add(id(call))
            stack.extend(
                s.call
                for s in call.inputs.values()
                if isinstance(s, Pending) and s.call is not None and not s.call.emitted
            )
        return [c for c in self.calls if id(c) in need]

    def emit(self, targets: Iterable[PendingCall], *, final: bool) -> Program:
        """Queue ``targets`` (and what they need) in the current session.

        ``final``: every use of every output is known, so key paths may be folded into transforms.
        """
        for call in self._closure(targets):
            if final:
                call.fused = call.fusable_path()
            bindings: dict[str, str | P.Variable] = {}
            for name, source in call.inputs.items():
                if isinstance(source, str):
                    bindings[name] = source
                else:
                    bindings[name] = yield from self._binding(source)
            function = P.SemanticFunction.from_template(
                call.template,
                name=call.name,
                sampling=call.sampling,
                transforms={call.output: call.transforms()} if call.transforms() else {},
                model=call.model,
            )
            variable = function(**bindings)
            assert isinstance(variable, P.Variable)
            call.variable = variable

    def _binding(self, source: Pending) -> Generator[Effect, Any, str | P.Variable]:
        """What an input placeholder is bound to: the producer's variable, or the value as text."""
        if source.call is None:
            assert source.variable is not None
            return source.variable
        if not source.call.emitted:
            yield from self.emit([source.call], final=False)
        if source.path == source.call.fused:
            assert source.call.variable is not None
            return source.call.variable
        # A part of an output the server holds whole: look it up here, send the text (one round trip).
        value = yield from self.value_of(source)
        return value if isinstance(value, str) else str(value)

    # ------------------------------------------------------------------------------------------ values
    def value_of(self, pending: Pending) -> Generator[Effect, Any, Any]:
        """The concrete value of one pending output (sending and fetching what it needs)."""
        values = yield from self.resolve_all([pending])
        return values[0]

    def resolve_all(self, pendings: list[Pending]) -> Generator[Effect, Any, list[Any]]:
        """The values of ``pendings``: unsent calls are sent, then every missing value in one `Fetch`."""
        calls = [p.call for p in pendings if p.call is not None]
        unsent = [c for c in calls if not c.emitted]
        if unsent:
            yield from self.emit(unsent, final=False)
        wanted: list[P.Variable] = []
        owners: list[PendingCall | Pending] = []
        for p in pendings:
            if p.call is None:
                assert p.variable is not None
                wanted.append(p.variable)
                owners.append(p)
            elif not p.call.fetched and p.call not in owners:
                assert p.call.variable is not None
                wanted.append(p.call.variable)
                owners.append(p.call)
        external: dict[int, Any] = {}
        if wanted:
            try:
                got = yield Fetch(wanted, self.criteria)
            except P.VariableFailedError as e:
                # A parser that failed server-side is LangChain's OutputParserException, as it would be
                # in the chain run by LangChain: retry and fallback policies written for it apply.
                parser_error = server_parser_error(e)
                if parser_error is None:
                    raise
                raise parser_error from e
            for owner, value in zip(owners, got, strict=True):
                if isinstance(owner, PendingCall):
                    owner.raw, owner.fetched = value, True
                else:
                    external[id(owner)] = value
        return [external[id(p)] if p.call is None else self._finish(p) for p in pendings]

    @staticmethod
    def _finish(pending: Pending) -> Any:
        """A fetched output's value for ``pending``: client-side post-processing, then its key path."""
        call = pending.call
        assert call is not None and call.fetched
        if call.fused:  # the server already looked the fused path up (and a fused call has no `post`)
            assert pending.path[: len(call.fused)] == call.fused, "a use of a fused output that was not known"
            return apply_path(call.raw, pending.path[len(call.fused) :])
        value = call.plan.post(call.raw) if call.plan.post is not None else call.raw
        return apply_path(value, pending.path)

    def resolve(self, value: Any) -> Generator[Effect, Any, Any]:
        """``value`` with every pending part replaced by its concrete value."""
        pendings = list(dict.fromkeys(iter_symbolic(value)))
        if not pendings:
            return replace_symbolic(value, lambda p: p)
        values = yield from self.resolve_all(pendings)
        by_id = {id(p): v for p, v in zip(pendings, values, strict=True)}
        return replace_symbolic(value, lambda p: by_id[id(p)])

    def collect(self, value: Any) -> Generator[Effect, Any, Any]:
        """The end of a run: send every call still needed (key paths folded), fetch the outputs."""
        outputs = list(dict.fromkeys(iter_symbolic(value)))
        for p in outputs:
            if p.call is not None:
                p.call.demands.add(p.path)
        yield from self.emit([p.call for p in outputs if p.call is not None], final=True)
        return (yield from self.resolve(value))

    def submit(self, value: Any) -> Generator[Effect, Any, dict[str, P.Variable]]:
        """The end of a run that does not wait: send every call, return the outputs' variables.

        A dict output gives one variable per key, anything else ``{"output": variable}``. Text known on
        the client becomes a new variable of the session; other values and joined texts cannot be one.
        """
        outputs = value if isinstance(value, dict) else {"output": value}
        calls: list[PendingCall] = []
        for item in outputs.values():
            if isinstance(item, Pending) and item.call is not None:
                item.call.demands.add(item.path)
                calls.append(item.call)
        yield from self.emit(calls, final=True)
        variables: dict[str, P.Variable] = {}
        for key, item in outputs.items():
            if isinstance(item, Pending):
                bound = yield from self._binding(item)
                variables[key] = (
                    bound if isinstance(bound, P.Variable) else P.current_session().variable(bound)
                )
            elif isinstance(item, str):
                variables[key] = P.current_session().variable(item)
            elif isinstance(item, P.Variable):
                variables[key] = item
            else:
                raise TypeError(
                    f"submit(): output {key!r} is a {type(item).__name__} ({item!r}), not the output of a "
                    "model step or text: it cannot be a variable; use invoke() to get it"
                )
        return variables
