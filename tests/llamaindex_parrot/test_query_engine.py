"""The query-engine path, offline: an index over local text, `ParrotLLM` in every response mode, and the
Parrot synthesizers giving LlamaIndex's answers in one round trip."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from llama_index.core import Document, SummaryIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llamaindex_parrot import ParrotLLM, ParrotTreeSummarize, get_response_synthesizer

from server.launcher import LaunchedServer
from tests.llamaindex_parrot.conftest import Prompts, Traffic, one_round_trip
from workload_text import stdlib_text

QUERY = "How do I join paths?"


@pytest.fixture(scope="module")
def index(tokenizer: Callable[[str], list[int]]) -> SummaryIndex:
    documents = [Document(text=stdlib_text(6_000)[:6_000])]
    splitter = SentenceSplitter(chunk_size=160, chunk_overlap=0, tokenizer=tokenizer)
    return SummaryIndex(splitter.get_nodes_from_documents(documents))


@pytest.fixture
def plain_llm(served: LaunchedServer) -> ParrotLLM:
    """No tokenizer of its own: LlamaIndex's and the Parrot synthesizers count with LlamaIndex's global
    tokenizer (tiktoken from its bundled cache, no download), so both pack alike."""
    return ParrotLLM(served.url, max_tokens=8, context_window=1024)


@pytest.mark.parametrize("mode", ["refine", "compact", "tree_summarize", "simple_summarize", "accumulate"])
def test_every_response_mode_runs_on_parrot(
    index: SummaryIndex, plain_llm: ParrotLLM, prompts: Prompts, mode: str
) -> None:
    response = index.as_query_engine(llm=plain_llm, response_mode=mode).query(QUERY)
    assert str(response)
    assert len(response.source_nodes) == len(index.index_struct.nodes) > 3
    # Every LLM call was an unrendered semantic call; nothing was rendered on the client.
    assert prompts.semantic and not prompts.completions


@pytest.mark.parametrize("mode", ["refine", "compact", "tree_summarize"])
def test_parrot_synthesizers_in_the_engine_give_llamaindex_answers(
    index: SummaryIndex, plain_llm: ParrotLLM, prompts: Prompts, traffic: Traffic, mode: str
) -> None:
    expected = index.as_query_engine(llm=plain_llm, response_mode=mode).query(QUERY)
    theirs = sorted(prompts.semantic)
    prompts.clear()
    traffic.take()
    # as_query_engine resolves an LLM even when given a synthesizer (Settings.llm would be OpenAI's).
    synthesizer = get_response_synthesizer(plain_llm, mode)
    engine = index.as_query_engine(llm=plain_llm, response_synthesizer=synthesizer)
    response = engine.query(QUERY)
    one_round_trip(traffic.take())
    assert str(response) == str(expected)
    assert sorted(prompts.semantic) == theirs


async def test_retriever_query_engine_async(
    index: SummaryIndex, plain_llm: ParrotLLM, traffic: Traffic
) -> None:
    engine = RetrieverQueryEngine(
        index.as_retriever(), response_synthesizer=ParrotTreeSummarize(llm=plain_llm)
    )
    expected = await index.as_query_engine(llm=plain_llm, response_mode="tree_summarize").aquery(QUERY)
    traffic.take()
    response = await engine.aquery(QUERY)
    one_round_trip(traffic.take())
    assert str(response) == str(expected)


@pytest.mark.parametrize("mode", ["compact", "tree_summarize"])
def test_streaming_query_engine_yields_tokens(index: SummaryIndex, plain_llm: ParrotLLM, mode: str) -> None:
    expected = str(index.as_query_engine(llm=plain_llm, response_mode=mode).query(QUERY))
    synthesizer = get_response_synthesizer(plain_llm, mode, streaming=True)
    engine = index.as_query_engine(llm=plain_llm, response_synthesizer=synthesizer, streaming=True)
    response = engine.query(QUERY)
    assert isinstance(response, StreamingResponse)
    parts = list(response.response_gen)
    assert len(parts) > 1 and "".join(parts) == expected


async def test_streaming_retriever_query_engine_async(index: SummaryIndex, plain_llm: ParrotLLM) -> None:
    expected = str(await index.as_query_engine(llm=plain_llm, response_mode="refine").aquery(QUERY))
    engine = RetrieverQueryEngine(
        index.as_retriever(),
        response_synthesizer=get_response_synthesizer(plain_llm, "refine", streaming=True),
    )
    response = await engine.aquery(QUERY)
    assert isinstance(response, AsyncStreamingResponse)
    parts = [part async for part in response.async_response_gen()]
    assert len(parts) > 1 and "".join(parts) == expected
