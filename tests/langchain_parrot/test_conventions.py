"""OpenAI and LangChain conventions on the embedded tiny server: an OpenAI-style base URL,
token counts from the server's tokenizer (``trim_messages`` really trims), LangChain's
``OutputParserException`` for a parser that fails server-side, sampling refused at construction."""

from __future__ import annotations

from collections import Counter
from operator import itemgetter
from typing import Any

import parrot as P
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, get_buffer_string, trim_messages
from langchain_core.output_parsers import JsonOutputParser, StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda
from langchain_parrot import ChatFormat, ChatParrot, ParrotLLM, ServerParserError, compile_chain

from server.launcher import LaunchedServer, launch

# Every chain here runs wholly on the server.
pytestmark = pytest.mark.filterwarnings("error::langchain_parrot.ClientSideStepWarning")

TOKENIZE = ("POST", "/tokenize")


def chat_prompt(human: str) -> ChatPromptTemplate:
    return ChatPromptTemplate.from_messages([("system", "You answer in JSON."), ("human", human)])


@pytest.fixture(scope="module")
def chat(served: LaunchedServer, chat_format: ChatFormat) -> ChatParrot:
    return ChatParrot(base_url=served.url, max_tokens=6, chat_format=chat_format)


# ---------------------------------------------------------------------------------------------- base URLs
@pytest.mark.parametrize("suffix", ["/", "/v1", "/v1/"])
def test_models_take_an_openai_style_base_url(served: LaunchedServer, suffix: str) -> None:
    chat = ChatParrot(base_url=served.url + suffix, max_tokens=4)
    llm = ParrotLLM(base_url=served.url + suffix, max_tokens=4)
    assert chat.base_url == llm.base_url == served.url  # kept as the server root
    assert chat.invoke("hi").content == ChatParrot(base_url=served.url, max_tokens=4).invoke("hi").content
    assert llm.invoke("hi") == ParrotLLM(base_url=served.url, max_tokens=4).invoke("hi")


