"""One case of the decode-kernel benchmarks (`benchmarks.kernels`, `benchmarks.kernel_tuning`): a decode
step of ``batch`` sequences sharing a ``prefix``-token prompt, each with a private ``suffix``, timed under
plain paged decode and under shared-prefix decode on the same caches (`run_case`), and the memory-traffic
ceiling of the speedup (`ceiling`).

The shape is fixed: GQA 32/8 heads, head dim 128, page 16 (`HEADS`, `KV_HEADS`, `HEAD_DIM`, `BLOCK`), the
physical blocks shuffled. Imports the kernels and torch only, like `kernel_timing`: the kernels are timed
without the engine loaded beside them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

import kernels
from benchmarks.harness.kernel_timing import interleaved

__all__ = ["BLOCK", "HEADS", "HEAD_DIM", "KV_HEADS", "Row", "ceiling", "run_case"]

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


@dataclass
class Row:
    """One case's figures: the medians of the repeats, the speedup (the median of the per-repeat ratios),
    its ceiling and the share of it reached, and the largest difference between the two outputs."""

    batch: int
    prefix: int
    suffix: int
    plain_ms: float
    shared_ms: float
    speedup: float
    ceiling: float
    frac_of_ceiling: float
    max_abs_diff: float
    # CUDA: the times above are device times with the L2 cache flushed before each call (what the kernels
    # do); these are wall times of a call as an eager caller sees them, host launch overhead included.
    plain_wall_ms: float = math.nan
    shared_wall_ms: float = math.nan
    # CUDA: plain paged decode over a private copy of the prefix per sequence, the DRAM traffic the ceiling
    # assumes (over shared blocks a GPU serves the repeats from L2), and the speedup against it.
    plain_private_ms: float = math.nan
    speedup_vs_private: float = math.nan


def ceiling(batch: int, prefix: int, suffix: int) -> float:
    """KV tokens read by plain paged decode over those read by shared-prefix decode."""
    return batch * (prefix + suffix) / (prefix + batch * suffix)


def run_case(
    batch: int,
    prefix: int,
    suffix: int,
    repeats: int,
    device: torch.device,
    dtype: torch.dtype,
    private: bool | None = None,
) -> Row:
    """One case on ``device`` in ``dtype`` (CUDA: the Triton kernels; CPU: the torch path): the two decodes'
    outputs compared, then ``repeats`` interleaved timings of each (`kernel_timing.interleaved`); with
    ``private`` (default: on CUDA) plain decode over a copy of the prefix per sequence too."""
    gen = torch.Generator().manual_seed(batch * 100_003 + prefix)
    n_prefix = -(-prefix // BLOCK)
    n_suffix = -(-suffix // BLOCK)
    num_blocks = n_prefix + batch * n_suffix
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    # Shuffled physical blocks, as a long-running paged cache has them.
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    prefix_table = perm[:n_prefix]
    suffix_tables = perm[n_prefix:].view(batch, n_suffix)

    def i32(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=torch.int32).contiguous()

    plain_tables = i32(torch.cat([prefix_table.expand(batch, n_prefix), suffix_tables], dim=1))
    plain_lens = i32(torch.full((batch,), prefix + suffix))
    prefix_tables = i32(prefix_table[None])
    prefix_lens = i32(torch.tensor([prefix]))
    group_of = i32(torch.zeros(batch))
    suffix_tables_d = i32(suffix_tables)
    suffix_lens = i32(torch.full((batch,), suffix))
    backend: kernels.Backend = "auto" if device.type == "cuda" else "torch"
    scale = HEAD_DIM**-0.5

    def plain() -> torch.Tensor:
        return kernels.paged_decode_attention(
            q, k_cache, v_cache, plain_tables, plain_lens, scale, backend=backend
        )

    def shared() -> torch.Tensor:
        return kernels.shared_prefix_decode_attention(
            q,
            k_cache,
            v_cache,
            prefix_tables,
            prefix_lens,
            group_of,
            suffix_tables_d,
            suffix_lens,
            scale,
            backend=backend,
        )

    fns = [plain, shared]
    if device.type == "cuda" if private is None else private:  # each sequence's own copy of the prefix
        copies = prefix_table.long().repeat(batch).to(device)
        k_own, v_own = torch.cat([k_cache, k_cache[copies]]), torch.cat([v_cache, v_cache[copies]])
        own = torch.arange(num_blocks, num_blocks + batch * n_prefix, dtype=torch.int32).view(batch, n_prefix)
        own_tables = i32(torch.cat([own, suffix_tables], dim=1))

        def plain_private() -> torch.Tensor:
            return kernels.paged_decode_attention(
                q, k_own, v_own, own_tables, plain_lens, scale, backend=backend
            )

        fns.append(plain_private)
    # The first calls also warm up (compilation, workspaces, caches).
    outputs = [fn().float() for fn in fns]
    diff = max((outputs[0] - o).abs().max().item() for o in outputs[1:])
    # Interleaved (`kernel_timing.interleaved`), and each speedup taken as the median of the back-to-back
    # pairs' ratios: on a shared machine whose speed shifts between runs, a pair sees one state, while a
    # ratio of two medians can mix states.
    t = interleaved(fns, repeats, device)
    (plain_ms, shared_ms), (plain_wall, shared_wall) = t.ms[:2], t.wall_ms[:2]

    def over_shared(times: list[float]) -> float:
        return statistics.median(p / s for p, s in zip(times, shared_ms, strict=True))

    speedup = over_shared(plain_ms)
    private_ms, vs_private = math.nan, math.nan
    if len(t.ms) > 2:
        private_ms, vs_private = statistics.median(t.ms[2]), over_shared(t.ms[2])
    ceil = ceiling(batch, prefix, suffix)
    return Row(
        batch,
        prefix,
        suffix,
        statistics.median(plain_ms),
        statistics.median(shared_ms),
        speedup,
        ceil,
        speedup / ceil,
        diff,
        statistics.median(plain_wall),
        statistics.median(shared_wall),
        private_ms,
        vs_private,
    )
