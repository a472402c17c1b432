"""The call IR: steps, prompt rendering (values verbatim, steps continuing each other), prefix hashes, and the
call checks (`validate_call`) that guard it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings, strategies as st
from parrot.protocol import (
    CallError,
    PlaceholderSpec,
    SamplingConfig,
    SubmitCallRequest,
    SubmitCallResponse,
    TransformSpec,
)
from parrot.template import TemplateError
from pydantic import ValidationError

from server.serve.call_checks import validate_call
from server.serve.ir import (
    PREFIX_HASH_HEX_CHARS,
    CallIR,
    Gen,
    MissingValueError,
    TextFill,
    VarFill,
    build_call,
    input_vars,
    prefix_hash,
    prefix_hashes,
    render_prompt,
)


def spec(name: str, role: str = "input", **kw: Any) -> PlaceholderSpec:
    return PlaceholderSpec(name=name, role=role, **kw)  # type: ignore[arg-type]


def call(template: str, *specs: PlaceholderSpec, call_id: str = "c1", **kw: Any) -> CallIR:
    """Build a call whose output variables are named after the outputs: output ``x`` -> ``"v_x"``."""
    request = SubmitCallRequest(template=template, placeholders=list(specs), **kw)
    outputs = {s.name: f"v_{s.name}" for s in specs if s.role == "output"}
    return build_call(request, outputs, call_id=call_id)


# The two semantic functions of Figure 7 in the Parrot paper.
WRITE_CODE = (
    "You are an expert software engineer.\nWrite python code of {{input:task}}.\nCode: {{output:code}}"
)
WRITE_TESTS = (
    "You are an experienced QA engineer.\nYou write test code for {{input:task}}.\n"
    "Code: {{input:code}}.\nYour test code: {{output:test}}"
)

# One template, three steps: text and an input before each output, a tail after the last one.
STEPS = (
    "System: be brief.\nQ: {{input:q}}\nA: {{output:a}}\n"
    "Why {{input:q}}? {{output:why}}\nSource {{input:src}}: {{output:score}}\n(tail {{input:late}})"
)


def steps_call() -> CallIR:
    return call(
        STEPS,
        spec("q", var_id="vq"),
        spec("src", value="a {{literal}} value"),
        spec("late", var_id="vlate"),
        spec("a", "output", sampling=SamplingConfig(max_tokens=8)),
        spec("why", "output", transforms=[TransformSpec(type="strip")]),
        spec("score", "output", transforms=[TransformSpec(type="json", key="s")]),
        func_name="qa",
        criteria="latency",
    )


# ------------------------------------------------------------------------------------------------- steps
def test_figure7_calls() -> None:
    code = call(WRITE_CODE, spec("task", var_id="v_task"), spec("code", "output"))
    assert len(code.steps) == 1 and code.tail == ()
    (step,) = code.steps
    assert step.fills == (
        TextFill("You are an expert software engineer.\nWrite python code of "),
        VarFill("v_task", "task"),
        TextFill(".\nCode: "),
    )
    assert step.gen == Gen("v_code", "code", SamplingConfig())
    tests = call(
        WRITE_TESTS, spec("task", var_id="v_task"), spec("code", var_id="v_code"), spec("test", "output")
    )
    assert input_vars(tests.steps[0]) == ["v_task", "v_code"]  # the dataflow edge write_code -> write_tests
    values = {"v_task": "a snake game", "v_code": "print('snake')"}
    assert render_prompt(tests, 0, values) == (
        "You are an experienced QA engineer.\nYou write test code for a snake game.\n"
        "Code: print('snake').\nYour test code: "
    )


def test_steps_split_at_each_output() -> None:
    c = steps_call()
    assert (c.call_id, c.func_name, c.criteria, c.model) == ("c1", "qa", "latency", None)
    assert c.outputs == {"a": "v_a", "why": "v_why", "score": "v_score"}
    assert [s.index for s in c.steps] == [0, 1, 2]
    assert [s.gen.name for s in c.steps] == ["a", "why", "score"]
    assert c.steps[0].fills == (TextFill("System: be brief.\nQ: "), VarFill("vq", "q"), TextFill("\nA: "))
    assert c.steps[1].fills == (TextFill("\nWhy "), VarFill("vq", "q"), TextFill("? "))
    # A literal input value is text known now, never a variable to wait for; it keeps its name.
    assert c.steps[2].fills == (TextFill("\nSource "), TextFill("a {{literal}} value", "src"), TextFill(": "))
    assert c.tail == (TextFill("\n(tail "), VarFill("vlate", "late"), TextFill(")"))
    assert [input_vars(s) for s in c.steps] == [["vq"], ["vq"], []]
    assert c.input_vars == ["vq", "vlate"]  # every variable named, tail included (all must exist)
    assert c.steps[0].gen.sampling == SamplingConfig(max_tokens=8)
    assert c.steps[1].gen.sampling == SamplingConfig()  # the default when the spec gives none
    assert c.steps[2].gen.transforms == (TransformSpec(type="json", key="s"),)
    assert len(c.segments) == 3 + 1 + 3 + 1 + 3 + 1 + 3


def test_call_ids_default_to_fresh_ones() -> None:
    request = SubmitCallRequest(template="{{output:o}}", placeholders=[spec("o", "output")])
    a, b = (build_call(request, {"o": "v"}) for _ in range(2))
    assert a.call_id != b.call_id and len(a.call_id) == 32


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ({"a": "v1"}, "the outputs are"),
        ({"a": "v1", "b": "v2", "c": "v3"}, "the outputs are"),
        ({"a": "v1", "b": "v1"}, "distinct"),
        ({"a": "v1", "b": ""}, "non-empty"),
    ],
)
def test_output_ids_must_match_the_outputs(outputs: dict[str, str], message: str) -> None:
    request = SubmitCallRequest(
        template="{{output:a}}, {{output:b}}", placeholders=[spec("a", "output"), spec("b", "output")]
    )
    with pytest.raises(ValueError, match=message):
        build_call(request, outputs)


# ------------------------------------------------------------------------------------------------ render
VALUES = {"vq": "What is {{output:x}}?", "v_a": "It is {{{{ braces }}", "v_why": " because\n", "vlate": "zzz"}


def test_values_are_inserted_verbatim() -> None:
    prompt = render_prompt(steps_call(), 0, VALUES)
    assert prompt == "System: be brief.\nQ: What is {{output:x}}?\nA: "


def test_each_step_continues_the_previous_one() -> None:
    c = steps_call()
    prompts = [render_prompt(c, i, VALUES) for i in range(3)]
    for i in range(2):
        output = VALUES[c.steps[i].gen.var_id]
        assert prompts[i + 1].startswith(prompts[i] + output)
    assert prompts[2] == (
        "System: be brief.\nQ: What is {{output:x}}?\nA: It is {{{{ braces }}\n"
        "Why What is {{output:x}}??  because\n\nSource a {{literal}} value: "
    )
    assert "zzz" not in prompts[2]  # the tail never reaches a prompt


def test_rendering_needs_every_value_it_uses() -> None:
    c = steps_call()
    assert render_prompt(c, 0, {"vq": "q"})  # later outputs are not needed yet
    with pytest.raises(
        MissingValueError, match=r"call 'c1', step 0: no value for 'q' \(variable 'vq'\)"
    ) as info:
        render_prompt(c, 0, {})
    assert (info.value.var_id, info.value.name) == ("vq", "q")
    with pytest.raises(MissingValueError, match="no value for 'a'"):
        render_prompt(c, 1, {"vq": "q"})  # step 1 continues step 0's output
    with pytest.raises(IndexError, match="has 3 step"):
        render_prompt(c, 3, VALUES)


# ------------------------------------------------------------------------------------------------ hashes
def test_a_hash_at_every_boundary() -> None:
    c = steps_call()
    prompt = render_prompt(c, 2, VALUES)
    hashes = prefix_hashes(c, 2, VALUES)
    offsets = [o for o, _ in hashes]
    assert offsets == sorted(set(offsets)) and offsets[-1] == len(prompt)
    assert len(hashes) == 3 + 1 + 3 + 1 + 3  # 11 segments before step 2's output, none of them empty
    for offset, digest in hashes:
        assert digest == prefix_hash(prompt[:offset]) and len(digest) == PREFIX_HASH_HEX_CHARS
    # Step 1's boundaries are the first ones of step 2: its prompt is a prefix of step 2's.
    assert prefix_hashes(c, 1, VALUES) == hashes[: len(prefix_hashes(c, 1, VALUES))]


def test_shared_constant_prefix_gives_shared_hashes() -> None:
    system = "You are a helpful assistant. Answer with care.\n"
    template = system + "User: {{input:u}}\nAssistant: {{output:r}}"
    a = call(template, spec("u", var_id="x"), spec("r", "output"), call_id="a")
    b = call(template, spec("u", value="hello"), spec("r", "output"), call_id="b")
    ha = prefix_hashes(a, 0, {"x": "help me"})
    hb = prefix_hashes(b, 0, {})
    assert ha[0] == hb[0] == (len(system + "User: "), prefix_hash(system + "User: "))
    assert all(x[1] != y[1] for x, y in zip(ha[1:], hb[1:], strict=True))  # diverged at the input
    # A function sharing only part of that constant text shares no boundary with it: boundaries sit at
    # placeholders; the engine's token-level fork is what reuses the common part there.
    c = call(
        system + "Summarize: {{input:doc}} -> {{output:s}}", spec("doc", var_id="d"), spec("s", "output")
    )
    hc = prefix_hashes(c, 0, {"d": "text"})
    assert hc[0][0] == len(system + "Summarize: ") and hc[0][1] != ha[0][1]
    assert prefix_hash(system) not in {h for _, h in ha}  # no boundary there in either call


def test_hashes_depend_on_the_text_only() -> None:
    # The same prompt from a constant, a literal value or a variable: same digest at the same offset.
    template_const = "Hi Bob. {{output:o}}"
    by_const = prefix_hashes(call(template_const, spec("o", "output")), 0, {})
    by_value = prefix_hashes(
        call("Hi {{input:n}}. {{output:o}}", spec("n", value="Bob"), spec("o", "output")), 0, {}
    )
    by_var = prefix_hashes(
        call("Hi {{input:n}}. {{output:o}}", spec("n", var_id="vn"), spec("o", "output")), 0, {"vn": "Bob"}
    )
    assert by_const[-1] == by_value[-1] == by_var[-1] == (8, prefix_hash("Hi Bob. "))


def test_empty_values_add_no_boundary_and_odd_text_hashes() -> None:
    c = call("A{{input:x}}B{{output:o}}", spec("x", var_id="vx"), spec("o", "output"))
    assert [o for o, _ in prefix_hashes(c, 0, {"vx": ""})] == [1, 2]
    # A lone surrogate can arrive in JSON; hashing must not crash and must stay split-independent.
    odd = "\ud800 é 🦜"
    assert prefix_hashes(c, 0, {"vx": odd})[-1] == (len("A" + odd + "B"), prefix_hash("A" + odd + "B"))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=5), min_size=1, max_size=5))
def test_hash_of_pieces_equals_hash_of_whole(parts: list[str]) -> None:
    template = "".join(f"{{{{input:p{i}}}}}" for i in range(len(parts))) + " {{output:o}}"
    specs = [spec(f"p{i}", var_id=f"v{i}") for i in range(len(parts))]
    c = call(template, *specs, spec("o", "output"))
    values = {f"v{i}": part for i, part in enumerate(parts)}
    prompt = render_prompt(c, 0, values)
    for offset, digest in prefix_hashes(c, 0, values):
        assert digest == prefix_hash(prompt[:offset])


# ---------------------------------------------------------------------------------------- validate_call
OK_TEMPLATE = "Task: {{input:t}}\nCode: {{output:code}}"


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([spec("t", value="x"), spec("t", value="y"), spec("code", "output")], "'t' has two specs"),
        ([spec("code", "output")], "the template uses 't' but no placeholder spec names them"),
        ([spec("t", value="x")], "the template uses 'code'"),
        (
            [spec("t", value="x"), spec("code", "output"), spec("extra", value="e")],
            r"spec\(s\) 'extra' do not appear in the template: remove them, or add \{\{input:extra\}\}",
        ),
        (
            [spec("t", "output"), spec("code", "output")],
            "'t' is an input in the template but its spec says role 'output'",
        ),
        ([spec("t", value="x"), spec("code")], "'code' is an output in the template"),
        (
            [spec("t"), spec("code", "output")],
            "input 't' needs exactly one of var_id .* or value .*; got neither",
        ),
        ([spec("t", value="x", var_id="v"), spec("code", "output")], "got both"),
        ([spec("t", var_id=""), spec("code", "output")], "empty var_id"),
        (
            [spec("t", value="x", transforms=[TransformSpec(type="strip")]), spec("code", "output")],
            "input 't' has transforms or sampling: those apply to outputs only",
        ),
        ([spec("t", var_id="v", sampling=SamplingConfig()), spec("code", "output")], "outputs only"),
        (
            [spec("t", value="x"), spec("code", "output", value="v")],
            "output 'code' gives a value: the call generates it",
        ),
        (
            [spec("t", value="x"), spec("code", "output", var_id="no spaces")],
            "a variable id is 1-64 characters",
        ),
    ],
)
def test_validate_call_errors(specs: list[PlaceholderSpec], message: str) -> None:
    with pytest.raises(CallError, match=message):
        validate_call(OK_TEMPLATE, specs)
    with pytest.raises(CallError, match=message):  # build_call checks the same way
        build_call(SubmitCallRequest(template=OK_TEMPLATE, placeholders=specs), {"code": "v"})


def test_outputs_may_choose_their_var_ids_but_not_the_same_one() -> None:
    template = "{{input:t}} {{output:a}} {{output:b}}"
    chosen = [spec("t", value="x"), spec("a", "output", var_id="out-a"), spec("b", "output", var_id="out_b")]
    validate_call(template, chosen)
    same = [spec("t", value="x"), spec("a", "output", var_id="v"), spec("b", "output", var_id="v")]
    with pytest.raises(CallError, match="two outputs ask for the same var_id"):
        validate_call(template, same)


def test_validate_call_returns_the_pieces_and_checks_the_template_first() -> None:
    pieces = validate_call(OK_TEMPLATE, [spec("t", value=""), spec("code", "output")])  # an empty value: fine
    assert len(pieces) == 4
    with pytest.raises(TemplateError, match="unknown role"):
        validate_call("{{inptu:t}} {{output:code}}", [])


def test_wire_models() -> None:
    body = {
        "template": OK_TEMPLATE,
        "placeholders": [
            {"name": "t", "role": "input", "var_id": "v1"},
            {
                "name": "code",
                "role": "output",
                "transforms": [{"type": "strip"}],
                "sampling": {"max_tokens": 4},
            },
        ],
        "criteria": "throughput",
    }
    request = SubmitCallRequest.model_validate(body)
    assert request.placeholders[1].sampling == SamplingConfig(max_tokens=4)
    assert SubmitCallRequest.model_validate_json(request.model_dump_json()) == request
    for bad in (
        {**body, "criteria": "fast"},
        {**body, "extra": 1},
        {**body, "placeholders": [{"name": "t", "role": "in"}]},
    ):
        with pytest.raises(ValidationError):
            SubmitCallRequest.model_validate(bad)
    response = SubmitCallResponse(call_id="c", outputs={"code": "v2"})
    assert response.model_dump() == {"call_id": "c", "outputs": {"code": "v2"}}
