"""What a call must satisfy before it joins a session's graph (`check_new_call`): pure, over what the graph
exposes, so that a rejected call leaves no trace."""

from __future__ import annotations

from typing import Protocol

from server.serve.ir import CallIR, VarFill
from server.serve.step_node import CycleError, DuplicateCallError, StepNode
from server.serve.variables import StepId, UnknownVariableError, VariableConflictError, VariableTable


class GraphView(Protocol):
    """What the checks read of a session graph (`SessionGraph`)."""

    variables: VariableTable

    def __contains__(self, step: object) -> bool: ...

    def consumers(self, var_id: str) -> list[StepNode]: ...

    def next_step(self, node: StepNode) -> StepNode | None: ...


def check_new_call(graph: GraphView, call: CallIR) -> None:
    """Every check of `SessionGraph.add_call`, before anything changes: the call is new, its inputs exist,
    its outputs are fresh variables nothing else produces, and it closes no cycle."""
    if any(StepId(call.call_id, step.index) in graph for step in call.steps):
        raise DuplicateCallError(
            f"call {call.call_id!r} is already pending in this session: give each call a new id"
        )
    for seg in call.segments:
        if isinstance(seg, VarFill) and seg.var_id not in graph.variables:
            raise UnknownVariableError(
                f"input {seg.name!r} of call {call.call_id!r} names variable {seg.var_id!r}, which does "
                "not exist in this session: create it first (POST /variables) or use an id a call of "
                "this session returned in its 'outputs'",
                seg.var_id,
            )
    outputs = [step.gen.var_id for step in call.steps]
    if len(set(outputs)) != len(outputs):
        raise ValueError(f"call {call.call_id!r} names an output variable twice: {outputs}")
    for step in call.steps:
        var_id = step.gen.var_id
        if var_id not in graph.variables:
            continue
        var = graph.variables.get(var_id)
        if var.status != "pending":
            state = "already has a value" if var.status == "ready" else f"has failed ({var.error})"
            raise VariableConflictError(
                f"output {step.gen.name!r} of call {call.call_id!r} names {var.describe()}, which "
                f"{state}: an output must be a fresh variable",
                var_id,
            )
        if var.producer is not None:
            raise VariableConflictError(
                f"output {step.gen.name!r} of call {call.call_id!r} names {var.describe()}, which is "
                f"already the output of {var.producer}: a variable has one producer",
                var_id,
            )
    _check_acyclic(graph, call)


def _check_acyclic(graph: GraphView, call: CallIR) -> None:
    """Raise `CycleError` if adding ``call`` would close a cycle.

    The graph is acyclic before the call. A new cycle must pass through the call, and the call's own
    edges only go forward (step j -> step j+1), so it must leave the call at some output of step i,
    run through existing nodes and come back to an input of some step j <= i. So: walk downstream from
    the outputs, last step first, accumulating what is reachable from steps i..k, and check step i's
    inputs against it. Fresh outputs have no consumers, so this costs O(call) for ordinary submissions.
    """
    parent: dict[str, str | None] = {}  # reachable variable -> the variable it was reached from
    seen_steps: set[StepId] = set()
    for step in reversed(call.steps):
        out = step.gen.var_id
        if out not in parent:
            parent[out] = None
            stack = [out]
            while stack:
                var_id = stack.pop()
                for consumer in graph.consumers(var_id):
                    # A consumer's later steps come after it: their outputs are downstream too.
                    node: StepNode | None = consumer
                    while node is not None and node.id not in seen_steps:
                        seen_steps.add(node.id)
                        if node.output not in parent:
                            parent[node.output] = var_id
                            stack.append(node.output)
                        node = graph.next_step(node)
        for fill in step.fills:
            if isinstance(fill, VarFill) and fill.var_id in parent:
                path = [fill.var_id]
                while (up := parent[path[-1]]) is not None:
                    path.append(up)
                path.reverse()
                output = next(s.gen.name for s in call.steps if s.gen.var_id == path[0])
                raise CycleError(
                    f"call {call.call_id!r} would create a cycle: its input {fill.name!r} (variable "
                    f"{fill.var_id!r}) depends on its own output {output!r} (variables "
                    f"{' -> '.join(path)}); a call cannot consume what it produces",
                    path,
                )
