"""Prompts as unrendered templates: the text the server renders equals LangChain's, byte for byte.

Each case builds the semantic call a compiled chain would send for a prompt, fills its placeholders as the
server does (a variable's value verbatim, a structured value as ``str()``), and compares the result with
LangChain rendering the same prompt on the same values — for values the server produces (`Pending`) and
for values known at submit time.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder, PromptTemplate
from langchain_parrot import (
    TINY_MODEL_DIR,
    ChatFormat,
    ChatParrot,
    MissingVariableError,
    ParrotLLM,
    UnsupportedInputError,
)
from langchain_parrot.messages import to_wire_messages
from langchain_parrot.parsers import OutputPlan, plan_output
from langchain_parrot.prompts import NotExpressibleError, plain_variables, render_prompt
from langchain_parrot.steps import ModelStep
from langchain_parrot.submission import Submission
from langchain_parrot.values import Pending, PendingCall
from parrot.protocol import SamplingConfig
from parrot.template import TemplatePlaceholder, TemplateText, parse_template

from server.serve.transforms import render_value

# Values chosen to break naive rendering: template syntax of every kind, HTML, markers' own characters.
NASTY = 'a {{input:x}} }} {{{{ {x} <b>&amp;"</b> \ue000 \n\ttabs '


def producer(kind: str) -> Pending:
    """A pending output of an earlier step, of the given kind."""
    call = PendingCall(
        name="earlier",
        template="{{output:out}}",
        output="out",
        inputs={},
        sampling=SamplingConfig(),
        model=None,
        plan=OutputPlan(kind=kind),  # type: ignore[arg-type]
    )
    return Pending(call=call)


def build_call(prompt: Any, values: Any, chat_format: ChatFormat | None) -> PendingCall:
    model = (
        ChatParrot(base_url="http://parrot.invalid", max_tokens=8)
        if chat_format
        else ParrotLLM(base_url="http://parrot.invalid", max_tokens=8)
    )
    step = ModelStep(
        label="t",
        prompt=prompt,
        model=model,
        kwargs={},
        plan=plan_output([], chat=chat_format is not None),
        chat_format=chat_format,
    )
    program = step.run(values, Submission(None))
    with pytest.raises(StopIteration) as done:  # rendered without waiting for any value
        next(program)
    pending = done.value.value
    assert isinstance(pending, Pending) and pending.call is not None
    return pending.call


def server_render(call: PendingCall, produced: dict[int, tuple[str, str]]) -> str:
    """The prompt the server renders for ``call``: values by the producer's id, as (stored value, kind)."""
    text = []
    pieces = parse_template(call.template)
    assert isinstance(pieces[-1], TemplatePlaceholder) and pieces[-1].role == "output"
    for piece in pieces[:-1]:
        if isinstance(piece, TemplateText):
            text.append(piece.text)
            continue
        source = call.inputs[piece.name]
        text.append(source if isinstance(source, str) else render_value(*produced[id(source.call)]))
    return "".join(text)


def langchain_render(prompt: Any, values: dict[str, Any], chat_format: ChatFormat | None) -> str:
    rendered = prompt.invoke(values)
    if chat_format is None:
        return rendered.to_string()
    return chat_format.template_text(to_wire_messages(rendered.to_messages()))


def check(
    prompt: Any, concrete: dict[str, Any], pending: dict[str, str], chat_format: ChatFormat | None
) -> PendingCall:
    """Compile ``prompt`` with the ``pending`` variables produced server-side; compare the renderings.

    ``pending`` maps a variable to its kind; its value is ``concrete[name]``.
    """
    produced: dict[int, tuple[str, str]] = {}
    values = dict(concrete)
    for name, kind in pending.items():
        p = producer(kind)
        stored = concrete[name] if kind == "text" else json.dumps(concrete[name])
        produced[id(p.call)] = (stored, kind)
        values[name] = p
    call = build_call(prompt, values, chat_format)
    assert server_render(call, produced) == langchain_render(prompt, concrete, chat_format)
    return call


