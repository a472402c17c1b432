"""The Parrot synthesizers against LlamaIndex's own, same LLM and prompt helper: same prompts, same answer,
one submission and one get per query (streaming: test_streaming.py)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import parrot as P
import pytest
from llama_index.core.prompts import PromptTemplate
from llama_index.core.response_synthesizers import (
    BaseSynthesizer,
    CompactAndRefine,
    Refine,
    TreeSummarize,
)
from llama_index.core.schema import NodeWithScore, TextNode
from llamaindex_parrot import (
    EmptyNodesError,
    MissingTemplateVariableError,
    ParrotCompactAndRefine,
    ParrotLLM,
    ParrotRefine,
    ParrotTreeSummarize,
    UnsupportedSynthesisError,
)
from llamaindex_parrot.packing import default_answer_budget

from tests.llamaindex_parrot.conftest import (
    BATCH,
    CALLS,
    GET,
    Prompts,
    Traffic,
    one_round_trip,
    while_ticking,
)

QUERY = "What does the standard library say about files?"
# Windows that make real structures of eight 120-token chunks: LlamaIndex leaves 500 tokens of room
# beside each refine chunk, so 1024 tokens keep every chunk whole (a chain of 8 refine steps; "compact"
# packs them into 3); a 400-token window splits the tree's text into 3 map calls and a reduce.
REFINE_WINDOW, TREE_WINDOW = 1024, 400
PAIRS: list[tuple[type[BaseSynthesizer], type[BaseSynthesizer], int]] = [
    (ParrotRefine, Refine, REFINE_WINDOW),
    (ParrotCompactAndRefine, CompactAndRefine, REFINE_WINDOW),
    (ParrotTreeSummarize, TreeSummarize, TREE_WINDOW),
]
PAIR_IDS = ["refine", "compact", "tree_summarize"]


@pytest.fixture
def small_llm(llm: ParrotLLM) -> ParrotLLM:
    return llm.model_copy(update={"context_window": REFINE_WINDOW})


@pytest.fixture
def tree_llm(llm: ParrotLLM) -> ParrotLLM:
    return llm.model_copy(update={"context_window": TREE_WINDOW})


def compare(
    ours: BaseSynthesizer,
    theirs: BaseSynthesizer,
    chunks: list[str],
    prompts: Prompts,
    traffic: Traffic,
    **kwargs: Any,
) -> tuple[str, list[str]]:
    """Run both on ``chunks``; assert the same answer and the same rendered prompts; our query's traffic
    is one submission and one get. Returns the answer and the prompts."""
    traffic.take()
    answer = ours.get_response(QUERY, chunks, **kwargs)
    one_round_trip(traffic.take())
    ours_prompts = list(prompts.semantic)
    prompts.clear()
    expected = theirs.get_response(QUERY, chunks, **kwargs)
    assert answer == expected
    # Same calls: LlamaIndex's map calls run one by one, the server's in any order.
    assert sorted(ours_prompts) == sorted(prompts.semantic)
    return answer, ours_prompts


@pytest.mark.parametrize(("ours", "theirs", "window"), PAIRS, ids=PAIR_IDS)
def test_same_answer_and_prompts_in_one_round_trip(
    llm: ParrotLLM,
    chunks: list[str],
    prompts: Prompts,
    traffic: Traffic,
    ours: type[BaseSynthesizer],
    theirs: type[BaseSynthesizer],
    window: int,
) -> None:
    sized = llm.model_copy(update={"context_window": window})
    helper = sized.prompt_helper()
    answer, rendered = compare(
        ours(llm=sized), theirs(llm=sized, prompt_helper=helper), chunks, prompts, traffic
    )
    assert answer
    assert len(rendered) >= 3  # a real chain / tree, not one call


def test_tree_has_a_map_stage_and_one_reduce(
    tree_llm: ParrotLLM, chunks: list[str], prompts: Prompts
) -> None:
    ours = ParrotTreeSummarize(llm=tree_llm)
    helper = tree_llm.prompt_helper()
    packed = helper.repack(ours.get_prompts()["summary_template"].partial_format(query_str=QUERY), chunks)
    assert len(packed) > 1
    ours.get_response(QUERY, chunks)
    assert len(prompts.semantic) == len(packed) + 1
    reduce_prompt = prompts.semantic[-1]
    assert reduce_prompt.count("\n\n") >= len(packed) - 1


async def test_async_matches_sync(
    small_llm: ParrotLLM, tree_llm: ParrotLLM, chunks: list[str], traffic: Traffic
) -> None:
    for synth in (ParrotRefine(llm=small_llm), ParrotTreeSummarize(llm=tree_llm)):
        expected = synth.get_response(QUERY, chunks[:4])
        traffic.take()
        answer, ticks, took = await while_ticking(lambda s=synth: s.aget_response(QUERY, chunks[:4]))
        assert answer == expected
        assert ticks >= min(3, took / 0.02), (ticks, took)  # the event loop ran meanwhile
        one_round_trip(traffic.take())


@pytest.mark.parametrize(("ours", "theirs", "window"), [PAIRS[0], PAIRS[2]], ids=["refine", "tree_summarize"])
def test_packing_that_depends_on_an_answer_waits_for_it(
    llm: ParrotLLM,
    chunks: list[str],
    prompts: Prompts,
    traffic: Traffic,
    ours: type[BaseSynthesizer],
    theirs: type[BaseSynthesizer],
    window: int,
) -> None:
    """With an answer budget no prompt can hold, every decision waits for the answer it depends on: more
    round trips, still LlamaIndex's answer and prompts."""
    sized = llm.model_copy(update={"context_window": window})
    synth = ours(llm=sized, answer_token_budget=100_000)
    traffic.take()
    answer = synth.get_response(QUERY, chunks[:4])
    counts = traffic.take()
    assert counts[BATCH] + counts[CALLS] + counts[GET] > 2
    ours_prompts = sorted(prompts.semantic)
    prompts.clear()
    assert answer == theirs(llm=sized, prompt_helper=sized.prompt_helper()).get_response(QUERY, chunks[:4])
    assert ours_prompts == sorted(prompts.semantic)


