"""KV memory of requests that share a prefix, served without and with fork, on our engine alone.

``n`` requests share a ``P``-token prefix and each has a distinct ``S``-token suffix. Without fork each
fills its whole prompt; with fork the prefix is filled once and every request forks from it, sharing its
full blocks. `measure_kv` counts the blocks in use exactly with every context alive, beside the count the
paged design predicts; `kv_table` shows both ways side by side.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from benchmarks.harness.generators import OurEngine
from benchmarks.harness.output import fmt_num, markdown_table
from benchmarks.harness.stats import safe_ratio
from server.engine import SamplingParams

__all__ = ["KVMode", "KVResult", "blocks", "kv_table", "measure_kv"]


@dataclass
class KVMode:
    """One way of serving the shared-prefix requests: blocks in use (measured and predicted), work done."""

    blocks_used: int
    blocks_expected: int
    prefill_tokens_computed: int
    seconds: float
    grouped_decode_steps: int  # decode steps that read the shared prefix once for the whole group


@dataclass
class KVResult:
    requests: int
    prefix_tokens: int
    suffix_tokens: int
    new_tokens: int
    block_size: int
    no_fork: KVMode
    fork: KVMode

    @property
    def ratio(self) -> float:
        return safe_ratio(self.no_fork.blocks_used, self.fork.blocks_used)


def blocks(n_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``n_tokens`` tokens."""
    return -(-n_tokens // block_size)


async def measure_kv(ours: OurEngine, prefix: list[int], suffixes: list[list[int]], new: int) -> KVResult:
    """Blocks in use for the shared-prefix requests without and with fork, every context still alive."""
    engine, n, p, s = ours.engine, len(suffixes), len(prefix), len(suffixes[0])
    bs, sampling = engine.block_size, SamplingParams(max_tokens=new, ignore_eos=True)
    # After a generate of G tokens a context holds P+S+G tokens, of which P+S+G-1 have KV (the last sampled
    # one is never computed). A fork shares the parent's full blocks and copies a partial last one.
    per_request = blocks(p + s + new - 1, bs)

    async def one(cid: int, tokens: list[int], parent: int | None = None) -> None:
        await engine.fill(cid, tokens, parent_context_id=parent)
        await engine.generate(cid, sampling)

    async def run(fork: bool) -> KVMode:
        before = engine.stats()
        assert before.blocks_used == 0, f"{before.blocks_used} blocks in use before the KV measurement"
        ids, start = ours.context_ids(n), time.perf_counter()
        if fork:
            ids.append(root := ours.context_ids(1)[0])
            await engine.fill(root, prefix)
            await asyncio.gather(*(one(c, x, root) for c, x in zip(ids[:n], suffixes, strict=True)))
        else:
            await asyncio.gather(*(one(c, prefix + x) for c, x in zip(ids, suffixes, strict=True)))
        seconds, after = time.perf_counter() - start, engine.stats()
        await asyncio.gather(*(engine.free_context(c) for c in ids))
        return KVMode(
            blocks_used=after.blocks_used,
            blocks_expected=blocks(p, bs) + n * (per_request - p // bs) if fork else n * per_request,
            prefill_tokens_computed=after.prefill_tokens_computed - before.prefill_tokens_computed,
            seconds=seconds,
            grouped_decode_steps=after.grouped_decode_steps - before.grouped_decode_steps,
        )

    return KVResult(n, p, s, new, bs, no_fork=await run(False), fork=await run(True))


def kv_table(kv: KVResult) -> str:
    """Exact block counts without and with fork, against the counts the paged design predicts."""
    fields = ("blocks_used", "blocks_expected", "prefill_tokens_computed", "seconds")
    rows = [
        [
            label,
            *(fmt_num(getattr(m, f), 2 if f == "seconds" else 0) for f in fields),
            str(m.grouped_decode_steps),
        ]
        for label, m in (("without fork", kv.no_fork), ("with fork", kv.fork))
    ]
    ratios = [safe_ratio(getattr(kv.no_fork, f), getattr(kv.fork, f)) for f in fields]
    rows.append(["without / with", *(f"{x:.2f}x" for x in ratios), ""])
    headers = ["KV cache", "blocks used", "expected", "prefill tokens computed", "time s"]
    return markdown_table([*headers, "shared-prefix decode steps"], rows, [False] + [True] * 5)
