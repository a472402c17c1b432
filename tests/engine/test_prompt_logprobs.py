"""`LLMEngine.score`: a prompt's per-token log-probabilities from the fill's own prefill, against Hugging
Face's forward on the same weights, across chunked prefills, batches and the generate that follows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.errors import ContextExistsError, InvalidRequestError
from server.engine.sampling import TokenLogprob
from tests.engine.conftest import _hf_model, context_ids, prompts


def hf_scores(path: Path, prompt: list[int], top: int) -> list[tuple[int, float, list[int]]]:
    """Each token after the first: (token, its log-probability, the ``top`` likeliest ids) under HF."""
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([prompt])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    out = []
    for i, token in enumerate(prompt[1:]):
        ids = logprobs[i].topk(top).indices.tolist() if top else []
        out.append((token, logprobs[i, token].item(), ids))
    return out


def assert_matches(scored: list[TokenLogprob], expected: list[tuple[int, float, list[int]]]) -> None:
    assert [s.token_id for s in scored] == [e[0] for e in expected]
    assert [s.logprob for s in scored] == pytest.approx([e[1] for e in expected], abs=1e-4)
    assert [[t for t, _ in s.top] for s in scored] == [e[2] for e in expected]


async def test_scores_equal_hf_forward(engine: LLMEngine, gqa_model: Path) -> None:
    for prompt in prompts(4, seed=3, low=2, high=60):
        cid = next(context_ids)
        scored = await engine.score(cid, prompt, top=3)
        await engine.free_context(cid)
        assert len(scored) == len(prompt) - 1
        assert_matches(scored, hf_scores(gqa_model, prompt, 3))


async def test_a_prompt_longer_than_the_token_budget_is_scored_across_its_chunks(
    engine: LLMEngine, gqa_model: Path
) -> None:
    prompt = prompts(1, seed=5, low=300, high=301)[0]  # the engine's budget is 256 tokens a step
    cid = next(context_ids)
    scored = await engine.score(cid, prompt, top=1)
    await engine.free_context(cid)
    assert_matches(scored, hf_scores(gqa_model, prompt, 1))


async def test_scoring_fills_batched_with_generates_score_as_alone(engine: LLMEngine) -> None:
    batch = prompts(6, seed=7, low=2, high=50)
    alone = []
    for prompt in batch:
        cid = next(context_ids)
        alone.append(await engine.score(cid, prompt))
        await engine.free_context(cid)
    gen_id = next(context_ids)
    await engine.fill(gen_id, batch[0])
    ids = [next(context_ids) for _ in batch]
    together, _ = await asyncio.gather(
        asyncio.gather(*(engine.score(c, p) for c, p in zip(ids, batch, strict=True))),
        engine.generate(gen_id, SamplingParams(max_tokens=8, ignore_eos=True)),
    )
    for c in [*ids, gen_id]:
        await engine.free_context(c)
    for a, t in zip(alone, together, strict=True):
        assert [s.token_id for s in t] == [s.token_id for s in a]
        assert [s.logprob for s in t] == pytest.approx([s.logprob for s in a], abs=1e-5)
        assert all(s.top == () for s in t)


async def test_a_generate_continues_a_scored_context(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=11, low=20, high=21)[0]
    cid = next(context_ids)
    await engine.score(cid, prompt, top=2)
    first = await engine.generate(cid, SamplingParams(max_tokens=1, ignore_eos=True, logprobs=2))
    await engine.free_context(cid)
    assert first.logprobs is not None
    rescored_id = next(context_ids)
    rescored = await engine.score(rescored_id, prompt + first.token_ids, top=2)
    await engine.free_context(rescored_id)
    # The generated token's logprob is the one the longer prompt's score gives it.
    assert rescored[-1].token_id == first.token_ids[0]
    assert rescored[-1].logprob == pytest.approx(first.logprobs[0].logprob, abs=1e-5)


async def test_one_token_scores_nothing(engine: LLMEngine) -> None:
    cid = next(context_ids)
    assert await engine.score(cid, [42], top=1) == []
    assert engine.context_length(cid) == 1
    await engine.free_context(cid)


async def test_scoring_needs_a_new_context_and_a_bounded_top(engine: LLMEngine) -> None:
    cid = next(context_ids)
    await engine.fill(cid, [5, 6, 7])
    with pytest.raises(ContextExistsError, match="new context id"):
        await engine.score(cid, [8, 9])
    with pytest.raises(InvalidRequestError, match=r"integer in \[0, 20\]"):
        await engine.score(next(context_ids), [8, 9], top=21)
    with pytest.raises(InvalidRequestError, match="no tokens to score"):
        await engine.score(next(context_ids), [])
    await engine.free_context(cid)
    # The engine serves on.
    assert len(await engine.score(next(context_ids), [8, 9, 10])) == 2


async def test_a_preempted_scoring_fill_scores_each_token_once(gqa_model: Path) -> None:
    # 20 blocks of 16 tokens: two generates that keep growing preempt the scoring fill that came after them,
    # which then recomputes its chunks.
    config = EngineConfig(dtype="float32", num_kv_blocks=20, max_num_batched_tokens=32, block_size=16)
    eng = LLMEngine.from_pretrained(gqa_model, config)
    firsts, (prompt,) = prompts(2, seed=13, low=40, high=41), prompts(1, seed=17, low=150, high=151)
    halfway = asyncio.Event()

    async def grow(cid: int, p: list[int]) -> None:
        await eng.fill(cid, p)
        n = 0
        async for _ in eng.generate_stream(cid, SamplingParams(max_tokens=130, ignore_eos=True)):
            n += 1
            if n == 60:
                halfway.set()

    async def score_later() -> list[TokenLogprob]:
        await halfway.wait()
        return await eng.score(next(context_ids), prompt, top=1)

    try:
        *_, scored = await asyncio.gather(*(grow(next(context_ids), p) for p in firsts), score_later())
        preemptions = eng.core.scheduler.num_preemptions
    finally:
        eng.shutdown()
    assert preemptions > 0
    assert_matches(scored, hf_scores(gqa_model, prompt, 1))
