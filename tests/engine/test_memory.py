"""Exact KV accounting: forks share blocks, frees return every block, nothing leaks."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.block_manager import BlockAllocator
from server.engine.context import ContextTable, blocks_for
from tests.engine.conftest import hf_greedy, prompts

B = 16


async def test_forks_share_the_prefix_blocks(gqa_model: Path) -> None:
    with LLMEngine.from_pretrained(gqa_model, EngineConfig(num_kv_blocks=256)) as engine:
        for p in (64, 70):  # a multiple of the block size, and not
            prefix = prompts(1, seed=p, low=p, high=p + 1)[0]
            n, suffix = 8, 5
            await engine.fill(0, prefix)
            assert engine.stats().blocks_used == blocks_for(p, B)
            await asyncio.gather(
                *(engine.fill(i + 1, prompts(1, seed=i, low=suffix, high=suffix + 1)[0], 0) for i in range(n))
            )
            own = (
                blocks_for(p + suffix, B) - p // B
            )  # blocks past the shared full ones (incl. a copied partial)
            assert engine.stats().blocks_used == blocks_for(p, B) + n * own
            assert engine.stats().blocks_used < (n + 1) * blocks_for(p + suffix, B)
            await engine.free_context(0)  # the children keep the shared blocks alive
            assert engine.stats().blocks_used == p // B + n * own
            for i in range(n):
                await engine.free_context(i + 1)
            assert engine.stats().blocks_used == 0
            # The high-water mark outlives the frees, exactly: all contexts were alive at once.
            assert engine.stats().blocks_peak == blocks_for(p, B) + n * own
            engine.reset_peak_blocks()
            assert engine.stats().blocks_peak == 0


async def test_prefill_is_computed_once_for_shared_prefix(gqa_model: Path) -> None:
    with LLMEngine.from_pretrained(gqa_model, EngineConfig(num_kv_blocks=256)) as engine:
        prefix = prompts(1, seed=1, low=100, high=101)[0]
        await engine.fill(0, prefix)
        await asyncio.gather(*(engine.fill(i + 1, [7, 8, 9], 0) for i in range(10)))
        await asyncio.gather(*(engine.generate(i + 1, SamplingParams(max_tokens=4)) for i in range(10)))
        assert engine.stats().prefill_tokens_computed == 100 + 10 * 3


class _NoCopy:
    def __call__(self, src: int, dst: int) -> None:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from("cfgwe"), st.integers(0, 7), st.integers(0, 40)), max_size=60))
def test_context_table_never_leaks(ops: list[tuple[str, int, int]]) -> None:
    """Random create/fork/grow/evict/free sequences: ref counts stay consistent, every block comes back."""
    alloc = BlockAllocator(400)
    table = ContextTable(alloc, B, _NoCopy())
    for op, cid, n in ops:
        live = list(table)
        if op == "c" and cid not in table:
            table.create(cid, None)
        elif op == "f" and live and cid not in table:
            table.create(cid, live[n % len(live)])
        elif op == "g" and cid in table:
            ctx = table.get(cid)
            ctx.token_ids.extend([5] * n)
            if table.blocks_needed(ctx, ctx.num_pending) <= alloc.num_free:
                table.reserve(ctx, ctx.num_pending)
                ctx.num_cached = len(ctx.token_ids)
        elif op == "e" and cid in table:
            table.evict(table.get(cid))
        elif op == "w" and cid in table:
            table.free(cid)
        held = sum(len(c.block_table) for c in table)
        distinct = {b for c in table for b in c.block_table}
        assert alloc.num_used == len(distinct)
        assert sum(alloc.ref_count(b) for b in distinct) == held
        for c in table:
            assert len(c.block_table) == blocks_for(c.num_cached, B)
    for c in list(table):
        table.free(c.context_id)
    assert alloc.num_used == 0


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.integers(0, 2**31 - 1))
def test_engine_returns_every_block_after_random_workload(gqa_model: Path, seed: int) -> None:
    rng = random.Random(seed)

    async def workload() -> None:
        cfg = EngineConfig(num_kv_blocks=48, max_num_batched_tokens=64, max_num_seqs=6)
        with LLMEngine.from_pretrained(gqa_model, cfg) as engine:
            live: list[int] = []
            tasks = []
            for cid in range(1, 14):
                parent = rng.choice(live) if live and rng.random() < 0.6 else None
                prompt = prompts(1, seed=rng.randrange(1000), low=1, high=60)[0]
                await engine.fill(cid, prompt, parent)
                live.append(cid)
                tasks.append(engine.generate(cid, SamplingParams(max_tokens=rng.randint(1, 12))))
                if rng.random() < 0.3:
                    await asyncio.gather(*tasks)
                    tasks = []
                    victim = live.pop(rng.randrange(len(live)))
                    await engine.free_context(victim)
            await asyncio.gather(*tasks)
            for cid in live:
                await engine.free_context(cid)
            stats = engine.stats()
            assert stats.blocks_used == 0 and stats.contexts == 0

    asyncio.run(workload())


async def test_fork_from_a_busy_parent_waits_for_it(engine: LLMEngine, gqa_model: Path) -> None:
    """A fork asked while the parent is still generating sees the parent's finished state."""
    prompt = prompts(1, seed=40)[0]
    await engine.fill(801, prompt)
    parent_gen = asyncio.ensure_future(engine.generate(801, SamplingParams(max_tokens=10, ignore_eos=True)))
    await asyncio.sleep(0)
    child_len = await engine.fill(802, [7, 8], parent_context_id=801)
    generated = (await parent_gen).token_ids
    assert child_len == len(prompt) + 10 + 2
    out = await engine.generate(802, SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.token_ids == hf_greedy(gqa_model, prompt + generated + [7, 8], 4)
    for cid in (801, 802):
        await engine.free_context(cid)
