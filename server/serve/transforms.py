"""Declarative output transforms: the manager's one implementation of what happens to a call's output text.

A call's output placeholder may carry a list of `TransformSpec` (see `parrot.protocol`): named transforms
from a whitelist, with plain options, applied in order to the text the LLM produced. Nothing here runs client
code. Where langchain-core already implements a parser (JSON with markdown fences and partial JSON, the list
parsers, XML), we call it rather than rewrite it, so a compiled LangChain chain gets exactly what LangChain's
own parser would give for the same text — parity by construction, not by imitation.

Values: a variable's value is text. A transform may produce a structured value (a list, a dict, a number);
that travels as JSON with the type tag ``"json"``. `TransformResult` carries both forms, and
`render_value` turns either back into the text LangChain's `PromptTemplate` would insert into a prompt
(``str()`` of the Python object, as an f-string does).

Bounds: nothing a client sends may hold the server. Regular expressions run on RE2 (``google-re2``), whose
matching is linear in the text and releases the GIL; a pattern RE2 cannot run (a backreference, a
look-around) is refused when the call is submitted (`TransformPatternError`, HTTP 400). Every transform is
bounded in time and output size (`TransformLimits`); exceeding a bound fails the variable with a
`TransformLimitError` naming the limit. The checks here are cooperative (after each transform, and between
regex matches); `server.serve.transform_runner` runs transforms in worker processes and enforces the time
limit hard, whatever a parser does.

RE2 differs from Python's ``re`` in a few places a pattern may notice: ``\\d``, ``\\w``, ``\\s`` and ``\\b``
are ASCII-only, ``$`` (without ``(?m)``) matches only at the very end, and Python's ``\\Z`` is
written ``\\z``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import re2
from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import (
    CommaSeparatedListOutputParser,
    JsonOutputParser,
    MarkdownListOutputParser,
    NumberedListOutputParser,
    XMLOutputParser,
)
from parrot.protocol import TRANSFORM_FAILED, CallError, TransformSpec
from pydantic import ValidationError

__all__ = [
    "DEFAULT_LIMITS",
    "MAX_PATTERN_CHARS",
    "MAX_REFUSED_TEXT_CHARS",
    "MAX_TRANSFORM_OUTPUT_CHARS",
    "RE2_MAX_MEM",
    "TRANSFORM_TIME_LIMIT_S",
    "XML_PARSER",
    "LimitName",
    "TransformError",
    "TransformLimitError",
    "TransformLimits",
    "TransformPatternError",
    "TransformResult",
    "TransformSpec",
    "ValueKind",
    "apply_transforms",
    "render_data",
    "render_value",
    "validate_transforms",
]

ValueKind = Literal["text", "json"]
LimitName = Literal["time", "output_size"]

# Defaults of `TransformLimits`. A transform on an LLM output (max_tokens long) takes milliseconds; two
# seconds is far above any honest use and short enough that a hostile one is cut before a client notices.
TRANSFORM_TIME_LIMIT_S = 2.0
# A transform's output, counted in characters of its wire form (the text, or the JSON of a structured
# value): well above any LLM output, low enough that a findall of the empty pattern cannot balloon.
MAX_TRANSFORM_OUTPUT_CHARS = 1 << 20
# Patterns are written by people; RE2's own program-size bound (RE2_MAX_MEM) does the rest.
MAX_PATTERN_CHARS = 1000
# RE2's memory budget per compiled pattern (program plus DFA cache; RE2 falls back to its slower, still
# linear, NFA when the DFA cache fills). 8 MiB is RE2's default.
RE2_MAX_MEM = 8 << 20
# The re2 module caches up to 128 compiled patterns, each up to RE2_MAX_MEM; we purge beyond this many.
_RE2_CACHE_MAX = 16

# How much of the offending text an error message quotes: enough to see what the model wrote, bounded so a
# long output does not flood logs or the variable's failure message.
_QUOTE_CHARS = 200
# The most characters of refused text a `TransformError` keeps as data (``text``), for the failed variable's
# ``llm_output``. The text is a model's output, already bounded by max_tokens; this bounds what one failure
# holds and sends (worker pipe, variable table, every get of it and of its dependents) whatever the model's
# context window. A text is kept whole or not at all: a client told it has the model's output gets all of
# it; beyond this it has only the message's quote (the first _QUOTE_CHARS characters and the length).
MAX_REFUSED_TEXT_CHARS = 1 << 16

# XML goes through defusedxml (a server dependency), LangChain's default hardened backend: an LLM answer
# declaring entities is refused rather than expanded.
XML_PARSER: Literal["defusedxml"] = "defusedxml"

# The parsers are stateless pydantic models; build each once rather than per output.
_JSON = JsonOutputParser()
_CSV = CommaSeparatedListOutputParser()
_NUMBERED = NumberedListOutputParser()
_MARKDOWN = MarkdownListOutputParser()
_XML = XMLOutputParser(parser=XML_PARSER)


class TransformError(Exception):
    """A transform failed on a call's output; the manager marks the output variable failed with it.

    ``text`` is the text the transform refused to parse (its input: the model's output, or what the text
    transforms before it made of it), when the failure is a parser refusing it — invalid JSON or XML, a
    regex that does not match, a parser raising on it. It is None for failures that are not about the
    text's syntax (a key path missing from the parsed value, a structured value given to a text transform,
    a limit, a dead worker) and for a text over `MAX_REFUSED_TEXT_CHARS`. ``error_type`` is what the failed
    variable reports as its type.
    """

    error_type: ClassVar[str] = TRANSFORM_FAILED

    def __init__(self, transform_type: str, message: str, *, text: str | None = None) -> None:
        super().__init__(f"{transform_type} transform failed: {message}")
        self.transform_type = transform_type
        self.message = message
        self.text = text if text is not None and len(text) <= MAX_REFUSED_TEXT_CHARS else None


class TransformLimitError(TransformError):
    """A transform exceeded one of its bounds: ``limit`` names which (``"time"`` or ``"output_size"``)."""

    error_type: ClassVar[str] = "transform_limit"

    def __init__(self, transform_type: str, limit: LimitName, message: str) -> None:
        super().__init__(transform_type, f"{limit} limit exceeded: {message}")
        self.limit: LimitName = limit


class TransformPatternError(TransformError, CallError):
    """A regex pattern the server will not run (invalid for RE2, unsupported by RE2, or too long).

    A `CallError` (HTTP 400) when a call is submitted; a `TransformError` (its variable fails) if a spec
    reaches `apply_transforms` unchecked.
    """

    def __init__(self, pattern: str, reason: str) -> None:
        super().__init__("regex", f"pattern {pattern!r} cannot be used: {reason}")
        self.pattern = pattern
        self.reason = reason


@dataclass(frozen=True)
class TransformLimits:
    """Bounds on every transform: wall time each, output size each, and the regex pattern and its memory."""

    time_s: float = TRANSFORM_TIME_LIMIT_S
    max_output_chars: int = MAX_TRANSFORM_OUTPUT_CHARS
    max_pattern_chars: int = MAX_PATTERN_CHARS
    re2_max_mem: int = RE2_MAX_MEM

    def __post_init__(self) -> None:
        if not (self.time_s > 0 and self.max_output_chars > 0 and self.max_pattern_chars > 0):
            raise ValueError(f"transform limits must be positive: {self}")
        if self.re2_max_mem < 1 << 16:  # below this RE2 cannot compile even trivial patterns
            raise ValueError(f"re2_max_mem must be at least 64 KiB: {self.re2_max_mem}")


DEFAULT_LIMITS = TransformLimits()


@dataclass(frozen=True)
class TransformResult:
    """A variable's value after its transforms.

    ``kind == "text"``: ``value`` is the text and ``data`` is the same string.
    ``kind == "json"``: ``data`` is the structured value and ``value`` is ``json.dumps(data)``.
    """

    value: str
    kind: ValueKind
    data: Any

    @classmethod
    def of(cls, data: Any) -> TransformResult:
        """Wrap a transform's output: a string stays text, anything else becomes tagged JSON."""
        if isinstance(data, str):
            return cls(data, "text", data)
        # ensure_ascii (the default) escapes lone surrogates that json.loads can produce from "\ud800",
        # which would otherwise make the value unencodable as UTF-8 on the wire.
        return cls(json.dumps(data), "json", data)

    def render(self) -> str:
        """The text LangChain's PromptTemplate inserts for this value (see `render_data`)."""
        return render_data(self.data)


