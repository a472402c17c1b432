"""Objective deduction over session graphs: Figure 9's latency marks, task groups, throughput, depth, and the
incremental upkeep (reprioritisation events, a cost linear in what changes)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Iterator

import pytest
from hypothesis import given, settings, strategies as st
from parrot.protocol import Criteria

from server.serve.deduction import StepObjective, deduce, objective
from server.serve.graph import GraphError, SessionGraph, StepNode
from server.serve.variables import StepId
from tests.serve.test_graph import ids, make_call, run

_STRENGTH: dict[Criteria | None, int] = {None: 0, "throughput": 1, "latency": 2}


def s(call_id: str, index: int = 0) -> StepId:
    return StepId(call_id, index)


def criteria(g: SessionGraph) -> dict[StepId, Criteria | None]:
    return {sid: o.criteria for sid, o in deduce(g).items()}


def figure_9_graph() -> SessionGraph:
    """A map-reduce app in the shape of Figure 9 of the paper.

    Figure 9 (section 5.2) shows an application generating two latency-sensitive semantic variables: the
    requests that directly produce them (Requests 1 and 2) are labelled latency-sensitive, "as are their
    immediate predecessors (Request 3)", and the parallel requests of one stage further upstream are grouped
    into task groups (Task Groups 0 and 1), scheduled for the completion time of the whole group rather than
    each request's latency.

    Here, with one latency variable: a document is split into chunks; three map calls summarise them in
    parallel (a task group, named by its consumer ``reduce``); a reduce call combines the summaries; a final
    call answers from the reduce output, and the app gets that answer with latency criteria. So ``final``
    produces the latency variable (Requests 1 and 2), ``reduce`` is its immediate predecessor (Request 3),
    and the maps are a task group upstream, throughput-preferred. An unrelated call of the same app is got
    with throughput criteria.
    """
    g = SessionGraph()
    g.variables.create("doc", "text", var_id="doc")
    for i in range(3):
        g.add_call(
            make_call(
                "Summarise {{input:doc}} part " + str(i) + ": {{output:sum}}", {"doc": "doc"}, f"map{i}"
            )
        )
    g.add_call(
        make_call(
            "Combine {{input:a}} {{input:b}} {{input:c}}: {{output:all}}",
            {"a": "map0.sum", "b": "map1.sum", "c": "map2.sum"},
            "reduce",
        )
    )
    g.add_call(make_call("Answer from {{input:all}}: {{output:answer}}", {"all": "reduce.all"}, "final"))
    g.add_call(make_call("Translate {{input:doc}}: {{output:fr}}", {"doc": "doc"}, "side"))
    return g


def test_figure_9_latency_marks_and_task_group() -> None:
    g = figure_9_graph()
    assert criteria(g) == dict.fromkeys(deduce(g), None)  # nothing wanted
    group = s("reduce")
    # The task group exists from the moment its consumer was submitted, before any get.
    assert {sid: o.task_group for sid, o in deduce(g).items()} == {
        s("map0"): group,
        s("map1"): group,
        s("map2"): group,
        s("reduce"): None,
        s("final"): None,
        s("side"): None,
    }
    g.take_reprioritised()
    g.activate("final.answer", "latency")
    g.activate("side.fr", "throughput")
    got = deduce(g)
    assert got == {
        s("map0"): StepObjective("throughput", group, 0),
        s("map1"): StepObjective("throughput", group, 0),
        s("map2"): StepObjective("throughput", group, 0),
        s("reduce"): StepObjective("latency", None, 1),
        s("final"): StepObjective("latency", None, 2),
        s("side"): StepObjective("throughput", None, 0),
    }
    assert all(objective(node) == got[node.id] for node in g.steps())
    # In the order the marks were made: the producer, its immediate predecessor, the stage upstream, side.
    assert ids(g.take_reprioritised()) == [
        s("final"),
        s("reduce"),
        s("map0"),
        s("map1"),
        s("map2"),
        s("side"),
    ]
    assert g.take_reprioritised() == []


def test_figure_9_two_latency_outputs_share_their_immediate_predecessor() -> None:
    # Requests 1 and 2 each produce a latency variable from Request 3's output; a map stage feeds Request 3.
    g = SessionGraph()
    g.variables.create("doc", "text", var_id="doc")
    for i in range(2):
        g.add_call(make_call("Map {{input:d}} " + str(i) + " {{output:m}}", {"d": "doc"}, f"map{i}"))
    g.add_call(make_call("R3 {{input:a}} {{input:b}} {{output:o}}", {"a": "map0.m", "b": "map1.m"}, "r3"))
    g.add_call(make_call("R1 {{input:x}} {{output:o}}", {"x": "r3.o"}, "r1"))
    g.add_call(make_call("R2 {{input:x}} {{output:o}}", {"x": "r3.o"}, "r2"))
    g.activate("r1.o", "latency")
    g.activate("r2.o", "latency")
    assert deduce(g) == {
        s("map0"): StepObjective("throughput", s("r3"), 0),
        s("map1"): StepObjective("throughput", s("r3"), 0),
        s("r3"): StepObjective("latency", None, 1),
        s("r1"): StepObjective("latency", None, 2),
        s("r2"): StepObjective("latency", None, 2),
    }


def test_map_reduce_puts_the_map_stage_in_one_task_group_and_throughput_upstream() -> None:
    g = SessionGraph()
    g.variables.create(None, "d", var_id="d")
    n = 8
    for i in range(n):
        g.add_call(make_call("Map {{input:d}} " + str(i) + " {{output:m}}", {"d": "d"}, f"m{i}"))
    inputs = {f"x{i}": f"m{i}.m" for i in range(n)}
    body = " ".join("{{input:x" + str(i) + "}}" for i in range(n))
    g.add_call(make_call(f"Reduce {body} {{{{output:r}}}}", inputs, "r"))
    g.activate("r.r", "throughput")
    got = deduce(g)
    assert {got[s(f"m{i}")].task_group for i in range(n)} == {s("r")}
    assert {v.criteria for v in got.values()} == {"throughput"}
    # A later, stricter get wins: the maps produce the reduce's inputs, its immediate predecessors.
    g.activate("r.r", "latency")
    assert {v.criteria for v in deduce(g).values()} == {"latency"}
    g.activate("r.r", "throughput")  # weaker: changes nothing
    assert {v.criteria for v in deduce(g).values()} == {"latency"}


def test_a_chain_is_all_latency_without_groups_and_a_multi_output_call_is_not_a_group() -> None:
    g = SessionGraph()
    g.add_call(make_call("A {{output:x}} then {{output:y}}", {}, "a"))
    g.add_call(make_call("B {{input:x}} {{input:y}} {{output:z}}", {"x": "a.x", "y": "a.y"}, "b"))
    g.activate("b.z", "latency")
    got = deduce(g)
    # Two outputs of one call feed b, but they are one context chain, not parallel steps: no group. Both
    # produce b's inputs, so both are its immediate predecessors.
    assert got == {
        s("a", 0): StepObjective("latency", None, 0),
        s("a", 1): StepObjective("latency", None, 1),
        s("b"): StepObjective("latency", None, 2),
    }


def test_a_multi_output_step_s_immediate_predecessor_is_its_previous_step() -> None:
    g = SessionGraph()
    g.variables.create("q", "question", var_id="q")
    (up,) = g.add_call(make_call("Up {{input:q}} {{output:u}}", {"q": "q"}, "up"))
    s0, s1, s2, s3 = g.add_call(
        make_call("{{input:u}} {{output:a}} {{output:b}} {{output:c}} {{output:d}}", {"u": "up.u"}, "m")
    )
    g.activate("m.c", "latency")  # s2: its previous step s1 is its only pending predecessor
    assert [x.criteria for x in (up, s0, s1, s2, s3)] == [
        "throughput",
        "throughput",
        "latency",
        "latency",
        None,  # downstream of the get: not needed for it
    ]
    assert (up.task_group, s0.task_group, s1.task_group) == (None, None, None)
    assert ids(g.take_reprioritised()) == [s("m", 2), s("m", 1), s("m", 0), s("up")]
    g.activate("m.a", "latency")  # s0 and its input's producer
    assert [x.criteria for x in (up, s0, s1, s2, s3)] == ["latency", "latency", "latency", "latency", None]
    assert ids(g.take_reprioritised()) == [s("m", 0), s("up")]


def test_a_later_latency_get_strengthens_only_the_producer_and_its_immediate_predecessors() -> None:
    g = SessionGraph()
    g.variables.create("seed", "s", var_id="v0")
    chain = [
        g.add_call(
            make_call("{{input:p}} {{output:o}}", {"p": f"v{i}"}, f"c{i}", outputs={"o": f"v{i + 1}"})
        )[0]
        for i in range(5)
    ]
    (side,) = g.add_call(make_call("{{input:p}} {{output:o}}", {"p": "v2"}, "side"))
    assert g.activate("v5", "throughput") == chain[::-1]
    assert [c.criteria for c in chain] == ["throughput"] * 5 and side.criteria is None
    assert ids(g.take_reprioritised()) == [s(f"c{i}") for i in (4, 3, 2, 1, 0)]

    before = g.visits
    assert g.activate("v5", "latency") == []  # already activated
    assert [c.criteria for c in chain] == ["throughput"] * 3 + ["latency"] * 2
    assert ids(g.take_reprioritised()) == [s("c4"), s("c3")]
    assert g.visits - before <= 2  # the producer's predecessor, nothing further upstream
    assert side.criteria is None

    g.activate("v5", "latency")  # again: nothing changes, nothing to re-prioritise
    g.activate("v5", "throughput")
    assert g.take_reprioritised() == [] and [c.criteria for c in chain][-2:] == ["latency", "latency"]

    # A step's criteria survive its predecessors' completion and are never weakened.
    run(g, chain[0], "one")
    run(g, chain[1], "two")
    assert [c.criteria for c in chain[2:]] == ["throughput", "latency", "latency"]
    assert g.take_reprioritised() == []


def test_a_get_before_the_producer_exists_marks_it_when_it_is_added() -> None:
    g = SessionGraph()
    g.variables.create("doc", "text", var_id="doc")
    g.variables.create("answer", var_id="answer")  # created unset; a call will produce it
    (a,) = g.add_call(make_call("A {{input:d}} {{output:o}}", {"d": "doc"}, "a"))
    (b,) = g.add_call(make_call("B {{input:x}} {{output:o}}", {"x": "a.o"}, "b"))
    assert g.activate("answer", "latency") == []  # nothing produces it yet
    assert criteria(g) == {s("a"): None, s("b"): None} and g.take_reprioritised() == []

    (c,) = g.add_call(make_call("C {{input:x}} {{output:o}}", {"x": "b.o"}, "c", outputs={"o": "answer"}))
    assert c.activated and c.criteria == "latency"
    assert (b.criteria, a.criteria) == ("latency", "throughput")  # immediate predecessor, then upstream
    # The steps that were already pending changed; the new one starts with its objective.
    assert ids(g.take_reprioritised()) == [s("b"), s("a")]


def test_a_late_producer_of_a_latency_step_s_input_is_its_immediate_predecessor() -> None:
    g = SessionGraph()
    g.variables.create("x", var_id="x")  # unset: produced by a call submitted later
    g.variables.create("doc", "text", var_id="doc")
    (c,) = g.add_call(make_call("C {{input:x}} {{output:o}}", {"x": "x"}, "c"))
    (d,) = g.add_call(make_call("D {{input:x}} {{output:o}}", {"x": "c.o"}, "d"))
    g.activate("d.o", "latency")
    assert (c.criteria, d.criteria) == ("latency", "latency")
    g.take_reprioritised()

    (up,) = g.add_call(make_call("Up {{input:d}} {{output:o}}", {"d": "doc"}, "up"))
    (p,) = g.add_call(make_call("P {{input:u}} {{output:o}}", {"u": "up.o"}, "p", outputs={"o": "x"}))
    # p feeds c, which is an immediate predecessor (not a producer) of the latency get: p is throughput.
    assert (up.criteria, p.criteria) == ("throughput", "throughput")
    assert ids(g.take_reprioritised()) == [s("up")]  # p is new; up was pending and changed

    g.variables.create("y", var_id="y")
    g.add_call(make_call("E {{input:y}} {{output:o}}", {"y": "y"}, "e"))
    g.activate("e.o", "latency")
    (q,) = g.add_call(make_call("Q {{output:o}}", {}, "q", outputs={"o": "y"}))
    assert q.criteria == "latency"  # it produces an input of the latency producer e


def test_task_group_is_formed_when_the_consumer_arrives_after_its_producers() -> None:
    g = SessionGraph()
    g.variables.create("doc", "text", var_id="doc")
    maps = [g.add_call(make_call("M {{input:d}} {{output:m}}", {"d": "doc"}, f"m{i}"))[0] for i in range(3)]
    assert [m.task_group for m in maps] == [None] * 3 and g.take_reprioritised() == []
    (r,) = g.add_call(make_call("R {{input:a}} {{input:b}} {{output:r}}", {"a": "m0.m", "b": "m1.m"}, "r"))
    assert [m.task_group for m in maps] == [s("r"), s("r"), None]
    assert ids(g.take_reprioritised()) == [s("m0"), s("m1")]  # queued maps learn their group
    assert r.task_group is None and r.criteria is None  # no get yet: groups do not need one

    # A second consumer of m1 and m2: m2 joins it, m1 stays in the first consumer's group (sticky).
    g.add_call(make_call("T {{input:a}} {{input:b}} {{output:t}}", {"a": "m1.m", "b": "m2.m"}, "t"))
    assert [m.task_group for m in maps] == [s("r"), s("r"), s("t")]
    assert ids(g.take_reprioritised()) == [s("m2")]

    # Sticky as the group shrinks: when m0 completes, m1 alone still belongs to r's group.
    run(g, maps[0], "zero")
    assert maps[1].task_group == s("r") and g.take_reprioritised() == []


def test_a_late_producer_completes_a_task_group() -> None:
    g = SessionGraph()
    g.variables.create("late", var_id="late")  # produced by a call submitted after its consumer
    (m0,) = g.add_call(make_call("M {{output:m}}", {}, "m0"))
    (r,) = g.add_call(make_call("R {{input:a}} {{input:b}} {{output:r}}", {"a": "m0.m", "b": "late"}, "r"))
    assert m0.task_group is None  # one pending producer: nothing parallel yet
    (m1,) = g.add_call(make_call("M {{output:m}}", {}, "m1", outputs={"m": "late"}))
    assert (m0.task_group, m1.task_group) == (s("r"), s("r"))
    assert ids(g.take_reprioritised()) == [s("m0")]
    assert r.task_group is None


def test_a_call_with_criteria_marks_like_a_get_of_each_output() -> None:
    g = SessionGraph()
    g.variables.create("seed", "s", var_id="v0")
    chain = [
        g.add_call(
            make_call("{{input:p}} {{output:o}}", {"p": f"v{i}"}, f"c{i}", outputs={"o": f"v{i + 1}"})
        )[0]
        for i in range(4)
    ]
    g.add_call(make_call("{{input:p}} {{output:a}} {{output:b}}", {"p": "v4"}, "top", criteria="latency"))
    assert [c.criteria for c in chain] == ["throughput", "throughput", "throughput", "latency"]
    assert criteria(g)[s("top", 0)] == criteria(g)[s("top", 1)] == "latency"
    assert ids(g.take_reprioritised()) == [s("c3"), s("c2"), s("c1"), s("c0")]


def test_objectives_of_failed_and_cancelled_steps_leave_with_them() -> None:
    g = SessionGraph()
    (a,) = g.add_call(make_call("A {{output:o}}", {}, "a"))
    g.add_call(make_call("B {{input:x}} {{output:o}}", {"x": "a.o"}, "b"))
    g.activate("b.o", "latency")
    g.fail_step(a, "boom")
    assert g.take_reprioritised() == [] and deduce(g) == {}
    g.add_call(make_call("C {{output:o}}", {}, "c"))
    g.activate("c.o", "throughput")
    g.cancel_all()
    assert g.take_reprioritised() == [] and deduce(g) == {}


# ----------------------------------------------------------------------------------------------- cost
def _chain_visits(n: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """Submit an n-step chain call by call, get its end with latency, complete it step by step. Returns
    the graph's ``visits`` and, counted independently, the predecessors ``_predecessors`` yielded."""
    yielded = 0
    original = SessionGraph._predecessors

    def counting(self: SessionGraph, node: StepNode) -> Iterator[StepNode]:
        nonlocal yielded
        for pred in original(self, node):
            yielded += 1
            yield pred

    monkeypatch.setattr(SessionGraph, "_predecessors", counting)
    g = SessionGraph()
    g.variables.create("seed", "s", var_id="v0")
    for i in range(n):
        g.add_call(make_call("{{input:p}} {{output:o}}", {"p": f"v{i}"}, f"c{i}", outputs={"o": f"v{i + 1}"}))
    g.activate(f"v{n}", "latency")
    assert [x.criteria for x in g.steps()[-3:]] == ["throughput", "latency", "latency"]
    assert len(g.take_reprioritised()) == n
    for i in range(n):
        (step,) = g.runnable_steps()
        run(g, step, f"part {i}")
    assert len(g) == 0
    monkeypatch.setattr(SessionGraph, "_predecessors", original)
    return g.visits, yielded