@pytest.mark.parametrize(
    ("template", "fmt", "plain"),
    [
        ("{a} {b:>5} {c!r} {d!s} {a}", "f-string", {"a", "d"}),
        ("{{{a}}} {{&b}} {{c}} {{#d}}{{e}}{{/d}} {{f.g}}", "mustache", {"a", "b"}),
        (
            "{{ a }} {{ b|upper }} {% if c %}{{ a }}{% endif %} {{ d.e }}"
            " {% for x in f %}{{ x }}{% endfor %}",
            "jinja2",
            {"a"},
        ),
    ],
)
def test_plain_variables(template: str, fmt: str, plain: set[str]) -> None:
    assert plain_variables(PromptTemplate.from_template(template, template_format=fmt)) == plain


def test_fstring_prompt_with_pending_and_literal_values() -> None:
    prompt = PromptTemplate.from_template("Context:\n{context}\nQ: {question} {{literal}} {n} {d}\nA:")
    concrete = {"context": NASTY, "question": "why {{input:x}}?", "n": 3, "d": {"k": ["{{", "v"]}}
    call = check(prompt, concrete, {"context": "text"}, None)
    # The constant text and the str values are placeholders (a shared prefix); other values are baked in.
    assert call.template.startswith("Context:\n{{input:context}}\nQ: {{input:question}}")
    assert call.inputs["question"] == "why {{input:x}}?"


def test_structured_values_render_as_str_of_the_python_value() -> None:
    prompt = PromptTemplate.from_template("Items: {items}\nMeta: {meta}")
    concrete = {"items": ["a", "b's", 'c"d', 1.5, None], "meta": {"nested": {"x": [True, 2]}}}
    check(prompt, concrete, {"items": "json", "meta": "json"}, None)


def test_mustache_and_jinja2_prompts() -> None:
    mustache = PromptTemplate.from_template("M {{{a}}} then {{b}} and {{&c}}", template_format="mustache")
    call = check(mustache, {"a": NASTY, "b": NASTY, "c": "plain"}, {"a": "text", "c": "text"}, None)
    assert "{{input:b}}" not in call.template  # HTML-escaped by LangChain: baked in, escaped
    jinja = PromptTemplate.from_template("J {{ a }} {{ b | upper }}!", template_format="jinja2")
    check(jinja, {"a": NASTY, "b": "loud"}, {"a": "text"}, None)


def test_chat_prompt_through_the_chat_template(chat_format: ChatFormat) -> None:
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "You are a careful {role}. Use {{braces}}."),
            MessagesPlaceholder("history"),
            ("human", [{"type": "text", "text": "Summarize: {text}"}, {"type": "text", "text": " ({lang})"}]),
            ("ai", "Sure."),
            ("human", "{followup}"),
        ]
    )
    concrete = {
        "role": "editor",
        "history": [HumanMessage("earlier question"), AIMessage("earlier answer")],
        "text": NASTY,
        "lang": "en",
        "followup": "and {{output:x}} then",
    }
    call = check(prompt, concrete, {"text": "text"}, chat_format)
    # System messages are constant text at the start: the shared prefix of every call of this prompt.
    first = parse_template(call.template)[0]
    assert isinstance(first, TemplateText) and first.text.startswith("<|system|>\nYou are a careful ")


def test_chat_prompt_for_a_completion_model() -> None:
    prompt = ChatPromptTemplate.from_messages([("system", "S {a}"), ("human", "H {b}")])
    check(prompt, {"a": "x", "b": NASTY}, {"b": "text"}, None)  # LangChain's "System: ...\nHuman: ..."


def test_partial_variables() -> None:
    prompt = PromptTemplate.from_template("{greeting}, {name}! Today is {day}.").partial(
        greeting="Hello", day=lambda: "Monday"
    )
    check(prompt, {"name": NASTY}, {"name": "text"}, None)


def test_a_missing_variable_is_named() -> None:
    prompt = PromptTemplate.from_template("{a} and {b} and {c}")
    with pytest.raises(MissingVariableError) as info:
        build_call(prompt, {"a": "x"}, None)
    assert (
        info.value.variables == ["b", "c"]
        and "'b', 'c'" in str(info.value)
        and "received: 'a'" in str(info.value)
    )
    assert isinstance(info.value, KeyError)  # what LangChain raises for the same mistake


