"""The engine contexts the manager keeps after their request ends, so that later requests fork them.

Every kept context (a shared constant prefix, a finished step, a finished OpenAI request) is an entry of a
`PrefixStore` keyed by engine and cache namespace; a request's context is made by forking the longest one its
tokens extend and filling the rest (`fill_from_cache`). Beyond ``ManagerConfig.max_cached_prefixes`` per
engine, the least recently used ones nothing forks from are freed. Contexts of different cache salts
(namespaces) never meet.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools

from server.engine import EngineError
from server.serve.engine_registry import EngineRegistry
from server.serve.manager_config import ManagerConfig
from server.serve.prefix_store import Entry, Match, PrefixStore, common_prefix_len


def namespace(cache_salt: str | None) -> str:
    """The prefix-cache namespace of a salt: contexts and prefix hashes of different salts never meet."""
    if cache_salt is None:
        return ""
    return "#" + hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class KeptContexts:
    """The kept contexts of every engine of ``registry``, and the context ids the manager hands out."""

    def __init__(self, registry: EngineRegistry, config: ManagerConfig) -> None:
        self.registry = registry
        self.config = config
        engines = registry.engines
        self._store = PrefixStore(engines[0].block_size if engines else 16)
        self._ids = itertools.count(1)
        self._prefix_fills: dict[tuple[str, tuple[int, ...]], asyncio.Future[None]] = {}

    def new_id(self) -> int:
        """A context id no other request of any engine holds."""
        return next(self._ids)

    def match(self, engine_id: int, ns: str, token_ids: list[int]) -> Match | None:
        """The kept context sharing the most leading tokens with ``token_ids`` on the engine, if worth a
        fork: a whole context, or a leading part of at least one KV block (a shorter part would cost a
        block copy to save less than a block of prefill)."""
        if not self.config.prefix_sharing:
            return None
        match = self._store.longest_common_prefix(_key(engine_id, ns), token_ids)
        if match is None or (not match.whole and match.length < self.registry.engines[engine_id].block_size):
            return None
        return match

    async def fill(
        self,
        engine_id: int,
        ns: str,
        context_id: int,
        token_ids: list[int],
        priority: float | None = None,
        tenant: str | None = None,
    ) -> int:
        """Make ``context_id`` hold ``token_ids``: a fork of the leading tokens they share with a kept
        context (held against eviction while the fork is made), filled with the rest; returns how many
        were forked (not computed). ``priority``, ``tenant``: the request's place in the engine's queue
        (its prefill is ordered as its generation is)."""
        match = self.match(engine_id, ns, token_ids)
        engine = self.registry.engines[engine_id]
        if match is None:
            await engine.fill(context_id, token_ids, priority=priority, tenant=tenant)
            return 0
        self._store.acquire(match.entry)
        try:
            await engine.fill(
                context_id,
                token_ids[match.length :],
                match.entry.context_id,
                parent_len=None if match.whole else match.length,
                priority=priority,
                tenant=tenant,
            )
        finally:
            self._store.release(match.entry)
        return match.length

    async def share_prefix(self, engine_id: int, ns: str, prefix: list[int]) -> None:
        """Make ``prefix`` one shared context on the engine, unless a kept context already holds it: every
        request starting with it forks it instead of prefilling it again (steps of one session or many)."""
        if len(prefix) < self.config.min_shared_prefix_tokens:
            return
        match = self.match(engine_id, ns, prefix)
        if match is not None and match.length >= len(prefix):
            return
        key = (_key(engine_id, ns), tuple(prefix))
        pending = self._prefix_fills.get(key)
        if pending is not None:  # another request is filling this very prefix: wait for it
            await asyncio.shield(pending)
            return
        pending = self._prefix_fills[key] = asyncio.get_running_loop().create_future()
        context_id = self.new_id()
        try:
            await self.fill(engine_id, ns, context_id, prefix)
            await self.keep(engine_id, ns, context_id, prefix)
        except BaseException:
            await self.registry.free(engine_id, context_id)
            raise
        finally:
            del self._prefix_fills[key]
            pending.set_result(None)

    async def keep(self, engine_id: int, ns: str, context_id: int, token_ids: list[int]) -> None:
        """Store a finished context as a shareable prefix; beyond the engine's cap (all namespaces together,
        so that many salts cannot hold more), free the least recently used ones nothing forks from."""
        free = self.registry.free
        if not self.registry.in_service(engine_id):  # failed or draining: nothing will fork from it there
            await free(engine_id, context_id)
            return
        entry = self._store.insert(_key(engine_id, ns), context_id, token_ids)
        if entry.context_id != context_id:  # the same tokens are already held by another context
            await free(engine_id, context_id)
        keys = self.store_keys(engine_id)
        excess = sum(len(self._store.entries(k)) for k in keys) - self.config.max_cached_prefixes
        if excess <= 0:
            return
        idle = [e for k in keys for e in self._store.evict_candidates(k)]
        stale: list[Entry] = sorted(idle, key=lambda e: e.last_used)[:excess]
        for old in stale:
            self._store.remove(old)
            await free(engine_id, old.context_id)

    async def keep_as(
        self, engine_id: int, ns: str, context_id: int, held: list[int], canonical: list[int]
    ) -> None:
        """Keep a finished context so that it holds ``canonical`` (what a consumer continuing its prompt
        renders, tokenized whole) where it holds ``held`` (the prompt and the generated tokens, EOS and any
        stop string included).

        Where the two part within the last block of ``canonical`` (a stop string cut mid-token, a
        re-tokenized ending), a fork of the agreeing part filled with the canonical tokens replaces the
        context — one short fill here instead of one per consumer. An earlier parting (a transform rewrote
        the value) keeps the context as it is: consumers fork from the part that agrees."""
        common = common_prefix_len(held, canonical)
        engine = self.registry.engines[engine_id]
        refill = len(canonical) - common
        if refill == 0 or refill > engine.block_size or common == 0:
            await self.keep(engine_id, ns, context_id, held)
            return
        fresh = self.new_id()
        try:
            await engine.fill(fresh, canonical[common:], context_id, parent_len=common)
        except EngineError:
            await self.registry.free(engine_id, fresh)
            await self.keep(engine_id, ns, context_id, held)
            return
        await self.registry.free(engine_id, context_id)
        await self.keep(engine_id, ns, fresh, canonical)

    def store_keys(self, engine_id: int) -> list[str]:
        """The store's keys of an engine: its shared namespace and every salted one."""
        return [k for k in self._store.engines() if k.split("#", 1)[0] == str(engine_id)]

    def forget(self, engine_id: int) -> list[int]:
        """Take the engine's kept contexts out of the index (every namespace); returns their ids."""
        entries = [e for key in self.store_keys(engine_id) for e in self._store.remove_engine(key)]
        return [e.context_id for e in entries]

    async def drop(self) -> int:
        """Free every kept context no request is forking from; returns how many went."""
        dropped = 0
        for key in self._store.engines():
            engine_id = int(key.split("#", 1)[0])
            for entry in self._store.evict_candidates(key):
                self._store.remove(entry)
                await self.registry.free(engine_id, entry.context_id)
                dropped += 1
        return dropped


def _key(engine_id: int, ns: str) -> str:
    """The store's key of an engine's contexts in a cache namespace (salted ones apart)."""
    return f"{engine_id}{ns}"
