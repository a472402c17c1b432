"""The manager's prefix store: longest whole-entry prefix match, per-engine separation, refcounts, LRU order,
idempotent insert, removal (with trie pruning), and a property test against a brute-force scan."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from server.serve.prefix_store import DEFAULT_BLOCK_SIZE, Entry, EntryInUseError, Match, PrefixStore


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def test_system_prompt_shared_by_50_requests() -> None:
    store = PrefixStore()
    system = tokens(1000, seed=1)  # 62 full blocks of 16 and a partial one of 8
    entry = store.insert("e0", 1, system)
    for i in range(50):
        request = system + tokens(20 + i, seed=100 + i)
        match = store.longest_prefix("e0", request)
        assert match is not None
        assert match.entry is entry
        assert match.length == 1000
        assert match.rest(request) == tuple(request[1000:])
    assert len(store) == 1


def test_nested_prefixes_choose_the_longest() -> None:
    store = PrefixStore(block_size=4)
    base = tokens(40, seed=2)
    short = store.insert("e", 1, base[:10])  # ends inside a chunk
    mid = store.insert("e", 2, base[:16])  # ends on a chunk boundary
    long = store.insert("e", 3, base[:23])
    assert store.longest_prefix("e", base) == Match(long, 23)
    assert store.longest_prefix("e", base[:22]) == Match(mid, 16)
    assert store.longest_prefix("e", base[:15]) == Match(short, 10)
    assert store.longest_prefix("e", base[:9]) is None
    # A request equal to an entry matches it whole: the context can generate without any fill.
    assert store.longest_prefix("e", base[:16]) == Match(mid, 16)


def test_divergence_inside_an_entry_does_not_match_it() -> None:
    store = PrefixStore(block_size=4)
    base = tokens(30, seed=3)
    store.insert("e", 1, base)
    for diverge_at in (0, 3, 4, 17, 29):
        request = list(base)
        request[diverge_at] += 1
        assert store.longest_prefix("e", request) is None, diverge_at
    # With a shorter entry ending before the divergence, that one matches instead.
    shorter = store.insert("e", 2, base[:12])
    request = list(base)
    request[20] += 1
    assert store.longest_prefix("e", request) == Match(shorter, 12)
    # A request that is a strict prefix of an entry cannot use it (the engine forks whole contexts).
    assert store.longest_prefix("e", base[:25]) == Match(shorter, 12)


def test_engines_are_separate() -> None:
    store = PrefixStore()
    prompt = tokens(100, seed=4)
    a = store.insert("a", 1, prompt[:50])
    b = store.insert("b", 1, prompt[:80])  # same context id on another engine is another context
    assert store.longest_prefix("a", prompt) == Match(a, 50)
    assert store.longest_prefix("b", prompt) == Match(b, 80)
    assert store.longest_prefix("c", prompt) is None
    assert store.engines_holding(prompt) == {"a": 50, "b": 80}
    assert store.engines_holding(prompt[:60]) == {"a": 50}
    assert store.engines_holding(tokens(100, seed=5)) == {}
    assert store.get("a", 1) is a and store.get("b", 1) is b
    assert store.evict_candidates("a") == [a]


def test_refcounts_block_eviction_and_removal() -> None:
    store = PrefixStore()
    e1 = store.insert("e", 1, tokens(20, seed=6))
    e2 = store.insert("e", 2, tokens(20, seed=7))
    store.acquire(e1)
    store.acquire(e1)
    assert e1.refs == 2
    assert store.evict_candidates("e") == [e2]
    with pytest.raises(EntryInUseError):
        store.remove(e1)
    store.release(e1)
    assert store.evict_candidates("e") == [e2]
    store.release(e1)
    assert e1.refs == 0
    assert set(store.evict_candidates("e")) == {e1, e2}
    with pytest.raises(ValueError, match="without a matching acquire"):
        store.release(e1)


def test_lru_order() -> None:
    store = PrefixStore()
    a, b, c = (store.insert("e", i, tokens(10, seed=10 + i)) for i in range(3))
    assert store.evict_candidates("e") == [a, b, c]
    store.touch(a)
    assert store.evict_candidates("e") == [b, c, a]
    store.acquire(b)
    store.release(b)  # in use until its release: most recent
    assert store.evict_candidates("e") == [c, a, b]
    # Lookups are probes: they never reorder.
    store.longest_prefix("e", c.token_ids)
    store.engines_holding(c.token_ids)
    assert store.evict_candidates("e") == [c, a, b]
    store.insert("e", 99, c.token_ids)  # a redundant insert counts as a use of the existing entry
    assert store.evict_candidates("e") == [a, b, c]
    assert store.entries("e") == [a, b, c]


def test_parent_of_live_entries_stays_evictable() -> None:
    store = PrefixStore()
    system = tokens(64, seed=12)
    parent = store.insert("e", 1, system)
    child = store.insert("e", 2, system + tokens(30, seed=13))
    store.acquire(child)
    assert store.evict_candidates("e") == [parent]
    store.remove(parent)
    assert store.longest_prefix("e", (*child.token_ids, 5)) == Match(child, 94)
    assert store.longest_prefix("e", [*system, 5]) is None


def test_idempotent_insert() -> None:
    store = PrefixStore()
    prompt = tokens(40, seed=14)
    first = store.insert("e", 1, prompt)
    assert store.insert("e", 1, prompt) is first  # same context again
    again = store.insert("e", 2, prompt)  # another context with identical tokens: redundant
    assert again is first and again.context_id == 1
    assert store.get("e", 2) is None
    assert len(store) == 1
    assert store.insert("f", 2, prompt) is not first  # another engine keeps its own
    with pytest.raises(ValueError, match="other tokens"):
        store.insert("e", 1, prompt[:-1])
    with pytest.raises(ValueError, match="at least one token"):
        store.insert("e", 3, [])


def test_remove_and_prune() -> None:
    store = PrefixStore(block_size=4)
    base = tokens(30, seed=15)
    a = store.insert("e", 1, base[:9])
    b = store.insert("e", 2, base[:30])
    store.remove(b)
    assert not b.live and b not in store
    assert store.longest_prefix("e", base) == Match(a, 9)
    with pytest.raises(ValueError, match="not in the store"):
        store.acquire(b)
    store.remove(b)  # already gone: no-op
    # Only a's path (two chunks) is left in the trie.
    root = store._roots["e"]
    assert len(root.children) == 1 and len(next(iter(root.children.values())).children) == 1
    store.remove(a)
    assert len(store) == 0 and store.engines() == []
    assert store.longest_prefix("e", base) is None


def test_force_remove_and_remove_engine() -> None:
    store = PrefixStore()
    a = store.insert("e", 1, tokens(10, seed=16))
    store.acquire(a)
    store.remove(a, force=True)
    store.release(a)  # the engine is gone; the pending release just drops the count
    assert a.refs == 0 and not a.live
    b = store.insert("f", 1, tokens(10, seed=17))
    store.acquire(b)
    assert store.remove_engine("f") == [b]
    assert not b.live and store.engines_holding(b.token_ids) == {}


def test_default_block_size_matches_engine() -> None:
    assert PrefixStore().block_size == DEFAULT_BLOCK_SIZE == 16
    with pytest.raises(ValueError):
        PrefixStore(block_size=0)


def brute_force(entries: list[Entry], engine_id: str, query: tuple[int, ...]) -> tuple[int, int] | None:
    best: tuple[int, int] | None = None
    for e in entries:
        n = len(e.token_ids)
        if e.engine_id == engine_id and query[:n] == e.token_ids and (best is None or n > best[1]):
            best = (e.context_id, n)
    return best


# A tiny vocabulary and short sequences make shared prefixes, chunk-boundary endings and divergences common.
seqs = st.lists(st.integers(0, 2), min_size=1, max_size=14)


@settings(max_examples=200, deadline=None)
@given(
    block_size=st.integers(1, 5),
    inserts=st.lists(st.tuples(st.sampled_from("ab"), seqs), max_size=25),
    removals=st.lists(st.integers(0, 30), max_size=8),
    queries=st.lists(st.tuples(st.sampled_from("ab"), st.lists(st.integers(0, 2), max_size=18)), max_size=12),
)
def test_longest_prefix_matches_brute_force(
    block_size: int,
    inserts: list[tuple[str, list[int]]],
    removals: list[int],
    queries: list[tuple[str, list[int]]],
) -> None:
    store = PrefixStore(block_size=block_size)
    for context_id, (engine_id, toks) in enumerate(inserts):
        store.insert(engine_id, context_id, toks)
    live = [e for eng in ("a", "b") for e in store.entries(eng)]
    for i in removals:
        if i < len(live):
            store.remove(live[i])
    live = [e for e in live if e.live]
    assert len(store) == len(live)
    # Queries: random ones, plus every live entry's tokens extended, cut short, and exact.
    probes = [(eng, tuple(q)) for eng, q in queries]
    for e in live:
        probes += [(e.engine_id, (*e.token_ids, 1)), (e.engine_id, e.token_ids[:-1]), ("a", e.token_ids)]
    for engine_id, query in probes:
        match = store.longest_prefix(engine_id, query)
        got = None if match is None else (match.entry.context_id, match.length)
        assert got == brute_force(live, engine_id, query)
        holding = store.engines_holding(query)
        for eng in ("a", "b"):
            expected = brute_force(live, eng, query)
            assert holding.get(eng) == (None if expected is None else expected[1])


# ------------------------------------------------------------------------ longest common prefix (partial)
def test_common_prefix_finds_a_part_of_an_entry_inside_and_across_blocks() -> None:
    store = PrefixStore(block_size=4)
    base = tokens(30, seed=7)
    entry = store.insert("e", 1, base)
    for diverge_at in range(1, 30):
        request = [*base[:diverge_at], 99999, *tokens(5, seed=diverge_at)]
        match = store.longest_common_prefix("e", request)
        assert match == Match(entry, diverge_at), diverge_at
        assert not match.whole
    assert store.longest_common_prefix("e", [99999, *base]) is None
    # A request that is a strict prefix of the entry matches all of its own tokens.
    assert store.longest_common_prefix("e", base[:10]) == Match(entry, 10)
    # A whole entry wins a tie (its fork copies nothing).
    short = store.insert("e", 2, base[:12])
    assert store.longest_common_prefix("e", [*base[:12], 99999]) == Match(short, 12)
    assert store.longest_common_prefix("e", base) == Match(entry, 30)
    assert store.longest_common_prefix("e", base).whole


def test_common_prefix_picks_the_entry_agreeing_longest_among_many() -> None:
    store = PrefixStore(block_size=4)
    system = tokens(10, seed=1)
    entries = {i: store.insert("e", i, [*system, *tokens(8 + i, seed=50 + i)]) for i in range(6)}
    for i, entry in entries.items():
        request = [*entry.token_ids[: 10 + 3 + i], 77777]
        match = store.longest_common_prefix("e", request)
        assert match is not None and match.entry is entry and match.length == 13 + i
    other = store.longest_common_prefix("e", [*system, 55555])
    assert other is not None and other.length == 10 and other.entry in entries.values()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=8),
    st.lists(st.integers(0, 3), min_size=0, max_size=24),
)
def test_common_prefix_agrees_with_a_brute_force_scan(seqs: list[list[int]], request: list[int]) -> None:
    store = PrefixStore(block_size=3)
    for i, seq in enumerate(seqs):
        store.insert("e", i, seq)

    def common(a: tuple[int, ...]) -> int:
        n = 0
        while n < min(len(a), len(request)) and a[n] == request[n]:
            n += 1
        return n

    best = max((common(e.token_ids) for e in store.entries("e")), default=0)
    match = store.longest_common_prefix("e", request)
    if best == 0:
        assert match is None
    else:
        assert match is not None and match.length == best
        assert tuple(match.entry.token_ids[:best]) == tuple(request[:best])
