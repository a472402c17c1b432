"""Structured outputs end to end, on a scripted engine (the tiny model's text is random, never JSON).

`ScriptedEngine` has the interface the manager drives (tokenizer, fill, generate, free_context, stats) and
answers each prompt from a script, so the real manager and app run real JSON/XML/pydantic transforms on
model outputs. It lives in the tests only. `server.launch` builds its engines from a model name, so the
app around the scripted engines is served here with uvicorn directly (`serve_scripted`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from operator import itemgetter
from typing import Any

import parrot as P
import pytest
import uvicorn
from fastapi import FastAPI
from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import (
    JsonOutputParser,
    PydanticOutputParser,
    StrOutputParser,
    XMLOutputParser,
)
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePick
from langchain_parrot import (
    TINY_MODEL_DIR,
    ChatFormat,
    ChatParrot,
    ClientSideStepWarning,
    ServerParserError,
    compile_chain,
)
from langchain_parrot.errors import server_parser_error
from langchain_parrot.messages import to_wire_messages
from pydantic import BaseModel
from transformers import AutoTokenizer

from server.engine.interface import Engine
from server.engine.request import GenerateResult
from server.engine.wire import EngineStats
from server.http.app import create_app
from server.serve.manager import Manager


class _Answer:
    """A finished generation behind the engine's stream interface (token ids, then ``result()``)."""

    def __init__(self, result: GenerateResult) -> None:
        self._result = result
        self._tokens = iter(result.token_ids)

    def __aiter__(self) -> _Answer:
        return self

    async def __anext__(self) -> int:
        try:
            return next(self._tokens)
        except StopIteration:
            raise StopAsyncIteration from None

    async def result(self) -> GenerateResult:
        return self._result

    def cancel(self) -> None:
        pass


