"""LangChain output parsers as server-side transforms (`parrot.transforms`), plus what stays on the client.

A model's output parsers become the transforms of its semantic call's output: the server applies them
with the very parsers of langchain-core (`server.serve.transforms`), so a compiled chain gets what
LangChain's parser gives for the same text. What cannot run on the server stays on the client: the
validation of `PydanticOutputParser` (its JSON is parsed server-side, the model built here) and the
wrapping of a chat model's text into an ``AIMessage``.

Supported, by exact class: `StrOutputParser`, `JsonOutputParser` (also `SimpleJsonOutputParser`; fenced
and partial JSON as LangChain parses them), `CommaSeparatedListOutputParser`, `NumberedListOutputParser`,
`MarkdownListOutputParser` (custom ``pattern``s become ``regex`` transforms), `XMLOutputParser` and
`PydanticOutputParser`. Any other parser — including subclasses, whose ``parse`` may differ — is an
`UnsupportedParserError` at compile time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import parrot as P
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import (
    BaseOutputParser,
    CommaSeparatedListOutputParser,
    JsonOutputParser,
    MarkdownListOutputParser,
    NumberedListOutputParser,
    PydanticOutputParser,
    StrOutputParser,
    XMLOutputParser,
)
from parrot.protocol import TransformSpec

from langchain_parrot.errors import UnsupportedParserError

__all__ = ["SUPPORTED_PARSERS", "OutputPlan", "ValueKind", "is_output_parser", "plan_output"]

# What a step's value is, as far as the next steps are concerned:
#   text     a str (rendered into a later prompt as is, server-side)
#   json     a structured value (list, dict...) the server holds as JSON and renders as str() — LangChain's
#            rendering of the same Python value
#   message  an AIMessage built on the client (a chat model's output without a parser)
#   object   a Python object built on the client (a pydantic model)
ValueKind = Literal["text", "json", "message", "object"]

SUPPORTED_PARSERS: tuple[type[BaseOutputParser[Any]], ...] = (
    StrOutputParser,
    JsonOutputParser,
    CommaSeparatedListOutputParser,
    NumberedListOutputParser,
    MarkdownListOutputParser,
    XMLOutputParser,
    PydanticOutputParser,
)

_DEFAULT_NUMBERED = NumberedListOutputParser.model_fields["pattern"].default
_DEFAULT_MARKDOWN = MarkdownListOutputParser.model_fields["pattern"].default
_DEFAULT_XML_ENCODING = XMLOutputParser.model_fields["encoding_matcher"].default


@dataclass(frozen=True)
class OutputPlan:
    """How a model step's output is produced: server-side transforms, then a client-side ``post``."""

    kind: ValueKind
    transforms: list[TransformSpec] = field(default_factory=list)
    post: Callable[[Any], Any] | None = None

    @property
    def keyable(self) -> bool:
        """Whether a key path can be added to the last transform (it parses JSON or XML, without a key)."""
        last = self.transforms[-1] if self.transforms else None
        return self.post is None and last is not None and last.type in ("json", "xml") and last.key is None

    def with_key(self, path: Sequence[str]) -> list[TransformSpec]:
        """The transforms with ``path`` looked up by the last one (see `keyable`)."""
        *head, last = self.transforms
        return [*head, last.model_copy(update={"key": ".".join(path)})]


def is_output_parser(runnable: Any) -> bool:
    """Whether ``runnable`` is an output parser (translatable or not)."""
    return isinstance(runnable, BaseOutputParser)


def _describe(parser: Any) -> str:
    return f"{type(parser).__module__}.{type(parser).__qualname__}"


def _unsupported(parser: Any, why: str) -> UnsupportedParserError:
    names = ", ".join(cls.__name__ for cls in SUPPORTED_PARSERS)
    return UnsupportedParserError(
        f"cannot run output parser {_describe(parser)} on the Parrot server: {why}. Supported parsers "
        f"(exact classes): {names}. To run it on the client instead, wrap it: "
        "RunnableLambda(lambda message: parser.invoke(message))"
    )


def _list_regex(parser: Any, pattern: str, multiline: bool) -> TransformSpec:
    source = f"(?m){pattern}" if multiline else pattern
    # Checked here, on the client that wrote the pattern (the server checks it again with RE2): LangChain's
    # list parsers take one group, or the whole match.
    try:
        groups = re.compile(source).groups
    except re.error as e:
        raise _unsupported(parser, f"its pattern {pattern!r} is not a one-group regex ({e})") from None
    if groups > 1:
        why = f"its pattern {pattern!r} is not a one-group regex (it has {groups} groups)"
        raise _unsupported(parser, why)
    return P.transforms.regex(source, findall=True)


def _transform(parser: Any) -> TransformSpec | None:
    """The transform of one parser (None for StrOutputParser, which keeps the text)."""
    kind = type(parser)
    if kind is StrOutputParser:
        return None
    if kind is JsonOutputParser:
        return P.transforms.json()
    if kind is CommaSeparatedListOutputParser:
        return P.transforms.csv_list()
    if kind is NumberedListOutputParser:
        if parser.pattern == _DEFAULT_NUMBERED:
            return P.transforms.numbered_list()
        return _list_regex(parser, parser.pattern, multiline=False)
    if kind is MarkdownListOutputParser:
        if parser.pattern == _DEFAULT_MARKDOWN:
            return P.transforms.markdown_list()
        return _list_regex(parser, parser.pattern, multiline=True)
    if kind is XMLOutputParser:
        if parser.encoding_matcher.pattern != _DEFAULT_XML_ENCODING.pattern:
            raise _unsupported(parser, "it has a custom encoding_matcher")
        return P.transforms.xml()  # the server parses with defusedxml either way (`parser` only hardens)
    if kind is PydanticOutputParser:
        return P.transforms.json()
    if isinstance(parser, SUPPORTED_PARSERS):
        raise _unsupported(parser, f"it subclasses {kind.__mro__[1].__name__} and may parse differently")
    raise _unsupported(parser, "it is not one of the parsers with a server-side transform")


def _wrap_message(text: str) -> AIMessage:
    return AIMessage(content=text)


def _pydantic_post(parser: PydanticOutputParser[Any]) -> Callable[[Any], Any]:
    def validate(data: Any) -> Any:
        # The server parsed the JSON exactly as JsonOutputParser does; the parser's own parse of that JSON
        # then builds (and validates) the model, raising OutputParserException as LangChain would.
        return parser.parse(json.dumps(data))

    return validate


def plan_output(parsers: Sequence[Any], *, chat: bool) -> OutputPlan:
    """The `OutputPlan` of a model step followed by ``parsers`` (``chat``: the model is a chat model).

    Raises `UnsupportedParserError` for a parser without a transform, or one that would read the
    structured value an earlier parser made (LangChain's text parsers read text).
    """
    transforms: list[TransformSpec] = []
    post: Callable[[Any], Any] | None = None
    kind: ValueKind = "message" if chat else "text"
    for parser in parsers:
        spec = _transform(parser)
        if kind in ("json", "object"):
            raise _unsupported(parser, f"it would read the {kind} value the parser before it produced")
        if spec is None:  # StrOutputParser: a message's text, or the text itself
            kind = "text"
            continue
        transforms.append(spec)
        if type(parser) is PydanticOutputParser:
            kind, post = "object", _pydantic_post(parser)
        else:
            kind = "json"
    if kind == "message":
        post = _wrap_message
    return OutputPlan(kind=kind, transforms=transforms, post=post)