def test_a_non_dict_input_needs_a_one_variable_prompt() -> None:
    call = build_call(PromptTemplate.from_template("On {topic}:"), "parrots", None)
    assert call.template == "On {{input:topic}}:{{output:output}}" and call.inputs == {"topic": "parrots"}
    with pytest.raises(TypeError, match="expects a dict"):
        build_call(PromptTemplate.from_template("{a} {b}"), "parrots", None)


def test_markers_only_where_the_value_is_inserted_plainly() -> None:
    with pytest.raises(NotExpressibleError, match="formatted with '>5'"):
        render_prompt(PromptTemplate.from_template("{a:>5}"), {}, {"a": "x"}, None)
    rendered = render_prompt(PromptTemplate.from_template("<{a}|{a}>"), {}, {"a": "x"}, None)
    assert rendered.pieces == ["<", 0, "|", 0, ">"] and rendered.items == ["x"]


def test_a_chat_template_that_rewrites_contents_keeps_values_on_the_client() -> None:
    stripping = ChatFormat(
        lambda messages: "".join(f"[{m['role']}]{m['content'].strip()}" for m in messages),
        bos_token=None,
        adds_bos=False,
    )
    assert not stripping.transparent
    prompt = ChatPromptTemplate.from_messages([("human", "{a}")])
    with pytest.raises(NotExpressibleError):
        render_prompt(prompt, {}, {"a": "x"}, stripping)
    # Values known at submit time are simply rendered by LangChain and the chat template.
    call = build_call(prompt, {"a": "  padded  "}, stripping)
    assert call.template == "[user]padded{{output:output}}" and call.inputs == {}


def test_chat_format_drops_the_bos_the_manager_adds_back(chat_format: ChatFormat) -> None:
    text = chat_format.render([{"role": "user", "content": "hi"}])
    assert chat_format.adds_bos and text.startswith(chat_format.bos_token or "\0")
    assert (
        chat_format.template_text([{"role": "user", "content": "hi"}])
        == text[len(chat_format.bos_token or "") :]
    )
    broken = ChatFormat(lambda messages: "no bos here", bos_token="<s>", adds_bos=True)
    with pytest.raises(UnsupportedInputError, match="does not start with it"):
        broken.template_text([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi é {x} \n"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "One?"},
            {"role": "assistant", "content": "Two."},
            {"role": "user", "content": "Three?"},
        ],
    ],
)
def test_the_servers_model_card_renders_as_the_tokenizer(messages: list[dict[str, str]]) -> None:
    """`ChatFormat.from_card` (Jinja over the published template) equals `transformers`' own rendering, for
    the tiny model's template and for SmolLM2's (a system prompt added when there is none)."""
    from transformers import AutoTokenizer

    from server.engine import LLMEngine
    from server.http.openai_api import model_card

    engine = LLMEngine.from_pretrained("tiny")
    try:
        card = model_card("tiny", engine, 0).model_dump()
    finally:
        engine.shutdown()
    from_card, from_tok = ChatFormat.from_card(card), ChatFormat.from_tokenizer(engine.tokenizer)
    assert from_card is not None
    assert from_card.render(messages) == from_tok.render(messages)
    assert (from_card.bos_token, from_card.adds_bos) == (from_tok.bos_token, from_tok.adds_bos)
    smol = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR), local_files_only=True)
    smol.chat_template = SMOLLM2_TEMPLATE
    smol_card = {**card, "chat_template": SMOLLM2_TEMPLATE}
    assert ChatFormat.from_card(smol_card).render(messages) == ChatFormat.from_tokenizer(smol).render(
        messages
    )


def test_a_card_without_a_template_gives_no_format() -> None:
    assert ChatFormat.from_card({"id": "m", "chat_template": None}) is None


# SmolLM2-135M-Instruct's chat template, as its GGUF carries it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