def test_deduction_and_activation_of_a_long_chain_cost_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    small, small_edges = _chain_visits(200, monkeypatch)
    big, big_edges = _chain_visits(2000, monkeypatch)
    # 3n - 2 exactly: n - 1 input producers looked at on submission (task groups), n predecessors in the
    # latency get's marking walk, n - 1 in its activation walk; completing the steps walks nothing.
    assert (small, big) == (3 * 200 - 2, 3 * 2000 - 2)
    assert (small_edges, big_edges) == (2 * 200 - 1, 2 * 2000 - 1)  # the two walks, counted from outside
    assert big <= 11 * small  # linear, not quadratic (which would be 100x)


def test_a_chain_got_with_latency_as_it_grows_costs_constant_work_per_call() -> None:
    g = SessionGraph()
    g.variables.create("seed", "s", var_id="v0")
    costs = []
    for i in range(300):
        before = g.visits
        g.add_call(make_call("{{input:p}} {{output:o}}", {"p": f"v{i}"}, f"c{i}", outputs={"o": f"v{i + 1}"}))
        g.activate(f"v{i + 1}", "latency")
        costs.append(g.visits - before)
    assert max(costs) <= 5
    assert [x.criteria for x in g.steps()] == ["latency"] * 300


# ------------------------------------------------------------------------------------------ properties
def reference_criteria(g: SessionGraph) -> dict[StepId, Criteria | None]:
    """The rules applied from scratch to the graph as it is now (the old, whole-graph deduction)."""
    marks: dict[StepId, Criteria | None] = {node.id: None for node in g.steps()}

    def at_least(nodes: Iterable[StepNode], c: Criteria) -> None:
        for node in nodes:
            if _STRENGTH[c] > _STRENGTH[marks[node.id]]:
                marks[node.id] = c

    for var_id, wanted in g.wanted().items():
        producer = g.producer(var_id)
        if wanted is None or producer is None:
            continue
        at_least(g.steps_upstream(var_id), "throughput")
        if wanted == "latency":
            at_least([producer, *g.predecessors(producer)], "latency")
    return marks


