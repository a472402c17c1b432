"""`compile_chain` end to end on the embedded server, against plain LangChain on the same server.

For every chain of the table, the compiled chain and the original (run by LangChain, one OpenAI-style
request per model call) must give equal outputs (greedy decoding) *and* make the engine generate from
exactly the same token ids — the prompts the server renders are the ones LangChain renders.
"""

from __future__ import annotations

import asyncio
import socket
import time
import warnings
from collections import Counter
from collections.abc import Callable
from operator import itemgetter
from typing import Any

import parrot as P
import pytest
from langchain_core.language_models import FakeListChatModel
from langchain_core.output_parsers import (
    CommaSeparatedListOutputParser,
    JsonOutputParser,
    MarkdownListOutputParser,
    NumberedListOutputParser,
    StrOutputParser,
)
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough
from langchain_core.runnables.passthrough import RunnablePick
from langchain_parrot import (
    ChatFormat,
    ChatParrot,
    ClientSideStepWarning,
    CompileError,
    MissingVariableError,
    ParrotLLM,
    UnsupportedParserError,
    compile_chain,
)
from pydantic import BaseModel, Field

from server.launcher import LaunchedServer
from tests.langchain_parrot.conftest import PromptRecorder

# Every chain here runs wholly on the server unless a test says otherwise (with pytest.warns).
pytestmark = pytest.mark.filterwarnings("error::langchain_parrot.ClientSideStepWarning")

SYSTEM = "You are a meticulous assistant who writes short, precise answers for busy readers."


@pytest.fixture(scope="module")
def chat(served: LaunchedServer, chat_format: ChatFormat) -> ChatParrot:
    return ChatParrot(base_url=served.url, max_tokens=6, chat_format=chat_format)


@pytest.fixture(scope="module")
def llm(served: LaunchedServer) -> ParrotLLM:
    return ParrotLLM(base_url=served.url, max_tokens=6)


def chat_prompt(human: str, **kwargs: Any) -> ChatPromptTemplate:
    return ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", human)], **kwargs)


def requests_during(served: LaunchedServer, run: Callable[[], Any]) -> tuple[Any, Counter[tuple[str, str]]]:
    before = Counter(served.request_counts)
    out = run()
    return out, Counter(served.request_counts) - before