def render_data(data: Any) -> str:
    """Render a (possibly structured) value into prompt text exactly as LangChain's PromptTemplate does.

    An f-string template formats each variable with ``format(value, "")``, which for str, numbers, bools,
    None, lists and dicts is ``str(value)`` — so ``["a", "b"]`` becomes ``"['a', 'b']"`` in the prompt.
    """
    return data if isinstance(data, str) else str(data)


def render_value(value: str, kind: ValueKind = "text") -> str:
    """Render a stored variable value (text, or JSON tagged ``"json"``) into prompt text."""
    if kind == "text":
        return value
    return render_data(json.loads(value))


def validate_transforms(
    specs: Sequence[TransformSpec | Mapping[str, Any]], limits: TransformLimits = DEFAULT_LIMITS
) -> list[TransformSpec]:
    """Validate transform specs up front (at submit time).

    Raises pydantic's ValidationError on a malformed spec and `TransformPatternError` (a `CallError`:
    HTTP 400) on a regex pattern the server will not run.
    """
    checked = [s if isinstance(s, TransformSpec) else TransformSpec.model_validate(s) for s in specs]
    for spec in checked:
        if spec.type == "regex":
            assert spec.pattern is not None  # the spec validator requires it
            _check_group(spec, _compile(spec.pattern, limits))
    return checked


