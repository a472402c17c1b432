"""The engine's side of disaggregated serving: lending its KV to other engines, and moving KV in and out.

A base of `LLMEngine`; every change of its core's state runs on the engine thread (`_run_on_thread`), like
every other command.

* `lease_kv` pins a context's cached tokens for another engine to attend over (`remote_kv.KVLease`) and
  `kv_source` is what that engine calls to do so — the holder side of Mutel's attention parallelism;
  `release_kv` lets go. A lease holds a reference on each block, so the blocks count as used (exact
  accounting) until it is released, whatever happens to the context.
* `export_kv` / `import_kv` copy KV out of one engine and into another (`kv_transfer.KVBlob`): Splitwise's
  prompt transfer, or Mutel's one-time move of what a decode instance generated.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from server.engine.context import Context, blocks_for
from server.engine.errors import (
    ContextBusyError,
    InvalidRequestError,
    PromptTooLongError,
    UnknownContextError,
)
from server.engine.kv_transfer import KVBlob, read_kv, write_kv
from server.engine.model_runner import KVCache
from server.engine.remote_kv import KVLease, LocalKVSource
from server.engine.submit_checks import inherited

if TYPE_CHECKING:
    from server.engine.engine_core import EngineCore

T = TypeVar("T")


class KVExchange:
    """Lease, export and import of KV (see the module docstring), over the engine state declared here."""

    # What this relies on from `LLMEngine`: its core (the state, changed only on the engine thread), the
    # thread's liveness and the way onto it.
    model_name: str
    block_size: int
    core: EngineCore
    _dead: BaseException | None
    _thread: threading.Thread
    _kv_source: LocalKVSource | None = None

    async def _run_on_thread(self, fn: Callable[[], T]) -> T:
        raise NotImplementedError

    def _kv(self) -> KVCache:
        kv = getattr(self.core.runner, "kv", None)  # the simulator's runner has no KV to lend
        if not isinstance(kv, KVCache):
            raise InvalidRequestError(f"engine {self.model_name!r} has no KV cache to lend or move")
        return kv

    @property
    def kv_source(self) -> LocalKVSource:
        """What another engine in this process calls to attend over KV this engine leased to it."""
        if self._kv_source is None:
            kv = self._kv()
            alive: Callable[[], bool] = lambda: self._dead is None and self._thread.is_alive()  # noqa: E731
            self._kv_source = LocalKVSource(self.model_name, kv.k, kv.v, alive)
        return self._kv_source

    async def lease_kv(self, context_id: int, num_tokens: int | None = None) -> KVLease:
        """Pin the first ``num_tokens`` (default: all) tokens of a context, all computed, for another engine
        to attend over; they stay as they are until `release_kv`, even if the context changes or goes."""

        def lease() -> KVLease:
            ctx = _idle(self, context_id, "lease_kv")
            n = ctx.num_cached if num_tokens is None else num_tokens
            if not 0 < n <= ctx.num_cached:
                raise InvalidRequestError(
                    f"lease_kv: context {context_id} has {ctx.num_cached} computed tokens; a lease covers "
                    f"1..{ctx.num_cached} of them, not {n}"
                )
            blocks = tuple(ctx.block_table[: blocks_for(n, self.block_size)])
            self.core.allocator.share(list(blocks))
            held = KVLease(context_id, blocks, n)
            self.core.leases[held.lease_id] = held
            return held

        return await self._run_on_thread(lease)

    async def release_kv(self, lease: KVLease) -> None:
        """Let go of a lease: its blocks return once nothing else holds them. Releasing twice is an error."""

        def release() -> None:
            held = self.core.leases.pop(lease.lease_id, None)
            if held is None:
                raise InvalidRequestError(f"release_kv: lease {lease.lease_id} is not held here (released?)")
            self.core.allocator.release(list(held.blocks))

        await self._run_on_thread(release)

    async def export_kv(self, context_id: int, start: int = 0, end: int | None = None) -> KVBlob:
        """A copy of the KV of tokens ``[start, end)`` (default: all) of a context, every one computed (of a
        context with a remote prefix: of the tokens held here, counted from the first of them)."""

        def export() -> KVBlob:
            ctx = _idle(self, context_id, "export_kv", allow_remote=True)
            stop = ctx.num_cached if end is None else end
            if not 0 <= start <= stop <= ctx.num_cached:
                raise InvalidRequestError(
                    f"export_kv: tokens [{start}, {stop}) are not within the {ctx.num_cached} computed "
                    f"tokens of context {context_id}"
                )
            blob = read_kv(self._kv().k, self._kv().v, ctx, start, stop)
            self.core.kv_bytes_moved += blob.nbytes
            return blob

        return await self._run_on_thread(export)

    async def import_kv(
        self,
        context_id: int,
        blob: KVBlob,
        parent_context_id: int | None = None,
        *,
        parent_len: int | None = None,
        pending: list[int] | None = None,
    ) -> int:
        """Append ``blob``'s tokens with their KV to a context (new, forked from the parent as `fill`
        does, or an existing one), computing nothing: they follow its last computed token, so tokens of it
        not computed yet (a sampled one, say) must be the blob's first. ``pending``: tokens to append after
        them without KV, computed by whatever extends the context next (as a generate leaves its last
        sampled token). Returns its length."""

        def import_() -> int:
            kv = self._kv()
            if tuple(blob.k.shape[2:]) != tuple(kv.k[0].shape[2:]) or blob.k.shape[0] != len(kv.k):
                raise InvalidRequestError(
                    f"import_kv: the KV has shape {tuple(blob.k.shape)} (layers, tokens, kv heads, head "
                    "dim); "
                    f"this engine's model needs ({len(kv.k)}, n, {kv.k[0].shape[2]}, {kv.k[0].shape[3]})"
                )
            created = context_id not in self.core.contexts
            if created:
                parent = None
                if parent_context_id is not None:
                    parent = _idle(self, parent_context_id, "import_kv")
                forked = 0 if parent is None else inherited("import_kv", parent, parent_len)
                self.core.check_length("import_kv", forked + len(blob.token_ids) + len(pending or []), False)
                ctx = self.core.contexts.create(context_id, parent, parent_len)
            else:
                ctx = _idle(self, context_id, "import_kv")
                if parent_context_id is not None or parent_len is not None:
                    raise InvalidRequestError(
                        f"import_kv: context {context_id} already exists; nothing is forked into it"
                    )
                self.core.check_length(
                    "import_kv", ctx.num_cached + len(blob.token_ids) + len(pending or []), False
                )
            try:
                uncomputed = ctx.token_ids[ctx.num_cached :]
                if list(blob.token_ids[: len(uncomputed)]) != uncomputed:
                    raise InvalidRequestError(
                        f"import_kv: context {context_id} has {len(uncomputed)} tokens not computed yet, "
                        f"{uncomputed[:5]}...; imported KV continues the last computed token, so it must "
                        "start with them"
                    )
                need = self.core.contexts.blocks_needed(ctx, len(blob.token_ids))
                if not self.core.scheduler.make_room(need, keep=(ctx,)):
                    raise PromptTooLongError(
                        f"import_kv: {len(blob.token_ids)} tokens need {need} free KV blocks and only "
                        f"{self.core.allocator.num_free} can be freed now; retry later or free contexts"
                    )
                self.core.contexts.reserve(ctx, len(blob.token_ids))
            except Exception:
                if created:
                    self.core.contexts.free(context_id)
                raise
            del ctx.token_ids[ctx.num_cached :]  # the pending tokens come back with their KV
            write_kv(kv.k, kv.v, ctx, blob)
            ctx.token_ids.extend(pending or [])
            self.core.kv_bytes_moved += blob.nbytes
            return len(ctx.token_ids)

        return await self._run_on_thread(import_)


def _idle(engine: KVExchange, context_id: int, op: str, allow_remote: bool = False) -> Context:
    if context_id not in engine.core.contexts:
        raise UnknownContextError(f"{op}: context {context_id} does not exist (never created, or freed)")
    ctx: Context = engine.core.contexts.get(context_id)
    if ctx.busy:
        raise ContextBusyError(f"{op}: context {context_id} is being extended by a request; wait for it")
    if ctx.remote is not None and not allow_remote:
        raise InvalidRequestError(
            f"{op}: context {context_id} starts with KV held by engine {ctx.remote.source.name!r}; "
            "only a context whose KV is all here can be leased or extended by import"
        )
    return ctx
