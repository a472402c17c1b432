"""The manager's prefix store: which engine contexts hold which token prefixes. Pure data, no I/O, no clock.

The manager keeps some engine contexts alive purely as *shareable prefixes* — typically the rendered prompt
up to the end of a constant segment of a template (a system prompt, few-shot examples), or a producer step's
context that a dependent step's prompt continues. Each is an `Entry` ``(engine_id, context_id, token_ids)``.
A new request asks `PrefixStore.longest_prefix` for the longest entry on its engine whose tokens are a
prefix of its own, forks from that context (``engine.fill(new_id, rest, parent_context_id=...)``) and fills
only the rest; identical constant prefixes across sessions therefore share one engine context.

Two lookups. `longest_prefix` finds the longest entry whose tokens are *all* a prefix of the request (fork
the whole context). `longest_common_prefix` finds the entry sharing the most leading tokens with the request,
whole or not: the engine forks from the first k tokens of a context (``parent_len``), so every kept context
is a prefix cache at token granularity — a consumer whose prompt quotes its producer's prompt and output, or
a chat turn that repeats the conversation, reuses the part that agrees and fills only the rest.

Why any match length is useful: a fork shares every cached block of its parent by reference, the partial last
block too (copy-on-write costs at most one block copy when the child first writes), so a match of L > 0
tokens saves L tokens of prefill. A match may even be the whole request (L == len(tokens)): the context keeps
the last hidden state, so a generate samples from it without filling anything.

Layout (why it is fast): per engine, a trie over chunks of `block_size` tokens. A node at depth d stands for
the d*block_size tokens on its path and holds the entry ending exactly there, if any, plus the entries ending
*inside* its next chunk ("tails", keyed by their partial last chunk). A lookup walks the request's full chunks
down the trie — O(len(tokens) / block_size) dict probes, independent of how many entries there are — then
scans back up from the deepest node: at each node the tails (longest first) are longer than the node's own
entry, which is longer than anything above it, so the first hit is the longest match. Chunk tuples are exact
keys (no hash collisions to worry about). ``block_size`` need not equal the engines' KV block size — it only
sets the trie's fan-out — but 16, the engine's, keeps nodes aligned with what a fork shares for free.

Reference counting and LRU: a request `acquire`s the entry it forks from and `release`s it once its fork
exists; an entry with references is never an eviction candidate (freeing it would break the pending fork).
Under KV pressure the manager asks `evict_candidates` (unreferenced, least recently used first), removes what
it picks and calls the engine's ``free_context`` for each. An entry whose context is the parent of other live
entries (or of live request contexts) is still evictable: the engine refcounts blocks, so the children keep
the shared blocks alive and freeing the parent just drops its own references — it frees the blocks nobody else
holds, and later requests sharing only the shorter prefix lose that reuse. Lookups (`longest_prefix`,
`engines_holding`) never change LRU order, so the scheduler can probe freely; `touch`, `acquire`, `release`
and a repeated `insert` do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["DEFAULT_BLOCK_SIZE", "Entry", "EntryInUseError", "Match", "PrefixStore", "common_prefix_len"]

DEFAULT_BLOCK_SIZE = 16  # the engine's KV block size (server/engine)

Tokens = tuple[int, ...]


class EntryInUseError(RuntimeError):
    """An entry with references was removed without ``force``: a request is about to fork from it."""


@dataclass(eq=False)
class Entry:
    """An engine context kept alive as a shareable prefix. Compared by identity: one entry per context.

    ``refs`` and ``live`` are maintained by the store; read them, never assign them.
    """

    engine_id: str
    context_id: int
    token_ids: Tokens
    refs: int = field(default=0, init=False)
    live: bool = field(default=True, init=False)  # False once removed from the store
    last_used: int = field(default=0, init=False)  # the store's use counter when last touched

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Entry(engine_id={self.engine_id!r}, context_id={self.context_id}, "
            f"len={len(self.token_ids)}, refs={self.refs}, live={self.live})"
        )


@dataclass(frozen=True)
class Match:
    """The longest entry whose tokens prefix a request: fork from ``entry.context_id``, fill ``rest``."""

    entry: Entry
    length: int  # how many of the request's (and the entry's) leading tokens agree: no prefill for them

    @property
    def whole(self) -> bool:
        """Whether the match is the entry's every token (fork the whole context), not a leading part."""
        return self.length == len(self.entry.token_ids)

    def rest(self, token_ids: Sequence[int]) -> Tokens:
        """The request's tokens past the match: what the fork still has to fill."""
        return tuple(token_ids[self.length :])