def _check_group(spec: TransformSpec, compiled: Any) -> None:
    """Raise `TransformPatternError` unless ``spec.group`` names a group of ``compiled`` (or, left out, the
    pattern has at most one group to take)."""
    pattern, n, group = spec.pattern or "", compiled.groups, spec.group
    if group is None:
        if n > 1:
            raise TransformPatternError(pattern, f"it has {n} groups; choose one with 'group'")
    elif isinstance(group, int):
        if not 0 <= group <= n:
            raise TransformPatternError(pattern, f"group {group} is out of range: it has {n} group(s)")
    elif group not in compiled.groupindex:
        names = sorted(compiled.groupindex) or "none"
        raise TransformPatternError(pattern, f"it has no group named {group!r} (named: {names})")


def apply_transforms(
    specs: Sequence[TransformSpec | Mapping[str, Any]],
    text: str,
    limits: TransformLimits = DEFAULT_LIMITS,
    on_start: Callable[[int, str], None] | None = None,
) -> TransformResult:
    """Apply ``specs`` in order to an LLM's output ``text``, each within ``limits``.

    ``on_start(index, type)`` is called as each transform begins (the process runner times them with it).

    Raises pydantic's ValidationError for an invalid spec and `TransformPatternError` for an unusable
    pattern (both before anything runs), `TransformLimitError` for a transform over a bound, and
    `TransformError` for a transform that fails on this text (``text`` holds the text a parser refused).
    """
    data: Any = text
    spec_type = "transform"
    try:
        for index, spec in enumerate(validate_transforms(specs, limits)):
            spec_type = spec.type
            if on_start is not None:
                on_start(index, spec.type)
            data = _run_one(spec, data, limits)
        return TransformResult.of(data)
    except (TransformError, ValidationError):
        raise
    except (RecursionError, ValueError, TypeError) as e:
        # Whatever else a parser or json.dumps throws on hostile output (say, JSON nested 10k deep) is still
        # this transform failing on this text: the caller gets the one typed error it handles. ``data`` is
        # still the failing transform's input; after a structured step the model's text is what to show.
        refused = data if isinstance(data, str) else text
        raise TransformError(spec_type, f"{type(e).__name__}: {e} on {_quote(refused)}", text=refused) from e