def test_custom_templates_with_partials(
    small_llm: ParrotLLM, chunks: list[str], prompts: Prompts, traffic: Traffic
) -> None:
    qa = PromptTemplate("[{style}] Facts: {context_str}\nQ: {query_str}\nA: ").partial_format(style="terse")
    refine = PromptTemplate(
        "[{style}] Q: {query_str}\nDraft: {existing_answer}\nMore: {context_msg}\nBetter: "
    ).partial_format(style="terse")
    ours = ParrotRefine(llm=small_llm, text_qa_template=qa, refine_template=refine)
    theirs = Refine(
        llm=small_llm, prompt_helper=small_llm.prompt_helper(), text_qa_template=qa, refine_template=refine
    )
    _, rendered = compare(ours, theirs, chunks[:3], prompts, traffic)
    assert rendered[0].startswith("[terse] Facts: ") and rendered[1].startswith("[terse] Q: ")


def test_response_kwargs_and_prev_response(
    small_llm: ParrotLLM, chunks: list[str], prompts: Prompts, traffic: Traffic
) -> None:
    qa = PromptTemplate("({lang}) {context_str}\nQ: {query_str}\nA: ")
    refine = PromptTemplate("({lang}) {query_str} | {existing_answer} | {context_msg} -> ")
    ours = ParrotRefine(llm=small_llm, text_qa_template=qa, refine_template=refine)
    theirs = Refine(
        llm=small_llm, prompt_helper=small_llm.prompt_helper(), text_qa_template=qa, refine_template=refine
    )
    _, rendered = compare(ours, theirs, chunks[:2], prompts, traffic, lang="en")
    assert rendered[0].startswith(f"(en) {chunks[0][:20]}") and rendered[1].startswith(f"(en) {QUERY} | ")
    prompts.clear()
    _, rendered = compare(ours, theirs, chunks[:2], prompts, traffic, lang="en", prev_response="Earlier.")
    assert rendered[0].startswith(f"(en) {QUERY} | Earlier. | {chunks[0][:20]}")


