"""The template grammar of the wire protocol: good templates, every error with its message and place, the
brace escape, and round trips (parse -> render gives the template back)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st
from parrot.template import (
    ROLES,
    TemplateError,
    TemplatePiece,
    TemplatePlaceholder,
    TemplateText,
    escape_text,
    parse_template,
    placeholder_names,
    render_template,
)


def inp(name: str) -> TemplatePlaceholder:
    return TemplatePlaceholder("input", name)


def out(name: str) -> TemplatePlaceholder:
    return TemplatePlaceholder("output", name)


def text(s: str) -> TemplateText:
    return TemplateText(s)


# ------------------------------------------------------------------------------------------ good templates
WRITE_TESTS = """You are an experienced QA engineer.
    You write test code for {{input:task}}.
    Code: {{input:code}}.
    Your test code: {{output:test}}
"""


def test_figure7_docstring() -> None:
    pieces = parse_template(WRITE_TESTS)
    assert pieces == [
        text("You are an experienced QA engineer.\n    You write test code for "),
        inp("task"),
        text(".\n    Code: "),
        inp("code"),
        text(".\n    Your test code: "),
        out("test"),
        text("\n"),
    ]
    assert placeholder_names(pieces, "input") == ["task", "code"]
    assert placeholder_names(pieces, "output") == ["test"]
    assert render_template(pieces) == WRITE_TESTS


def test_several_outputs_and_repeated_input() -> None:
    template = "Q: {{input:q}}\nA: {{output:a}}\nWhy ({{input:q}}): {{output:why}}\nConfidence: {{output:c}}"
    pieces = parse_template(template)
    assert placeholder_names(pieces, "output") == ["a", "why", "c"]
    assert placeholder_names(pieces, "input") == ["q"]  # distinct names, first appearance
    assert [p for p in pieces if isinstance(p, TemplatePlaceholder)] == [
        inp("q"),
        out("a"),
        inp("q"),
        out("why"),
        out("c"),
    ]


def test_positions_are_source_offsets() -> None:
    template = "ab {{ input : x }}\n{{output:y}}!"
    pieces = parse_template(template)
    assert [template[p.start : p.end] for p in pieces] == [
        "ab ",
        "{{ input : x }}",
        "\n",
        "{{output:y}}",
        "!",
    ]


@pytest.mark.parametrize(
    "template",
    ["{{ input:x }}{{output:y}}", "{{input : x}}{{output:y}}", "{{\tinput:\tx\t}}{{output:y}}"],
)
def test_spaces_and_tabs_inside_braces_are_tolerated(template: str) -> None:
    assert parse_template(template) == [inp("x"), out("y")]


def test_placeholders_may_touch_unless_both_are_outputs() -> None:
    assert parse_template("{{input:a}}{{input:b}}{{output:c}}{{input:a}}") == [
        inp("a"),
        inp("b"),
        out("c"),
        inp("a"),
    ]
    assert parse_template("{{output:o}}") == [out("o")]  # an empty prompt is the engine's business
    assert parse_template("{{output:a}} {{output:b}}") == [out("a"), text(" "), out("b")]


def test_names_are_python_identifiers() -> None:
    assert placeholder_names(parse_template("{{input:_x9}} {{input:café}} {{output:Ünïcode}}"), "input") == [
        "_x9",
        "café",
    ]


# --------------------------------------------------------------------------------------------- braces
@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{{{ jinja }} {{output:y}}", [text("{{ jinja }} "), out("y")]),  # the escape
        ("{{{{{{{{{{output:y}}", [text("{{{{"), out("y")]),
        ('{"a": {"b": 1}} {{output:y}}', [text('{"a": {"b": 1}} '), out("y")]),  # single { and }} are text
        ("}} {{output:y}} }}", [text("}} "), out("y"), text(" }}")]),
        ("{{{input:x}}} {{output:y}}", [text("{"), inp("x"), text("} "), out("y")]),  # { before a placeholder
        ("{{{{{{{input:x}}{{output:y}}", [text("{{{"), inp("x"), out("y")]),  # 7 = escape, {, opener
        ("{{{{{input:x}} {{output:y}}", [text("{{{input:x}} "), out("y")]),  # 5 = escape + lone {: text
        ("{{{{{{input:x}} {{output:y}}", [text("{{"), inp("x"), text(" "), out("y")]),  # 6 = escape + opener
        ("{{output:y}}{{{{", [out("y"), text("{{")]),
        ("{{output:y}}{{{{{", [out("y"), text("{{{")]),
    ],
)
def test_brace_rules(template: str, expected: list[TemplatePiece]) -> None:
    assert parse_template(template) == expected
    assert render_template(expected) == template


def test_escape_text() -> None:
    assert escape_text("a {{b}} {c} }}") == "a {{{{b}} {c} }}"
    assert parse_template(escape_text("{{input:x}} is literal") + "{{output:y}}") == [
        text("{{input:x}} is literal"),
        out("y"),
    ]


# -------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("template", "line", "column", "message"),
    [
        ("Task: {{input:task\nCode: {{output:code}}", 1, 7, "unclosed '{{'"),
        ("Task: {{input:task", 1, 7, "or write '{{{{' for a literal '{{'"),
        ("a {{input:x {{output:y}}", 1, 3, "unclosed '{{'"),
        (
            "x\n  {{inptu:task}} {{output:y}}",
            2,
            3,
            "unknown role 'inptu' in '{{inptu:task}}': the role is "
            "'input' or 'output' (did you mean 'input'?)",
        ),
        ("{{Output:y}}", 1, 1, "did you mean 'output'?"),
        (
            "{{zzz:y}} {{output:z}}",
            1,
            1,
            "unknown role 'zzz' in '{{zzz:y}}': the role is 'input' or 'output'",
        ),
        ("{{task}} {{output:y}}", 1, 1, "'{{task}}' has no role: write {{input:task}} or {{output:task}}"),
        ("{{}} {{output:y}}", 1, 1, "has no role: placeholders are {{input:NAME}} or {{output:NAME}}"),
        ("{{input:}} {{output:y}}", 1, 1, "'{{input:}}' has an empty name: write {{input:NAME}}"),
        ("{{output: }}", 1, 1, "empty name: write {{output:NAME}}"),
        (
            "{{input:my-var}} {{output:y}}",
            1,
            1,
            "name 'my-var' in '{{input:my-var}}' is not a Python identifier",
        ),
        ("{{input:1st}} {{output:y}}", 1, 1, "not a Python identifier"),
        ("{{input:a b}} {{output:y}}", 1, 1, "not a Python identifier"),
        (
            "Code: {{output:code}}{{output:test}}",
            1,
            22,
            "outputs 'code' and 'test' are adjacent: put constant "
            "text between them so that 'code' has a boundary where it ends",
        ),
        ("A: {{output:a}}\nB: {{output:a}}", 2, 4, "output 'a' appears twice (first at line 1, column 4)"),
        (
            "{{input:x}} then\n{{output:x}}",
            2,
            1,
            "'x' is used as both input (at line 1, column 1) and output",
        ),
        ("{{output:x}}.\n{{input:x}}", 2, 1, "'x' is used as both output (at line 1, column 1) and input"),
    ],
)
def test_errors_say_what_and_where(template: str, line: int, column: int, message: str) -> None:
    with pytest.raises(TemplateError) as info:
        parse_template(template)
    err = info.value
    assert message in str(err)
    assert (err.line, err.column) == (line, column)
    assert err.offset is not None and str(err).startswith(f"template, line {line}, column {column} (offset ")
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    "template", ["", "plain text", "{{input:x}} only inputs", "{{{{output:y}} is escaped"]
)
def test_a_template_needs_an_output(template: str) -> None:
    with pytest.raises(TemplateError, match=r"no \{\{output:NAME\}\} placeholder") as info:
        parse_template(template)
    assert info.value.offset is None and info.value.line is None


def test_the_first_error_in_the_text_is_reported() -> None:
    with pytest.raises(TemplateError) as info:
        parse_template("{{output:a}}{{output:b}} {{inptu:c}}")
    assert "adjacent" in str(info.value)


# ------------------------------------------------------------------------------------------------ property
_texts = st.text(alphabet=st.sampled_from("ab {}:\n\té"), max_size=8)


@st.composite
def valid_pieces(draw: st.DrawFn) -> list[TemplatePiece]:
    """Pieces of a valid template: >= 1 output, unique outputs, text between outputs, inputs may repeat."""
    roles = draw(st.lists(st.sampled_from(ROLES), min_size=1, max_size=6))
    if "output" not in roles:
        roles[draw(st.integers(0, len(roles) - 1))] = "output"
    pieces: list[TemplatePiece] = []
    n_outputs = 0
    for role in roles:
        before = draw(_texts)
        if not before and pieces and role == "output" == getattr(pieces[-1], "role", None):
            before = " "
        if before:
            pieces.append(TemplateText(before))
        if role == "input":
            pieces.append(inp(draw(st.sampled_from(["a", "b", "task", "café"]))))
        else:
            pieces.append(out(f"out{n_outputs}"))
            n_outputs += 1
    if after := draw(_texts):
        pieces.append(TemplateText(after))
    return pieces


@settings(max_examples=200, deadline=None)
@given(valid_pieces())
def test_render_then_parse_round_trips(pieces: list[TemplatePiece]) -> None:
    template = render_template(pieces)
    parsed = parse_template(template)
    assert parsed == pieces
    assert render_template(parsed) == template
    # Offsets cover the source exactly, piece after piece.
    assert [(p.start, p.end) for p in parsed] == list(
        zip([0] + [p.end for p in parsed[:-1]], [p.end for p in parsed], strict=True)
    )
    assert parsed[-1].end == len(template)


# Brace-heavy fragments so that random text often holds placeholders, escapes and near misses.
_fragments = st.sampled_from(
    ["{", "}", "{{", "}}", "input", "output", ":", " ", "\n", "x", "y", "-", "{{output:o}}", "{{input:i}}"]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_fragments, max_size=14).map("".join))
def test_any_text_parses_or_raises_template_error(template: str) -> None:
    try:
        parsed = parse_template(template)
    except TemplateError:
        return
    assert parse_template(render_template(parsed)) == parsed
    canonical = all(
        template[p.start : p.end] == f"{{{{{p.role}:{p.name}}}}}"
        for p in parsed
        if isinstance(p, TemplatePlaceholder)
    )
    if canonical:  # written without spaces inside braces: rendering gives back the very same template
        assert render_template(parsed) == template


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("{}ab\n"), max_size=12), st.text(max_size=6))
def test_escaped_text_is_literal_anywhere(literal: str, other: str) -> None:
    template = "{{input:i}}" + escape_text(literal) + "{{output:o}}" + escape_text(other)
    expected = [inp("i"), *([text(literal)] if literal else []), out("o"), *([text(other)] if other else [])]
    assert parse_template(template) == expected


_HEAVY = ("torch", "transformers", "server", "langchain", "langchain_core", "llama_index")


@pytest.mark.parametrize(
    ("code", "forbidden"),
    [
        # The wire schema (what the server imports): pydantic and the standard library only.
        ("import parrot.protocol", (*_HEAVY, "httpx")),
        # The whole client API, every export loaded: httpx + pydantic, never the server side.
        ("import parrot as P; [getattr(P, name) for name in P.__all__]", _HEAVY),
    ],
)
def test_client_imports_stay_light(code: str, forbidden: tuple[str, ...]) -> None:
    check = f"import sys; {code}; bad = [m for m in {forbidden!r} if m in sys.modules]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", check], check=True)
