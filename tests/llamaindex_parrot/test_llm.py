"""`ParrotLLM` on the embedded server: unrendered predict with LlamaIndex's exact rendering, the OpenAI-path
methods, truly async versions, and clear errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import parrot as P
import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.output_parsers.pydantic import PydanticOutputParser
from llama_index.core.program.llm_program import LLMTextCompletionProgram
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_REFINE_PROMPT_SEL,
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
)
from llamaindex_parrot import MissingTemplateVariableError, ParrotLLM
from pydantic import BaseModel

from server.launcher import LaunchedServer
from tests.llamaindex_parrot.conftest import BATCH, CALLS, Prompts, Traffic, while_ticking

QA = {"context_str": "The sky is blue at noon.", "query_str": "What color is the sky?"}
CASES = [
    (DEFAULT_TEXT_QA_PROMPT_SEL, QA),
    (
        DEFAULT_REFINE_PROMPT_SEL,
        {"query_str": "Color?", "existing_answer": "Blue", "context_msg": "Red at dusk."},
    ),
    (DEFAULT_TREE_SUMMARIZE_PROMPT_SEL, {"context_str": "One.\n\nTwo.", "query_str": "Summarize."}),
    (
        PromptTemplate("[{tone}] {context_str}\nQ: {query_str}\nA: ").partial_format(tone="terse"),
        {"context_str": "{braces} stay", "query_str": "Why?"},
    ),
]
IDS = ["text_qa", "refine", "tree_summarize", "custom_with_partial"]


def test_metadata_comes_from_the_server(served: LaunchedServer, llm: ParrotLLM) -> None:
    engine = served.engines[0]
    meta = llm.metadata
    assert meta.context_window == engine.max_model_len
    assert meta.model_name == engine.model_name
    assert meta.num_output == llm.max_tokens == 8
    assert not meta.is_chat_model


@pytest.mark.parametrize(("prompt", "values"), CASES, ids=IDS)
def test_predict_sends_llamaindex_rendering_unrendered(
    llm: ParrotLLM, prompts: Prompts, traffic: Traffic, prompt: PromptTemplate, values: dict[str, str]
) -> None:
    answer = llm.predict(prompt, **values)
    counts = traffic.take()
    assert prompts.semantic == [llm._get_prompt(prompt, **values)]  # what the server rendered
    assert not prompts.completions
    assert counts[CALLS] + counts[BATCH] == 1
    # The same text through /v1/completions (client-side rendering) gives the same greedy answer.
    rendered = llm.model_copy(update={"unrendered": False})
    assert rendered.predict(prompt, **values) == answer
    assert prompts.completions == prompts.semantic


async def test_apredict_equals_predict(llm: ParrotLLM, prompts: Prompts) -> None:
    expected = await asyncio.to_thread(llm.predict, DEFAULT_TEXT_QA_PROMPT_SEL, **QA)
    assert await llm.apredict(DEFAULT_TEXT_QA_PROMPT_SEL, **QA) == expected
    assert prompts.semantic[0] == prompts.semantic[1]


async def test_stream_yields_the_answer(llm: ParrotLLM) -> None:
    expected = await llm.apredict(DEFAULT_TEXT_QA_PROMPT_SEL, **QA)
    chunks = await asyncio.to_thread(lambda: list(llm.stream(DEFAULT_TEXT_QA_PROMPT_SEL, **QA)))
    assert len(chunks) > 1 and "".join(chunks) == expected  # token by token, as the server writes it
    achunks = [t async for t in await llm.astream(DEFAULT_TEXT_QA_PROMPT_SEL, **QA)]
    assert len(achunks) > 1 and "".join(achunks) == expected


def test_a_stream_made_here_and_read_on_another_thread_closes_its_session(
    llm: ParrotLLM, served: LaunchedServer
) -> None:
    """Its session is never the current one of any reader's context, so reading it on one thread and
    stopping it on another (as a web framework's thread pool may) still deletes it on the server."""
    before = len(served.manager.sessions)
    chunks = llm.stream(DEFAULT_TEXT_QA_PROMPT_SEL, **QA)
    with pytest.raises(RuntimeError, match="no active Parrot session"):
        P.current_session()
    with ThreadPoolExecutor(1) as reader, ThreadPoolExecutor(1) as closer:
        assert reader.submit(next, chunks).result()
        closer.submit(chunks.close).result()  # another thread: another context
    assert len(served.manager.sessions) == before


def test_complete_and_chat_streams_match(llm: ParrotLLM, prompts: Prompts) -> None:
    done = llm.complete("Once upon a time")
    assert done.text and done.raw["usage"]["completion_tokens"] == 8
    streamed = list(llm.stream_complete("Once upon a time"))
    assert streamed[-1].text == done.text == "".join(c.delta or "" for c in streamed)
    assert prompts.completions == ["Once upon a time"] * 2
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hi!")]
    said = llm.chat(messages)
    assert said.message.role == "assistant" and said.message.content
    assert list(llm.stream_chat(messages))[-1].message.content == said.message.content


async def test_async_methods_match_and_do_not_block_the_loop(llm: ParrotLLM) -> None:
    messages = [ChatMessage(role="user", content="Hi!")]
    expected = {
        "complete": llm.complete("Once upon a time").text,
        "chat": llm.chat(messages).message.content,
        "predict": llm.predict(DEFAULT_TEXT_QA_PROMPT_SEL, **QA),
    }

    async def stream_text(gen: Awaitable[Any]) -> str:
        return [c async for c in await gen][-1].text

    async def stream_chat() -> str | None:
        return [c async for c in await llm.astream_chat(messages)][-1].message.content

    runs: dict[str, Callable[[], Awaitable[Any]]] = {
        "complete": lambda: llm.acomplete("Once upon a time"),
        "complete_stream": lambda: stream_text(llm.astream_complete("Once upon a time")),
        "chat": lambda: llm.achat(messages),
        "chat_stream": stream_chat,
        "predict": lambda: llm.apredict(DEFAULT_TEXT_QA_PROMPT_SEL, **QA),
    }
    for name, run in runs.items():
        result, ticks, took = await while_ticking(run)
        # The loop kept running while the request was in flight (a blocking call would freeze the ticker).
        assert ticks >= min(3, took / 0.02), (name, ticks, took)
        text = result if isinstance(result, str) else getattr(result, "text", None) or result.message.content
        assert text == expected[name.removesuffix("_stream")], name


class Person(BaseModel):
    name: str
    age: int


def test_structured_predict_renders_like_llamaindex_and_parses_like_it(
    llm: ParrotLLM, prompts: Prompts
) -> None:
    prompt = PromptTemplate("Extract the person from: {text}")
    with pytest.raises(ValueError) as ours:
        llm.structured_predict(Person, prompt, text="Ada, 36")
    program = LLMTextCompletionProgram.from_defaults(
        output_parser=PydanticOutputParser(output_cls=Person), prompt=PromptTemplate(prompt.template), llm=llm
    )
    expected = llm.completion_to_prompt(program.prompt.format(llm=llm, text="Ada, 36"))
    assert prompts.semantic == [expected] and "Person" in expected  # the format instructions are there
    # LlamaIndex's own path (rendered, through complete) sends the same text and fails the same way on the
    # tiny model's gibberish.
    with pytest.raises(ValueError) as theirs:
        llm.model_copy(update={"unrendered": False}).structured_predict(Person, prompt, text="Ada, 36")
    assert prompts.completions == [expected]
    assert str(ours.value) == str(theirs.value)


async def test_astructured_predict_parses_a_json_answer(llm: ParrotLLM, prompts: Prompts) -> None:
    prompt = PromptTemplate('Answer with JSON. {text} {{"name": "Ada", "age": 36}}')
    with pytest.raises(ValueError, match="json"):
        await llm.astructured_predict(Person, prompt, text="Who?", llm_kwargs={"max_tokens": 2})
    assert len(prompts.semantic) == 1


def test_missing_variable_sends_nothing(llm: ParrotLLM, traffic: Traffic) -> None:
    assert llm.metadata.context_window  # the model card, read once on first use (LlamaIndex reads it)
    traffic.take()
    with pytest.raises(MissingTemplateVariableError, match="query_str"):
        llm.predict(DEFAULT_TEXT_QA_PROMPT_SEL, context_str="only the context")
    assert not traffic.take()


def test_unknown_sampling_option_is_refused(llm: ParrotLLM) -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        llm.complete("x", max_new_tokens=3)


def test_unreachable_server_is_named_quickly(dead_url: str) -> None:
    started = time.perf_counter()
    lazy = ParrotLLM(dead_url)  # constructing asks the server nothing
    with pytest.raises(P.ConnectionError, match=dead_url):
        lazy.metadata  # noqa: B018 - the first use asks for the model card
    offline = ParrotLLM(dead_url, model="tiny", context_window=512)  # never needs to ask
    assert offline.metadata.context_window == 512
    with pytest.raises(P.ConnectionError, match=dead_url):
        offline.predict(DEFAULT_TEXT_QA_PROMPT_SEL, **QA)
    with pytest.raises(P.ConnectionError, match=dead_url):
        offline.complete("x")
    assert time.perf_counter() - started < 10


def test_unknown_model_and_oversized_window_are_refused_on_first_use(served: LaunchedServer) -> None:
    with pytest.raises(ValueError, match=r"does not serve model 'gpt-4'.*'tiny'"):
        ParrotLLM(served.url, model="gpt-4").metadata  # noqa: B018 - the first use asks the server
    with pytest.raises(ValueError, match="context_window=9000 is over the 4096 tokens"):
        ParrotLLM(served.url, context_window=9000).prompt_helper()
    assert ParrotLLM(served.url, context_window=1000).metadata.model_name == "tiny"


def test_a_prompt_over_the_window_fails_with_the_servers_reason(llm: ParrotLLM) -> None:
    huge = {"context_str": "word " * 6000, "query_str": "?"}
    # The server's explanation comes through (its wording is the server's; it names the 4096-token window).
    with pytest.raises(P.VariableFailedError, match="4096"):
        llm.predict(DEFAULT_TEXT_QA_PROMPT_SEL, **huge)
