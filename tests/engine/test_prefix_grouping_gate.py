"""The engine's "auto" shared-prefix grouping on CPU follows the gate of the decode it would replace: with
our C++ decode kernel, a step groups a prefix only at 8+ members and 256 MiB of prefix KV re-read per layer
(`kernels.gate.CPU_KERNEL_MIN_SAVED_BYTES`), not at the 6 MiB the torch path's gate uses."""

from __future__ import annotations

import asyncio

import pytest

from kernels import cpu_kernels
from server.engine import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(
    cpu_kernels.paged_decode_kernel() is None, reason="the C++ decode kernel is not built here"
)

TWO_TOKENS = SamplingParams(max_tokens=2, ignore_eos=True)


async def _grouped_steps(members: int, prefix_len: int) -> int:
    cfg = EngineConfig(
        dtype="float32", num_kv_blocks=members * 2 + prefix_len // 16 + 8, max_num_seqs=members
    )
    with LLMEngine.from_pretrained("tiny", cfg) as eng:
        await eng.fill(0, [5 + i % 1000 for i in range(prefix_len)])
        await asyncio.gather(*(eng.fill(i + 1, [7, 8 + i], parent_context_id=0) for i in range(members)))
        await asyncio.gather(*(eng.generate(i + 1, TWO_TOKENS) for i in range(members)))
        return eng.stats().grouped_decode_steps


async def test_many_members_of_a_short_prefix_stay_ungrouped() -> None:
    # 63 x 256 tokens x 1 KiB saves 15.8 MiB per layer (the torch path's gate would group) but the
    # kernel reads such a prefix faster than the grouped pass.
    assert await _grouped_steps(64, 256) == 0
    assert await _grouped_steps(32, 2048) == 0  # 62 MiB: measured 0.78x grouped


async def test_enough_members_of_a_long_prefix_are_grouped() -> None:
    assert await _grouped_steps(128, 4000) > 0  # 496 MiB: measured 1.45x grouped