def test_the_base_url_from_the_environment_may_end_in_v1(
    served: LaunchedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARROT_BASE_URL", served.url + "/v1")
    assert ChatParrot().base_url == ParrotLLM().base_url == served.url


def test_a_chain_over_both_spellings_is_one_server(served: LaunchedServer, chat_format: ChatFormat) -> None:
    first = ChatParrot(base_url=served.url, max_tokens=4, chat_format=chat_format)
    second = ChatParrot(base_url=served.url + "/v1", max_tokens=4, chat_format=chat_format)
    chain = {"a": chat_prompt("Say {x}") | first | StrOutputParser()} | chat_prompt("Echo {a}") | second
    compiled = compile_chain(chain)  # no CompileError: the same server
    assert compiled.invoke({"x": "hi"}).content == chain.invoke({"x": "hi"}).content


def test_a_bad_base_url_fails_at_construction() -> None:
    with pytest.raises(ValueError, match=r"(?s)base_url.*must start with http:// or https://"):
        ChatParrot(base_url="parrot.invalid:9000")


# ----------------------------------------------------------------------------------------- token counts
TEXT = "Parrots mimic speech; some learn hundreds of words."


def test_token_ids_are_the_served_models(served: LaunchedServer) -> None:
    tokenizer = served.engines[0].tokenizer
    expected = tokenizer.encode(TEXT, add_special_tokens=False)
    chat = ChatParrot(base_url=served.url)
    llm = ParrotLLM(base_url=served.url + "/v1")
    assert chat.get_token_ids(TEXT) == llm.get_token_ids(TEXT) == expected
    assert chat.get_num_tokens("hello world") == len(
        tokenizer.encode("hello world", add_special_tokens=False)
    )
    assert chat.get_num_tokens("hello world") > 0
    messages = [SystemMessage("Be brief."), HumanMessage(TEXT), AIMessage("Indeed.")]
    # LangChain's own way of counting messages (each as "Role: content"), with the server's tokenizer.
    assert chat.get_num_tokens_from_messages(messages) == sum(
        len(tokenizer.encode(get_buffer_string([m]), add_special_tokens=False)) for m in messages
    )


def test_token_counts_are_asked_once_per_text(served: LaunchedServer) -> None:
    chat = ChatParrot(base_url=served.url)
    before = Counter(served.request_counts)
    first = chat.get_num_tokens(TEXT + " (once)")
    assert chat.get_num_tokens(TEXT + " (once)") == first
    assert (Counter(served.request_counts) - before)[TOKENIZE] == 1


def test_trim_messages_trims_by_the_servers_tokens(served: LaunchedServer) -> None:
    chat = ChatParrot(base_url=served.url)
    messages = [
        SystemMessage("You are a terse assistant."),
        HumanMessage("Tell me about parrots. " * 4),
        AIMessage("They are clever birds that live long lives. " * 3),
        HumanMessage("And their diet? " * 4),
        AIMessage("Seeds, nuts and fruit."),
        HumanMessage("Thanks!"),
    ]
    total = chat.get_num_tokens_from_messages(messages)
    limit = total // 2
    trimmed = trim_messages(
        messages, max_tokens=limit, token_counter=chat, strategy="last", include_system=True
    )
    assert 2 <= len(trimmed) < len(messages)
    assert trimmed[0] == messages[0] and trimmed[-1] == messages[-1]
    assert chat.get_num_tokens_from_messages(trimmed) <= limit < total


def test_token_counts_send_the_api_key() -> None:
    with launch("tiny", api_keys=["k-1"]) as keyed:
        assert ChatParrot(base_url=keyed.url, api_key="k-1").get_num_tokens("hello world") > 0
        with pytest.raises(P.AuthError):
            ChatParrot(base_url=keyed.url, api_key=None).get_num_tokens("hello world")


# ------------------------------------------------------------------------------------ parser failures
@pytest.fixture
def json_chain(chat: ChatParrot) -> Any:
    return chat_prompt("JSON for {x}") | chat | JsonOutputParser()  # the tiny model writes no JSON


def test_a_parser_failing_on_the_server_is_langchains_exception(json_chain: Any) -> None:
    with pytest.raises(OutputParserException) as theirs:
        json_chain.invoke({"x": "gibberish"})
    with pytest.raises(ServerParserError) as ours:
        compile_chain(json_chain).invoke({"x": "gibberish"})
    error = ours.value
    assert isinstance(error, OutputParserException) and isinstance(error, P.VariableFailedError)
    assert error.transform == "json" and error.llm_output_complete and error.var_id
    # The model's text, as the uncompiled chain's parser saw it (JsonOutputParser strips it first).
    assert error.llm_output is not None and error.llm_output.strip() == theirs.value.llm_output
    assert "invalid JSON" in str(error)


def test_a_failed_parse_upstream_is_langchains_exception_too(chat: ChatParrot, json_chain: Any) -> None:
    chain = {"topic": json_chain | itemgetter("topic")} | chat_prompt("Write about {topic}") | chat
    with pytest.raises(OutputParserException) as theirs:
        chain.invoke({"x": "gibberish"})
    with pytest.raises(ServerParserError, match="upstream") as ours:
        compile_chain(chain).invoke({"x": "gibberish"})
    assert ours.value.llm_output is not None and ours.value.llm_output.strip() == theirs.value.llm_output


async def test_retry_and_fallback_policies_on_parser_errors_apply(json_chain: Any) -> None:
    compiled = compile_chain(json_chain)
    with pytest.raises(ServerParserError):
        await compiled.ainvoke({"x": "gibberish"})
    calls = []

    def fallback(value: Any) -> dict[str, Any]:
        calls.append(value)
        return {"fallback": True}

    guarded = compiled.with_fallbacks(
        [RunnableLambda(fallback)], exceptions_to_handle=(OutputParserException,)
    )
    assert guarded.invoke({"x": "gibberish"}) == {"fallback": True}
    assert await guarded.ainvoke({"x": "gibberish"}) == {"fallback": True}
    assert len(calls) == 2


# ------------------------------------------------------------------------------------------- sampling
BAD_SAMPLING = [
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"stop": [""]}, "stop strings must be non-empty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
]


@pytest.mark.parametrize("cls", [ChatParrot, ParrotLLM])
@pytest.mark.parametrize(("kwargs", "message"), BAD_SAMPLING)
def test_bad_sampling_fails_at_construction(cls: type, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cls(base_url="http://parrot.invalid:9000", **kwargs)


def test_penalties_go_with_every_kind_of_call(served: LaunchedServer) -> None:
    """ChatOpenAI's presence and frequency penalties, and vLLM's repetition penalty: fields or call-time,
    in the OpenAI body and in a semantic call's sampling alike, accepted by the server."""
    chat = ChatParrot(base_url=served.url, max_tokens=4, frequency_penalty=0.5, repetition_penalty=1.3)
    params = chat.call_params(presence_penalty=0.25)
    penalties = {"frequency_penalty": 0.5, "presence_penalty": 0.25, "repetition_penalty": 1.3}
    assert penalties.items() <= params.body().items()
    sampling = params.sampling()
    assert {name: getattr(sampling, name) for name in penalties} == penalties
    assert chat.bind(presence_penalty=0.25).invoke("hi").content is not None
    assert ParrotLLM(base_url=served.url, max_tokens=4, repetition_penalty=1.3).invoke("hi") is not None


def test_bad_bound_sampling_fails_before_any_request(served: LaunchedServer) -> None:
    chat = ChatParrot(base_url=served.url, max_tokens=4)
    before = Counter(served.request_counts)
    with pytest.raises(ValueError, match="ChatParrot: temperature must be"):
        chat.bind(temperature=-1).invoke("hi")
    with pytest.raises(ValueError, match="ParrotLLM: top_p must be"):
        ParrotLLM(base_url=served.url, max_tokens=4).invoke("hi", top_p=0)
    assert not Counter(served.request_counts) - before
