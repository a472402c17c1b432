"""The Parrot synthesizers with ``streaming=True``: the final answer token by token, joining to the
non-streaming answer; the DAG still one submission; the session deleted however the stream ends."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable, Iterator

import parrot as P
import pytest
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, TextNode
from llamaindex_parrot import ParrotCompactAndRefine, ParrotLLM, ParrotRefine, ParrotTreeSummarize

from server.launcher import LaunchedServer
from tests.llamaindex_parrot.conftest import BATCH, CALLS, DELETE, GET, SESSION, Traffic, while_ticking
from tests.llamaindex_parrot.test_synthesizers import QUERY, REFINE_WINDOW, TREE_WINDOW

STREAM = ("GET", "/v1/sessions/{session_id}/variables/{var_id}/stream")
SYNTHESIZERS: list[tuple[type[BaseSynthesizer], int]] = [
    (ParrotRefine, REFINE_WINDOW),
    (ParrotCompactAndRefine, REFINE_WINDOW),
    (ParrotTreeSummarize, TREE_WINDOW),
]
IDS = ["refine", "compact", "tree_summarize"]
Make = Callable[..., BaseSynthesizer]


@pytest.fixture(params=SYNTHESIZERS, ids=IDS)
def make(request: pytest.FixtureRequest, llm: ParrotLLM) -> Make:
    """``make(**options)``: a Parrot synthesizer whose window makes a real chain / tree of four chunks."""
    cls, window = request.param
    sized = llm.model_copy(update={"context_window": window})
    return lambda **kwargs: cls(llm=sized, **kwargs)


@pytest.fixture
def sessions(served: LaunchedServer) -> Callable[[], int]:
    """How many sessions the server has open now."""
    return lambda: len(served.manager.sessions)


def streamed_once(counts: dict[tuple[str, str], int]) -> None:
    """The query's calls went in one submission and its answer came through one stream, no get."""
    assert counts[SESSION] == 0 and counts[DELETE] == 1, counts  # (opened by its batch)
    assert counts[CALLS] + counts[BATCH] == 1 and counts[GET] == 0, counts
    assert counts[STREAM] >= 1, counts


def test_get_response_streams_the_answer(
    make: Make, chunks: list[str], traffic: Traffic, sessions: Callable[[], int]
) -> None:
    expected = make().get_response(QUERY, chunks[:4])
    before = sessions()
    traffic.take()
    gen = make(streaming=True).get_response(QUERY, chunks[:4])
    assert isinstance(gen, Iterator) and not isinstance(gen, str)
    parts = [next(gen)]
    # The session is open while the stream is, but it is not the reader's current session.
    assert sessions() == before + 1
    with pytest.raises(RuntimeError, match="no active Parrot session"):
        P.current_session()
    parts += list(gen)
    assert len(parts) > 1 and all(parts), parts
    assert "".join(parts) == expected
    assert sessions() == before
    streamed_once(traffic.take())


def test_synthesize_gives_a_streaming_response(make: Make, chunks: list[str]) -> None:
    nodes = [NodeWithScore(node=TextNode(text=c), score=1.0) for c in chunks[:4]]
    expected = str(make().synthesize(QUERY, nodes))
    response = make(streaming=True).synthesize(QUERY, nodes)
    assert isinstance(response, StreamingResponse)
    parts = list(response.response_gen)
    assert len(parts) > 1 and "".join(parts) == expected
    assert len(response.source_nodes) == 4


async def test_async_streams_without_blocking_the_loop(
    make: Make, chunks: list[str], traffic: Traffic, sessions: Callable[[], int]
) -> None:
    expected = await make().aget_response(QUERY, chunks[:4])
    before = sessions()
    traffic.take()

    async def read() -> list[str]:
        gen = await make(streaming=True).aget_response(QUERY, chunks[:4])
        assert isinstance(gen, AsyncIterator)
        return [part async for part in gen]

    parts, ticks, took = await while_ticking(read)
    assert len(parts) > 1 and "".join(parts) == expected
    assert ticks >= min(3, took / 0.02), (ticks, took)  # the event loop ran meanwhile
    assert sessions() == before
    streamed_once(traffic.take())

    nodes = [NodeWithScore(node=TextNode(text=c), score=1.0) for c in chunks[:4]]
    response = await make(streaming=True).asynthesize(QUERY, nodes)
    assert isinstance(response, AsyncStreamingResponse)
    parts = [part async for part in response.async_response_gen()]
    assert len(parts) > 1 and "".join(parts) == expected


def test_closing_or_dropping_the_stream_deletes_the_session(
    make: Make, chunks: list[str], traffic: Traffic, sessions: Callable[[], int]
) -> None:
    before = sessions()
    traffic.take()
    gen = make(streaming=True).get_response(QUERY, chunks[:4])
    next(gen)
    gen.close()
    assert sessions() == before
    unread = make(streaming=True).get_response(QUERY, chunks[:4])
    assert sessions() == before + 1
    del unread
    gc.collect()
    assert sessions() == before
    counts = traffic.take()
    assert counts[SESSION] == 0 and counts[DELETE] == 2, counts


async def test_async_closing_or_dropping_the_stream_deletes_the_session(
    make: Make, chunks: list[str], sessions: Callable[[], int]
) -> None:
    before = sessions()
    gen = await make(streaming=True).aget_response(QUERY, chunks[:4])
    await gen.__anext__()
    await gen.aclose()
    assert sessions() == before
    unread = await make(streaming=True).aget_response(QUERY, chunks[:4])
    assert sessions() == before + 1
    del unread
    gc.collect()  # the event loop closes a collected async generator in a task of its own
    for _ in range(200):
        if sessions() == before:
            break
        await asyncio.sleep(0.01)
    assert sessions() == before


def test_a_failed_answer_raises_from_the_stream(
    served: LaunchedServer, tokenizer: Callable[[str], list[int]], sessions: Callable[[], int]
) -> None:
    """A window the server does not have (given, so never checked): the second chunk's step fails, and so
    does the answer depending on it."""
    llm = ParrotLLM(served.url, model="tiny", context_window=100_000, max_tokens=8, tokenizer=tokenizer)
    chunks = ["The sky is blue.", "word " * 6000]
    before = sessions()
    for cls in (ParrotRefine, ParrotTreeSummarize):
        gen = cls(llm=llm, streaming=True).get_response(QUERY, chunks)
        with pytest.raises(P.VariableFailedError, match="4096"):
            list(gen)
        assert sessions() == before


async def test_async_failed_answer_raises_from_the_stream(
    served: LaunchedServer, tokenizer: Callable[[str], list[int]], sessions: Callable[[], int]
) -> None:
    llm = ParrotLLM(served.url, model="tiny", context_window=100_000, max_tokens=8, tokenizer=tokenizer)
    before = sessions()
    gen = await ParrotRefine(llm=llm, streaming=True).aget_response(QUERY, ["Blue.", "word " * 6000])
    with pytest.raises(P.VariableFailedError, match="4096"):
        [part async for part in gen]
    assert sessions() == before


async def test_errors_before_the_submission_raise_from_the_call(dead_url: str, chunks: list[str]) -> None:
    llm = ParrotLLM(dead_url, model="tiny", context_window=REFINE_WINDOW, max_tokens=8)
    with pytest.raises(P.ConnectionError, match=dead_url):
        ParrotRefine(llm=llm, streaming=True).get_response(QUERY, chunks[:2])
    with pytest.raises(P.ConnectionError, match=dead_url):
        await ParrotTreeSummarize(llm=llm, streaming=True).aget_response(QUERY, chunks[:2])