def strict_compile(chain: Runnable[Any, Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClientSideStepWarning)  # every step of these chains compiles
        return compile_chain(chain)


def same_run(
    served: LaunchedServer,
    recorder: PromptRecorder,
    chain: Runnable[Any, Any],
    value: Any,
    compiled: Any = None,
) -> tuple[Any, Counter[tuple[str, str]]]:
    """Run ``chain`` compiled and plain; assert equal outputs and equal engine prompts; return the
    compiled output and the requests the compiled run made."""
    compiled = compiled or strict_compile(chain)
    mark = recorder.mark()
    out, counts = requests_during(served, lambda: compiled.invoke(value))
    compiled_prompts = recorder.since(mark)
    mark = recorder.mark()
    expected = chain.invoke(value)
    plain_prompts = recorder.since(mark)
    assert _comparable(out) == _comparable(expected)
    assert sorted(compiled_prompts) == sorted(plain_prompts)
    assert counts[("POST", "/v1/chat/completions")] == counts[("POST", "/v1/completions")] == 0
    return out, counts


def _comparable(value: Any) -> Any:
    """Messages compare by content (a compiled AIMessage has no usage metadata to compare)."""
    if hasattr(value, "content") and hasattr(value, "response_metadata"):
        return ("message", value.content)
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


GET_VARIABLE = ("GET", "/v1/sessions/{session_id}/variables/{var_id}")
BATCH = ("POST", "/v1/sessions/{session_id}/batch")


def waits(counts: Counter[tuple[str, str]]) -> int:
    """Requests that may wait for a value: gets, and batches (the client's queue, with or without a get)."""
    return counts[GET_VARIABLE] + counts[BATCH]


def one_submission(counts: Counter[tuple[str, str]], outputs: int = 1) -> None:
    """One session, and no client round trip between calls: the queue is sent once and only the outputs
    are waited for (one request carries the session's creation, the queue and the get of a single output)."""
    assert counts[("POST", "/v1/sessions")] == 0 and counts[BATCH] == 1
    assert waits(counts) <= outputs + (1 if outputs > 1 else 0)


CHAINS: dict[str, Callable[[ChatParrot, ParrotLLM], tuple[Runnable[Any, Any], Any]]] = {
    "chat prompt, str parser": lambda chat, llm: (
        chat_prompt("Summarize {text} for {reader}") | chat | StrOutputParser(),
        {"text": "the history of parrots {{in braces}}", "reader": "kids"},
    ),
    "chat model without parser": lambda chat, llm: (chat_prompt("Hi {name}") | chat, {"name": "Polly"}),
    "bare chat model on text": lambda chat, llm: (chat | StrOutputParser(), "Hello there"),
    "completion model": lambda chat, llm: (PromptTemplate.from_template("Q: {q}\nA:") | llm, {"q": "why?"}),
    "chat prompt on a completion model": lambda chat, llm: (
        chat_prompt("Explain {x}") | llm | StrOutputParser(),
        {"x": "flight"},
    ),
    "dependent steps (dict literal)": lambda chat, llm: (
        {
            "outline": chat_prompt("Outline {topic}") | chat | StrOutputParser(),
            "audience": itemgetter("audience"),
        }
        | chat_prompt("Write about {outline} for {audience}")
        | chat
        | StrOutputParser(),
        {"topic": "parrots", "audience": "kids"},
    ),
    "assign, then pick": lambda chat, llm: (
        RunnablePassthrough.assign(draft=chat_prompt("Draft {topic}") | chat | StrOutputParser())
        | RunnablePassthrough.assign(
            final=chat_prompt("Polish {draft} on {topic}") | chat | StrOutputParser()
        )
        | RunnablePick("final"),
        {"topic": "wings"},
    ),
    "parallel branches": lambda chat, llm: (
        RunnableParallel(
            a=chat_prompt("Pros of {x}") | chat | StrOutputParser(),
            b=chat_prompt("Cons of {x}") | chat | StrOutputParser(),
            c=PromptTemplate.from_template("{x} in one word:") | llm | StrOutputParser(),
        ),
        {"x": "cages"},
    ),
    "map, join, reduce": lambda chat, llm: (
        chat_prompt("Summarize: {chunk}").pipe(chat).pipe(StrOutputParser()).map()
        | RunnableLambda("\n---\n".join)
        | chat_prompt("Combine these summaries:\n{summaries}")
        | chat
        | StrOutputParser(),
        [{"chunk": "part one"}, {"chunk": "part two"}, {"chunk": "part three"}],
    ),
    "bound stop and max_tokens": lambda chat, llm: (
        chat_prompt("List {n} birds") | chat.bind(stop=["lap", "ure"], max_tokens=4) | StrOutputParser(),
        {"n": "three"},
    ),
    "list parsers feed a prompt as str(list)": lambda chat, llm: (
        {
            "csv": chat_prompt("Name some {x}") | chat | CommaSeparatedListOutputParser(),
            "numbered": chat_prompt("Number {x}") | chat | NumberedListOutputParser(),
            "markdown": chat_prompt("Bullet {x}") | chat | MarkdownListOutputParser(),
        }
        | PromptTemplate.from_template("Lists: {csv} / {numbered} / {markdown}")
        | llm,
        {"x": "seeds"},
    ),
    "mustache and jinja2 prompts": lambda chat, llm: (
        {
            "m": PromptTemplate.from_template("M {{{topic}}}", template_format="mustache") | llm,
            "j": PromptTemplate.from_template("J {{ topic }}", template_format="jinja2") | llm,
        }
        | chat_prompt("{m} and {j}")
        | chat
        | StrOutputParser(),
        {"topic": "feathers & <beaks>"},
    ),
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_compiled_chain_equals_langchain(
    name: str, chat: ChatParrot, llm: ParrotLLM, served: LaunchedServer, recorder: PromptRecorder
) -> None:
    chain, value = CHAINS[name](chat, llm)
    out, counts = same_run(served, recorder, chain, value)
    one_submission(counts, outputs=len(out) if isinstance(out, dict) else 1)


def test_dependent_steps_never_fetch_the_intermediate(chat: ChatParrot, served: LaunchedServer) -> None:
    chain, value = CHAINS["dependent steps (dict literal)"](chat, chat)  # type: ignore[arg-type]
    compiled = strict_compile(chain)
    sessions = len(served.manager.sessions)
    before = Counter(served.request_counts)
    compiled.invoke(value)
    # The session is deleted after the result is back, off the caller's path, and the server counts a request
    # only once its response is out (after the manager already dropped the session): wait for both.
    delete = ("DELETE", "/v1/sessions/{session_id}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        len(served.manager.sessions) > sessions or served.request_counts[delete] == before[delete]
    ):
        time.sleep(0.01)
    assert len(served.manager.sessions) == sessions
    counts = Counter(served.request_counts) - before
    one_submission(counts)
    assert counts[delete] == 1
    # Everything else the run sent: the calls (or one batch holding them) and the one wait.
    assert sum(counts.values()) <= 5


def test_batch_and_async_equal_langchain(chat: ChatParrot, served: LaunchedServer) -> None:
    chain, _ = CHAINS["dependent steps (dict literal)"](chat, chat)  # type: ignore[arg-type]
    inputs = [{"topic": t, "audience": "adults"} for t in ("beaks", "nests", "songs")]
    compiled = strict_compile(chain)
    out, counts = requests_during(served, lambda: compiled.batch(inputs))
    assert out == chain.batch(inputs)
    # every input in one session (opened by its batch), submitted at once
    assert counts[("POST", "/v1/sessions")] == 0 and counts[("POST", "/v1/sessions/{session_id}/batch")] == 1

    import asyncio

    async def both() -> tuple[Any, Any]:
        return await compiled.ainvoke(inputs[0]), await compiled.abatch(inputs)

    single, many = asyncio.run(both())
    assert single == out[0] and many == out


def test_submit_chains_futures_through_a_python_loop(chat: ChatParrot, served: LaunchedServer) -> None:
    refine = (
        chat_prompt("Summary so far: {summary}\nNew text: {chunk}\nUpdated summary:")
        | chat
        | StrOutputParser()
    )
    compiled = strict_compile(refine)
    chunks = ["first part", "second part", "third part", "fourth part"]

    def loop() -> str:
        with P.Session(served.url):
            summary: str | P.Variable = "(nothing yet)"
            for chunk in chunks:
                summary = compiled.submit({"summary": summary, "chunk": chunk})["output"]
            assert isinstance(summary, P.Variable)
            return str(summary.get(criteria=P.LATENCY))

    out, counts = requests_during(served, loop)
    one_submission(counts)
    expected = "(nothing yet)"
    for chunk in chunks:
        expected = refine.invoke({"summary": expected, "chunk": chunk})
    assert out == expected


async def test_async_submit_and_async_client_steps(chat: ChatParrot, served: LaunchedServer) -> None:
    refine = chat_prompt("So far: {summary}\nNext: {chunk}") | chat | StrOutputParser()
    compiled = strict_compile(refine)
    async with P.Session(served.url):
        first = (await compiled.asubmit({"summary": "(none)", "chunk": "one"}))["output"]
        second = (await compiled.asubmit({"summary": first, "chunk": "two"}))["output"]
        got = await second.aget(criteria=P.LATENCY)
    expected = refine.invoke(
        {"summary": refine.invoke({"summary": "(none)", "chunk": "one"}), "chunk": "two"}
    )
    assert got == expected

    async def ashout(text: str) -> str:
        return text.upper()

    chain = (
        chat_prompt("Say {x}") | chat | StrOutputParser() | RunnableLambda(ashout) | chat_prompt("{y}") | chat
    )
    with pytest.warns(ClientSideStepWarning, match="ashout"):
        mixed = compile_chain(chain)
    assert (await mixed.ainvoke({"x": "hi"})).content == (await chain.ainvoke({"x": "hi"})).content


def test_opaque_steps_run_on_the_client_with_one_warning(
    chat: ChatParrot, served: LaunchedServer, recorder: PromptRecorder
) -> None:
    def shout(text: str) -> str:
        return text.upper()

    chain = (
        chat_prompt("Say {x}")
        | chat
        | StrOutputParser()
        | RunnableLambda(shout)
        | chat_prompt("Repeat {y}")
        | chat
        | StrOutputParser()
    )
    with pytest.warns(ClientSideStepWarning, match=r"'shout' \(a Python function\)"):
        compiled = compile_chain(chain)
    assert "shout (client-side)" in compiled.explain()
    _, counts = same_run(served, recorder, chain, {"x": "hello"}, compiled)
    assert counts[("POST", "/v1/sessions")] == 0  # one session (opened by its batch): fetched, then used
    assert waits(counts) == 2  # the first output, then the last


def test_uses_the_server_cannot_render_fall_back_to_the_client(
    chat: ChatParrot, llm: ParrotLLM, served: LaunchedServer, recorder: PromptRecorder
) -> None:
    # A format spec, an escaped mustache variable: the earlier output is fetched and LangChain renders it.
    chain = (
        {
            "a": chat_prompt("One {x}") | chat | StrOutputParser(),
            "b": chat_prompt("Two {x}") | chat | StrOutputParser(),
        }
        | PromptTemplate.from_template("{a:>40} {b!r}")
        | llm
    )
    with pytest.warns(ClientSideStepWarning, match=r"'a', 'b' come from earlier model steps"):
        _, counts = same_run(served, recorder, chain, {"x": "spec"})
    assert waits(counts) >= 2  # a and b were fetched before the last call was sent
    mustache = (
        chat_prompt("One {x}")
        | chat
        | StrOutputParser()
        | PromptTemplate.from_template("escaped {{y}}", template_format="mustache")
        | llm
    )
    with pytest.warns(ClientSideStepWarning, match="HTML-escaped"):
        same_run(served, recorder, mustache, {"x": "html"})


def test_other_providers_models_run_on_the_client(
    chat: ChatParrot, served: LaunchedServer, recorder: PromptRecorder
) -> None:
    fake = FakeListChatModel(responses=["a fake answer"])
    chain = (
        chat_prompt("Ask {x}")
        | chat
        | StrOutputParser()
        | chat_prompt("Relay {y}")
        | fake
        | StrOutputParser()
        | chat_prompt("Answer {z}")
        | chat
        | StrOutputParser()
    )
    with pytest.warns(ClientSideStepWarning, match=r"'FakeListChatModel' \(not a Parrot model\)"):
        compiled = compile_chain(chain)
    same_run(served, recorder, chain, {"x": "q"}, compiled)


def test_json_parser_failure_is_a_failed_variable(chat: ChatParrot) -> None:
    compiled = strict_compile(chat_prompt("JSON for {x}") | chat | JsonOutputParser())
    with pytest.raises(P.VariableFailedError, match="invalid JSON"):
        compiled.invoke({"x": "gibberish"})  # the tiny model does not write JSON


# ------------------------------------------------------------------------------------------- bad input
def test_missing_variable(chat: ChatParrot) -> None:
    compiled = strict_compile(chat_prompt("{a} and {b}") | chat)
    with pytest.raises(MissingVariableError, match="'b'"):
        compiled.invoke({"a": "x"})
    with pytest.raises(MissingVariableError):
        compiled.batch([{"a": "x"}])
    assert isinstance(compiled.batch([{"a": "x"}], return_exceptions=True)[0], MissingVariableError)


def test_untranslatable_parser_is_a_compile_error(chat: ChatParrot) -> None:
    class Upper(StrOutputParser):
        def parse(self, text: str) -> str:
            return text.upper()

    with pytest.raises(UnsupportedParserError, match="Upper"):
        compile_chain(chat_prompt("{a}") | chat | Upper())


def test_a_compiled_model_step_needs_max_tokens(served: LaunchedServer, chat_format: ChatFormat) -> None:
    unbounded = ChatParrot(base_url=served.url, chat_format=chat_format)
    with pytest.raises(CompileError, match=r"no max_tokens.*bind\(max_tokens="):
        compile_chain(chat_prompt("{x}") | unbounded)
    assert compile_chain(chat_prompt("{x}") | unbounded.bind(max_tokens=3)).invoke({"x": "y"}).content


def test_models_on_two_servers_are_a_compile_error(chat: ChatParrot, chat_format: ChatFormat) -> None:
    other = ChatParrot(base_url="http://127.0.0.1:1", chat_format=chat_format, max_tokens=4)
    with pytest.raises(CompileError, match="different servers"):
        compile_chain({"a": chat_prompt("{x}") | chat, "b": chat_prompt("{x}") | other})


def test_chat_model_without_chat_format_uses_the_servers_template(
    served: LaunchedServer, recorder: PromptRecorder
) -> None:
    """No chat_format given: the chat template the server publishes renders the compiled prompt, which
    reaches the engine as the same tokens as the chat endpoint's own rendering."""
    plain_chat = ChatParrot(base_url=served.url, max_tokens=5)
    chain = chat_prompt("Hello {x}") | plain_chat | StrOutputParser()
    _, counts = same_run(served, recorder, chain, {"x": "a"})
    assert counts[("GET", "/v1/models")] == 0  # read once, when the chain was first compiled


def test_chat_model_whose_server_publishes_no_template_runs_on_the_client(
    served: LaunchedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_chat = ChatParrot(base_url=served.url, max_tokens=5)
    card = plain_chat._served_card()
    monkeypatch.setattr(ChatParrot, "_served_card", lambda self: {**card, "chat_template": None})
    chain = chat_prompt("Hello {x}") | plain_chat | StrOutputParser()
    with pytest.warns(ClientSideStepWarning, match="without chat_format"):
        compiled = compile_chain(chain)
    assert compiled.invoke({"x": "a"}) == chain.invoke({"x": "a"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_down_names_the_url(chat_format: ChatFormat) -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    down = ChatParrot(base_url=url, chat_format=chat_format, max_retries=1, timeout=2, max_tokens=4)
    compiled = strict_compile(chat_prompt("{x}") | down)
    with pytest.raises(P.ConnectionError, match=rf"{url}.*gave up after 2 attempts"):
        compiled.invoke({"x": "y"})


# ------------------------------------------------------------------------------- structured and tools
class Rating(BaseModel):
    """A bounded object, which the random tiny model finishes too."""

    good: bool
    stars: int = Field(ge=1, le=5)


def test_with_structured_output_compiles_to_a_schema_output(
    served: LaunchedServer, recorder: PromptRecorder, chat_format: ChatFormat
) -> None:
    """``with_structured_output`` (json_schema) becomes one semantic call whose output is generated under
    the schema (`P.transforms.json(schema=...)`): the same object and prompts as LangChain's own run."""
    chat = ChatParrot(base_url=served.url, max_tokens=40, chat_format=chat_format)
    out, counts = same_run(
        served, recorder, chat_prompt("Rate {text}") | chat.with_structured_output(Rating), {"text": "a poem"}
    )
    assert isinstance(out, Rating)
    one_submission(counts)


def test_tool_models_and_unmappable_formats_run_on_the_client_with_the_reason(
    served: LaunchedServer, chat_format: ChatFormat
) -> None:
    chat = ChatParrot(base_url=served.url, max_tokens=64, chat_format=chat_format)
    forced = chat.bind_tools([Rating], tool_choice="Rating", parallel_tool_calls=False)
    text_parsed = chat.bind(response_format={"type": "json_object"}) | StrOutputParser()
    for chain, why in (
        (chat_prompt("Rate {text}") | forced, "answers tool calls"),
        (chat_prompt("Rate {text}") | text_parsed, "needs a JSON parser"),
    ):
        with pytest.warns(ClientSideStepWarning, match=why):
            compiled = compile_chain(chain)
        direct = chain.invoke({"text": "a poem"})
        out = compiled.invoke({"text": "a poem"})
        assert _comparable(out) == _comparable(direct)
        if why == "answers tool calls":
            assert out.tool_calls and Rating.model_validate(out.tool_calls[0]["args"])


# ----------------------------------------------------------------------------------------------- stream
def _joined(chunks: list[Any]) -> Any:
    out = chunks[0]
    for chunk in chunks[1:]:
        out = out + chunk
    return out


@pytest.mark.parametrize("parser", [True, False], ids=["str-parser", "chat-message"])
def test_a_compiled_chain_streams_its_last_model_steps_tokens(
    served: LaunchedServer, chat_format: ChatFormat, parser: bool
) -> None:
    chat = ChatParrot(base_url=served.url, max_tokens=12, chat_format=chat_format)
    chain = strict_compile(
        chat_prompt("Summarize {text}") | chat | StrOutputParser()
        if parser
        else chat_prompt("Summarize {text}") | chat
    )
    value = {"text": "the history of parrots"}
    chunks = list(chain.stream(value))
    assert len(chunks) > 1
    assert _comparable(_joined(chunks)) == _comparable(chain.invoke(value))

    async def collect() -> list[Any]:
        return [c async for c in chain.astream(value)]

    assert _comparable(_joined(asyncio.run(collect()))) == _comparable(chain.invoke(value))


def test_a_chain_ending_in_a_json_parser_streams_its_value_whole(
    served: LaunchedServer, chat_format: ChatFormat
) -> None:
    chat = ChatParrot(base_url=served.url, max_tokens=40, chat_format=chat_format)
    chain = strict_compile(chat_prompt("Rate {text}") | chat.with_structured_output(Rating))
    assert list(chain.stream({"text": "a poem"})) == [chain.invoke({"text": "a poem"})]
