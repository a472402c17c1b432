"""The KV block allocator: a free list and a reference count per block."""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    """Hands out fixed-size KV blocks; a block returns to the free list when its last reference goes."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        # High-water mark of `num_used` since creation or `reset_peak`: use only grows in `allocate`, so
        # it is exact without sampling (the figure a memory benchmark needs).
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1); the caller checks `num_free` first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return blocks

    def reset_peak(self) -> None:
        """Start a new high-water mark from the blocks in use now."""
        self.peak_used = self.num_used

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                raise RuntimeError(f"KV block {b} is shared after it was freed")
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] == 0:
                raise RuntimeError(f"KV block {b} is released twice")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
