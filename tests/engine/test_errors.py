"""Bad input gets a typed error, fails only its own request, and the engine keeps serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.engine import (
    ContextBusyError,
    ContextExistsError,
    EngineConfig,
    EngineDeadError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    LLMEngine,
    PromptTooLongError,
    RequestAbortedError,
    SamplingParams,
    TokenOutOfVocabError,
    UnknownContextError,
)
from tests.engine.conftest import hf_greedy, prompts

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


async def still_serves(engine: LLMEngine, gqa_model: Path, cid: int) -> None:
    prompt = prompts(1, seed=cid)[0]
    await engine.fill(cid, prompt)
    assert (await engine.generate(cid, GREEDY)).token_ids == hf_greedy(gqa_model, prompt, 6)
    await engine.free_context(cid)


async def test_unknown_context(engine: LLMEngine, gqa_model: Path) -> None:
    with pytest.raises(UnknownContextError, match="context 9999 does not exist"):
        await engine.generate(9999, GREEDY)
    with pytest.raises(UnknownContextError):
        await engine.free_context(9999)
    await still_serves(engine, gqa_model, 500)


async def test_missing_parent(engine: LLMEngine, gqa_model: Path) -> None:
    with pytest.raises(UnknownContextError, match="parent context 777"):
        await engine.fill(501, [10, 11], parent_context_id=777)
    with pytest.raises(UnknownContextError, match="parent context 777"):
        await engine.generate(501, GREEDY, parent_context_id=777)
    assert engine.stats().contexts == 0
    await still_serves(engine, gqa_model, 502)


async def test_token_out_of_vocab(engine: LLMEngine, gqa_model: Path) -> None:
    for bad in ([5, 4096], [-1], [3, 10**9]):
        with pytest.raises(TokenOutOfVocabError, match="outside the vocabulary"):
            await engine.fill(503, bad)
    assert engine.stats().contexts == 0
    await still_serves(engine, gqa_model, 504)


async def test_prompt_longer_than_context_window(engine: LLMEngine, gqa_model: Path) -> None:
    with pytest.raises(PromptTooLongError, match="context window is 512"):
        await engine.fill(505, [7] * 513)
    await engine.fill(505, [7] * 512)  # exactly the window fills, but nothing more can be generated
    with pytest.raises(PromptTooLongError, match="room for one more"):
        await engine.generate(505, GREEDY)
    with pytest.raises(PromptTooLongError):
        await engine.fill(505, [7])
    await engine.free_context(505)
    await still_serves(engine, gqa_model, 506)


async def test_prompt_larger_than_kv_cache(gqa_model: Path) -> None:
    with LLMEngine.from_pretrained(gqa_model, EngineConfig(dtype="float32", num_kv_blocks=4)) as engine:
        with pytest.raises(PromptTooLongError, match="exceed the KV cache"):
            await engine.fill(1, [7] * 100)
        await still_serves(engine, gqa_model, 2)


@pytest.mark.parametrize(
    "params,field",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(max_tokens=-3), "max_tokens"),
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(stop_token_ids=[99999]), "stop_token_ids"),
        (SamplingParams(stop=[""]), "stop"),
    ],
)
async def test_bad_sampling_params(engine: LLMEngine, params: SamplingParams, field: str) -> None:
    await engine.fill(507, [10, 11, 12])
    with pytest.raises(InvalidSamplingParamsError, match=field):
        await engine.generate(507, params)
    assert (await engine.generate(507, GREEDY)).finish_reason == "length"  # the context is unharmed
    await engine.free_context(507)


async def test_empty_context_cannot_generate(engine: LLMEngine) -> None:
    await engine.fill(508, [])
    with pytest.raises(InvalidRequestError, match="empty"):
        await engine.generate(508, GREEDY)
    await engine.free_context(508)


async def test_context_used_by_two_generates_at_once(engine: LLMEngine, gqa_model: Path) -> None:
    prompt = prompts(1, seed=3)[0]
    await engine.fill(509, prompt)
    first = asyncio.ensure_future(engine.generate(509, SamplingParams(max_tokens=30, ignore_eos=True)))
    await asyncio.sleep(0)
    with pytest.raises(ContextBusyError, match="being extended"):
        await engine.generate(509, GREEDY)
    assert len((await first).token_ids) == 30  # the first one is unaffected
    await engine.free_context(509)
    await still_serves(engine, gqa_model, 510)


async def test_refork_existing_context_from_other_parent(engine: LLMEngine) -> None:
    await engine.fill(511, [10, 11])
    await engine.fill(512, [12, 13])
    await engine.fill(513, [14], parent_context_id=511)
    with pytest.raises(ContextExistsError, match="already exists"):
        await engine.fill(513, [15], parent_context_id=512)
    await engine.fill(513, [15], parent_context_id=511)  # same parent: just appends
    assert engine.context_length(513) == 4
    for c in (511, 512, 513):
        await engine.free_context(c)


async def test_free_while_generating_aborts_that_request(engine: LLMEngine, gqa_model: Path) -> None:
    await engine.fill(514, prompts(1, seed=4)[0])
    gen = asyncio.ensure_future(engine.generate(514, SamplingParams(max_tokens=200, ignore_eos=True)))
    await asyncio.sleep(0.05)
    await engine.free_context(514)
    with pytest.raises(RequestAbortedError):
        await gen
    assert engine.stats().blocks_used == 0
    await still_serves(engine, gqa_model, 515)


async def test_cancelled_generate_releases_the_context(engine: LLMEngine) -> None:
    await engine.fill(516, prompts(1, seed=5)[0])
    gen = asyncio.ensure_future(engine.generate(516, SamplingParams(max_tokens=400, ignore_eos=True)))
    await asyncio.sleep(0.05)
    gen.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gen
    result = await engine.generate(516, GREEDY)  # no longer busy
    assert len(result.token_ids) == 6
    await engine.free_context(516)


async def test_kv_exhaustion_under_4x_oversubscription(gqa_model: Path) -> None:
    """32 requests whose KV needs ~4x the cache all complete, with HF-identical greedy tokens."""
    batch = prompts(32, seed=6, low=20, high=40)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    need = sum(-(-(len(p) + 24) // 16) for p in batch)
    cfg = EngineConfig(dtype="float32", num_kv_blocks=need // 4, max_num_seqs=32, max_num_batched_tokens=512)
    with LLMEngine.from_pretrained(gqa_model, cfg) as engine:

        async def one(cid: int, prompt: list[int]) -> list[int]:
            await engine.fill(cid, prompt)
            out = (await engine.generate(cid, sampling)).token_ids
            await engine.free_context(cid)
            return out

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        stats = engine.stats()
        assert stats.preemptions + stats.evictions > 0
        assert stats.blocks_used == 0
    assert all(len(r) == 24 for r in results)
    assert results == [hf_greedy(gqa_model, p, 24) for p in batch]


async def test_shutdown_engine_answers_dead(gqa_model: Path) -> None:
    engine = LLMEngine.from_pretrained(gqa_model, EngineConfig(num_kv_blocks=16))
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        await engine.fill(1, [10])
