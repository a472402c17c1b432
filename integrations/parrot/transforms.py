"""Declarative transforms: named, whitelisted operations the server applies to a call's output text.

Each helper returns a `parrot.protocol.TransformSpec`; no client code ever runs on the server. Give them to
``@P.semantic_function(transforms={"out": [P.transforms.json(key="items")]})``; they apply in list order.
``render`` is the one transform for inputs: it lets an input take any value, sent as ``str(value)`` (exactly
as LangChain's prompt templates render it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from parrot.protocol import TransformSpec

__all__ = ["csv_list", "json", "markdown_list", "numbered_list", "regex", "render", "strip", "xml"]


def strip() -> TransformSpec:
    """Strip leading and trailing whitespace."""
    return TransformSpec(type="strip")


def json(key: str | None = None, schema: dict[str, Any] | type[BaseModel] | None = None) -> TransformSpec:
    """Parse JSON (markdown-fence tolerant); ``key`` is an optional dotted path into it (``"a.b.0"``).

    With ``schema`` (a JSON Schema, or a pydantic model class), the output is generated under it by
    constrained decoding, so the text parsed is valid JSON of that schema by construction; such a transform
    must come first for its output.
    """
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        schema = schema.model_json_schema()
    return TransformSpec(type="json", key=key, json_schema=schema)


def csv_list() -> TransformSpec:
    """Split comma-separated text into a list of strings."""
    return TransformSpec(type="csv_list")


def regex(pattern: str, group: int | str | None = None, findall: bool = False) -> TransformSpec:
    """Extract with a regular expression: the first match, or every match with ``findall``.

    ``group`` picks a group by number or name (default: the only group, or the whole match).
    """
    return TransformSpec(type="regex", pattern=pattern, group=group, findall=findall)


def numbered_list() -> TransformSpec:
    """Parse a ``1. a`` / ``2. b`` list into a list of strings."""
    return TransformSpec(type="numbered_list")


def markdown_list() -> TransformSpec:
    """Parse a ``- a`` / ``* b`` list into a list of strings."""
    return TransformSpec(type="markdown_list")


def xml(key: str | None = None) -> TransformSpec:
    """Parse XML into nested dicts and lists; ``key`` is an optional dotted path into the result."""
    return TransformSpec(type="xml", key=key)


def render() -> TransformSpec:
    """For an input: accept any value and send ``str(value)`` (without it, inputs take only str/Variable)."""
    return TransformSpec(type="render")