def test_empty_nodes(small_llm: ParrotLLM, traffic: Traffic) -> None:
    assert small_llm.metadata.context_window  # the model card, read once on first use
    traffic.take()
    for cls in (ParrotRefine, ParrotCompactAndRefine, ParrotTreeSummarize):
        with pytest.raises(EmptyNodesError, match="no nodes"):
            cls(llm=small_llm).synthesize(QUERY, [])
        with pytest.raises(EmptyNodesError, match="no text chunks"):
            cls(llm=small_llm).get_response(QUERY, [])
        assert (
            str(cls(llm=small_llm, empty_response="Nothing found.").synthesize(QUERY, [])) == "Nothing found."
        )
    assert not traffic.take()


def test_synthesize_returns_a_response_with_sources(tree_llm: ParrotLLM, chunks: list[str]) -> None:
    nodes = [NodeWithScore(node=TextNode(text=c), score=1.0) for c in chunks[:2]]
    response = ParrotTreeSummarize(llm=tree_llm).synthesize(QUERY, nodes)
    assert str(response) and [n.node.get_content() for n in response.source_nodes] == chunks[:2]


def test_missing_template_variable_submits_nothing(
    small_llm: ParrotLLM, chunks: list[str], traffic: Traffic
) -> None:
    qa = PromptTemplate("{context_str} {query_str} {audience}")
    with pytest.raises(MissingTemplateVariableError, match="'audience'"):
        ParrotRefine(llm=small_llm, text_qa_template=qa).get_response(QUERY, chunks[:2])
    counts = traffic.take()
    assert counts[BATCH] + counts[CALLS] == 0


def test_unreachable_server(dead_url: str, chunks: list[str]) -> None:
    llm = ParrotLLM(dead_url, model="tiny", context_window=640, max_tokens=8)
    started = time.perf_counter()
    for cls in (ParrotRefine, ParrotTreeSummarize):
        with pytest.raises(P.ConnectionError, match=dead_url):
            cls(llm=llm).get_response(QUERY, chunks[:2])
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda llm: ParrotRefine(llm=llm, structured_answer_filtering=True), "structured_answer_filtering"),
        (lambda llm: ParrotRefine(llm=llm, output_cls=dict), "output_cls"),
        (lambda llm: ParrotTreeSummarize(llm=llm, multimodal=True), "multimodal"),
    ],
    ids=["filtering", "output_cls", "multimodal"],
)
def test_options_that_need_client_code_are_refused(
    small_llm: ParrotLLM, make: Callable[[ParrotLLM], Any], match: str
) -> None:
    with pytest.raises(UnsupportedSynthesisError, match=match):
        make(small_llm)


def test_needs_a_parrot_llm() -> None:
    from llama_index.core.llms import MockLLM

    with pytest.raises(TypeError, match="ParrotLLM"):
        ParrotRefine(llm=MockLLM())


def test_default_answer_budget_bounds_reencoded_answers(tokenizer: Callable[[str], list[int]]) -> None:
    """Any n generated tokens, decoded and counted again with the engine's tokenizer, stay within the
    default budget — also byte tokens that decode to U+FFFD."""
    from tokenizers import Tokenizer

    from server.engine.tiny import TOKENIZER_DIR

    decode = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json")).decode
    rng = random.Random(0)
    for n in (1, 2, 8, 32):
        for _ in range(300):
            ids = [rng.randrange(3, 4096) for _ in range(n)]
            assert len(tokenizer(decode(ids))) <= default_answer_budget(n)
