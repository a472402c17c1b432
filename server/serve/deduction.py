"""Objective deduction: what each pending step of a session must optimise, from the graph alone.

A pure function of a `SessionGraph` (no I/O, no clock), re-run whenever calls or gets arrive, in the spirit
of section 5.2 of the Parrot paper:

* ``get(criteria="latency")`` of a variable makes its producer **latency-critical**, and everything upstream
  of it too: every pending step on a path into a latency get is on its critical path.
* Two or more pending steps feeding one consumer step directly (its distinct input producers — the map stage
  under a reduce) form a **task group**: their consumer waits for the slowest of them, so the group is
  scheduled to minimise its completion time (placed together, in large batches) rather than each member's
  own latency. A group is named by its consumer's step id.
* ``get(criteria="throughput")`` makes everything upstream **throughput-preferred**, unless a latency get
  also reaches it (latency wins: it is the stricter promise).
* Steps no criteria reaches have no objective (``None``); the scheduler treats them as throughput work.
* Each step keeps its topological ``depth`` (0: nothing pending feeds it): app-level priority, lower first.
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot.protocol import Criteria

from server.serve.graph import SessionGraph, StepNode
from server.serve.variables import StepId

__all__ = ["StepObjective", "deduce"]

_STRENGTH: dict[Criteria | None, int] = {None: 0, "throughput": 1, "latency": 2}


@dataclass(frozen=True)
class StepObjective:
    """What the scheduler should optimise for one pending step.

    ``criteria``: ``"latency"``, ``"throughput"`` or None (nothing asked for it yet). ``task_group``: the
    step id of the consumer whose parallel inputs this step belongs to, or None. ``depth``: topological
    depth in the session (lower runs first).
    """

    criteria: Criteria | None
    task_group: StepId | None
    depth: int


def deduce(graph: SessionGraph) -> dict[StepId, StepObjective]:
    """The objective of every pending step of ``graph`` (see the module docstring for the rules)."""
    criteria: dict[StepId, Criteria | None] = {node.id: None for node in graph.steps()}
    for var_id, wanted in graph.wanted().items():
        if wanted is None:
            continue
        for node in graph.steps_upstream(var_id):
            if _STRENGTH[wanted] > _STRENGTH[criteria[node.id]]:
                criteria[node.id] = wanted
    groups = _task_groups(graph)
    return {
        node.id: StepObjective(criteria[node.id], groups.get(node.id), node.depth) for node in graph.steps()
    }


def _task_groups(graph: SessionGraph) -> dict[StepId, StepId]:
    """Step -> the consumer whose parallel producers it is one of (the first such consumer, in submission
    order, when a step feeds several)."""
    groups: dict[StepId, StepId] = {}
    for consumer in graph.steps():
        producers = _input_producers(graph, consumer)
        if len({p.id.call_id for p in producers}) < 2:  # the steps of one call are sequential, not parallel
            continue
        for producer in producers:
            groups.setdefault(producer.id, consumer.id)
    return groups


def _input_producers(graph: SessionGraph, consumer: StepNode) -> list[StepNode]:
    """The distinct pending steps producing ``consumer``'s inputs (not its own call's previous step: the
    steps of one call run one after the other on one context, never in parallel)."""
    seen: dict[StepId, StepNode] = {}
    for var_id in consumer.inputs:
        producer = graph.producer(var_id)
        if producer is not None and producer.id.call_id != consumer.id.call_id:
            seen.setdefault(producer.id, producer)
    return list(seen.values())