def reference_groups(g: SessionGraph) -> dict[StepId, set[StepId]]:
    """Step -> the consumers whose pending input producers, from two or more calls, include it now."""
    groups: dict[StepId, set[StepId]] = {}
    for consumer in g.steps():
        found = (g.producer(v) for v in consumer.inputs)
        producers = {p for p in found if p is not None and p.id.call_id != consumer.id.call_id}
        if len({p.id.call_id for p in producers}) >= 2:
            for p in producers:
                groups.setdefault(p.id, set()).add(consumer.id)
    return groups


def _random_op(g: SessionGraph, rng: random.Random, state: dict[str, int]) -> None:
    """One random operation of a client and an executor on ``g``."""
    variables = [v.var_id for v in g.variables]
    free = [v.var_id for v in g.variables if v.status == "pending" and v.producer is None]
    op = rng.choice(["create", "submit", "submit", "get", "get", "set", "run", "run", "fail"])
    if op == "create":
        state["vars"] += 1
        g.variables.create(var_id=f"u{state['vars']}", value=rng.choice([None, "given"]))
    elif op == "submit" and variables:
        call_id = f"c{state['calls']}"
        state["calls"] += 1
        parts, inputs, outputs = [], {}, {}
        for j in range(rng.randint(1, 3)):
            reads = rng.sample(variables, min(len(variables), rng.randint(0, 3)))
            for k, var_id in enumerate(reads):
                inputs[f"i{j}_{k}"] = var_id
            parts.append(
                " ".join(f"{{{{input:i{j}_{k}}}}}" for k in range(len(reads))) + f" {{{{output:o{j}}}}}"
            )
            if free and rng.random() < 0.3:
                outputs[f"o{j}"] = free.pop(rng.randrange(len(free)))  # a variable got before it is produced
        crit = rng.choice([None, None, "throughput", "latency"])
        # A cycle or a repeated output is rejected and leaves the graph unchanged.
        with contextlib.suppress(GraphError, ValueError):
            g.add_call(make_call(" | ".join(parts), inputs, call_id, outputs=outputs, criteria=crit))
    elif op == "get" and variables:
        g.activate(rng.choice(variables), rng.choice([None, "throughput", "latency"]))
    elif op == "set" and free:
        g.set_variable(rng.choice(free), "late")
    elif op in ("run", "fail") and g.runnable_steps():
        step = rng.choice(g.runnable_steps())
        if op == "fail":
            g.fail_step(step, "boom")
        else:
            run(g, step, "value")


