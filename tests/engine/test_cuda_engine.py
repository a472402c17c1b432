"""The engine on a CUDA GPU: Hugging Face's tokens, the Triton decode paths inside the engine, sampling on
the device, and two engines sharing one GPU. Skipped without one (``gpu``); the rest of this package's
engine tests also run on CUDA there, since `EngineConfig` defaults to it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.conftest import GREEDY, hf_greedy, prompts, run_prompt

pytestmark = pytest.mark.gpu


def cuda_config(**overrides: object) -> EngineConfig:
    return EngineConfig(**{"device": "cuda", "dtype": "float32", "num_kv_blocks": 256, **overrides})


async def test_fp32_batch_matches_hf(gqa_model: Path) -> None:
    batch = prompts(8, seed=21, low=2, high=90)
    with LLMEngine.from_pretrained(gqa_model, cuda_config()) as engine:
        ours = await asyncio.gather(*(run_prompt(engine, p) for p in batch))
    assert ours == [hf_greedy(gqa_model, p, GREEDY.max_tokens) for p in batch]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_half_precision_runs_and_mostly_agrees(gqa_model: Path, dtype: str) -> None:
    batch = prompts(8, seed=22, low=2, high=90)
    with LLMEngine.from_pretrained(gqa_model, cuda_config(dtype=dtype)) as engine:
        ours = await asyncio.gather(*(run_prompt(engine, p) for p in batch))
    reference = [hf_greedy(gqa_model, p, GREEDY.max_tokens) for p in batch]
    # Rounding may flip a near-tie late in a sequence; the first tokens must agree.
    assert sum(o[:3] == r[:3] for o, r in zip(ours, reference, strict=True)) >= 6


async def test_shared_prefix_kernel_in_the_engine_changes_nothing(gqa_model: Path) -> None:
    prefix = prompts(1, seed=23, low=300, high=301)[0]
    suffixes = prompts(8, seed=24, low=1, high=25)

    async def run(mode: str, graphs: bool = True) -> tuple[list[list[int]], int, int]:
        config = cuda_config(shared_prefix_decode=mode, cuda_graphs=graphs)
        with LLMEngine.from_pretrained(gqa_model, config) as eng:
            await eng.fill(0, prefix)
            await asyncio.gather(*(eng.fill(i + 1, s, parent_context_id=0) for i, s in enumerate(suffixes)))
            res = await asyncio.gather(*(eng.generate(i + 1, GREEDY) for i in range(len(suffixes))))
            replays = eng.core.runner.graphs.grouped_replays if eng.core.runner.graphs is not None else 0
            return [r.token_ids for r in res], eng.stats().grouped_decode_steps, replays

    grouped, steps, replays = await run("always")  # the Triton shared-prefix kernel inside graphs
    assert steps > 0 and replays == steps
    eager, eager_steps, _ = await run("always", graphs=False)  # ... and in eager steps
    plain, none, _ = await run("never")
    assert eager_steps > 0 and none == 0
    assert grouped == eager == plain


async def test_temperature_sampling_on_the_device(gqa_model: Path) -> None:
    sampling = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    prompt = prompts(1, seed=25)[0]
    with LLMEngine.from_pretrained(gqa_model, cuda_config()) as engine:
        first = await run_prompt(engine, prompt, sampling)
        again = await run_prompt(engine, prompt, sampling)
    assert len(first) == 8 and all(0 <= t < 4096 for t in first)
    assert first == again  # seeded


def test_two_engines_share_one_gpu(gqa_model: Path) -> None:
    total = torch.cuda.mem_get_info()[1]
    config = EngineConfig(device="cuda", dtype="float32", gpu_memory_utilization=0.3)
    with LLMEngine.from_pretrained(gqa_model, config) as a, LLMEngine.from_pretrained(gqa_model, config) as b:
        for engine in (a, b):
            kv = engine.stats().blocks_total * engine.block_size * 2 * 2 * 16 * 2 * 4  # 2 layers, 2 KV heads
            assert 0.2 * total < kv <= 0.3 * total


async def test_cuda_graph_decode_equals_eager(gqa_model: Path) -> None:
    batch = prompts(11, seed=26, low=2, high=120)  # 11 rows: bucket 16; the tail runs smaller buckets

    async def run(graphs: bool) -> tuple[list[list[int]], int]:
        with LLMEngine.from_pretrained(gqa_model, cuda_config(cuda_graphs=graphs, max_num_seqs=16)) as engine:
            out = await asyncio.gather(*(run_prompt(engine, p) for p in batch))
            runner = engine.core.runner
            return out, 0 if runner.graphs is None else runner.graphs.replays

    graphed, replays = await run(True)
    eager, none = await run(False)
    assert replays > 0 and none == 0
    assert graphed == eager
    assert graphed == [hf_greedy(gqa_model, p, GREEDY.max_tokens) for p in batch]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_triton_layer_kernels_agree_with_the_torch_ops(
    gqa_model: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine with the Triton layer kernels (`kernels.layer_ops`) and without them: the same greedy
    tokens but where a near-tie flips (the norm's mean sums in another order)."""
    from kernels import layer_ops
    from kernels.settings import LAYER_KERNELS

    batch = prompts(8, seed=27, low=2, high=90)

    async def run(enabled: bool) -> list[list[int]]:
        monkeypatch.setenv(LAYER_KERNELS.name, "1" if enabled else "0")
        layer_ops.clear_cache()
        probe = torch.zeros(1, 2, dtype=getattr(torch, dtype), device="cuda")
        assert (layer_ops.silu_mul_op(probe) is not None) == enabled
        with LLMEngine.from_pretrained(gqa_model, cuda_config(dtype=dtype)) as engine:
            return await asyncio.gather(*(run_prompt(engine, p) for p in batch))

    try:
        fused, plain = await run(True), await run(False)
    finally:
        monkeypatch.undo()
        layer_ops.clear_cache()
    assert sum(f[:3] == p[:3] for f, p in zip(fused, plain, strict=True)) >= 7
    assert sum(f == p for f, p in zip(fused, plain, strict=True)) >= 5
