"""The per-session dataflow graph: readiness, wake-ups, activation, failure propagation, cycles, cleanup."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings, strategies as st
from parrot.protocol import Criteria, PlaceholderSpec, SubmitCallRequest
from parrot.template import parse_template, placeholder_names

from server.serve.graph import (
    CycleError,
    DuplicateCallError,
    SessionGraph,
    StepNode,
    StepStateError,
    UnknownStepError,
)
from server.serve.ir import CallIR, build_call
from server.serve.variables import StepId, UnknownVariableError, VariableConflictError


def make_call(
    template: str,
    inputs: dict[str, str],
    call_id: str,
    *,
    values: dict[str, str] | None = None,
    outputs: dict[str, str] | None = None,
    criteria: Criteria | None = None,
) -> CallIR:
    """A call built through the real IR. ``inputs`` maps placeholder -> var_id, ``values`` placeholder ->
    literal text; output ``x`` gets variable ``"<call_id>.x"`` unless ``outputs`` names it."""
    out_names = placeholder_names(parse_template(template), "output")
    specs = [PlaceholderSpec(name=n, role="input", var_id=v) for n, v in inputs.items()]
    specs += [PlaceholderSpec(name=n, role="input", value=v) for n, v in (values or {}).items()]
    specs += [PlaceholderSpec(name=n, role="output") for n in out_names]
    request = SubmitCallRequest(template=template, placeholders=specs, criteria=criteria)
    ids = {n: (outputs or {}).get(n, f"{call_id}.{n}") for n in out_names}
    return build_call(request, ids, call_id=call_id)


def run(graph: SessionGraph, step: StepNode | StepId, value: str) -> list[StepNode]:
    """Dispatch and complete one step; return the steps it woke."""
    graph.mark_dispatched(step)
    return graph.complete_step(step, value)


def ids(nodes: Sequence[StepNode]) -> list[StepId]:
    return [n.id for n in nodes]


def assert_empty(graph: SessionGraph) -> None:
    assert len(graph) == 0
    assert graph.variable_nodes() == set()
    assert graph.ready_steps() == [] and graph.runnable_steps() == [] and graph.wanted() == {}


# The two semantic functions of Figure 7 in the Parrot paper.
WRITE_CODE = (
    "You are an expert software engineer.\nWrite python code of {{input:task}}.\nCode: {{output:code}}"
)
WRITE_TESTS = (
    "You are an experienced QA engineer.\nYou write test code for {{input:task}}.\n"
    "Code: {{input:code}}.\nYour test code: {{output:test}}"
)


# ---------------------------------------------------------------------------------------------- figure 7
def test_figure7_write_code_then_write_tests() -> None:
    graph = SessionGraph()
    graph.variables.create("task", "a snake game", var_id="task")
    (code,) = graph.add_call(make_call(WRITE_CODE, {"task": "task"}, "write_code"))
    (test,) = graph.add_call(
        make_call(WRITE_TESTS, {"task": "task", "code": "write_code.code"}, "write_tests")
    )
    assert (code.status, test.status) == ("ready", "waiting")
    assert (graph.depth(code), graph.depth(test)) == (0, 1)
    assert graph.ready_steps() == [code] and graph.runnable_steps() == []  # nobody asked for anything yet
    assert graph.producer("write_code.code") is code and graph.consumers("write_code.code") == [test]
    assert graph.variables.get("write_tests.test").producer == StepId("write_tests", 0)

    # Both gets arrive before anything runs: the objectives are known before dispatch.
    assert graph.activate("write_code.code", "latency") == [code]
    assert graph.activate("write_tests.test", "latency") == [test]  # code is already activated
    assert graph.runnable_steps() == [code]
    assert graph.wanted() == {"write_code.code": "latency", "write_tests.test": "latency"}

    graph.mark_dispatched(code)
    assert graph.runnable_steps() == [] and code.status == "dispatched"
    assert graph.complete_step(code, "def snake(): ...") == [test]  # wakes exactly the consumer
    assert code.status == "done" and code not in graph
    assert graph.runnable_steps() == [test]
    assert run(graph, test, "def test_snake(): ...") == []
    assert graph.variables.get("write_tests.test").value == "def test_snake(): ..."
    assert_empty(graph)


# ------------------------------------------------------------------------------------------------ shapes
def test_chain_of_ten_each_completion_readies_the_next() -> None:
    graph = SessionGraph()
    graph.variables.create("seed", "once upon a time", var_id="v0")
    steps = []
    for i in range(10):
        template = f"Step {i}. Continue: {{{{input:prev}}}}\n{{{{output:out}}}}"
        (node,) = graph.add_call(
            make_call(template, {"prev": f"v{i}"}, f"c{i}", outputs={"out": f"v{i + 1}"})
        )
        steps.append(node)
    assert [graph.depth(s) for s in steps] == list(range(10))
    assert graph.steps_upstream("v10") == steps[::-1]
    assert graph.activate("v10") == steps[::-1]  # one get activates the whole chain
    assert len(graph) == 10 and len(graph.variable_nodes()) == 10
    for i, step in enumerate(steps):
        assert graph.runnable_steps() == [step]
        woken = run(graph, step, f"part {i}")
        assert woken == steps[i + 1 : i + 2]
        assert len(graph) == 9 - i  # a completed step leaves the graph at once
    assert [graph.variables.get(f"v{i}").value for i in range(1, 11)] == [f"part {i}" for i in range(10)]
    assert_empty(graph)


def test_map_reduce_reduce_waits_for_every_map() -> None:
    graph = SessionGraph()
    n = 6
    maps = []
    for i in range(n):
        graph.variables.create(f"chunk{i}", f"text {i}", var_id=f"chunk{i}")
        (node,) = graph.add_call(
            make_call("Summarize {{input:c}}: {{output:s}}", {"c": f"chunk{i}"}, f"map{i}")
        )
        maps.append(node)
    template = "Combine: " + " ".join(f"{{{{input:s{i}}}}}" for i in range(n)) + " -> {{output:final}}"
    (reduce,) = graph.add_call(
        make_call(template, {f"s{i}": f"map{i}.s" for i in range(n)}, "reduce", criteria="throughput")
    )
    assert graph.predecessors(reduce) == maps  # the task group feeding one consumer
    assert all(graph.successors(m) == [reduce] for m in maps)
    assert graph.depth(reduce) == 1 and all(graph.depth(m) == 0 for m in maps)
    # Submitting with criteria activated the reduce and everything upstream of it.
    assert all(s.activated for s in [*maps, reduce]) and graph.wanted() == {"reduce.final": "throughput"}
    assert graph.runnable_steps() == maps and reduce.missing == n
    order = list(range(n))
    random.Random(7).shuffle(order)
    for k, i in enumerate(order):
        assert reduce.status == "waiting"
        woken = run(graph, maps[i], f"summary {i}")
        assert woken == ([reduce] if k == n - 1 else [])
    assert run(graph, reduce, "all of it") == []
    assert_empty(graph)


MULTI = "Q: {{input:q}}\nA: {{output:a}}\nWhy? {{output:why}}\nScore: {{output:score}}"


def test_multi_output_call_runs_its_steps_in_order() -> None:
    graph = SessionGraph()
    graph.variables.create("q", "why is the sky blue", var_id="q")
    s0, s1, s2 = graph.add_call(make_call(MULTI, {"q": "q"}, "qa", criteria="latency"))
    (use_a,) = graph.add_call(make_call("Echo {{input:a}}: {{output:e}}", {"a": "qa.a"}, "echo"))
    graph.activate("echo.e")
    assert [s.status for s in (s0, s1, s2, use_a)] == ["ready", "waiting", "waiting", "waiting"]
    assert [graph.depth(s) for s in (s0, s1, s2, use_a)] == [0, 1, 2, 1]
    assert graph.predecessors(s1) == [s0] and graph.successors(s0) == [s1, use_a]
    # Step 0's output wakes the call's next step (it continues the context) and the consumer of `a`.
    assert run(graph, s0, "Rayleigh scattering") == [s1, use_a]
    assert s2.status == "waiting"
    assert run(graph, s1, "short wavelengths scatter more") == [s2]
    assert run(graph, use_a, "echo") == []
    assert run(graph, s2, "9") == []
    assert_empty(graph)


def test_a_variable_set_by_the_client_wakes_its_consumers() -> None:
    graph = SessionGraph()
    graph.variables.create("q", var_id="q")  # created without a value: set later by PUT
    (a,) = graph.add_call(make_call("{{input:q}} {{output:a}}", {"q": "q"}, "a"))
    (b,) = graph.add_call(make_call("{{input:q}} and {{input:a}} {{output:b}}", {"q": "q", "a": "a.a"}, "b"))
    graph.activate("b.b")
    assert graph.consumers("q") == [a, b] and graph.ready_steps() == []
    assert graph.set_variable("q", "question") == [a]  # b still waits for a
    assert graph.consumers("q") == [] and b.missing == 1
    with pytest.raises(VariableConflictError, match="is the output of step 0 of call 'a': only that call"):
        graph.set_variable("a.a", "mine")
    with pytest.raises(VariableConflictError, match="already has a value"):
        graph.set_variable("q", "again")
    assert run(graph, a, "answer") == [b]


# ---------------------------------------------------------------------------------------------- failures
def test_failure_propagates_downstream_with_the_root_cause() -> None:
    graph = SessionGraph()
    graph.variables.create("doc", "text", var_id="doc")
    (a,) = graph.add_call(make_call("A {{input:d}} {{output:o}}", {"d": "doc"}, "A"))
    b0, b1 = graph.add_call(make_call("B {{input:x}} {{output:o}}, then {{output:p}}", {"x": "A.o"}, "B"))
    (c,) = graph.add_call(make_call("C {{input:x}} {{output:o}}", {"x": "B.p"}, "C"))
    # D reads A's output and an unrelated one: it fails too; E and F never touch A and are unaffected.
    (e,) = graph.add_call(make_call("E {{input:d}} {{output:o}}", {"d": "doc"}, "E"))
    (d,) = graph.add_call(make_call("D {{input:x}} {{input:y}} {{output:o}}", {"x": "A.o", "y": "E.o"}, "D"))
    (f,) = graph.add_call(make_call("F {{input:y}} {{output:o}}", {"y": "E.o"}, "F"))
    for out in ("C.o", "D.o", "F.o"):
        graph.activate(out)
    graph.mark_dispatched(a)

    refused = "hello " * 50  # the model's whole text: the message would quote only its start
    failed = graph.fail_step(
        a, "json transform failed: no JSON in 'hello'", error_type="transform_failed", llm_output=refused
    )
    root = "step 0 of call 'A' (output 'o') failed: json transform failed: no JSON in 'hello'"
    assert [v.var_id for v in failed] == ["A.o", "B.o", "D.o", "B.p", "C.o"]
    assert failed[0].error == root
    for var in failed[1:]:
        assert var.status == "failed" and var.error == f"upstream {root}"
    # Every variable that failed carries the root cause's type and text (one string, not copies).
    assert all(v.error_type == "transform_failed" and v.llm_output is refused for v in failed)
    assert [s.status for s in (a, b0, b1, c, d)] == ["failed"] * 5
    # The siblings are untouched: E is still runnable, F still waits for it, and D left E's consumers.
    assert graph.steps() == [e, f] and graph.runnable_steps() == [e]
    assert graph.consumers("E.o") == [f]
    assert run(graph, e, "fine") == [f] and run(graph, f, "fine too") == []
    assert_empty(graph)

    # A call submitted later on a failed variable fails at once, naming the same root (not nested).
    (g,) = graph.add_call(make_call("G {{input:x}} {{output:o}}", {"x": "C.o"}, "G"))
    late = graph.variables.get("G.o")
    assert g.status == "failed" and late.error == f"upstream {root}"
    assert (late.error_type, late.llm_output) == ("transform_failed", refused)
    assert_empty(graph)


def test_failure_of_a_later_input_spares_the_earlier_steps() -> None:
    graph = SessionGraph()
    graph.variables.create(var_id="bad")
    graph.variables.fail("bad", "never arrived")
    template = "First {{output:a}}. Now {{input:x}}: {{output:b}}. Then {{output:c}}"
    s0, s1, s2 = graph.add_call(make_call(template, {"x": "bad"}, "k", criteria="latency"))
    assert (s0.status, s1.status, s2.status) == ("ready", "failed", "failed")
    assert graph.variables.get("k.b").error == "upstream never arrived"
    assert graph.steps() == [s0] and graph.runnable_steps() == [s0]
    assert run(graph, s0, "ok") == []
    assert_empty(graph)


def test_fail_while_waiting_and_cancel_all() -> None:
    graph = SessionGraph()
    graph.variables.create(var_id="q")
    (a,) = graph.add_call(make_call("{{input:q}} {{output:o}}", {"q": "q"}, "a"))
    graph.fail_step(a, "timed out")  # a step can fail before it ever ran (a timeout, say)
    assert graph.consumers("q") == [] and graph.variable_nodes() == set()
    timed_out = graph.variables.get("a.o")
    assert (timed_out.error_type, timed_out.llm_output) == ("step_failed", None)  # no type given, no text

    graph.variables.create("r", "ready", var_id="r")
    (b,) = graph.add_call(make_call("{{input:r}} {{output:o}}", {"r": "r"}, "b", criteria="latency"))
    (c,) = graph.add_call(make_call("{{input:x}} {{output:o}}", {"x": "b.o"}, "c"))
    (d,) = graph.add_call(make_call("{{input:q}} {{output:o}}", {"q": "q"}, "d"))
    graph.mark_dispatched(b)
    cancelled = graph.cancel_all()
    assert cancelled == [b, c, d] and all(s.status == "cancelled" for s in cancelled)
    assert_empty(graph)
    for out in ("b.o", "c.o", "d.o"):
        var = graph.variables.get(out)
        assert (var.error, var.error_type) == ("cancelled: the session was deleted", "cancelled")
    assert graph.variables.get("r").value == "ready"  # the table lives until the session dies
    assert graph.cancel_all() == []


# -------------------------------------------------------------------------------------------- validation
def test_unknown_input_is_rejected_and_leaves_the_graph_unchanged() -> None:
    graph = SessionGraph()
    graph.variables.create("task", "t", var_id="task")
    graph.add_call(make_call(WRITE_CODE, {"task": "task"}, "write_code"))
    before = (graph.steps(), graph.variable_nodes(), [v.var_id for v in graph.variables])
    bad = make_call(WRITE_TESTS, {"task": "task", "code": "no-such-var"}, "write_tests")
    with pytest.raises(UnknownVariableError, match="input 'code' of call 'write_tests' names variable "
                       "'no-such-var', which does not exist") as info:  # fmt: skip
        graph.add_call(bad)
    assert info.value.http_status == 404 and info.value.var_id == "no-such-var"
    assert (graph.steps(), graph.variable_nodes(), [v.var_id for v in graph.variables]) == before
    # A variable only named in the tail (after the last output) must exist too, though nobody waits for it.
    tail = make_call("{{output:o}} tail {{input:late}}", {"late": "ghost"}, "t")
    with pytest.raises(UnknownVariableError, match="input 'late'"):
        graph.add_call(tail)


def test_outputs_must_be_fresh_and_call_ids_unique() -> None:
    graph = SessionGraph()
    graph.variables.create(value="value", var_id="done")
    with pytest.raises(VariableConflictError, match=r"names variable 'done', which already has a value"):
        graph.add_call(make_call("{{output:o}}", {}, "x", outputs={"o": "done"}))
    graph.add_call(make_call("{{output:o}}", {}, "x"))
    with pytest.raises(VariableConflictError, match="already the output of step 0 of call 'x'"):
        graph.add_call(make_call("{{output:o}}", {}, "y", outputs={"o": "x.o"}))
    with pytest.raises(DuplicateCallError, match="'x' is already pending"):
        graph.add_call(make_call("{{output:p}}", {}, "x"))
    assert len(graph) == 1 and len(graph.variables) == 2


def test_cycles_are_rejected() -> None:
    graph = SessionGraph()
    graph.variables.create("x", var_id="x")  # created unset, produced later: the only way to a cycle
    # A call consuming its own output.
    with pytest.raises(CycleError, match=r"input 'i' \(variable 'x'\) depends on its own output 'o'") as info:
        graph.add_call(make_call("{{input:i}} {{output:o}}", {"i": "x"}, "self", outputs={"o": "x"}))
    assert info.value.path == ["x"] and info.value.http_status == 400
    # x -> A -> y, then B consumes y and would produce x.
    (a,) = graph.add_call(make_call("{{input:i}} {{output:o}}", {"i": "x"}, "A", outputs={"o": "y"}))
    with pytest.raises(CycleError, match="x -> y") as info:
        graph.add_call(make_call("{{input:i}} {{output:o}}", {"i": "y"}, "B", outputs={"o": "x"}))
    assert info.value.path == ["x", "y"]
    # Through a later step of the call: step 0 reads y, step 1 would produce x (x -> A -> y -> step 0 -> 1).
    with pytest.raises(CycleError):
        graph.add_call(
            make_call("{{input:i}} {{output:p}}, {{output:o}}", {"i": "y"}, "C", outputs={"o": "x"})
        )
    assert graph.steps() == [a] and graph.variables.get("x").producer is None and graph.consumers("x") == [a]
    assert "C.p" not in graph.variables  # a rejected call leaves no trace


def test_a_later_step_may_read_what_an_earlier_output_feeds() -> None:
    # Not a cycle: Q's step 0 produces x, A turns x into y, Q's step 1 reads y (x was created unset first).
    graph = SessionGraph()
    graph.variables.create("x", var_id="x")
    (a,) = graph.add_call(make_call("A {{input:i}} {{output:o}}", {"i": "x"}, "A", outputs={"o": "y"}))
    graph.activate("y")  # a get before anyone produces x
    assert graph.wanted() == {"y": None} and a.activated
    q0, q1 = graph.add_call(
        make_call("Q {{output:x}}, then {{input:y}}: {{output:z}}", {"y": "y"}, "Q", outputs={"x": "x"})
    )
    assert graph.producer("x") is q0 and graph.variables.get("x").producer == StepId("Q", 0)
    assert [graph.depth(s) for s in (q0, a, q1)] == [0, 1, 2]  # A's depth was raised by its new producer
    assert q0.activated and not q1.activated  # q0 feeds the get of y; q1 does not
    assert run(graph, q0, "x!") == [a]  # q1 waits for y as well
    assert run(graph, a, "y!") == [q1]
    graph.mark_dispatched(q1)  # dispatching does not require activation: that is the executor's policy
    assert graph.complete_step(q1, "z!") == []
    assert_empty(graph)


def test_steps_are_driven_in_order() -> None:
    graph = SessionGraph()
    s0, s1 = graph.add_call(make_call("{{output:a}} and {{output:b}}", {}, "c"))
    with pytest.raises(StepStateError, match="step 1 of call 'c' is waiting: only a ready step"):
        graph.mark_dispatched(s1)
    with pytest.raises(StepStateError, match="is ready: complete a step only after mark_dispatched"):
        graph.complete_step(s0, "x")
    run(graph, s0, "x")
    with pytest.raises(UnknownStepError, match="step 0 of call 'c' is not in the graph"):
        graph.complete_step(s0, "x")
    with pytest.raises(UnknownStepError):
        graph.fail_step(StepId("nope", 0), "m")


# -------------------------------------------------------------------------------------------- activation
def test_only_steps_upstream_of_a_get_are_activated() -> None:
    graph = SessionGraph()
    graph.variables.create("t", "topic", var_id="t")
    (a,) = graph.add_call(make_call("{{input:t}} {{output:o}}", {"t": "t"}, "a"))
    (b,) = graph.add_call(make_call("{{input:x}} {{output:o}}", {"x": "a.o"}, "b"))
    (other,) = graph.add_call(make_call("{{input:t}} {{output:o}}", {"t": "t"}, "other"))
    assert graph.activate("a.o") == [a]  # b consumes a.o but is downstream: not needed for this get
    assert not b.activated and not other.activated
    assert graph.ready_steps() == [a, other] and graph.runnable_steps() == [a]
    assert graph.activate("b.o", "throughput") == [b]
    assert graph.activate("b.o", "latency") == [] and graph.wanted()["b.o"] == "latency"  # latency wins
    assert graph.activate("b.o", "throughput") == [] and graph.wanted()["b.o"] == "latency"
    run(graph, a, "A")
    assert graph.runnable_steps() == [b] and not other.activated and graph.wanted() == {"b.o": "latency"}
    assert graph.activate("a.o") == []  # settled: nothing left to activate
    with pytest.raises(UnknownVariableError):
        graph.activate("ghost")
    # A later call with criteria activates itself and its inputs' producers, not its siblings.
    (c,) = graph.add_call(make_call("{{input:x}} {{output:o}}", {"x": "b.o"}, "c", criteria="latency"))
    assert c.activated and not other.activated


# -------------------------------------------------------------------------------------------- properties
@st.composite
def dags(draw: st.DrawFn) -> tuple[int, list[list[list[int]]]]:
    """Client variables 0..k-1, then calls; call c's step j reads a list of earlier variables (by number).
    Variables are numbered in creation order: client ones, then each call's outputs in step order."""
    n_client = draw(st.integers(0, 3))
    calls: list[list[list[int]]] = []
    n_vars = n_client
    for _ in range(draw(st.integers(1, 10))):
        n_steps = draw(st.integers(1, 3))
        pick = st.lists(st.integers(0, n_vars - 1), max_size=3, unique=True) if n_vars else st.just([])
        calls.append([draw(pick) for _ in range(n_steps)])
        n_vars += n_steps
    return n_client, calls