@settings(max_examples=200, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(5, 60))
def test_incremental_objectives_match_the_rules_recomputed_from_scratch(
    rng: random.Random, n_ops: int
) -> None:
    """After every operation: each step's criteria is the strongest the rules gave it at any point while it
    was pending (they only strengthen), its task group the consumer it first qualified for, and
    `take_reprioritised` exactly the steps that were pending before and whose objective changed."""
    g = SessionGraph()
    g.variables.create(var_id="doc", value="text")
    state = {"vars": 0, "calls": 0}
    expected: dict[StepId, Criteria | None] = {}
    groups: dict[StepId, StepId | None] = {}
    for _ in range(n_ops):
        before = {node.id: (node.criteria, node.task_group) for node in g.steps()}
        _random_op(g, rng, state)
        pending = {node.id for node in g.steps()}
        for sid, c in reference_criteria(g).items():
            if _STRENGTH[c] > _STRENGTH[expected.get(sid)]:
                expected[sid] = c
        candidates = reference_groups(g)
        for node in g.steps():
            assert node.criteria == expected.get(node.id), node.id
            if groups.get(node.id) is not None:
                assert node.task_group == groups[node.id], node.id  # sticky
            elif node.id in candidates:
                assert node.task_group in candidates[node.id], node.id
            else:
                assert node.task_group is None, node.id
            groups[node.id] = node.task_group
        changed = {
            sid
            for sid, (c, group) in before.items()
            if sid in pending and (c, group) != (g.step(sid).criteria, g.step(sid).task_group)
        }
        reported = g.take_reprioritised()
        assert len(reported) == len(set(ids(reported)))
        assert set(ids(reported)) == changed
        expected = {sid: c for sid, c in expected.items() if sid in pending}
