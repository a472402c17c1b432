"""Objective deduction over session graphs: latency marks, task groups, throughput, depth."""

from __future__ import annotations

from server.serve.deduction import StepObjective, deduce
from server.serve.graph import SessionGraph
from server.serve.variables import StepId
from tests.serve.test_graph import make_call


def s(call_id: str, index: int = 0) -> StepId:
    return StepId(call_id, index)


def figure_9_graph() -> SessionGraph:
    """The DAG of Figure 9 of the paper, as we read it: a document is split into chunks; three map calls
    summarise them in parallel; a reduce call combines the summaries; a final call answers from the reduce
    output, and the app gets that answer with latency criteria. An unrelated call of the same app is got
    with throughput criteria."""
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
    assert {k: v.criteria for k, v in deduce(g).items()} == dict.fromkeys(deduce(g), None)  # nothing wanted
    g.activate("final.answer", "latency")
    g.activate("side.fr", "throughput")
    got = deduce(g)
    group = s("reduce")
    assert got == {
        s("map0"): StepObjective("latency", group, 0),
        s("map1"): StepObjective("latency", group, 0),
        s("map2"): StepObjective("latency", group, 0),
        s("reduce"): StepObjective("latency", None, 1),
        s("final"): StepObjective("latency", None, 2),
        s("side"): StepObjective("throughput", None, 0),
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
    g.activate("r.r", "latency")  # a later, stricter get wins everywhere upstream
    assert {v.criteria for v in deduce(g).values()} == {"latency"}


def test_a_chain_is_all_latency_without_groups_and_a_multi_output_call_is_not_a_group() -> None:
    g = SessionGraph()
    g.add_call(make_call("A {{output:x}} then {{output:y}}", {}, "a"))
    g.add_call(make_call("B {{input:x}} {{input:y}} {{output:z}}", {"x": "a.x", "y": "a.y"}, "b"))
    g.activate("b.z", "latency")
    got = deduce(g)
    # Two outputs of one call feed b, but they are one context chain, not parallel steps: no group.
    assert got == {
        s("a", 0): StepObjective("latency", None, 0),
        s("a", 1): StepObjective("latency", None, 1),
        s("b"): StepObjective("latency", None, 2),
    }