@settings(max_examples=150, deadline=None)
@given(dags(), st.randoms(use_true_random=False), st.floats(0, 0.3))
def test_random_dags_complete_every_step_once(
    dag: tuple[int, list[list[list[int]]]], rng: random.Random, fail_rate: float
) -> None:
    n_client, calls = dag
    graph = SessionGraph()
    var = [f"v{i}" for i in range(n_client)]
    unset = []
    for i in range(n_client):
        if rng.random() < 0.5:
            graph.variables.create(value=f"client {i}", var_id=var[i])
        else:
            graph.variables.create(var_id=var[i])
            unset.append(var[i])
    irs: list[CallIR] = []
    for c, steps in enumerate(calls):
        names = {}
        parts = []
        for j, reads in enumerate(steps):
            for r in reads:
                names.setdefault(r, f"in{r}")
            parts.append(f"s{j} " + "".join(f"{{{{input:in{r}}}}} " for r in reads) + f"{{{{output:o{j}}}}}")
            var.append(f"c{c}.o{j}")
        irs.append(make_call(" | ".join(parts), {n: var[r] for r, n in names.items()}, f"c{c}"))

    done: list[StepId] = []
    roots: set[StepId] = set()
    submitted = 0
    while True:
        actions = (
            ["submit"] * (submitted < len(irs))
            + ["set"] * bool(unset)
            + ["run"] * bool(graph.runnable_steps())
        )
        if not actions:
            break
        action = rng.choice(actions)
        before = set(ids(graph.ready_steps()))
        if action == "submit":
            nodes = graph.add_call(irs[submitted])
            for node in nodes:
                if node in graph:
                    assert all(p.depth < node.depth for p in graph.predecessors(node))
                graph.activate(node.output)  # everyone is asked for, so everything must run
            submitted += 1
            continue
        if action == "set":
            woken = graph.set_variable(unset.pop(rng.randrange(len(unset))), "late")
        else:
            step = rng.choice(graph.runnable_steps())
            assert all(graph.variables.get(v).status == "ready" for v in step.inputs)
            if rng.random() < fail_rate:
                failed = graph.fail_step(step, "boom")
                roots.add(step.id)
                assert failed[0].var_id == step.output
                assert all(v.status == "failed" for v in failed)
                continue
            graph.mark_dispatched(step)
            woken = graph.complete_step(step, f"value of {step.id}")
            done.append(step.id)
        # Exactly the steps that became ready are woken: no more, no fewer.
        assert set(ids(woken)) == set(ids(graph.ready_steps())) - before

    assert_empty(graph)
    assert len(done) == len(set(done))  # no step ran twice
    # Reference: a step fails iff it is a root or depends on a failed step; every other step completed.
    failed_steps: set[StepId] = set()
    producer = {f"c{c}.o{j}": StepId(f"c{c}", j) for c, s in enumerate(calls) for j in range(len(s))}
    for c, steps in enumerate(calls):
        for j, reads in enumerate(steps):
            sid = StepId(f"c{c}", j)
            deps = [producer[var[r]] for r in reads if var[r] in producer] + (
                [StepId(f"c{c}", j - 1)] if j else []
            )
            if sid in roots or any(d in failed_steps for d in deps):
                failed_steps.add(sid)
            else:
                assert sid in done
            out = graph.variables.get(f"c{c}.o{j}")
            assert out.status == ("failed" if sid in failed_steps else "ready")
            if sid in failed_steps and sid not in roots:
                assert out.error is not None and out.error.startswith("upstream step ")
    assert len(done) + len(failed_steps) == sum(len(s) for s in calls)