@dataclass(eq=False)
class _Node:
    """A trie node at depth ``depth`` chunks; ``key`` is the chunk leading here from ``parent``."""

    depth: int
    parent: _Node | None = None
    key: Tokens = ()
    children: dict[Tokens, _Node] = field(default_factory=dict)
    exact: Entry | None = None  # the entry whose tokens end exactly at this node
    # Entries ending inside the next chunk: partial-chunk length -> partial chunk -> entry.
    tails: dict[int, dict[Tokens, Entry]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not self.children and self.exact is None and not self.tails


class PrefixStore:
    """Per engine, the contexts kept as shareable prefixes; longest-prefix lookup, refcounts, LRU order."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._roots: dict[str, _Node] = {}
        # Per engine, context_id -> entry in LRU order (least recently used first): touch is O(1) and the
        # candidates come out already ordered, with no clock to pass around.
        self._lru: dict[str, OrderedDict[int, Entry]] = {}
        self._uses = 0  # counts touches, so entries of different engine ids can be ordered by use too

    # ----------------------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._lru.values())

    def __contains__(self, entry: object) -> bool:
        return isinstance(entry, Entry) and self.get(entry.engine_id, entry.context_id) is entry

    def get(self, engine_id: str, context_id: int) -> Entry | None:
        """The entry of context ``context_id`` on ``engine_id``, if the store has it."""
        entries = self._lru.get(engine_id)
        return None if entries is None else entries.get(context_id)

    def entries(self, engine_id: str) -> list[Entry]:
        """Every entry on ``engine_id``, least recently used first."""
        return list(self._lru.get(engine_id, {}).values())

    def engines(self) -> list[str]:
        """Engines with at least one entry."""
        return list(self._lru)

    def longest_prefix(self, engine_id: str, token_ids: Sequence[int]) -> Match | None:
        """The longest entry on ``engine_id`` whose tokens are a prefix of ``token_ids`` (possibly all of
        them), or None. Does not touch LRU order; `acquire` the entry before forking from it."""
        root = self._roots.get(engine_id)
        if root is None:
            return None
        tokens = tuple(token_ids)
        bs = self.block_size
        # Walk the request's full chunks down as far as the trie goes.
        path = [root]
        node = root
        while (node.depth + 1) * bs <= len(tokens):
            start = node.depth * bs
            child = node.children.get(tokens[start : start + bs])
            if child is None:
                break
            path.append(child)
            node = child
        # Deepest first: a node's tails outrank its exact entry, which outranks everything shallower.
        for node in reversed(path):
            start = node.depth * bs
            rest = len(tokens) - start
            for k in sorted(node.tails, reverse=True):
                if k <= rest:
                    entry = node.tails[k].get(tokens[start : start + k])
                    if entry is not None:
                        return Match(entry, start + k)
            if node.exact is not None:
                return Match(node.exact, start)
        return None

    def longest_common_prefix(self, engine_id: str, token_ids: Sequence[int]) -> Match | None:
        """The entry on ``engine_id`` that shares the most leading tokens with ``token_ids``, whole or in
        part (``Match.whole`` tells), or None when none shares even one token. A whole entry wins a tie (its
        fork copies nothing). Costs one trie walk plus a scan of the deepest node's children and tails.
        Does not touch LRU order."""
        root = self._roots.get(engine_id)
        if root is None:
            return None
        tokens = tuple(token_ids)
        bs = self.block_size
        node = root
        while (node.depth + 1) * bs <= len(tokens):
            child = node.children.get(tokens[node.depth * bs : (node.depth + 1) * bs])
            if child is None:
                break
            node = child
        start = node.depth * bs
        rest = tokens[start : start + bs]
        best: Match | None = None
        if start > 0:  # anything below the deepest node agrees on its whole path
            best = Match(_any_entry(node), start)
        for key, child in node.children.items():
            n = common_prefix_len(key, rest)
            if n > 0 and (best is None or start + n > best.length):
                best = Match(_any_entry(child), start + n)
        for bucket in node.tails.values():
            for tail, entry in bucket.items():
                n = common_prefix_len(tail, rest)
                if n > 0 and (best is None or start + n > best.length):
                    best = Match(entry, start + n)
        whole = self.longest_prefix(engine_id, tokens)
        if whole is not None and (best is None or whole.length >= best.length):
            return whole
        return best

    def engines_holding(self, token_ids: Sequence[int]) -> dict[str, int]:
        """For scheduling: engine_id -> length of its longest entry prefixing ``token_ids``, for every engine
        with a match. No LRU effect."""
        out: dict[str, int] = {}
        for engine_id in self._roots:
            match = self.longest_prefix(engine_id, token_ids)
            if match is not None:
                out[engine_id] = match.length
        return out

    def evict_candidates(self, engine_id: str) -> list[Entry]:
        """Entries on ``engine_id`` with no references, least recently used first. The caller removes the
        ones it evicts (`remove`) and frees their contexts on the engine."""
        return [e for e in self._lru.get(engine_id, {}).values() if e.refs == 0]

    # --------------------------------------------------------------------------------------- mutations

    def insert(self, engine_id: str, context_id: int, token_ids: Sequence[int]) -> Entry:
        """Remember that context ``context_id`` on ``engine_id`` holds exactly ``token_ids``.

        Idempotent per token sequence: if the engine already has an entry with these tokens, that entry is
        returned (and touched) and nothing is stored — when its ``context_id`` differs from the one passed,
        the new context is redundant and the caller should free it (or keep it private). Raises ValueError
        for empty tokens (nothing to share) or a context id already stored with different tokens.
        """
        tokens = tuple(token_ids)
        if not tokens:
            raise ValueError("a prefix entry needs at least one token")
        existing = self.get(engine_id, context_id)
        if existing is not None and existing.token_ids != tokens:
            raise ValueError(
                f"context {context_id} on engine {engine_id!r} is already stored with other tokens "
                f"({len(existing.token_ids)} vs {len(tokens)})"
            )
        node, tail = self._descend(self._roots.setdefault(engine_id, _Node(0)), tokens, create=True)
        assert node is not None  # create=True always reaches the node
        if tail:
            bucket = node.tails.setdefault(len(tail), {})
            found = bucket.get(tail)
            if found is None:
                found = bucket[tail] = Entry(engine_id, context_id, tokens)
        else:
            found = node.exact
            if found is None:
                found = node.exact = Entry(engine_id, context_id, tokens)
        entries = self._lru.setdefault(engine_id, OrderedDict())
        entries[found.context_id] = found
        entries.move_to_end(found.context_id)  # newly inserted or reused: most recently used either way
        self._uses += 1
        found.last_used = self._uses
        return found

    def remove(self, entry: Entry, *, force: bool = False) -> None:
        """Forget ``entry`` (the caller frees its context on the engine). Raises `EntryInUseError` if it has
        references unless ``force`` (the engine is gone anyway); later `release` calls on it then only drop
        the count. Removing an entry already removed is a no-op."""
        if entry not in self:
            return
        if entry.refs > 0 and not force:
            raise EntryInUseError(f"{entry!r} has {entry.refs} reference(s): a request is forking from it")
        root = self._roots[entry.engine_id]
        node, tail = self._descend(root, entry.token_ids, create=False)
        assert node is not None
        if tail:
            bucket = node.tails[len(tail)]
            del bucket[tail]
            if not bucket:
                del node.tails[len(tail)]
        else:
            node.exact = None
        # Prune nodes left with nothing below them, so the trie's size follows the live entries.
        while node.parent is not None and node.empty():
            del node.parent.children[node.key]
            node = node.parent
        entries = self._lru[entry.engine_id]
        del entries[entry.context_id]
        if not entries:
            del self._lru[entry.engine_id]
            del self._roots[entry.engine_id]
        entry.live = False

    def remove_engine(self, engine_id: str) -> list[Entry]:
        """Forget every entry of ``engine_id`` (it left or died), references or not; returns them."""
        entries = list(self._lru.pop(engine_id, {}).values())
        self._roots.pop(engine_id, None)
        for entry in entries:
            entry.live = False
        return entries

    def touch(self, entry: Entry) -> None:
        """Mark ``entry`` most recently used."""
        self._check_live(entry)
        self._lru[entry.engine_id].move_to_end(entry.context_id)
        self._uses += 1
        entry.last_used = self._uses

    def acquire(self, entry: Entry) -> None:
        """A request is about to fork from ``entry``: pin it (never an eviction candidate) and touch it."""
        self._check_live(entry)
        entry.refs += 1
        self.touch(entry)

    def release(self, entry: Entry) -> None:
        """The fork from ``entry`` exists (or was abandoned): drop one reference and touch it — it was in use
        until now. On an entry force-removed meanwhile it only drops the count."""
        if not entry.live:
            entry.refs = max(0, entry.refs - 1)
            return
        if entry.refs <= 0:
            raise ValueError(f"release of {entry!r} without a matching acquire")
        entry.refs -= 1
        self.touch(entry)

    # ---------------------------------------------------------------------------------------- internals

    def _check_live(self, entry: Entry) -> None:
        if entry not in self:
            raise ValueError(f"{entry!r} is not in the store (removed, or from another store)")

    def _descend(self, root: _Node, tokens: Tokens, *, create: bool) -> tuple[_Node | None, Tokens]:
        """The node reached by ``tokens``' full chunks and the partial last chunk (``()`` if none). With
        ``create``, missing nodes are added; without, None when the path does not exist."""
        bs = self.block_size
        node = root
        full = len(tokens) // bs
        for i in range(full):
            chunk = tokens[i * bs : (i + 1) * bs]
            child = node.children.get(chunk)
            if child is None:
                if not create:
                    return None, ()
                child = node.children[chunk] = _Node(node.depth + 1, node, chunk)
            node = child
        return node, tokens[full * bs :]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _any_entry(node: _Node) -> Entry:
    """An entry at or below ``node`` (every node left in the trie has one: empty nodes are pruned)."""
    while True:
        if node.exact is not None:
            return node.exact
        for bucket in node.tails.values():
            for entry in bucket.values():
                return entry
        node = next(iter(node.children.values()))
