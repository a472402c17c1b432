"""Output transforms: parity with LangChain's own parsers and prompt rendering on the same texts, and their
errors (the bounds that keep a hostile transform from holding the server: `test_transform_bounds`).

Each parity table holds realistic LLM outputs; the expected value is always computed by LangChain (or, for
regex and key paths, which LangChain has no parser for, by Python's `re` and plain indexing) — never written
by hand — so the tests say "what LangChain does", not "what we think it does".
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

pytest.importorskip("langchain_core")


from hypothesis import given, settings, strategies as st
from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import (
    CommaSeparatedListOutputParser,
    JsonOutputParser,
    MarkdownListOutputParser,
    NumberedListOutputParser,
    StrOutputParser,
    XMLOutputParser,
)
from langchain_core.prompts import PromptTemplate

from server.serve.transforms import (
    MAX_REFUSED_TEXT_CHARS,
    XML_PARSER,
    TransformError,
    TransformResult,
    apply_transforms,
    render_data,
    render_value,
)


def run(text: str, *specs: dict[str, Any]) -> TransformResult:
    return apply_transforms(list(specs), text)


def langchain_render(value: Any) -> str:
    """What LangChain puts in a prompt for this value: an f-string PromptTemplate, minus its prefix."""
    return PromptTemplate.from_template("x {v}").format(v=value)[2:]


def check_result(result: TransformResult, expected: Any) -> None:
    """The result holds `expected` and its two forms agree (text, or JSON tagged "json")."""
    assert result.data == expected
    if isinstance(expected, str):
        assert (result.kind, result.value) == ("text", expected)
    else:
        assert result.kind == "json"
        assert json.loads(result.value) == expected
    assert render_value(result.value, result.kind) == langchain_render(expected)


# ----------------------------------------------------------------------------------------------- json
JSON_TEXTS = [
    '{"name": "Ada", "age": 36}',
    '  \n{"a": {"b": [1, 2, {"c": null}]}}\n\n',
    '```json\n{"answer": "yes", "confidence": 0.9}\n```',
    "```\n[1, 2, 3]\n```",
    'Sure! Here is the JSON:\n```json\n{"city": "Paris", "tags": ["a", "b"]}\n```\nHope this helps.',
    '{"name": "Al',  # partial: cut off inside a string
    '{"items": [1, 2',  # partial: open list and object
    '{"a": true, "b": false, "c": null, "d": -1.5e3}',
    '{"text": "line one\nline two"}',  # a raw newline inside a string (strict=False in LangChain)
    '{"action_input": "multi\nline text"}',  # LangChain's action_input repair
    '"just a string"',
    "42",
    '{"emoji": "\\ud83d\\ude00 ok", "unicode": "café"}',
]


@pytest.mark.parametrize("text", JSON_TEXTS)
def test_json_matches_langchain(text: str) -> None:
    check_result(run(text, {"type": "json"}), JsonOutputParser().parse(text))


@pytest.mark.parametrize(
    "text",
    [
        "Here is the JSON: {'a': 1}",  # prose around unfenced JSON: LangChain does not dig it out either
        "not json at all",
        "",
        "```json\n```",
        '{"action_input": "say "hi" now"}',  # beyond LangChain's quote repair
    ],
)
def test_json_failures_match_langchain(text: str) -> None:
    with pytest.raises(OutputParserException):
        JsonOutputParser().parse(text)
    with pytest.raises(TransformError) as info:
        run(text, {"type": "json"})
    assert info.value.transform_type == "json" and info.value.error_type == "transform_failed"
    assert "invalid JSON" in str(info.value) and repr(text) in str(info.value)
    assert info.value.text == text  # the refused text, as data


def test_json_mismatched_bracket_gives_none_like_langchain() -> None:
    # LangChain's partial parser answers None (not an error) for a stray closing bracket; parity keeps it.
    assert JsonOutputParser().parse('{"a": 1]') is None
    check_result(run('{"a": 1]', {"type": "json"}), None)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('{"a": {"b": [10, 20, 30]}}', "a.b.0"),
        ('{"a": {"b": [10, 20, 30]}}', "a.b.-1"),
        ('{"a": {"b": [10, 20, 30]}}', "a.b"),
        ('```json\n{"answer": "Paris", "why": "capital"}\n```', "answer"),
        ('{"0": "dict key, not index"}', "0"),
        ('[{"name": "x"}, {"name": "y"}]', "1.name"),
        ('{"result": {"items": [{"id": 1', "result.items.0.id"),  # partial JSON, then a key path
    ],
)
def test_json_key_path(text: str, key: str) -> None:
    expected = JsonOutputParser().parse(text)
    for part in key.split("."):
        expected = expected[part] if isinstance(expected, dict) else expected[int(part)]
    check_result(run(text, {"type": "json", "key": key}), expected)


@pytest.mark.parametrize(
    ("text", "key", "says"),
    [
        ('{"a": {"b": 1}}', "a.c", "no key 'c' at a (keys: 'b')"),
        ('{"a": [1, 2]}', "a.5", "no index '5' at a (a list of 2)"),
        ('{"a": [1, 2]}', "a.x", "no index 'x' at a"),
        ('{"a": 1}', "a.b", "cannot look up 'b' in int"),
        ("[]", "x", "no index 'x' at the top level"),
    ],
)
def test_json_missing_key_path(text: str, key: str, says: str) -> None:
    with pytest.raises(TransformError, match=re.escape(says)) as info:
        run(text, {"type": "json", "key": key})
    assert info.value.text is None  # the text parsed: what failed is the lookup, not the model's syntax


def test_json_too_deep_is_a_transform_error() -> None:
    with pytest.raises(TransformError, match="RecursionError") as info:
        run("[" * 5000, {"type": "json"})
    assert info.value.text == "[" * 5000


# ---------------------------------------------------------------------------------------------- lists
CSV_TEXTS = [
    "red, green, blue",
    "red,green ,  blue",
    '"New York, NY", Boston, "Austin"',
    "single",
    "",
    "  a ,b,\n c",
    "apples, bananas, and cherries.",
]


@pytest.mark.parametrize("text", CSV_TEXTS)
def test_csv_list_matches_langchain(text: str) -> None:
    check_result(run(text, {"type": "csv_list"}), CommaSeparatedListOutputParser().parse(text))


NUMBERED_TEXTS = [
    "1. apples\n2. bananas\n3. cherries",
    "Here are three ideas:\n\n1. Write tests\n2.  Ship it\n10. Celebrate\n\nThat's all.",
    "1.no space\n2. ok",
    "no list here",
    "",
]


@pytest.mark.parametrize("text", NUMBERED_TEXTS)
def test_numbered_list_matches_langchain(text: str) -> None:
    check_result(run(text, {"type": "numbered_list"}), NumberedListOutputParser().parse(text))


MARKDOWN_TEXTS = [
    "- a\n* b",
    "Steps:\n  - first step\n  - second step  \n-not an item\n* third",
    "- only one",
    "plain text",
    "",
]


@pytest.mark.parametrize("text", MARKDOWN_TEXTS)
def test_markdown_list_matches_langchain(text: str) -> None:
    check_result(run(text, {"type": "markdown_list"}), MarkdownListOutputParser().parse(text))


# ------------------------------------------------------------------------------------------------ xml
XML_TEXTS = [
    "<movies><movie>Jaws</movie><movie>Alien</movie></movies>",
    "```xml\n<root>\n  <a>1</a>\n  <b><c>2</c></b>\n</root>\n```",
    '<?xml version="1.0" encoding="UTF-8"?>\n<r><x>1</x></r>',
    "<answer>42</answer>",
    "<r><empty/><t>x</t></r>",
]


@pytest.mark.parametrize("text", XML_TEXTS)
def test_xml_matches_langchain(text: str) -> None:
    check_result(run(text, {"type": "xml"}), XMLOutputParser(parser=XML_PARSER).parse(text))


def test_xml_key_path() -> None:
    text = "<movies><movie>Jaws</movie><movie>Alien</movie></movies>"
    check_result(run(text, {"type": "xml", "key": "movies.1.movie"}), "Alien")


@pytest.mark.parametrize("text", ["Sure: <answer>42</answer> done", "<a><b></a>", "no xml"])
def test_xml_failures_match_langchain(text: str) -> None:
    with pytest.raises(OutputParserException):
        XMLOutputParser(parser=XML_PARSER).parse(text)
    with pytest.raises(TransformError, match="invalid XML") as info:
        run(text, {"type": "xml"})
    assert info.value.text == text


def test_xml_entity_declarations_are_refused() -> None:
    with pytest.raises(TransformError, match=r"(?i)entit"):
        run('<!DOCTYPE r [<!ENTITY e "boom">]><r>&e;</r>', {"type": "xml"})


# ---------------------------------------------------------------------------------------------- regex
REGEX_CASES = [
    ("Final answer: 42.", r"answer: (\d+)", None),
    ("Final answer: 42.", r"\d+", None),
    ("name=Ada; name=Bob", r"name=(?P<n>\w+)", "n"),
    ("x=1 y=2", r"(\w)=(\d)", 2),
    ("x=1 y=2", r"(\w)=(\d)", 0),
    ("a1 b c3", r"[a-z](\d)?", 1),  # a group that does not take part
]


@pytest.mark.parametrize(("text", "pattern", "group"), REGEX_CASES)
def test_regex_search_matches_re(text: str, pattern: str, group: int | str | None) -> None:
    match = re.search(pattern, text)
    assert match is not None
    g = group if group is not None else min(re.compile(pattern).groups, 1)
    check_result(run(text, {"type": "regex", "pattern": pattern, "group": group}), match.group(g) or "")


@pytest.mark.parametrize(("text", "pattern", "group"), [*REGEX_CASES, ("none here", r"\d+", None)])
def test_regex_findall_matches_re(text: str, pattern: str, group: int | str | None) -> None:
    spec = {"type": "regex", "pattern": pattern, "group": group, "findall": True}
    if group is None:  # with at most one group, the default is exactly re.findall
        expected = re.findall(pattern, text)
    else:
        expected = [m.group(group) or "" for m in re.finditer(pattern, text)]
    check_result(run(text, spec), expected)


def test_regex_no_match() -> None:
    says = "pattern '[0-9]+' does not match 'no digits'"
    with pytest.raises(TransformError, match=re.escape(says)) as info:
        run("no digits", {"type": "regex", "pattern": "[0-9]+"})
    assert info.value.text == "no digits"


# --------------------------------------------------------------------------------- strip, render, chains
@pytest.mark.parametrize("text", ["  hello \n", "\n\nAnswer: yes\t", "", "x"])
def test_strip_and_identity(text: str) -> None:
    check_result(run(text), StrOutputParser().parse(text))  # no transforms: what StrOutputParser gives
    check_result(run(text, {"type": "strip"}), text.strip())


RENDER_VALUES: list[Any] = [
    ["a", "b"],
    {"k": "v", "n": 1},
    {"outer": {"inner": [1, 2.5, None, True]}, "s": 'it\'s "quoted"'},
    [[1, 2], [], {}],
    "plain text",
    "",
    7,
    -0.5,
    1e20,
    True,
    None,
    ["café", "\n"],
]


@pytest.mark.parametrize("value", RENDER_VALUES)
def test_render_matches_prompt_template(value: Any) -> None:
    assert render_data(value) == langchain_render(value)
    # Through the wire form: a structured value is stored as JSON with the "json" tag.
    stored = TransformResult.of(value)
    assert render_value(stored.value, stored.kind) == langchain_render(value)
    assert stored.render() == langchain_render(value)


def test_render_transform_after_a_parser() -> None:
    text = '```json\n{"steps": ["plan", "write", "test"]}\n```'
    result = run(text, {"type": "json", "key": "steps"}, {"type": "render"})
    assert (result.kind, result.value) == ("text", langchain_render(["plan", "write", "test"]))
    assert run("1. a\n2. b", {"type": "numbered_list"}, {"type": "render"}).value == "['a', 'b']"


def test_chained_text_transforms() -> None:
    result = run('  Answer: ```json\n{"a": [1]}\n```  ', {"type": "strip"}, {"type": "json", "key": "a.0"})
    check_result(result, 1)
    result = run('Reply: {"x": 3}', {"type": "regex", "pattern": r"\{.*\}"}, {"type": "json", "key": "x"})
    check_result(result, 3)


def test_parser_after_structured_value_needs_render() -> None:
    says = r"strip transform failed: expects text, but .* produced list"
    with pytest.raises(TransformError, match=says) as info:
        run("a, b", {"type": "csv_list"}, {"type": "strip"})
    assert info.value.text is None  # a structured value is no model text refused


def test_error_message_truncates_long_text() -> None:
    text = "not json " * 50
    with pytest.raises(TransformError) as info:
        run(text, {"type": "json"})
    assert f"({len(text)} chars)" in str(info.value)
    assert len(str(info.value)) < 400
    assert info.value.text == text  # the message quotes the start; the error keeps all of it


def test_the_refused_text_is_the_failing_transforms_input() -> None:
    with pytest.raises(TransformError) as info:
        run("  not json\n", {"type": "strip"}, {"type": "json"})
    assert info.value.text == "not json"  # what the parser saw, as LangChain's parser would report it


def test_a_refused_text_over_the_bound_is_not_kept() -> None:
    # Whole or not at all: a client given llm_output must be able to trust it is the model's whole text.
    fits = "x" * MAX_REFUSED_TEXT_CHARS
    assert TransformError("json", "m", text=fits).text == fits
    assert TransformError("json", "m", text=fits + "x").text is None
    with pytest.raises(TransformError) as info:
        run(fits + "x", {"type": "json"})
    assert info.value.text is None and f"({MAX_REFUSED_TEXT_CHARS + 1} chars)" in str(info.value)


# ---------------------------------------------------------------------------------------------- properties
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(alphabet="abcxyz_", max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(value=json_values, fenced=st.booleans())
def test_json_roundtrip_and_render_property(value: Any, fenced: bool) -> None:
    text = json.dumps(value, indent=2)
    if fenced:
        text = f"Here you go:\n```json\n{text}\n```"
    expected = JsonOutputParser().parse(text)
    assert expected == value  # sanity: LangChain reads it back too
    check_result(run(text, {"type": "json"}), expected)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list('ab ,\n-*1."')), max_size=30))
def test_list_parsers_property(text: str) -> None:
    assert run(text, {"type": "csv_list"}).data == CommaSeparatedListOutputParser().parse(text)
    assert run(text, {"type": "numbered_list"}).data == NumberedListOutputParser().parse(text)
    assert run(text, {"type": "markdown_list"}).data == MarkdownListOutputParser().parse(text)