def _run_one(spec: TransformSpec, data: Any, limits: TransformLimits) -> Any:
    """Apply one validated transform to ``data`` and check its time and output size against ``limits``."""
    started = time.monotonic()
    out = _regex(spec, data, limits, started) if spec.type == "regex" else _APPLY[spec.type](spec, data)
    _check_time(spec.type, started, limits)
    size = len(out) if isinstance(out, str) else len(json.dumps(out))
    if size > limits.max_output_chars:
        raise TransformLimitError(
            spec.type, "output_size", f"output of {size} chars is over {limits.max_output_chars}"
        )
    return out


def _check_time(transform_type: str, started: float, limits: TransformLimits) -> None:
    elapsed = time.monotonic() - started
    if elapsed > limits.time_s:
        raise TransformLimitError(transform_type, "time", f"ran {elapsed:.2f} s, over {limits.time_s:g} s")


def _compile(pattern: str, limits: TransformLimits) -> Any:
    """Compile ``pattern`` with RE2 under ``limits``, or raise `TransformPatternError` saying why not."""
    if len(pattern) > limits.max_pattern_chars:
        raise TransformPatternError(
            pattern[:_QUOTE_CHARS] + ("..." if len(pattern) > _QUOTE_CHARS else ""),
            f"{len(pattern)} chars is over the {limits.max_pattern_chars}-char limit on patterns",
        )
    options = re2.Options()
    options.max_mem = limits.re2_max_mem
    options.log_errors = False  # a refused pattern is the client's error, not a line in our log
    try:
        compiled = re2.compile(pattern, options)
    except re2.error as e:
        reason = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise TransformPatternError(
            pattern,
            f"{reason} (the server runs regexes on RE2, which has no backreferences, look-around or "
            "possessive quantifiers and bounds repetition counts and program size; "
            "syntax: https://github.com/google/re2/wiki/Syntax)",
        ) from None
    finally:
        # re2.compile caches up to 128 patterns of up to max_mem each; keep the cache small instead.
        if re2._Regexp._make.cache_info().currsize > _RE2_CACHE_MAX:
            re2.purge()
    return compiled


# ----------------------------------------------------------------------------------------- the transforms
def _quote(text: str) -> str:
    if len(text) <= _QUOTE_CHARS:
        return repr(text)
    return f"{text[:_QUOTE_CHARS]!r}... ({len(text)} chars)"


def _text_input(spec: TransformSpec, data: Any) -> str:
    # Parsers read text; after a structured step (a list from csv_list, say) the user must say what they
    # mean — e.g. a `render` first — rather than have us guess a serialization.
    if not isinstance(data, str):
        raise TransformError(
            spec.type,
            f"expects text, but the previous transform produced {type(data).__name__} {_quote(str(data))}",
        )
    return data


def _lookup(spec: TransformSpec, data: Any) -> Any:
    """Follow ``spec.key`` ("a.b.0": dict keys, list indices) into a parsed value."""
    if spec.key is None:
        return data
    path: list[str] = []
    for part in spec.key.split("."):
        where = ".".join(path) or "the top level"
        if isinstance(data, dict):
            if part not in data:
                keys = ", ".join(repr(k) for k in list(data)[:20])
                raise TransformError(
                    spec.type, f"key path {spec.key!r}: no key {part!r} at {where} (keys: {keys or 'none'})"
                )
            data = data[part]
        elif isinstance(data, list):
            if not re.fullmatch(r"-?\d+", part) or not -len(data) <= int(part) < len(data):
                raise TransformError(
                    spec.type, f"key path {spec.key!r}: no index {part!r} at {where} (a list of {len(data)})"
                )
            data = data[int(part)]
        else:
            raise TransformError(
                spec.type,
                f"key path {spec.key!r}: cannot look up {part!r} in {type(data).__name__} {_quote(str(data))}"
                f" at {where}",
            )
        path.append(part)
    return data