class ScriptedEngine(Engine):
    """Answers ``script(prompt_text)``; records every prompt it generated from (as text)."""

    model_name = "scripted"
    block_size = 16
    max_model_len = 4096

    def __init__(self, script: Callable[[str], str]) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL_DIR))
        self.script = script
        self.contexts: dict[int, list[int]] = {}
        self.prompts: list[str] = []

    async def fill(
        self,
        context_id: int,
        token_ids: list[int],
        parent_context_id: int | None = None,
        *,
        parent_len: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> int:
        base = self.contexts.get(parent_context_id, []) if parent_context_id is not None else []
        base = base[:parent_len] if parent_len is not None else base
        self.contexts[context_id] = self.contexts.get(context_id, base) + list(token_ids)
        return len(self.contexts[context_id])

    def submit_generate(
        self,
        context_id: int,
        sampling: Any = None,
        parent_context_id: int | None = None,
        stream: bool = True,
        *,
        latency_cap: int | None = None,
        priority: float | None = None,
        tenant: str | None = None,
    ) -> _Answer:
        """What the manager and the OpenAI endpoints call: the answer, streamable."""
        tokens = self.contexts.setdefault(context_id, list(self.contexts.get(parent_context_id, [])))
        prompt = self.tokenizer.decode(tokens)
        self.prompts.append(prompt)
        text = self.script(prompt)
        out = self.tokenizer.encode(text, add_special_tokens=False)
        self.contexts[context_id] = tokens + out
        return _Answer(
            GenerateResult(token_ids=out, text=text, finish_reason="stop", prompt_tokens=len(tokens))
        )

    async def free_context(self, context_id: int) -> None:
        self.contexts.pop(context_id, None)

    def stats(self) -> EngineStats:
        zero = dict.fromkeys(
            [
                "blocks_used",
                "contexts",
                "running",
                "waiting",
                "tokens_in_last_step",
                "prefill_tokens_computed",
                "decode_tokens_computed",
                "steps",
                "preemptions",
                "evictions",
                "grouped_decode_steps",
            ],
            0,
        )
        return EngineStats(
            model=self.model_name,
            block_size=16,
            blocks_total=1024,
            blocks_free=1024,
            max_model_len=4096,
            **zero,
        )

    def shutdown(self) -> None:
        pass


# Longer than the 200 characters of a model's text that the server quotes in a transform's error (with
# blanks at its ends, which LangChain's JSON parser strips before it reports the text).
RAMBLE = "I would rather not write any JSON today, thank you. " * 6 + "\n"


def script(prompt: str) -> str:
    """The scripted model: a JSON plan, an XML card, a pydantic-shaped answer, a ramble, or an essay."""
    if "Ramble" in prompt:
        return RAMBLE
    if "Plan an essay" in prompt:
        return 'Here you go:\n```json\n{"topic": "parrots", "audience": "kids", "length": 3}\n```'
    if "XML card" in prompt:
        return "<card><name>Polly</name><age>3</age></card>"
    if "Describe the parrot" in prompt:
        return '{"name": "Polly", "age": 3}' if "good" in prompt else '{"name": "Polly"}'
    return "ESSAY<" + prompt.rsplit("<|user|>\n", 1)[-1].split("<|end|>")[0] + ">"


# Every chain here runs wholly on the server unless a test says otherwise (with pytest.warns).
pytestmark = pytest.mark.filterwarnings("error::langchain_parrot.ClientSideStepWarning")


class Parrot(BaseModel):
    name: str
    age: int


class Served:
    def __init__(self, url: str, app: FastAPI, engine: ScriptedEngine) -> None:
        self.url, self.app, self.engine = url, app, engine


@contextlib.contextmanager
def serve_scripted(engines: int = 1) -> Iterator[Served]:
    """The real app (manager + routes) over ``engines`` scripted engines, on a free local port; `Served`
    names the first engine."""
    scripted = [ScriptedEngine(script) for _ in range(engines)]
    app = create_app(Manager(scripted))  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the scripted server did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield Served(f"http://127.0.0.1:{port}", app, scripted[0])
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def scripted_chat(served: Served, chat_format: ChatFormat) -> ChatParrot:
    return ChatParrot(base_url=served.url, chat_format=chat_format, model="scripted", max_tokens=64)


@pytest.fixture(scope="module")
def served_script() -> Iterator[Served]:
    with serve_scripted() as served:
        yield served


@pytest.fixture(scope="module")
def chat(served_script: Served, chat_format: ChatFormat) -> ChatParrot:
    return scripted_chat(served_script, chat_format)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-engine", "two-engines"])
def engines_chat(request: pytest.FixtureRequest, chat_format: ChatFormat) -> Iterator[ChatParrot]:
    """A chat model on a scripted server of one engine, then of two."""
    with serve_scripted(request.param) as served:
        yield scripted_chat(served, chat_format)


def prompt(human: str) -> ChatPromptTemplate:
    return ChatPromptTemplate.from_messages([("system", "You are a helpful writer."), ("human", human)])


def counted(app: Any, run: Callable[[], Any]) -> tuple[Any, Counter[tuple[str, str]]]:
    before = Counter(app.state.request_counts)
    out = run()
    return out, Counter(app.state.request_counts) - before


def test_json_key_feeds_the_next_prompt_in_one_submission(
    served_script: Served, chat: ChatParrot, chat_format: ChatFormat
) -> None:
    engine = served_script.engine
    plan = prompt("Plan an essay about {subject}") | chat | JsonOutputParser()
    chain = (
        {"audience": plan | itemgetter("audience")}
        | prompt("Write for {audience}")
        | chat
        | StrOutputParser()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClientSideStepWarning)
        compiled = compile_chain(chain)
    mark = len(engine.prompts)
    out, counts = counted(served_script.app, lambda: compiled.invoke({"subject": "birds"}))
    # The key was looked up server-side and bound into the second call: no value went through the client.
    assert out == "ESSAY<Write for kids>"
    assert counts[("POST", "/v1/sessions")] == 0  # (the session opens with its first batch)
    assert (
        counts[("GET", "/v1/sessions/{session_id}/variables/{var_id}")]
        + counts[("POST", "/v1/sessions/{session_id}/batch")]
        <= 1
    )
    # The second prompt is exactly what LangChain renders with the parsed key.
    expected = chat_format.template_text(
        to_wire_messages(prompt("Write for {audience}").format_messages(audience="kids"))
    )
    assert engine.prompts[mark + 1] == chat_format.bos_token + expected


def test_a_value_piped_into_a_prompt_is_fetched_when_it_may_be_a_dict(chat: ChatParrot) -> None:
    # `x | prompt` uses x as the prompt's variables if x is a dict, else as its one variable: a value the
    # server is producing is fetched to decide (the warning says so). A dict literal names the variable
    # and keeps the chain on the server (test_json_key_feeds_the_next_prompt_in_one_submission).
    plan = prompt("Plan an essay about {subject}") | chat | JsonOutputParser()
    chain = plan | RunnablePick("topic") | prompt("Write about {topic}") | chat | StrOutputParser()
    with pytest.warns(ClientSideStepWarning, match="its input is a structured value"):
        assert compile_chain(chain).invoke({"subject": "x"}) == "ESSAY<Write about parrots>"
    card = prompt("An XML card for {who}") | chat | XMLOutputParser()
    chain = {"card": card | itemgetter("card")} | prompt("Write about {card}") | chat | StrOutputParser()
    expected = chain.invoke({"who": "Polly"})  # LangChain renders the parsed list of dicts with str()
    assert compile_chain(chain).invoke({"who": "Polly"}) == expected
    assert "[{'name': 'Polly'}, {'age': '3'}]" in expected


def test_two_keys_of_one_output_are_fetched_once_then_bound(served_script: Served, chat: ChatParrot) -> None:
    plan = prompt("Plan an essay about {subject}") | chat | JsonOutputParser()
    chain = plan | prompt("Write about {topic} for {audience}") | chat | StrOutputParser()
    compiled = compile_chain(chain)
    with pytest.warns(ClientSideStepWarning, match="structured value"):
        out, counts = counted(served_script.app, lambda: compiled.invoke({"subject": "x"}))
    assert out == chain.invoke({"subject": "x"}) == "ESSAY<Write about parrots for kids>"
    assert counts[("POST", "/v1/sessions")] == 0  # (the session opens with its first batch)


def test_whole_json_and_pydantic_outputs(chat: ChatParrot) -> None:
    plan = prompt("Plan an essay about {subject}") | chat | JsonOutputParser()
    assert compile_chain(plan).invoke({"subject": "x"}) == {
        "topic": "parrots",
        "audience": "kids",
        "length": 3,
    }
    describe = prompt("Describe the parrot ({quality})") | chat | PydanticOutputParser(pydantic_object=Parrot)
    compiled = compile_chain(describe)
    assert compiled.invoke({"quality": "good"}) == Parrot(name="Polly", age=3)
    with pytest.raises(OutputParserException):  # validated on the client, as LangChain does
        compiled.invoke({"quality": "bad"})
    with pytest.raises(OutputParserException):
        describe.invoke({"quality": "bad"})


def test_submit_returns_the_servers_parsed_value(chat: ChatParrot, served_script: Served) -> None:
    plan = prompt("Plan an essay about {subject}") | chat | JsonOutputParser()
    chain = {"plan": plan, "audience": plan | itemgetter("audience")}
    compiled = compile_chain(chain)
    with P.Session(served_script.url):
        variables = compiled.submit({"subject": "x"})
        assert set(variables) == {"plan", "audience"}
        assert variables["audience"].get() == "kids"
        assert variables["plan"].get()["length"] == 3


# ------------------------------------------------------------------------------------- refused outputs
PARSERS = [JsonOutputParser(), XMLOutputParser()]


def refusing_chains(chat: ChatParrot, parser: Any) -> list[Any]:
    """A chain whose parser refuses the model's long ramble, and one whose output reads the refused one."""
    refused = prompt("Ramble about {x}") | chat | parser
    fused = refused | itemgetter("topic") if isinstance(parser, JsonOutputParser) else refused
    downstream = {"topic": fused} | prompt("Write about {topic}") | chat | StrOutputParser()
    return [refused, downstream]


def check_refused(error: ServerParserError, transform: str) -> None:
    """The whole ramble came back as data, though the server's message quotes only its start."""
    assert isinstance(error, OutputParserException) and isinstance(error, P.VariableFailedError)
    assert f"... ({len(RAMBLE)} chars)" in str(error) and "only the start" not in str(error)
    assert error.llm_output == RAMBLE and error.llm_output_complete  # the model's text, as the parser got it
    assert error.transform == transform and error.error_type == "transform_failed"


@pytest.mark.parametrize("parser", PARSERS, ids=["json", "xml"])
def test_a_long_refused_output_comes_back_whole(engines_chat: ChatParrot, parser: Any) -> None:
    refused, downstream = refusing_chains(engines_chat, parser)
    with pytest.raises(OutputParserException) as theirs:
        refused.invoke({"x": "birds"})
    assert theirs.value.llm_output in (RAMBLE, RAMBLE.strip())  # LangChain's JSON parser strips first
    for chain in (refused, downstream):
        with pytest.raises(ServerParserError) as ours:
            compile_chain(chain).invoke({"x": "birds"})
        check_refused(ours.value, type(parser).__name__.removesuffix("OutputParser").lower())
    assert "upstream" in str(ours.value)


@pytest.mark.parametrize("parser", PARSERS, ids=["json", "xml"])
async def test_a_long_refused_output_comes_back_whole_async(engines_chat: ChatParrot, parser: Any) -> None:
    for chain in refusing_chains(engines_chat, parser):
        with pytest.raises(ServerParserError) as ours:
            await compile_chain(chain).ainvoke({"x": "birds"})
        check_refused(ours.value, type(parser).__name__.removesuffix("OutputParser").lower())


def test_without_the_text_as_data_the_message_quote_is_the_fallback() -> None:
    # What an older server sends (or ours, for a text over its bound): the message's quote, flagged as cut.
    quoted = f"json transform failed: invalid JSON in {RAMBLE[:200]!r}... ({len(RAMBLE)} chars)"
    error = server_parser_error(P.VariableFailedError("v failed", var_id="v", reason=quoted))
    assert error is not None and error.llm_output == RAMBLE[:200] and not error.llm_output_complete
    assert "only the start" in str(error)
    # A lookup that failed, or a failure the server types as something else, is no parser's refusal.
    missing = "json transform failed: key path 'a': no key 'a' at the top level (keys: none)"
    lookup = P.VariableFailedError("m", reason=missing, error_type="transform_failed")
    assert server_parser_error(lookup) is None
    other = P.VariableFailedError("m", reason=quoted, error_type="engine_failed", llm_output=RAMBLE)
    assert server_parser_error(other) is None
