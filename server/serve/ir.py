"""The manager's call IR: a semantic function call parsed once into segments and steps. Pure data, no I/O.

A call's template becomes a sequence of segments:

* `TextFill` — constant text, or the literal ``value`` of an input (either way, text the server already has);
* `VarFill` — an input bound to a variable, whose value may not exist yet;
* `Gen` — an output: generate into a fresh variable, with its sampling and transforms.

Each `Gen` together with the fills before it (since the previous `Gen`) is one `Step`. A call with k outputs
is k steps run on one context chain: step i+1's prompt is step i's prompt, then step i's output, then step
i+1's fills — so step i+1 continues step i's context. Fills after the last output form the call's ``tail``:
no step generates after them, so they never reach an engine and a variable used only there is not waited for.

Values are text inserted verbatim: a value is never parsed as template text, so a value holding
``"{{output:x}}"`` reaches the model as exactly those characters.

Prefix hashes: a hash of the rendered prompt at every segment boundary. The hash at offset k depends only
on the first k characters — not on how they were split into segments or where they came from — so identical
constant prefixes across calls and sessions give identical hashes, and a prefix store finds the longest
shared prefix with one lookup per boundary.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from parrot.protocol import (
    Criteria,
    SamplingConfig,
    SubmitCallRequest,
    TransformSpec,
)
from parrot.template import TemplatePlaceholder, TemplateText

from server.serve.call_checks import schema_guide, validate_call

__all__ = [
    "PREFIX_HASH_HEX_CHARS",
    "CallIR",
    "CallOutline",
    "Fill",
    "Gen",
    "MissingValueError",
    "Segment",
    "Step",
    "StepOutline",
    "TextFill",
    "VarFill",
    "build_call",
    "input_vars",
    "prefix_hash",
    "prefix_hashes",
    "prompt_chars",
    "render_prompt",
    "text_before",
]


@dataclass(frozen=True)
class TextFill:
    """Text known at submit time: constant template text, or an input's literal value (``name`` set)."""

    text: str
    name: str | None = None


@dataclass(frozen=True)
class VarFill:
    """An input placeholder bound to a variable of the session."""

    var_id: str
    name: str


Fill = TextFill | VarFill


@dataclass(frozen=True)
class Gen:
    """An output placeholder: generate into variable ``var_id``, then apply ``transforms`` in order."""

    var_id: str
    name: str
    sampling: SamplingConfig
    transforms: tuple[TransformSpec, ...] = ()


Segment = TextFill | VarFill | Gen


@dataclass(frozen=True)
class Step:
    """One generation: the fills since the previous output, then the output. ``index`` counts from 0."""

    index: int
    fills: tuple[Fill, ...]
    gen: Gen


@dataclass(frozen=True)
class CallIR:
    """A submitted call: its steps in order (one per output) and the fills after the last output."""

    call_id: str
    func_name: str | None
    steps: tuple[Step, ...]
    tail: tuple[Fill, ...] = ()
    model: str | None = None
    criteria: Criteria | None = None
    cache_salt: str | None = None  # its KV is shared only under this salt (None: the session's)
    parse_special_tokens: bool = False  # special-token strings in its values are control tokens

    @property
    def outputs(self) -> dict[str, str]:
        """Output name -> variable id, in template order."""
        return {step.gen.name: step.gen.var_id for step in self.steps}

    @property
    def segments(self) -> list[Segment]:
        """Every segment of the call in template order (the steps' fills and gens, then the tail)."""
        out: list[Segment] = []
        for step in self.steps:
            out.extend(step.fills)
            out.append(step.gen)
        out.extend(self.tail)
        return out

    @property
    def input_vars(self) -> list[str]:
        """Every input variable the call names (tail included: all must exist), distinct, in order."""
        return list(dict.fromkeys(s.var_id for s in self.segments if isinstance(s, VarFill)))


