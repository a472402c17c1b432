"""Random decode-attention problems shared by the kernel tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class Case:
    """One decode step over a shuffled paged cache, in both the grouped and the plain form."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    prefix_block_tables: torch.Tensor
    prefix_lens: torch.Tensor
    group_of: torch.Tensor
    suffix_block_tables: torch.Tensor
    suffix_lens: torch.Tensor
    scale: float

    @property
    def shared_args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.prefix_block_tables,
            self.prefix_lens,
            self.group_of,
            self.suffix_block_tables,
            self.suffix_lens,
            self.scale,
        )

    def to(self, device: str | torch.device, dtype: torch.dtype) -> Case:
        def f(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)

        return Case(
            f(self.q),
            f(self.k_cache),
            f(self.v_cache),
            f(self.prefix_block_tables),
            f(self.prefix_lens),
            f(self.group_of),
            f(self.suffix_block_tables),
            f(self.suffix_lens),
            self.scale,
        )


def random_case(
    seed: int,
    *,
    head_dim: int = 64,
    block_size: int = 16,
    min_batch: int = 1,
    max_batch: int = 9,
    max_prefix: int = 300,
    max_suffix: int = 70,
    allow_empty_suffix: bool = False,
    min_groups: int = 0,
    long_prefix: int | None = None,
) -> Case:
    """A seeded random problem: several groups plus ungrouped sequences, MHA or GQA, shuffled blocks.

    Prefix lengths include 0 and non-multiples of the block size. Table slots past a sequence's length
    hold junk block ids (a real cache's stale entries) that the kernels must never read. ``long_prefix``
    gives group 0 that many tokens and at least two members.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = rng.randint(min_batch, max_batch)
    num_kv_heads = rng.choice([1, 2, 4])
    num_heads = num_kv_heads * rng.choice([1, 1, 2, 4, 8])  # MHA as often as GQA
    num_groups = rng.randint(min_groups, 3)
    prefix_lens = [rng.choice([0, block_size, rng.randint(1, max_prefix)]) for _ in range(num_groups)]
    group_of = [rng.randint(-1, num_groups - 1) for _ in range(batch)]
    if long_prefix is not None:
        prefix_lens = prefix_lens or [0]
        prefix_lens[0] = long_prefix
        group_of[: min(2, batch)] = [0] * min(2, batch)
    lo = 0 if allow_empty_suffix else 1
    suffix_lens = [rng.randint(lo, max_suffix) for _ in range(batch)]

    def blocks(n: int) -> int:
        return -(-n // block_size)

    need = sum(blocks(n) for n in prefix_lens) + sum(blocks(n) for n in suffix_lens)
    num_blocks = need + rng.randint(1, 8)
    free = list(range(num_blocks))
    rng.shuffle(free)  # non-contiguous, out-of-order physical blocks

    def table(rows: list[int]) -> torch.Tensor:
        width = max([blocks(n) for n in rows] + [1]) + rng.randint(0, 2)
        out = torch.randint(0, num_blocks, (max(len(rows), 1), width), generator=gen, dtype=torch.int32)
        for i, n in enumerate(rows):
            for j in range(blocks(n)):
                out[i, j] = free.pop()
        return out

    prefix_tables = table(prefix_lens)
    suffix_tables = table(suffix_lens)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return Case(
        q=torch.randn(batch, num_heads, head_dim, generator=gen),
        k_cache=torch.randn(shape, generator=gen),
        v_cache=torch.randn(shape, generator=gen),
        prefix_block_tables=prefix_tables,
        prefix_lens=torch.tensor(prefix_lens or [0], dtype=torch.int32),
        group_of=torch.tensor(group_of, dtype=torch.int32),
        suffix_block_tables=suffix_tables,
        suffix_lens=torch.tensor(suffix_lens, dtype=torch.int32),
        scale=head_dim**-0.5 * rng.choice([1.0, 2.0]),
    )