def _strip(spec: TransformSpec, data: Any) -> str:
    return _text_input(spec, data).strip()


def _json(spec: TransformSpec, data: Any) -> Any:
    text = _text_input(spec, data)
    try:
        # JsonOutputParser.parse: strips, tolerates ```json fences, and completes partial JSON
        # (langchain_core.utils.json.parse_json_markdown with parse_partial_json).
        parsed = _JSON.parse(text)
    except OutputParserException as e:
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        raise TransformError(spec.type, f"invalid JSON{cause} in {_quote(text)}", text=text) from e
    return _lookup(spec, parsed)


def _csv_list(spec: TransformSpec, data: Any) -> list[str]:
    return _CSV.parse(_text_input(spec, data))


def _numbered_list(spec: TransformSpec, data: Any) -> list[str]:
    return _NUMBERED.parse(_text_input(spec, data))


def _markdown_list(spec: TransformSpec, data: Any) -> list[str]:
    return _MARKDOWN.parse(_text_input(spec, data))


def _regex(spec: TransformSpec, data: Any, limits: TransformLimits, started: float) -> str | list[str]:
    text = _text_input(spec, data)
    assert spec.pattern is not None  # the spec validator requires it
    pattern = _compile(spec.pattern, limits)
    # No group given: the only group, or the whole match — what re.findall returns (the validator rejects
    # a pattern with several groups and no choice). A group that did not take part reads as "", as in findall.
    group = spec.group if spec.group is not None else min(pattern.groups, 1)
    if spec.findall:
        return list(_bounded_findall(spec, pattern.finditer(text), group, limits, started))
    match = pattern.search(text)
    if match is None:
        raise TransformError(spec.type, f"pattern {spec.pattern!r} does not match {_quote(text)}", text=text)
    return match.group(group) or ""


def _bounded_findall(
    spec: TransformSpec, matches: Iterator[Any], group: int | str, limits: TransformLimits, started: float
) -> Iterator[str]:
    # Each match is linear work, but a text can hold many: check both bounds as the list grows, so a
    # findall of the empty pattern on a long text stops at the limit instead of building it first.
    size = 2  # "[]"
    for match in matches:
        item = match.group(group) or ""
        size += len(json.dumps(item)) + 2  # ", " between items
        if size > limits.max_output_chars:
            raise TransformLimitError(
                spec.type, "output_size", f"findall output is over {limits.max_output_chars} chars"
            )
        _check_time(spec.type, started, limits)
        yield item


def _xml(spec: TransformSpec, data: Any) -> Any:
    text = _text_input(spec, data)
    try:
        parsed = _XML.parse(text)
    except (OutputParserException, ValueError) as e:  # ValueError: defusedxml's own refusals
        cause = e.__cause__ or e  # LangChain wraps the ParseError, which says where the XML broke
        raise TransformError(spec.type, f"invalid XML ({cause}) in {_quote(text)}", text=text) from e
    return _lookup(spec, parsed)


def _render(spec: TransformSpec, data: Any) -> str:
    return render_data(data)


# regex is not here: it takes the limits too (its pattern's memory, its findall's bounds).
_APPLY: dict[str, Callable[[TransformSpec, Any], Any]] = {
    "strip": _strip,
    "json": _json,
    "csv_list": _csv_list,
    "numbered_list": _numbered_list,
    "markdown_list": _markdown_list,
    "xml": _xml,
    "render": _render,
}
