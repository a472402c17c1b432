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
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import (
    CommaSeparatedListOutputParser,
    JsonOutputParser,
    MarkdownListOutputParser,
    NumberedListOutputParser,
    XMLOutputParser,
)
from parrot.protocol import TransformSpec
from pydantic import ValidationError

__all__ = [
    "XML_PARSER",
    "TransformError",
    "TransformResult",
    "TransformSpec",
    "ValueKind",
    "apply_transforms",
    "render_data",
    "render_value",
    "validate_transforms",
]

ValueKind = Literal["text", "json"]

# How much of the offending text an error message quotes: enough to see what the model wrote, bounded so a
# long output does not flood logs or the variable's failure message.
_QUOTE_CHARS = 200

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
    """A transform failed on a call's output; the manager marks the output variable failed with it."""

    def __init__(self, transform_type: str, message: str) -> None:
        super().__init__(f"{transform_type} transform failed: {message}")
        self.transform_type = transform_type
        self.message = message


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


def validate_transforms(specs: Sequence[TransformSpec | Mapping[str, Any]]) -> list[TransformSpec]:
    """Validate transform specs up front (at submit time); raises pydantic's ValidationError on bad ones."""
    return [s if isinstance(s, TransformSpec) else TransformSpec.model_validate(s) for s in specs]


def apply_transforms(specs: Sequence[TransformSpec | Mapping[str, Any]], text: str) -> TransformResult:
    """Apply ``specs`` in order to an LLM's output ``text``.

    Raises pydantic's ValidationError for an invalid spec (before anything runs) and `TransformError` for a
    transform that fails on this text.
    """
    data: Any = text
    spec_type = "transform"
    try:
        for spec in validate_transforms(specs):
            spec_type = spec.type
            data = _APPLY[spec.type](spec, data)
        return TransformResult.of(data)
    except (TransformError, ValidationError):
        raise
    except (RecursionError, ValueError, TypeError) as e:
        # Whatever else a parser or json.dumps throws on hostile output (say, JSON nested 10k deep) is still
        # this transform failing on this text: the caller gets the one typed error it handles.
        raise TransformError(spec_type, f"{type(e).__name__}: {e} on {_quote(text)}") from e


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
        raise TransformError(spec.type, f"invalid JSON{cause} in {_quote(text)}") from e
    return _lookup(spec, parsed)


def _csv_list(spec: TransformSpec, data: Any) -> list[str]:
    return _CSV.parse(_text_input(spec, data))


def _numbered_list(spec: TransformSpec, data: Any) -> list[str]:
    return _NUMBERED.parse(_text_input(spec, data))


def _markdown_list(spec: TransformSpec, data: Any) -> list[str]:
    return _MARKDOWN.parse(_text_input(spec, data))


def _regex(spec: TransformSpec, data: Any) -> str | list[str]:
    text = _text_input(spec, data)
    assert spec.pattern is not None  # the spec validator requires it
    pattern = re.compile(spec.pattern)
    # No group given: the only group, or the whole match — what re.findall returns (the validator rejects
    # a pattern with several groups and no choice). A group that did not take part reads as "", as in findall.
    group = spec.group if spec.group is not None else min(pattern.groups, 1)
    if spec.findall:
        return [m.group(group) or "" for m in pattern.finditer(text)]
    match = pattern.search(text)
    if match is None:
        raise TransformError(spec.type, f"pattern {spec.pattern!r} does not match {_quote(text)}")
    return match.group(group) or ""


def _xml(spec: TransformSpec, data: Any) -> Any:
    text = _text_input(spec, data)
    try:
        parsed = _XML.parse(text)
    except (OutputParserException, ValueError) as e:  # ValueError: defusedxml's own refusals
        cause = e.__cause__ or e  # LangChain wraps the ParseError, which says where the XML broke
        raise TransformError(spec.type, f"invalid XML ({cause}) in {_quote(text)}") from e
    return _lookup(spec, parsed)


def _render(spec: TransformSpec, data: Any) -> str:
    return render_data(data)


_APPLY: dict[str, Callable[[TransformSpec, Any], Any]] = {
    "strip": _strip,
    "json": _json,
    "csv_list": _csv_list,
    "regex": _regex,
    "numbered_list": _numbered_list,
    "markdown_list": _markdown_list,
    "xml": _xml,
    "render": _render,
}
