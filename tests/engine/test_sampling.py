"""Sampling: greedy, temperature with seeds, top-k, top-p, stop strings, stop ids, EOS, streaming."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from server.engine import ContextBusyError, LLMEngine, SamplingParams
from server.engine.sampling import greedy_tokens, sample
from tests.engine.conftest import prompts

_ids = itertools.count(1000)


async def gen(engine: LLMEngine, prompt: list[int], sampling: SamplingParams) -> tuple[list[int], str, str]:
    cid = next(_ids)
    await engine.fill(cid, prompt)
    r = await engine.generate(cid, sampling)
    await engine.free_context(cid)
    return r.token_ids, r.text, r.finish_reason


@pytest.mark.parametrize("vocab", [49152, 1000, 256])  # chunked (SmolLM2's), not a chunk multiple, one chunk
def test_greedy_tokens_equal_argmax_with_ties_and_nan(vocab: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, vocab, generator=gen)
    logits[1, [7, vocab - 3]] = 100.0  # a tie: the first index wins
    logits[2, vocab - 1] = 100.0  # the last column
    logits[3] = -torch.inf
    logits[4, [5, 200]] = torch.nan  # argmax takes the first NaN as the maximum
    logits[5, 130:140] = 55.0
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits[:, :-1].contiguous()), logits[:, :-1].argmax(dim=-1))


def test_sampler_filters() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]] * 200)
    greedy = sample(logits[:1], [SamplingParams()], [None])
    assert greedy == [1]
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    top_k = sample(logits, [SamplingParams(temperature=1.0, top_k=2)] * 200, gens)
    assert set(top_k) == {1, 2}
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    top_p = sample(logits, [SamplingParams(temperature=1.0, top_p=0.4)] * 200, gens)
    assert set(top_p) == {1}  # token 1 alone carries >= 40% of the mass
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    hot = sample(logits, [SamplingParams(temperature=5.0)] * 200, gens)
    assert {0, 1, 2, 3} <= set(hot)


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # softmax([0, 1, 2, 3] / 1.0)
        (SamplingParams(temperature=1.0), [0.0321, 0.0871, 0.2369, 0.6439]),
        # / 2.0: flatter
        (SamplingParams(temperature=2.0), [0.1015, 0.1674, 0.2760, 0.4551]),
        # top-k 2 renormalises the two likeliest
        (SamplingParams(temperature=1.0, top_k=2), [0.0, 0.0, 0.2689, 0.7311]),
        # top-p 0.8: 0.6439 alone is short of it, with 0.2369 it is reached
        (SamplingParams(temperature=1.0, top_p=0.8), [0.0, 0.0, 0.2689, 0.7311]),
    ],
)
def test_sampled_frequencies_follow_the_filtered_distribution(
    params: SamplingParams, expected: list[float]
) -> None:
    """20,000 draws (each row its own seeded generator) land within 4 standard errors of each probability."""
    n = 20_000
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).expand(n, 4)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    counts = torch.bincount(torch.tensor(sample(logits, [params] * n, gens)), minlength=4) / n
    for got, p in zip(counts.tolist(), expected, strict=True):
        assert abs(got - p) <= 4 * (p * (1 - p) / n) ** 0.5 + 1e-9, (counts, expected)


def test_a_seeded_row_ignores_the_rest_of_the_batch() -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=5)
    alone = sample(logits[2:3], [mine], [torch.Generator().manual_seed(5)])
    others = [SamplingParams(temperature=t) for t in (0.0, 1.5, 0.7)] + [SamplingParams(), SamplingParams()]
    params = [*others[:2], mine, *others[2:]]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(5)]
    gens += [torch.Generator().manual_seed(2), None, None]
    assert sample(logits, params, gens)[2] == alone[0]


async def test_seeded_sampling_is_reproducible_and_batch_independent(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=20)[0]
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = await gen(engine, prompt, sp)
    others = [gen(engine, p, SamplingParams(max_tokens=16, temperature=1.0)) for p in prompts(5, seed=21)]
    together = await asyncio.gather(gen(engine, prompt, sp), *others)
    assert together[0] == alone
    other_seed = await gen(engine, prompt, SamplingParams(**{**sp.__dict__, "seed": 99}))
    assert other_seed[0] != alone[0]


async def test_top_k_1_is_greedy(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=22)[0]
    greedy = await gen(engine, prompt, SamplingParams(max_tokens=10, ignore_eos=True))
    top1 = await gen(engine, prompt, SamplingParams(max_tokens=10, temperature=0.7, top_k=1, ignore_eos=True))
    assert top1[0] == greedy[0]


async def test_stop_token_ids_and_stop_strings(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=23)[0]
    full_ids, full_text, _ = await gen(engine, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    stop_id = full_ids[5]
    ids, _, reason = await gen(engine, prompt, SamplingParams(max_tokens=20, stop_token_ids=[stop_id]))
    assert reason == "stop" and ids == full_ids[: full_ids.index(stop_id) + 1]
    needle = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert needle
    _, text, reason = await gen(engine, prompt, SamplingParams(max_tokens=20, stop=[needle], ignore_eos=True))
    assert reason == "stop" and text == full_text[: full_text.index(needle)]


async def test_eos_stops_unless_ignored(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=24)[0]
    full_ids, _, _ = await gen(engine, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    # Treat the 4th greedy token as this request's EOS: the engine stops there, or not when told to ignore it.
    eos = full_ids[3]
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos})
    try:
        ids, _, reason = await gen(engine, prompt, SamplingParams(max_tokens=8))
        assert reason == "stop" and ids[-1] == eos and len(ids) == full_ids.index(eos) + 1
        ids, _, reason = await gen(engine, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        assert reason == "length" and ids == full_ids
    finally:
        engine.eos_token_ids = saved


async def test_stream_yields_the_same_tokens(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=25)[0]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    ids, _, _ = await gen(engine, prompt, sp)
    cid = next(_ids)
    await engine.fill(cid, prompt)
    streamed = [t async for t in engine.generate_stream(cid, sp)]
    await engine.free_context(cid)
    assert streamed == ids


async def test_leaving_a_stream_early_aborts_it(engine: LLMEngine) -> None:
    cid = next(_ids)
    await engine.fill(cid, prompts(1, seed=26)[0])
    stream = engine.generate_stream(cid, SamplingParams(max_tokens=300, ignore_eos=True))
    got = []
    async for t in stream:
        got.append(t)
        if len(got) == 3:
            break
    await stream.aclose()
    # the context is free again once the abort lands
    for _ in range(100):
        try:
            await engine.fill(cid, [10])
            break
        except ContextBusyError:
            await asyncio.sleep(0.01)
    assert engine.context_length(cid) < len(prompts(1, seed=26)[0]) + 300
    await engine.free_context(cid)


@pytest.mark.parametrize("stop", [[], ["zz"]])
def test_incremental_detokenizer_reassembles_text(engine: LLMEngine, stop: list[str]) -> None:
    from server.engine.detokenize import IncrementalDetokenizer

    text = "héllo wörld — 你好, emoji 🦜 done zz"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(engine.tokenizer, stop)
    out = "".join(detok.push(t) for t in ids)
    assert "\ufffd" not in out
    assert text.startswith(out)
    assert out + detok.finish(text) == text


def test_incremental_detokenizer_never_streams_a_stop_string_arriving_in_one_token(engine: LLMEngine) -> None:
    from server.engine.detokenize import IncrementalDetokenizer

    text = "alpha beta STOP gamma"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    for stop in (["STOP"], ["a beta S"], ["ST", "gam"]):
        detok = IncrementalDetokenizer(engine.tokenizer, stop)
        out = "".join(detok.push(t) for t in ids)
        cut = min(text.find(s) for s in stop)
        assert out == text[:cut][: len(out)] and not any(s in out for s in stop)
        assert out + detok.finish(text[:cut]) == text[:cut]
