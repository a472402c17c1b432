"""LlamaIndex prompts -> Parrot templates (no server): the converted prompt is LlamaIndex's rendering."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_REFINE_PROMPT_SEL,
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
)
from llamaindex_parrot import MissingTemplateVariableError, ParrotLLM
from parrot.template import TemplatePlaceholder, parse_template


def offline_llm(**kwargs: object) -> ParrotLLM:
    # With the model and its window given, the LLM asks the server nothing: a URL nobody serves is fine.
    return ParrotLLM("http://127.0.0.1:9", model="m", context_window=2048, max_tokens=16, **kwargs)


def placeholders(template: str) -> list[tuple[str, str]]:
    return [(p.role, p.name) for p in parse_template(template) if isinstance(p, TemplatePlaceholder)]


@pytest.mark.parametrize(
    ("prompt", "values"),
    [
        (DEFAULT_TEXT_QA_PROMPT_SEL, {"context_str": "The sky is blue.", "query_str": "What color?"}),
        (
            DEFAULT_REFINE_PROMPT_SEL,
            {"query_str": "What color?", "existing_answer": "Blue.", "context_msg": "At dusk it is red."},
        ),
        (DEFAULT_TREE_SUMMARIZE_PROMPT_SEL, {"context_str": "a\n\nb", "query_str": "Summarize."}),
    ],
    ids=["text_qa", "refine", "tree_summarize"],
)
def test_default_prompts_render_as_llamaindex(prompt: PromptTemplate, values: dict[str, str]) -> None:
    llm = offline_llm()
    call = llm.unrendered_call(prompt, values)
    assert not call.rendered
    assert call.prompt_text() == llm._get_prompt(prompt, **values)
    assert placeholders(call.template)[-1] == ("output", call.output)
    assert {name for role, name in placeholders(call.template) if role == "input"} == set(values)
    assert call.inputs == values
    # The constant text is the template's text: no value leaked into it.
    for value in values.values():
        assert value not in call.template


def test_partials_merge_with_call_arguments() -> None:
    llm = offline_llm()
    prompt = PromptTemplate("Tone: {tone}. Context: {context_str}\nQ: {query_str}\nA: ").partial_format(
        tone="terse", query_str="overridden below"
    )
    values = {"context_str": "ctx", "query_str": "Why?"}
    call = llm.unrendered_call(prompt, values)
    assert (
        call.prompt_text() == llm._get_prompt(prompt, **values) == "Tone: terse. Context: ctx\nQ: Why?\nA: "
    )
    assert call.inputs == {"tone": "terse", "context_str": "ctx", "query_str": "Why?"}


def test_braces_in_template_and_values_survive() -> None:
    llm = offline_llm()
    prompt = PromptTemplate('JSON like {"a": {{1}}} then {{{{ and {x} and {y}')
    values = {"x": "{{input:evil}} {x}", "y": "}}{{output:z}}"}
    call = llm.unrendered_call(prompt, values)
    assert call.prompt_text() == llm._get_prompt(prompt, **values)
    assert placeholders(call.template) == [("input", "x"), ("input", "y"), ("output", "answer")]


def test_system_prompt_wrapper_and_mappings() -> None:
    llm = offline_llm(
        system_prompt="Be brief.",
        query_wrapper_prompt=PromptTemplate("[INST] {query_str} [/INST]"),
        completion_to_prompt=lambda text: f"<s>{text}",
    )
    prompt = PromptTemplate("Context {ctx} / question {q}", template_var_mappings={"context_str": "ctx"})
    values = {"context_str": "C", "q": "Q?"}
    call = llm.unrendered_call(prompt, values)
    assert call.prompt_text() == llm._get_prompt(prompt, **values)
    assert call.prompt_text().startswith("[INST] Be brief.\n\n<s>Context C")
    assert not call.rendered


def test_chat_templates_render_through_messages_to_prompt() -> None:
    llm = offline_llm()
    prompt = ChatPromptTemplate(
        [
            ChatMessage(role="system", content="You answer {style}."),
            ChatMessage(role="user", content="{question}"),
        ]
    )
    values = {"style": "briefly", "question": "Why {not}?"}
    call = llm.unrendered_call(prompt, values)
    assert not call.rendered
    assert call.prompt_text() == llm._get_prompt(prompt, **values)
    assert call.prompt_text() == "system: You answer briefly.\nuser: Why {not}?\nassistant: "


def test_names_that_are_not_identifiers_get_safe_placeholders() -> None:
    llm = offline_llm()
    prompt = PromptTemplate("{class} {answer} {a.b}")
    values = {"class": "x", "answer": "y", "a.b": "z"}
    call = llm.unrendered_call(prompt, values)
    assert call.prompt_text() == "x y z"
    names = [name for role, name in placeholders(call.template) if role == "input"]
    assert names == ["class_", "answer", "a_b"]
    assert call.output not in names


def test_a_value_computed_by_a_function_mapping_is_sent_rendered() -> None:
    llm = offline_llm()
    prompt = PromptTemplate("Shout: {loud}", function_mappings={"loud": lambda **kw: kw["text"].upper()})
    call = llm.unrendered_call(prompt, {"text": "hello"})
    assert call.rendered and call.prompt_text() == llm._get_prompt(prompt, text="hello") == "Shout: HELLO"


def test_missing_variable_is_named() -> None:
    llm = offline_llm()
    with pytest.raises(MissingTemplateVariableError) as err:
        llm.unrendered_call(DEFAULT_TEXT_QA_PROMPT_SEL, {"context_str": "ctx"})
    assert err.value.missing == ["query_str"]
    assert "'query_str'" in str(err.value) and "partial_format" in str(err.value)
    assert isinstance(err.value, KeyError)
