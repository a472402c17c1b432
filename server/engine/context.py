"""Contexts: token sequences whose KV lives in paged blocks, forked copy-free from one another.

A context holds every token id it has (inherited ones included), the block table covering the first
``num_cached`` of them, and, when every token is cached, the final hidden state of the last one (so a
generate can sample its first token without recomputing anything). Tokens past ``num_cached`` are pending:
the next fill or generate computes them (a generated token is pending until the model reads it back).

A fork shares all of the parent's blocks by reference, the partial last one too; whoever writes next into a
block that someone else also holds copies it first (copy-on-write), so a shared block is never written and a
fork costs at most one block copy. Blocks are only ever appended to, which is why full blocks stay shareable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from server.engine.block_manager import BlockAllocator
from server.engine.errors import ContextExistsError, UnknownContextError


@dataclass(eq=False)
class Context:
    context_id: int
    parent_id: int | None
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    last_hidden: torch.Tensor | None = None  # set iff every token is cached (and there is one)
    busy: bool = False  # a request is extending this context
    last_used: int = 0  # engine step of the last use, for LRU eviction
    num_inherited: int = 0  # tokens it was forked with: the parent's, not its own

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_cached


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


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

    def create(self, context_id: int, parent: Context | None) -> Context:
        """A new empty context, or a fork of ``parent`` sharing all of its cached blocks."""
        if context_id in self._contexts:
            raise ContextExistsError(f"context {context_id} already exists")
        ctx = Context(context_id, None if parent is None else parent.context_id)
        if parent is not None:
            ctx.token_ids = list(parent.token_ids)
            ctx.num_inherited = len(parent.token_ids)
            ctx.num_cached = parent.num_cached
            ctx.block_table = parent.block_table[: blocks_for(parent.num_cached, self.block_size)]
            self.allocator.share(ctx.block_table)
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
