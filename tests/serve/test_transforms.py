"""Output transforms: parity with LangChain's own parsers and prompt rendering on the same texts, errors,
and the bounds that keep a hostile transform from holding the server (RE2, time and output limits, the
process runner).

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

from collections.abc import Iterator

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
from parrot.protocol import CallError, TransformSpec
from pydantic import ValidationError

from server.serve.transform_runner import TransformRunner
from server.serve.transforms import (
    DEFAULT_LIMITS,
    MAX_REFUSED_TEXT_CHARS,
    XML_PARSER,
    TransformError,
    TransformLimitError,
    TransformLimits,
    TransformPatternError,
    TransformResult,
    apply_transforms,
    render_data,
    render_value,
    validate_transforms,
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


# ------------------------------------------------------------------------------------- spec validation
@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"type": "eval"}, "Input should be 'strip', 'json'"),
        (
            {"type": "json", "pattern": "x"},
            "'json' does not take option(s) ['pattern'] (it takes: json_schema, key)",
        ),
        ({"type": "strip", "key": "a"}, "transform 'strip' does not take option(s) ['key'] (it takes: none)"),
        ({"type": "csv_list", "findall": True}, "does not take option(s) ['findall']"),
        ({"type": "json", "bogus": 1}, "Extra inputs are not permitted"),
        ({"type": "json", "key": "a..b"}, "key path 'a..b' has an empty segment"),
        ({"type": "regex"}, "transform 'regex' needs a non-empty 'pattern'"),
        ({"type": "regex", "pattern": "(a)", "group": True}, "valid integer"),
    ],
)
def test_bad_specs_are_rejected_up_front(spec: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(says)):
        validate_transforms([spec])
    with pytest.raises(ValidationError):  # before any transform runs on the text
        apply_transforms([{"type": "strip"}, spec], "text")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"type": "regex", "pattern": "("}, "missing )"),
        ({"type": "regex", "pattern": "(a)(b)"}, "it has 2 groups; choose one with 'group'"),
        ({"type": "regex", "pattern": "(a)", "group": 2}, "group 2 is out of range: it has 1 group(s)"),
        ({"type": "regex", "pattern": "(?P<x>a)", "group": "y"}, "no group named 'y' (named: ['x'])"),
        # What Python's `re` could not bound: 5,000-deep nesting (RecursionError) and a 2 MB alternation
        # (seconds to compile). The spec itself takes them as text; the server refuses them by size.
        ({"type": "regex", "pattern": "(" * 5000 + "a" + ")" * 5000}, "over the 1000-char limit"),
        ({"type": "regex", "pattern": "|".join(["abcdef"] * 300_000)}, "over the 1000-char limit"),
    ],
)
def test_patterns_are_checked_by_the_server_with_re2(spec: dict[str, Any], says: str) -> None:
    assert TransformSpec.model_validate(spec).pattern == spec["pattern"]  # no compile while validating
    with pytest.raises(TransformPatternError, match=re.escape(says)):
        validate_transforms([spec])
    with pytest.raises(TransformPatternError):  # before any transform runs on the text
        apply_transforms([{"type": "strip"}, spec], "text")


def test_spec_models_and_dicts_are_both_accepted() -> None:
    specs = [TransformSpec(type="json", key="a"), {"type": "render"}]
    assert validate_transforms(specs) == [TransformSpec(type="json", key="a"), TransformSpec(type="render")]
    assert apply_transforms(specs, '{"a": [1]}').value == "[1]"
    # The spec round-trips through its JSON wire form.
    spec = TransformSpec(type="regex", pattern=r"(?P<n>\d+)", group="n", findall=True)
    assert TransformSpec.model_validate_json(spec.model_dump_json()) == spec


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


# ------------------------------------------------------------------------------- bounds: RE2 and limits
# A catastrophic pattern: with Python's `re` it backtracks for ever on a short text without "QQQ".
CATASTROPHIC = "(.*.*)*QQQ"


def test_catastrophic_pattern_is_linear_on_re2() -> None:
    text = "The quick brown fox jumps over the lazy dog again and again " * 4
    with pytest.raises(TransformError, match=re.escape(f"pattern {CATASTROPHIC!r} does not match")):
        run(text, {"type": "regex", "pattern": CATASTROPHIC})
    check_result(run(text + "QQQ", {"type": "regex", "pattern": CATASTROPHIC, "group": 0}), text + "QQQ")


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", r"invalid escape sequence: \1"),  # a backreference
        (r"foo(?=bar)", "invalid perl operator: (?="),  # look-ahead
        (r"(?<!x)y", "invalid perl operator: (?<!"),  # look-behind
        (r"a++", "bad repetition operator: ++"),  # possessive
        (r"end\Z", r"invalid escape sequence: \Z"),  # Python's \Z is RE2's \z
        (r"(?x) a b", "invalid perl operator: (?x"),  # verbose mode
        (r"(?:(?:a{100}){100}){100}", "invalid repetition size"),  # a program over RE2's size bound
    ],
)
def test_patterns_re2_cannot_run_are_refused_up_front(pattern: str, reason: str) -> None:
    spec = {"type": "regex", "pattern": pattern}
    TransformSpec.model_validate(spec)  # valid for Python's re (the client's check) ...
    with pytest.raises(TransformPatternError) as info:  # ... but not what the server runs
        validate_transforms([spec])
    e = info.value
    assert isinstance(e, CallError)  # HTTP 400 at submit
    assert (e.pattern, e.transform_type) == (pattern, "regex")
    assert reason in e.reason and repr(pattern) in str(e) and "RE2" in str(e)
    with pytest.raises(TransformPatternError):  # before any transform runs on the text
        apply_transforms([{"type": "strip"}, spec], "text")


def test_pattern_length_is_bounded() -> None:
    limits = TransformLimits(max_pattern_chars=10)
    assert validate_transforms([{"type": "regex", "pattern": "a" * 10}], limits)
    with pytest.raises(TransformPatternError, match="11 chars is over the 10-char limit on patterns"):
        validate_transforms([{"type": "regex", "pattern": "a" * 11}], limits)
    with pytest.raises(TransformPatternError, match=f"{DEFAULT_LIMITS.max_pattern_chars + 1} chars is over"):
        validate_transforms([{"type": "regex", "pattern": "a" * (DEFAULT_LIMITS.max_pattern_chars + 1)}])


def test_re2_memory_is_bounded() -> None:
    # Twenty alternatives of a thousand repetitions: a program far over a 64 KiB budget.
    big = "(?:" + "|".join(f"{i}a{{1000}}" for i in range(20)) + ")"
    with pytest.raises(TransformPatternError, match="pattern too large"):
        validate_transforms([{"type": "regex", "pattern": big}], TransformLimits(re2_max_mem=1 << 16))


def test_findall_output_is_bounded() -> None:
    limits = TransformLimits(max_output_chars=1000)
    spec = {"type": "regex", "pattern": "x?", "findall": True}  # an (empty) match at every position
    assert len(apply_transforms([spec], "a" * 100, limits).data) == 101
    with pytest.raises(TransformLimitError) as info:
        apply_transforms([spec], "a" * 10_000, limits)
    assert info.value.limit == "output_size" and info.value.transform_type == "regex"
    assert "output_size limit exceeded: findall output is over 1000 chars" in str(info.value)


def test_every_transform_output_is_bounded() -> None:
    limits = TransformLimits(max_output_chars=20)
    assert apply_transforms([{"type": "csv_list"}], "a, b, c", limits).data == ["a", "b", "c"]
    with pytest.raises(TransformLimitError) as info:
        apply_transforms([{"type": "csv_list"}], ", ".join("abcdefgh"), limits)
    assert info.value.limit == "output_size" and info.value.transform_type == "csv_list"
    assert "output of 40 chars is over 20" in str(info.value)
    with pytest.raises(TransformLimitError, match="strip transform failed: output_size limit") as too_big:
        apply_transforms([{"type": "strip"}], "y" * 21, limits)
    assert too_big.value.text is None and too_big.value.error_type == "transform_limit"


def test_limits_must_be_sane() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        TransformLimits(time_s=0)
    with pytest.raises(ValueError, match="at least 64 KiB"):
        TransformLimits(re2_max_mem=1024)


# Unclosed JSON takes the partial-JSON repair path: ~0.5 s for these 2 MB on a fast core (linear in the
# size since langchain-core 1.x; it was quadratic before), far over the 0.05 s limit the test sets.
SLOW_JSON = '{"a": [' + "1," * 1_000_000


@pytest.fixture(scope="module")
def runner() -> Iterator[TransformRunner]:
    r = TransformRunner(workers=1)
    yield r
    r.close()


@pytest.mark.parametrize(
    ("specs", "text"),
    [
        ([{"type": "json", "key": "a.1"}], '```json\n{"a": [1, {"b": "c"}]}\n```'),
        ([{"type": "regex", "pattern": r"(?P<n>\d+)", "group": "n", "findall": True}], "1 22 333"),
        ([{"type": "numbered_list"}, {"type": "render"}], "1. a\n2. b"),
        ([{"type": "strip"}], "  lone \ud800 surrogate and caf\u00e9  "),
        ([], "no transforms"),
    ],
)
def test_runner_gives_what_apply_gives(
    runner: TransformRunner, specs: list[dict[str, Any]], text: str
) -> None:
    assert runner.run(specs, text) == apply_transforms(specs, text)


@pytest.mark.parametrize(
    ("specs", "text", "error"),
    [
        ([{"type": "json"}], "not json", TransformError),
        ([{"type": "regex", "pattern": CATASTROPHIC}], "x" * 24, TransformError),
        ([{"type": "regex", "pattern": r"(a)\1"}], "aa", TransformPatternError),
        # Over the output limit (made small, so that a loaded machine cannot hit the time limit first).
        ([{"type": "regex", "pattern": "x?", "findall": True}], "a" * 4_000, TransformLimitError),
    ],
)
def test_runner_raises_what_apply_raises(
    runner: TransformRunner, specs: list[dict[str, Any]], text: str, error: type[Exception]
) -> None:
    limits = TransformLimits(max_output_chars=1_000)
    with pytest.raises(error) as expected:
        apply_transforms(specs, text, limits)
    with pytest.raises(error) as got:
        runner.run(specs, text, limits)
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)
    assert got.value.text == expected.value.text  # type: ignore[attr-defined]


@pytest.mark.parametrize("transform", ["json", "xml"])
def test_runner_brings_back_the_whole_refused_text(runner: TransformRunner, transform: str) -> None:
    # Longer than the message quotes, with what the pipe's JSON must carry intact (a lone surrogate, a
    # newline, non-ASCII), and garbage to the parser.
    text = "<<not {json} nor xml>> caf\u00e9 \ud800\n" * 20
    with pytest.raises(TransformError) as info:
        runner.run([{"type": transform}], text)
    assert info.value.text == text and len(text) > 200 and "... (" in str(info.value)
    assert info.value.error_type == "transform_failed"


def test_runner_stops_a_runaway_transform_and_keeps_serving(runner: TransformRunner) -> None:
    killed = runner.killed
    limits = TransformLimits(time_s=0.05, max_output_chars=len(SLOW_JSON))
    with pytest.raises(TransformLimitError) as info:
        runner.run([{"type": "strip"}, {"type": "json"}], SLOW_JSON, limits)
    e = info.value
    assert (e.limit, e.transform_type) == ("time", "json")  # it names the transform that ran over
    assert (
        str(e)
        == "json transform failed: time limit exceeded: still running after 0.05 s; stopped (worker killed)"
    )
    assert runner.killed == killed + 1
    assert runner.run([{"type": "json", "key": "ok"}], '{"ok": true}').data is True  # a fresh worker


def test_runner_replaces_a_worker_that_died_while_idle(runner: TransformRunner) -> None:
    runner.run([{"type": "strip"}], "x")  # a worker is idle now
    (worker,) = runner._idle
    worker.proc.kill()
    worker.proc.wait()
    assert runner.run([{"type": "strip"}], " y ").value == "y"
    assert runner._idle and runner._idle[0] is not worker


def test_closed_runner_refuses_work() -> None:
    r = TransformRunner(workers=1)
    r.close()
    with pytest.raises(RuntimeError, match="closed"):
        r.run([{"type": "strip"}], "x")