@dataclass(frozen=True)
class StepOutline:
    """A step's place in the dataflow, without its text: its index, output variable and input variables."""

    index: int
    output: str
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class CallOutline:
    """A call's shape without its text (what a session keeps of every call it submitted, for the live view:
    ids only, so a finished call's prompt text is not held until the session ends)."""

    call_id: str
    func_name: str | None
    criteria: Criteria | None
    steps: tuple[StepOutline, ...]

    @classmethod
    def of(cls, call: CallIR) -> CallOutline:
        steps = tuple(StepOutline(s.index, s.gen.var_id, tuple(input_vars(s))) for s in call.steps)
        return cls(call.call_id, call.func_name, call.criteria, steps)


class MissingValueError(LookupError):
    """A prompt was rendered before a variable it needs has a value (a scheduling bug, not a user error)."""

    def __init__(self, var_id: str, name: str, call_id: str, step_index: int) -> None:
        super().__init__(
            f"call {call_id!r}, step {step_index}: no value for {name!r} (variable {var_id!r}); "
            "render a step only once its inputs and the call's earlier outputs are set"
        )
        self.var_id = var_id
        self.name = name


def input_vars(step: Step) -> list[str]:
    """The input variables ``step`` waits for, distinct, in order. Earlier outputs of the same call are not
    listed: the steps of a call run in order, so they exist by construction."""
    return list(dict.fromkeys(f.var_id for f in step.fills if isinstance(f, VarFill)))


def build_call(
    request: SubmitCallRequest, var_ids_for_outputs: Mapping[str, str], *, call_id: str | None = None
) -> CallIR:
    """Validate ``request`` (`validate_call`: `TemplateError` / `CallError`) and build its IR.

    ``var_ids_for_outputs`` maps each output name to the fresh variable the session created for it; it must
    name exactly the template's outputs, with distinct ids (anything else is a bug in the caller:
    ``ValueError``). ``call_id`` defaults to a random hex id.
    """
    pieces = validate_call(request.template, request.placeholders)
    specs = {spec.name: spec for spec in request.placeholders}
    outputs = [p.name for p in pieces if isinstance(p, TemplatePlaceholder) and p.role == "output"]
    if sorted(var_ids_for_outputs) != sorted(outputs):
        raise ValueError(
            f"var_ids_for_outputs names {sorted(var_ids_for_outputs)}, the outputs are {outputs}"
        )
    ids = list(var_ids_for_outputs.values())
    if len(set(ids)) != len(ids) or not all(ids):
        raise ValueError(f"output variable ids must be distinct and non-empty: {ids}")

    steps: list[Step] = []
    fills: list[Fill] = []
    for piece in pieces:
        if isinstance(piece, TemplateText):
            fills.append(TextFill(piece.text))
            continue
        spec = specs[piece.name]
        if piece.role == "output":
            # A private copy: the IR outlives the request and must not change if the request object does.
            sampling = spec.sampling.model_copy() if spec.sampling is not None else SamplingConfig()
            if (guide := schema_guide(spec.transforms)) is not None:  # validate_call: the only constraint
                sampling.guided = guide
            gen = Gen(var_ids_for_outputs[piece.name], piece.name, sampling, tuple(spec.transforms))
            steps.append(Step(len(steps), tuple(fills), gen))
            fills = []
        elif spec.value is not None:
            fills.append(TextFill(spec.value, piece.name))
        else:
            assert spec.var_id is not None  # validate_call: an input has exactly one of value / var_id
            fills.append(VarFill(spec.var_id, piece.name))
    return CallIR(
        call_id=call_id if call_id is not None else uuid.uuid4().hex,
        func_name=request.func_name,
        steps=tuple(steps),
        tail=tuple(fills),
        model=request.model,
        criteria=request.criteria,
        cache_salt=request.cache_salt,
        parse_special_tokens=bool(request.parse_special_tokens),
    )


def _parts(call: CallIR, step_index: int, values: Mapping[str, str]) -> Iterator[str]:
    """The texts of the segments that make up ``step_index``'s prompt, in order."""
    if not 0 <= step_index < len(call.steps):
        raise IndexError(
            f"call {call.call_id!r} has {len(call.steps)} step(s); there is no step {step_index}"
        )
    for step in call.steps[: step_index + 1]:
        for fill in step.fills:
            if isinstance(fill, TextFill):
                yield fill.text
            else:
                yield _value(call, step_index, values, fill.var_id, fill.name)
        if step.index < step_index:
            yield _value(call, step_index, values, step.gen.var_id, step.gen.name)


