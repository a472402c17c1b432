"""The cluster scheduler (Algorithm 1): branch order on hand-made cluster states, caps, starvation."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings, strategies as st

from server.serve.scheduler import EngineState, QueuedRequest, SchedulerConfig, schedule


def engines(n: int = 3, capacity: int = 1000, latency_cap: int = 300, **running: int) -> list[EngineState]:
    return [
        EngineState(i, capacity=capacity, latency_cap=latency_cap, running=running.get(f"e{i}", 0))
        for i in range(n)
    ]


def req(key: str, seq: int, tokens: int = 50, **kw) -> QueuedRequest:  # type: ignore[no-untyped-def]
    return QueuedRequest(key=key, app=kw.pop("app", "app"), seq=seq, tokens=tokens, **kw)


def test_task_group_beats_queue_prefix_beats_context_beats_find_engine() -> None:
    # The group's members hold contexts on engine 2 and share a prefix with `p`, but the group branch
    # places the whole group together first (on the engine where its members' prefix is cached).
    queue = [
        req("g1", 0, task_group="reduce", shared_prefix="sys", cached={2: 64}),
        req("g2", 1, task_group="reduce", shared_prefix="sys"),
        req("g3", 2, task_group="reduce", shared_prefix="sys"),
        req("p1", 3, shared_prefix="doc", cached={0: 32}),
        req("p2", 4, shared_prefix="doc"),
        req("c", 5, cached={1: 80}),
        req("f", 6),
    ]
    d = schedule(queue, engines(e0=400, e1=100))
    assert d.reasons == {
        "g1": "task_group",
        "g2": "task_group",
        "g3": "task_group",
        "p1": "queue_prefix",
        "p2": "queue_prefix",
        "c": "context",
        "f": "find_engine",
    }
    assert {d.assignments[k] for k in ("g1", "g2", "g3")} == {2}
    assert d.assignments["p1"] == d.assignments["p2"] == 0  # together, where p1's prefix is cached
    assert d.assignments["c"] == 1
    # find_engine for throughput work takes the least loaded engine: 1 and 2 both run 150 tokens by now
    # (engine 0 runs 500), and the tie goes to the lower id.
    assert d.assignments["f"] == 1


def test_prefix_batches_follow_the_engine_running_their_prefix() -> None:
    """No context holds the prefix yet, but engine 0 runs a request of it (its fill under way): a batch of
    that prefix goes there, busier or not, while it fits; a lone request, other prefixes and task groups go
    by load."""
    states = [
        EngineState(0, capacity=1000, latency_cap=300, running=400, prefixes=frozenset({"sys"})),
        EngineState(1, capacity=1000, latency_cap=300),
    ]
    d = schedule([req("b1", 0, shared_prefix="sys"), req("b2", 1, shared_prefix="sys")], states)
    assert d.assignments == {"b1": 0, "b2": 0} and d.reasons["b1"] == "queue_prefix"
    assert schedule([req("a", 0, shared_prefix="sys")], states).assignments == {"a": 1}
    pair = [req("o1", 0, shared_prefix="other"), req("o2", 1, shared_prefix="other")]
    assert set(schedule(pair, states).assignments.values()) == {1}
    group = [req(f"g{i}", i, task_group="map", shared_prefix="sys") for i in range(2)]
    assert set(schedule(group, states).assignments.values()) == {1}
    big = [req(f"big{i}", i, tokens=350, shared_prefix="sys") for i in range(2)]
    assert set(schedule(big, states).assignments.values()) == {1}  # 700 more would not fit engine 0
    # Within one round too: a batch placed first marks its engine for a later batch of its prefix.
    first = [req("x1", 0, shared_prefix="new"), req("x2", 1, shared_prefix="new")]
    later = [req("y1", 2, shared_prefix="new", model="m"), req("y2", 3, shared_prefix="new", model="m")]
    d = schedule(first + later, [replace(e, model="m") for e in states])
    assert {d.assignments[k] for k in ("x1", "x2", "y1", "y2")} == {1}


def test_a_lone_request_follows_a_cache_routed_engine_running_its_prefix_unless_far_busier() -> None:
    """An OpenAI backend's prefix cache is its only sharing: a request alone meets the backend that runs
    its prefix (a burst's straggler), unless that backend is past both the slack and 1.5x the least
    loaded; our own engines still place it by load."""
    backend = EngineState(0, 10_000, 4000, running=400, prefixes=frozenset({"sys"}), cache_routed=True)
    idle = EngineState(1, 10_000, 4000, cache_routed=True)
    lone = [req("a", 0, shared_prefix="sys")]
    d = schedule(lone, [backend, idle])
    assert d.assignments == {"a": 0} and d.reasons["a"] == "context"
    assert schedule(lone, [replace(backend, cache_routed=False), idle]).assignments == {"a": 1}
    assert schedule([req("b", 0, shared_prefix="other")], [backend, idle]).assignments == {"b": 1}
    tight = SchedulerConfig(prefix_slack_tokens=399)
    assert schedule(lone, [backend, idle], tight).assignments == {"a": 1}  # 400 more, and > 1.5x of 0
    busy = replace(idle, running=300)  # 100 more than it: within 1.5x, so still balanced
    assert schedule(lone, [backend, busy], tight).assignments == {"a": 0}
    group = [req(f"g{i}", i, task_group="map", shared_prefix="sys") for i in range(2)]
    assert set(schedule(group, [backend, idle]).assignments.values()) == {1}  # groups go by load


def test_find_engine_spreads_latency_work_and_keeps_throughput_off_latency_engines() -> None:
    d = schedule([req("l", 0, criteria="latency")], engines(e0=200, e1=100, e2=150))
    assert d.assignments == {"l": 1}  # least loaded
    busy = [EngineState(0, 1000, 300, running=100, latency_running=True), EngineState(1, 1000, 300, 500)]
    d = schedule([req("t", 0, tokens=100, criteria="throughput")], busy)
    assert d.assignments == {"t": 1}


def test_a_context_holder_that_is_full_falls_through_to_find_engine() -> None:
    d = schedule([req("c", 0, tokens=200, cached={0: 100})], engines(n=2, capacity=1000, e0=900))
    assert d.assignments == {"c": 1} and d.reasons == {"c": "find_engine"}


def test_a_group_too_big_for_any_engine_is_placed_member_by_member() -> None:
    group = [req(f"g{i}", i, tokens=400, task_group="t") for i in range(3)]
    d = schedule(group, engines(n=2, capacity=1000))
    # The first member goes alone; what is left of the group fits together on the other engine.
    assert d.reasons == {"g0": "find_engine", "g1": "task_group", "g2": "task_group"}
    assert d.assignments["g1"] == d.assignments["g2"] != d.assignments["g0"]


def test_pinned_steps_wait_for_their_engine_and_oversized_ones_are_unfit() -> None:
    d = schedule(
        [req("pin", 0, tokens=200, pinned=0), req("huge", 1, tokens=5000)],
        engines(n=2, capacity=1000, e0=900),
    )
    assert d.assignments == {} and d.unfit == ["huge"]
    d = schedule([req("pin", 0, tokens=200, pinned=0)], engines(n=2, capacity=1000))
    assert d.assignments == {"pin": 0} and d.reasons == {"pin": "pinned"}


def test_latency_requests_never_exceed_the_latency_cap() -> None:
    queue = [req(f"l{i}", i, tokens=100, criteria="latency") for i in range(10)]
    d = schedule(queue, engines(n=2, capacity=1000, latency_cap=300))
    assert len(d.assignments) == 6  # 3 per engine under the 300-token cap; the rest wait
    # Throughput work may fill an engine running latency work only up to the latency cap.
    d = schedule([req("t", 0, tokens=250)], [EngineState(0, 1000, 300, running=100, latency_running=True)])
    assert d.assignments == {}


def test_aged_requests_go_first_and_engines_drain_for_them() -> None:
    config = SchedulerConfig(aging_rounds=3)
    big = req("big", 0, tokens=900, depth=5)
    small = [req(f"s{i}", i + 1, tokens=100) for i in range(5)]
    state = engines(n=1, capacity=1000, e0=200)
    # Young: small requests of lower depth go first and keep the engine busy.
    assert "big" not in schedule([big, *small], state, config).assignments
    # Aged: nothing is placed ahead of it, so running work drains until it fits.
    aged = QueuedRequest(**{**big.__dict__, "waited": 3})
    assert schedule([aged, *small], state, config).assignments == {}
    assert schedule([aged, *small], engines(n=1, capacity=1000), config).assignments["big"] == 0


def test_no_starvation_under_a_steady_stream() -> None:
    """A big request among an endless stream of small ones is placed within aging_rounds + drain rounds."""
    config = SchedulerConfig(aging_rounds=4)
    running: list[tuple[int, int]] = []  # (tokens, rounds left)
    waiting = [req("big", 0, tokens=800, depth=9)]
    seq = 1
    for rnd in range(30):
        waiting += [req(f"s{seq + i}", seq + i, tokens=100) for i in range(3)]
        seq += 3
        state = [EngineState(0, 1000, 300, running=sum(t for t, _ in running))]
        d = schedule(waiting, state, config)
        if "big" in d.assignments:
            assert rnd <= 4 + 3
            return
        by_key = {r.key: r for r in waiting}
        running = [(t, left - 1) for t, left in running if left > 1]
        running += [(by_key[k].tokens, 3) for k in d.assignments]
        waiting = [
            QueuedRequest(**{**r.__dict__, "waited": r.waited + 1})
            for r in waiting
            if r.key not in d.assignments
        ]
    raise AssertionError("the big request starved")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 600),
            st.sampled_from([None, "latency", "throughput"]),
            st.sampled_from([None, "g1", "g2"]),
            st.sampled_from([None, "p1", "p2"]),
            st.dictionaries(st.integers(0, 3), st.integers(0, 200), max_size=2),
            st.one_of(st.none(), st.integers(0, 3)),
        ),
        max_size=25,
    ),
    st.lists(st.tuples(st.integers(0, 1200), st.booleans()), min_size=1, max_size=4),
)
def test_caps_are_never_violated(requests: list, states: list) -> None:  # type: ignore[type-arg]
    queue = [
        req(f"r{i}", i, tokens=t, criteria=c, task_group=g, shared_prefix=p, cached=cached, pinned=pin)
        for i, (t, c, g, p, cached, pin) in enumerate(requests)
    ]
    cluster = [
        EngineState(i, capacity=1000, latency_cap=400, running=run, latency_running=lat)
        for i, (run, lat) in enumerate(states)
    ]
    d = schedule(queue, cluster)
    by_key = {r.key: r for r in queue}
    assert set(d.assignments).isdisjoint(d.unfit)
    for engine in cluster:
        mine = [by_key[k] for k, e in d.assignments.items() if e == engine.engine_id]
        total = engine.running + sum(r.tokens for r in mine)
        latency = engine.latency_running or any(r.latency_bound for r in mine)
        if mine:
            assert total <= (engine.latency_cap if latency else engine.capacity)
        assert all(r.pinned in (None, engine.engine_id) for r in mine)


def test_tenants_take_turns_so_a_flood_never_holds_back_another_tenants_step() -> None:
    flood = [req(f"f{i}", i, tokens=10, tenant="a", app="batch", shared_prefix="p") for i in range(2000)]
    victim = req("v", 5000, tokens=10, tenant="b", app="chat", criteria="latency")
    # Two free places: the flood's first step and the victim's (its turn comes before the flood's second).
    state = [EngineState(0, 100_000, 4096, steps=62, max_steps=64)]
    assert set(schedule([*flood, victim], state).assignments) == {"f0", "v"}
    # Aged flood steps do not jump the turns either: aging orders steps within a turn.
    aged = [replace(r, waited=100) for r in flood]
    assert set(schedule([*aged, victim], state).assignments) == {"f0", "v"}


def test_apps_of_one_tenant_take_turns_and_one_app_keeps_its_own_order() -> None:
    a = [req(f"a{i}", i, tenant="t", app="a", depth=1 - i % 2) for i in range(4)]  # a1, a3 at depth 0
    b = [req("b0", 10, tenant="t", app="b")]
    state = [EngineState(0, 100_000, 4096, max_steps=2)]
    assert set(schedule([*a, *b], state).assignments) == {"a1", "b0"}  # a's first turn: its shallowest
    assert set(schedule(a, [replace(state[0], max_steps=3)]).assignments) == {"a1", "a3", "a0"}


def test_an_engine_takes_at_most_max_steps_requests() -> None:
    queue = [req(f"r{i}", i, tokens=1) for i in range(10)]
    d = schedule(queue, [EngineState(0, 1000, 300, steps=3, max_steps=7)])
    assert sorted(d.assignments) == ["r0", "r1", "r2", "r3"]
    assert schedule(queue, [EngineState(0, 1000, 300, max_steps=None)]).assignments.keys() == {
        r.key for r in queue
    }


def test_a_prefix_batch_takes_what_an_engine_has_room_for_in_one_pass() -> None:
    queue = [req(f"r{i}", i, tokens=10, shared_prefix="p") for i in range(2000)]
    d = schedule(queue, [EngineState(0, 100_000, 4096, steps=0, max_steps=128)])
    assert sorted(d.assignments, key=lambda k: int(k[1:])) == [f"r{i}" for i in range(128)]
    assert set(d.reasons.values()) == {"queue_prefix"}


def test_shorter_predicted_requests_go_first_among_equals() -> None:
    """SSJF in the manager's queue: one engine with room for one request; of three otherwise equal requests
    (one tenant, each its own app, as OpenAI requests are) the lowest priority goes first, then arrival."""
    one = [EngineState(0, capacity=60, latency_cap=60)]
    queue = [
        req("long", 0, app="a", priority=200.0),
        req("short", 1, app="b", priority=10.0),
        req("unknown", 2, app="c"),  # no prediction: priority 0
    ]
    assert schedule(queue, one).assignments == {"unknown": 0}
    assert schedule(queue[:2], one).assignments == {"short": 0}
    aged = [replace(r, waited=8) for r in queue[:2]]  # aged requests keep the same order among themselves
    assert schedule(aged, one).assignments == {"short": 0}
