"""Contexts: token sequences whose KV lives in paged blocks, forked copy-free from one another.

A context holds every token id it has (inherited ones included), the block table covering the first
``num_cached`` of them, and, usually when every token is cached, the final hidden state of the last one (so
a generate can sample its first token without recomputing anything). Tokens past ``num_cached`` are
pending: the next fill or generate computes them (a generated token is pending until the model reads it
back).

A fork takes the parent's first ``k`` tokens — all of them by default, or a prefix (``parent_len``) — and
shares the blocks holding their KV by reference, a partial last one too; whoever writes next into a block
that someone else also holds copies it first (copy-on-write), so a shared block is never written and a fork
costs at most one block copy. Blocks are only ever appended to, which is why full blocks stay shareable. A
fork keeps the parent's last hidden state only when it takes the whole parent; a fully cached context
without one (a prefix fork nothing was filled into) has its last token recomputed by the next generate
(`ContextTable.uncache_last`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from server.engine.block_manager import BlockAllocator
from server.engine.errors import ContextExistsError, UnknownContextError

if TYPE_CHECKING:
    from server.engine.remote_kv import RemotePrefix


@dataclass(eq=False)
class Context:
    context_id: int
    parent_id: int | None
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    # Set only when every token is cached (and there is one); a prefix fork may lack it (`uncache_last`).
    last_hidden: torch.Tensor | None = None
    busy: bool = False  # a request is extending this context
    last_used: int = 0  # engine step of the last use, for LRU eviction
    num_inherited: int = 0  # tokens it was forked with: the parent's, not its own
    # Leading tokens whose KV another engine holds (attention parallelism): they come before every token
    # here, which all sit that many positions further on; None: the context is whole.
    remote: RemotePrefix | None = None

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_cached

    @property
    def position_offset(self) -> int:
        """The position of ``token_ids[0]``: the remote prefix's length (0 for a whole context)."""
        return 0 if self.remote is None else self.remote.num_tokens


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slot_indices(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The KV cache slots (block * block_size + offset) of positions ``[start, end)``, a run per block (an
    8,192-token fill's slots in 0.23 ms here, 0.44 token by token)."""
    slots: list[int] = []
    p = start
    while p < end:
        block, offset = divmod(p, block_size)
        n = min(block_size - offset, end - p)
        first = block_table[block] * block_size + offset
        slots.extend(range(first, first + n))
        p += n
    return slots


class ContextTable:
    """Every live context, and the block bookkeeping of creating, growing, evicting and freeing them."""

    def __init__(
        self, allocator: BlockAllocator, block_size: int, copy_block: Callable[[int, int], None]
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._copy_block = copy_block  # copies one block's KV in every layer: (src, dst)
        self._contexts: dict[int, Context] = {}

    def __contains__(self, context_id: int) -> bool:
        return context_id in self._contexts

    def __len__(self) -> int:
        return len(self._contexts)

    def __iter__(self) -> Iterator[Context]:
        return iter(self._contexts.values())

    def get(self, context_id: int) -> Context:
        try:
            return self._contexts[context_id]
        except KeyError:
            raise UnknownContextError(
                f"context {context_id} does not exist (never created, or freed)"
            ) from None

    def create(self, context_id: int, parent: Context | None, parent_len: int | None = None) -> Context:
        """A new empty context, or a fork of the first ``parent_len`` tokens of ``parent`` (all of them if
        None) sharing the blocks that hold their KV. The caller checked ``0 <= parent_len <= len(parent)``."""
        if context_id in self._contexts:
            raise ContextExistsError(f"context {context_id} already exists")
        ctx = Context(context_id, None if parent is None else parent.context_id)
        if parent is not None:
            k = len(parent.token_ids) if parent_len is None else parent_len
            assert 0 <= k <= len(parent.token_ids), f"parent_len {k} outside [0, {len(parent.token_ids)}]"
            ctx.token_ids = parent.token_ids[:k]
            ctx.num_inherited = k
            ctx.num_cached = min(parent.num_cached, k)
            ctx.block_table = parent.block_table[: blocks_for(ctx.num_cached, self.block_size)]
            self.allocator.share(ctx.block_table)
            if k == len(parent.token_ids):
                ctx.last_hidden = parent.last_hidden
        self._contexts[context_id] = ctx
        return ctx

    def free(self, context_id: int) -> Context:
        ctx = self._contexts.pop(context_id)
        self.allocator.release(ctx.block_table)
        ctx.block_table = []
        return ctx

    def blocks_needed(self, ctx: Context, num_new: int) -> int:
        """Free blocks needed to write ``num_new`` more tokens into ``ctx`` (new ones + copy-on-write)."""
        have = len(ctx.block_table)
        need = blocks_for(ctx.num_cached + num_new, self.block_size) - have
        if self._needs_copy(ctx) and num_new > 0:
            need += 1
        return need

    def reserve(self, ctx: Context, num_new: int) -> None:
        """Make ``ctx`` writable for ``num_new`` more tokens; the caller checked `blocks_needed` fits."""
        if num_new <= 0:
            return
        if self._needs_copy(ctx):
            idx = ctx.num_cached // self.block_size
            (fresh,) = self.allocator.allocate(1)
            self._copy_block(ctx.block_table[idx], fresh)
            self.allocator.release([ctx.block_table[idx]])
            ctx.block_table[idx] = fresh
        extra = blocks_for(ctx.num_cached + num_new, self.block_size) - len(ctx.block_table)
        if extra > 0:
            ctx.block_table.extend(self.allocator.allocate(extra))

    def uncache_last(self, ctx: Context) -> None:
        """Make the last cached token pending again, so the next step recomputes its hidden state: for a
        generate on a fully cached context without `Context.last_hidden` (a prefix fork). A block it leaves
        empty is released; a shared block it stays in is copied when the token is written back."""
        assert ctx.num_cached > 0, "no cached token to recompute"
        ctx.num_cached -= 1
        ctx.last_hidden = None
        keep = blocks_for(ctx.num_cached, self.block_size)
        self.allocator.release(ctx.block_table[keep:])
        del ctx.block_table[keep:]

    def reclaimable(self, ctx: Context) -> int:
        """Blocks that `evict` would return to the free list."""
        return sum(1 for b in ctx.block_table[self._first_private(ctx) :] if self.allocator.ref_count(b) == 1)

    def evict(self, ctx: Context, keep_shared: bool = True) -> None:
        """Drop the KV of ``ctx`` (past its leading shared blocks, if ``keep_shared``); its tokens stay and
        are recomputed when it is next extended."""
        keep = self._first_private(ctx) if keep_shared else 0
        self.allocator.release(ctx.block_table[keep:])
        del ctx.block_table[keep:]
        cached = min(ctx.num_cached, keep * self.block_size)
        if cached != ctx.num_cached:
            ctx.num_cached = cached
            ctx.last_hidden = None

    def _first_private(self, ctx: Context) -> int:
        # Leading full blocks someone else also holds stay: dropping them frees no memory.
        full = ctx.num_cached // self.block_size
        i = 0
        while i < full and self.allocator.ref_count(ctx.block_table[i]) > 1:
            i += 1
        return i

    def _needs_copy(self, ctx: Context) -> bool:
        if ctx.num_cached % self.block_size == 0:
            return False
        return self.allocator.ref_count(ctx.block_table[ctx.num_cached // self.block_size]) > 1
