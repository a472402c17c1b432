"""Parsers as server transforms: on fixed texts, the server's result equals LangChain's parser's.

The compiled path is reproduced exactly: the server's `apply_transforms`, the value stored as the variable
holds it (JSON text for a structured value, as the client reads it back), then the plan's client-side
``post``. The reference is LangChain parsing the same text as a chat model's message.
"""

from __future__ import annotations

import json
from operator import itemgetter
from typing import Any

import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import (
    CommaSeparatedListOutputParser,
    JsonOutputParser,
    MarkdownListOutputParser,
    NumberedListOutputParser,
    PydanticOutputParser,
    SimpleJsonOutputParser,
    StrOutputParser,
    XMLOutputParser,
)
from langchain_parrot import UnsupportedParserError
from langchain_parrot.parsers import plan_output
from pydantic import BaseModel

from server.serve.transforms import TransformError, apply_transforms


class Parrot(BaseModel):
    name: str
    age: int


def compiled(parsers: list[Any], text: str, key: list[str] | None = None) -> Any:
    """What a compiled chain returns for a chat model that wrote ``text``."""
    plan = plan_output(parsers, chat=True)
    specs = plan.with_key(key) if key else plan.transforms
    result = apply_transforms(specs, text)
    value = json.loads(result.value) if result.kind == "json" else result.value
    return plan.post(value) if plan.post is not None else value


def reference(parsers: list[Any], text: str) -> Any:
    """What LangChain's parsers give for the same message."""
    value: Any = AIMessage(content=text)
    for parser in parsers:
        value = parser.invoke(value)
    return value


JSON_TEXTS = [
    '{"a": 1, "b": [1, 2.5, null, true], "c": {"d": "e"}}',
    '```json\n{"topic": "parrots", "audience": "kids"}\n```',
    'Sure! Here it is:\n```\n{"a": "x"}\n```\nanything after',
    '{"a": [1, 2',  # partial: LangChain completes it
    '  {"k": "v with \\"quotes\\" and \\u00e9"}  ',
    "[1, 2, 3]",
    '"just a string"',
    '{"unicode": "日本語", "emoji": "🦜"}',
]
CASES: list[tuple[list[Any], str]] = [
    *[([JsonOutputParser()], t) for t in JSON_TEXTS],
    *[([SimpleJsonOutputParser()], t) for t in JSON_TEXTS[:3]],
    *[([StrOutputParser(), JsonOutputParser()], t) for t in JSON_TEXTS[:2]],
    *[
        ([CommaSeparatedListOutputParser()], t)
        for t in ["a, b, c", '"a, b", c', "single", "", "x,y\n", " spaced ,  out "]
    ],
    *[
        ([NumberedListOutputParser()], t)
        for t in ["1. foo\n2. bar\n3. baz", "no list here", "1. a\n\n10. b\n11.c", "Intro\n1. x\n2. y"]
    ],
    *[([MarkdownListOutputParser()], t) for t in ["- a\n* b\n  - c", "text\n- x\n-y", "nothing"]],
    ([NumberedListOutputParser(pattern=r"(\w+);")], "alpha; beta;gamma;"),
    ([MarkdownListOutputParser(pattern=r"^>\s(.+)$")], "> one\n> two\nthree"),
    *[
        ([XMLOutputParser()], t)
        for t in [
            "<root><a>1</a><b>2</b></root>",
            "```xml\n<r><x>y</x><x>z</x></r>\n```",
            '<?xml version="1.0" encoding="UTF-8"?><p><q>w</q></p>',
        ]
    ],
    ([XMLOutputParser(parser="xml")], "<root><a>1</a></root>"),
    ([PydanticOutputParser(pydantic_object=Parrot)], '{"name": "Polly", "age": 3}'),
    ([PydanticOutputParser(pydantic_object=Parrot)], '```json\n{"name": "Polly", "age": "4"}\n```'),
    ([StrOutputParser()], " keeps  whitespace \n"),
    ([], "a chat model's text"),
]


@pytest.mark.parametrize(
    ("parsers", "text"), CASES, ids=lambda v: repr(v)[:40] if isinstance(v, str) else None
)
def test_compiled_parse_equals_langchain(parsers: list[Any], text: str) -> None:
    assert compiled(parsers, text) == reference(parsers, text)


@pytest.mark.parametrize(
    ("parsers", "text"),
    [
        ([JsonOutputParser()], "not json at all"),
        ([XMLOutputParser()], "<a>unclosed"),
        ([PydanticOutputParser(pydantic_object=Parrot)], '{"name": "Polly"}'),
        ([PydanticOutputParser(pydantic_object=Parrot)], "no json"),
    ],
)
def test_compiled_parse_fails_where_langchain_fails(parsers: list[Any], text: str) -> None:
    with pytest.raises(OutputParserException):
        reference(parsers, text)
    # The server fails the variable (TransformError); client-side validation raises LangChain's own error.
    with pytest.raises((TransformError, OutputParserException)):
        compiled(parsers, text)


def test_a_key_path_equals_itemgetter() -> None:
    text = '```json\n{"topic": {"name": "parrots"}, "n": 2}\n```'
    assert (
        compiled([JsonOutputParser()], text, key=["topic", "name"])
        == itemgetter("topic")(reference([JsonOutputParser()], text))["name"]
    )
    xml = "<root><title>Parrots</title></root>"
    assert compiled([XMLOutputParser()], xml, key=["root"]) == reference([XMLOutputParser()], xml)["root"]


def test_plans_say_what_the_value_is() -> None:
    assert plan_output([], chat=True).kind == "message"
    assert plan_output([], chat=False).kind == "text"
    assert plan_output([StrOutputParser()], chat=True).kind == "text"
    assert plan_output([JsonOutputParser()], chat=True).keyable
    assert not plan_output([CommaSeparatedListOutputParser()], chat=True).keyable
    pydantic = plan_output([PydanticOutputParser(pydantic_object=Parrot)], chat=True)
    assert pydantic.kind == "object" and not pydantic.keyable


def test_untranslatable_parsers_are_rejected_with_a_hint() -> None:
    class ShoutingParser(StrOutputParser):
        def parse(self, text: str) -> str:
            return text.upper()

    with pytest.raises(
        UnsupportedParserError, match=r"ShoutingParser.*subclasses StrOutputParser.*RunnableLambda"
    ):
        plan_output([ShoutingParser()], chat=True)
    with pytest.raises(UnsupportedParserError, match="would read the json value"):
        plan_output([JsonOutputParser(), CommaSeparatedListOutputParser()], chat=True)
    with pytest.raises(UnsupportedParserError, match="one-group regex"):
        plan_output([NumberedListOutputParser(pattern=r"(\d+)\. (\w+)")], chat=True)
