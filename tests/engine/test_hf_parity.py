"""Greedy tokens of our engine equal Hugging Face `generate` on the same saved weights."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from kernels import cpu_kernels
from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.conftest import GREEDY, context_ids, hf_greedy, prompts, run_prompt


async def test_single_request_matches_hf(engine: LLMEngine, gqa_model: Path) -> None:
    prompt = prompts(1, seed=1)[0]
    assert await run_prompt(engine, prompt) == hf_greedy(gqa_model, prompt, GREEDY.max_tokens)


@pytest.fixture(params=["cpp_kernel", "torch_path"])
def cpu_decode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which CPU decode attention runs: our C++ kernel (where it builds) or the torch path."""
    if request.param == "torch_path":
        monkeypatch.setattr(cpu_kernels, "paged_decode_kernel", lambda: None)
    elif cpu_kernels.paged_decode_kernel() is None:
        pytest.skip("the CPU kernel could not be built here")
    return str(request.param)


async def test_batch_of_8_different_lengths_matches_hf(
    engine: LLMEngine, gqa_model: Path, cpu_decode: str
) -> None:
    batch = prompts(8, seed=2, low=2, high=60)
    ours = await asyncio.gather(*(run_prompt(engine, p) for p in batch))
    assert ours == [hf_greedy(gqa_model, p, GREEDY.max_tokens) for p in batch]


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("mha", {"num_key_value_heads": 4}),
        ("gqa4", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8}),
        (
            "llama3_rope",
            {
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            },
        ),
        ("linear_rope", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        ("tied", {"tie_word_embeddings": True}),
        ("bias", {"attention_bias": True, "mlp_bias": True}),
    ],
)
async def test_architecture_variants_match_hf(
    model_factory: Callable[..., Path], name: str, overrides: dict
) -> None:
    path = model_factory(name, **overrides)
    batch = prompts(3, seed=3, low=5, high=50)
    with LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", num_kv_blocks=128)) as engine:
        ours = await asyncio.gather(*(run_prompt(engine, p) for p in batch))
    assert ours == [hf_greedy(path, p, GREEDY.max_tokens) for p in batch]


async def test_sharded_checkpoint_loads(tmp_path: Path, gqa_model: Path) -> None:
    from tests.engine.conftest import save_hf_model

    path = save_hf_model(tmp_path / "sharded", max_shard_size="200KB")
    assert (path / "model.safetensors.index.json").is_file()
    prompt = prompts(1, seed=4)[0]
    with LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", num_kv_blocks=64)) as engine:
        assert await run_prompt(engine, prompt) == hf_greedy(gqa_model, prompt, GREEDY.max_tokens)


async def test_fork_of_shared_prefix_equals_full_prompt(engine: LLMEngine, gqa_model: Path) -> None:
    prefix = prompts(1, seed=5, low=37, high=38)[0]  # not a multiple of the block size
    suffixes = prompts(4, seed=6, low=1, high=20)
    root = next(context_ids)
    await engine.fill(root, prefix)
    children = [next(context_ids) for _ in suffixes]
    await asyncio.gather(
        *(engine.fill(c, s, parent_context_id=root) for c, s in zip(children, suffixes, strict=True))
    )
    forked = await asyncio.gather(*(engine.generate(c, GREEDY) for c in children))
    for c in [root, *children]:
        await engine.free_context(c)
    assert [r.token_ids for r in forked] == [
        hf_greedy(gqa_model, prefix + s, GREEDY.max_tokens) for s in suffixes
    ]


async def test_generate_directly_from_parent_context(engine: LLMEngine, gqa_model: Path) -> None:
    prompt = prompts(1, seed=7, low=32, high=33)[0]  # exactly two full blocks
    root = next(context_ids)
    await engine.fill(root, prompt)
    kids = [next(context_ids) for _ in range(3)]
    results = await asyncio.gather(*(engine.generate(k, GREEDY, parent_context_id=root) for k in kids))
    for c in [root, *kids]:
        await engine.free_context(c)
    expected = hf_greedy(gqa_model, prompt, GREEDY.max_tokens)
    assert all(r.token_ids == expected for r in results)


async def test_chunked_fill_equals_one_fill(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=8, low=45, high=46)[0]
    whole = await run_prompt(engine, prompt)
    cid = next(context_ids)
    for start in range(0, len(prompt), 7):
        await engine.fill(cid, prompt[start : start + 7])
    pieces = (await engine.generate(cid, GREEDY)).token_ids
    await engine.free_context(cid)
    assert pieces == whole


async def test_continuing_after_generate_equals_full_prompt(engine: LLMEngine, gqa_model: Path) -> None:
    prompt = prompts(1, seed=9)[0]
    cid = next(context_ids)
    await engine.fill(cid, prompt)
    first = await engine.generate(cid, SamplingParams(max_tokens=5, ignore_eos=True))
    more = prompts(1, seed=10, low=3, high=6)[0]
    await engine.fill(cid, more)
    second = await engine.generate(cid, GREEDY)
    await engine.free_context(cid)
    assert second.token_ids == hf_greedy(gqa_model, prompt + first.token_ids + more, GREEDY.max_tokens)


async def test_small_token_budget_chunks_prefill(gqa_model: Path) -> None:
    batch = prompts(4, seed=11, low=30, high=60)
    cfg = EngineConfig(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=3)
    with LLMEngine.from_pretrained(gqa_model, cfg) as engine:
        ours = await asyncio.gather(*(run_prompt(engine, p) for p in batch))
        assert engine.stats().tokens_in_last_step <= 16
    assert ours == [hf_greedy(gqa_model, p, GREEDY.max_tokens) for p in batch]


async def test_results_unchanged_after_blocks_are_reused(engine: LLMEngine) -> None:
    batch = prompts(6, seed=12, low=10, high=50)
    first = await asyncio.gather(*(run_prompt(engine, p) for p in batch))
    await asyncio.gather(*(run_prompt(engine, p) for p in prompts(6, seed=13, low=10, high=80)))
    again = await asyncio.gather(*(run_prompt(engine, p) for p in reversed(batch)))
    assert list(reversed(again)) == first
    assert engine.stats().blocks_used == 0


async def test_shared_prefix_grouping_does_not_change_outputs(gqa_model: Path, cpu_decode: str) -> None:
    prefix = prompts(1, seed=14, low=70, high=71)[0]
    suffixes = prompts(6, seed=15, low=1, high=25)

    async def run(mode: str) -> list[list[int]]:
        cfg = EngineConfig(dtype="float32", num_kv_blocks=128, shared_prefix_decode=mode)
        with LLMEngine.from_pretrained(gqa_model, cfg) as eng:
            await eng.fill(0, prefix)
            outs = await asyncio.gather(
                *(eng.fill(i + 1, s, parent_context_id=0) for i, s in enumerate(suffixes))
            )
            assert outs
            res = await asyncio.gather(*(eng.generate(i + 1, GREEDY) for i in range(len(suffixes))))
            assert (eng.stats().grouped_decode_steps > 0) == (mode == "always")
            return [r.token_ids for r in res]

    assert await run("always") == await run("never")
