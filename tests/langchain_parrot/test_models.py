"""`ParrotLLM` and `ChatParrot` used directly: the endpoints, batching, streaming, usage, stop, errors."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import parrot as P
import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_parrot import ChatParrot, ParrotLLM, UnsupportedInputError
from langchain_parrot._http import backoff_delay

from server.launcher import LaunchedServer


def counts_since(served: LaunchedServer, before: dict[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    return {k: v - before.get(k, 0) for k, v in served.request_counts.items() if v != before.get(k, 0)}


@pytest.fixture
def llm(served: LaunchedServer) -> ParrotLLM:
    return ParrotLLM(base_url=served.url, max_tokens=8)


@pytest.fixture
def chat(served: LaunchedServer) -> ChatParrot:
    return ChatParrot(base_url=served.url, max_tokens=8)


def test_construction_touches_no_network() -> None:
    llm = ParrotLLM(base_url="http://parrot.invalid:1", model="tiny")
    chat = ChatParrot(base_url="http://parrot.invalid:1")
    assert llm._connection is None and chat._connection is None
    with pytest.raises(ValueError, match="http:// or https://"):
        ParrotLLM(base_url="parrot.invalid").connection  # noqa: B018 - the property builds the connection


def test_llm_invoke_reports_usage_and_finish_reason(llm: ParrotLLM) -> None:
    result = llm.generate(["The parrot said"])
    generation = result.generations[0][0]
    assert generation.text and generation.generation_info == {"finish_reason": "length"}
    usage = result.llm_output["token_usage"]  # type: ignore[index]
    assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 0
    assert llm.invoke("The parrot said") == generation.text  # greedy: deterministic


def test_llm_batch_is_one_request(llm: ParrotLLM, served: LaunchedServer) -> None:
    prompts = ["one", "two two", "three three three"]
    singles = [llm.invoke(p) for p in prompts]
    before = dict(served.request_counts)
    assert llm.batch(prompts) == singles
    assert counts_since(served, before) == {("POST", "/v1/completions"): 1}


async def test_llm_async_and_streaming(llm: ParrotLLM) -> None:
    full = llm.invoke("Streaming parrots")
    chunks = list(llm.stream("Streaming parrots"))
    assert len([c for c in chunks if c]) > 1 and "".join(chunks) == full
    achunks = [c async for c in llm.astream("Streaming parrots")]
    assert "".join(achunks) == full
    assert await llm.ainvoke("Streaming parrots") == full
    assert await llm.abatch(["Streaming parrots", "x"]) == [full, llm.invoke("x")]


def test_llm_streaming_flag_feeds_callbacks(served: LaunchedServer) -> None:
    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            self.tokens.append(token)

    handler = Tokens()
    llm = ParrotLLM(base_url=served.url, max_tokens=8, streaming=True)
    text = llm.invoke("Count with me", config={"callbacks": [handler]})
    assert len(handler.tokens) > 1 and "".join(handler.tokens) == text


def test_stop_sequences_cut_the_output(llm: ParrotLLM, chat: ChatParrot) -> None:
    free = llm.invoke("hello")
    stop = free.strip()[2:5]
    assert stop and stop in free
    cut = llm.generate(["hello"], stop=[stop])
    assert cut.generations[0][0].text == free[: free.index(stop)]
    assert cut.generations[0][0].generation_info == {"finish_reason": "stop"}
    # The model's own `stop` field, and `bind(stop=...)`, do the same.
    assert (
        ParrotLLM(base_url=llm.base_url, max_tokens=8, stop=[stop]).invoke("hello")
        == free[: free.index(stop)]
    )
    assert llm.bind(stop=[stop]).invoke("hello") == free[: free.index(stop)]
    message = chat.invoke("hello")
    chat_stop = str(message.content)[1:4]
    cut_message = chat.invoke("hello", stop=[chat_stop])
    assert cut_message.content == str(message.content)[: str(message.content).index(chat_stop)]
    assert cut_message.response_metadata["finish_reason"] == "stop"


def test_chat_usage_metadata_and_bound_parameters(chat: ChatParrot) -> None:
    message = chat.invoke("Hello")
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] == 8
    assert message.response_metadata["model_name"] == "tiny"
    short = chat.bind(max_tokens=3).invoke("Hello")
    assert short.usage_metadata is not None and short.usage_metadata["output_tokens"] == 3
    assert str(message.content).startswith(str(short.content))  # greedy: a prefix of the longer answer
    # call-time tools must already be OpenAI function tools (bind_tools converts the other kinds)
    with pytest.raises(TypeError, match="unsupported call argument tools"):
        chat.invoke("Hello", tools=[{"name": "x"}])


def test_chat_batch_runs_concurrently_and_matches_invoke(chat: ChatParrot) -> None:
    inputs = ["Hello", "Hey", "Good morning"]
    assert [m.content for m in chat.batch(inputs)] == [chat.invoke(i).content for i in inputs]


def test_chat_model_is_passed_to_the_server(chat: ChatParrot) -> None:
    with pytest.raises(P.NotFoundError, match="no-such-model"):
        chat.invoke("Hello", model="no-such-model")


def test_chat_rejects_what_the_server_cannot_take(chat: ChatParrot) -> None:
    image = HumanMessage(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    with pytest.raises(UnsupportedInputError, match="image_url"):
        chat.invoke([image])
    # a tool result must answer a call an earlier AI message made (OpenAI's rule), before any request
    with pytest.raises(UnsupportedInputError, match="tool"):
        chat.invoke([HumanMessage("hi"), ToolMessage("42", tool_call_id="1")])


# ------------------------------------------------------------------------------------------- failures
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_down_raises_after_retries_naming_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    chat = ChatParrot(base_url=url, max_retries=2, timeout=2)
    start = time.monotonic()
    with pytest.raises(P.ConnectionError) as info:
        chat.invoke("Hello")
    assert url in str(info.value) and "gave up after 3 attempts" in str(info.value)
    assert time.monotonic() - start < 5  # two backoffs, never a hang


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers (a hung or overloaded server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_slow_server_times_out(silent_server: str) -> None:
    llm = ParrotLLM(base_url=silent_server, timeout=0.3, max_retries=1)
    start = time.monotonic()
    with pytest.raises(P.ConnectionError, match="timed out") as info:
        llm.invoke("Hello")
    assert silent_server in str(info.value)
    assert time.monotonic() - start < 3


async def test_slow_server_times_out_async(silent_server: str) -> None:
    chat = ChatParrot(base_url=silent_server, timeout=0.3, max_retries=0)
    with pytest.raises(P.ConnectionError, match="timed out"):
        await chat.ainvoke("Hello")


def test_busy_server_is_retried_with_backoff() -> None:
    answers = iter([503, 502, 200])
    seen: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(time.monotonic())
        status = next(answers)
        if status != 200:
            return httpx.Response(status, json={"error": {"type": "no_engine", "message": "busy"}})
        body = {"id": "1", "created": 0, "model": "tiny", "choices": [{"index": 0, "text": "ok"}]}
        return httpx.Response(200, json=body)

    client = httpx.Client(transport=httpx.MockTransport(handler))
    llm = ParrotLLM(base_url="http://parrot.test", http_client=client, max_retries=2)
    assert llm.invoke("x") == "ok"
    assert len(seen) == 3
    assert seen[1] - seen[0] >= 0.25 and seen[2] - seen[1] >= 0.5  # exponential backoff


def test_busy_server_gives_up_with_its_error() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503, json={"error": {"type": "no_engine", "message": "no engine is free"}})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    llm = ParrotLLM(base_url="http://parrot.test", http_client=client, max_retries=1)
    with pytest.raises(P.ServiceUnavailableError, match=r"no engine is free.*gave up after 2 attempts"):
        llm.invoke("x")
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(P.ServiceUnavailableError):
        ParrotLLM(base_url="http://parrot.test", http_client=client, max_retries=0).invoke("x")
    assert len(calls) == 1


def test_client_errors_are_not_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(400, json={"error": {"type": "unsupported_option", "message": "n=2"}})

    llm = ParrotLLM(
        base_url="http://parrot.test", http_client=httpx.Client(transport=httpx.MockTransport(handler))
    )
    with pytest.raises(P.BadRequestError, match="n=2"):
        llm.invoke("x")
    assert len(calls) == 1


def test_backoff_doubles_and_is_capped() -> None:
    delays = [backoff_delay(n) for n in range(8)]
    assert 0.25 <= delays[0] <= 0.28 and 0.5 <= delays[1] <= 0.55
    assert all(d <= 4.4 for d in delays)