def _value(call: CallIR, step_index: int, values: Mapping[str, str], var_id: str, name: str) -> str:
    try:
        return values[var_id]
    except KeyError:
        raise MissingValueError(var_id, name, call.call_id, step_index) from None


def prompt_chars(call: CallIR, step_index: int, values: Mapping[str, str]) -> int:
    """How many characters `render_prompt` would make of step ``step_index``, computed from the texts'
    and values' lengths without rendering; a value not in ``values`` counts 0 (a lower bound while some
    are still unknown). An input used many times counts each time."""
    total = 0
    for step in call.steps[: step_index + 1]:
        for fill in step.fills:
            total += len(fill.text) if isinstance(fill, TextFill) else len(values.get(fill.var_id, ""))
        if step.index < step_index:
            total += len(values.get(step.gen.var_id, ""))
    return total


def text_before(call: CallIR, var_id: str, values: Mapping[str, str]) -> str | None:
    """The prompt text of ``call`` before its first use of input ``var_id``, or None when the call does not
    use it or a variable before it has no value in ``values`` yet. (A producer whose prompt equals this
    text is *continued* by the call: its context is what the call's prompt starts with.)"""
    parts: list[str] = []
    for seg in call.segments:
        if isinstance(seg, TextFill):
            parts.append(seg.text)
        elif isinstance(seg, VarFill) and seg.var_id == var_id:
            return "".join(parts)
        else:
            var = seg.var_id
            if var not in values:
                return None
            parts.append(values[var])
    return None


def render_prompt(call: CallIR, step_index: int, values: Mapping[str, str]) -> str:
    """The full prompt text of step ``step_index``: everything before its output, verbatim.

    ``values`` maps variable ids to the text to insert: for an input, its value rendered as prompt text
    (`server.serve.transforms.render_value` for a structured value); for an earlier output of this call,
    the text the engine generated, before transforms, so the prompt continues that step's context exactly.
    Raises `MissingValueError` for a variable without a value, ``IndexError`` for a step that does not exist.
    """
    return "".join(_parts(call, step_index, values))


# 16 bytes: collisions are out of reach for any realistic number of distinct prefixes, and the digests stay
# short in logs. ``person`` keeps these digests apart from any other blake2b use of the same text.
_DIGEST_SIZE = 16
_PERSON = b"parrot-prefix"
PREFIX_HASH_HEX_CHARS = 2 * _DIGEST_SIZE


def _hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=_DIGEST_SIZE, person=_PERSON)


def _encode(text: str) -> bytes:
    # JSON can carry lone surrogates ("\ud800"), which strict UTF-8 refuses; surrogatepass encodes each one
    # the same way whether the text is hashed whole or in pieces, so the hash stays split-independent.
    return text.encode("utf-8", "surrogatepass")


def prefix_hash(text: str) -> str:
    """The prefix hash of ``text``: equal to `prefix_hashes`' digest at a boundary where the prompt so far
    is ``text`` (for instance a plain ``/v1/completions`` prompt, or a cached context's text)."""
    hasher = _hasher()
    hasher.update(_encode(text))
    return hasher.hexdigest()


def prefix_hashes(call: CallIR, step_index: int, values: Mapping[str, str]) -> list[tuple[int, str]]:
    """``(char_offset, hex_digest)`` at every segment boundary of step ``step_index``'s prompt.

    The digest at offset k is ``prefix_hash(prompt[:k])``, computed incrementally (one pass over the text).
    Offsets strictly increase (an empty segment adds no boundary) and the last one is the whole prompt.
    ``values`` as for `render_prompt`.
    """
    hasher = _hasher()
    offset = 0
    out: list[tuple[int, str]] = []
    for part in _parts(call, step_index, values):
        if not part:
            continue
        hasher.update(_encode(part))
        offset += len(part)
        out.append((offset, hasher.copy().hexdigest()))
    return out
