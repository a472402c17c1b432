"""Objective deduction kept incrementally on a session graph's pending steps (the rules:
`server.serve.deduction`; after Figure 9 of the Parrot paper).

`Objectives` owns what the rules need beyond the graph's edges: the variables a ``get`` (or a submission
with ``criteria``) asked for, with the strongest objective asked, and the steps whose objective changed
since the manager last looked. It reads the edges through the graph's `Topology`: each walk stops at the
first step already marked (criteria only strengthen, and a step with criteria has its whole upstream
marked), so an operation costs the steps it changes, never the graph's size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from parrot.protocol import Criteria

from server.serve.step_node import StepNode
from server.serve.variables import StepId

__all__ = ["Objectives", "Topology"]

# Which objective wins when a variable is asked for twice: latency is the stricter promise.
_STRENGTH: dict[Criteria | None, int] = {None: 0, "throughput": 1, "latency": 2}


class Topology(Protocol):
    """The edges of a session graph, as the objectives walk them."""

    visits: int  # steps the walks have examined, ever (see `SessionGraph`)

    def producer(self, var_id: str) -> StepNode | None: ...

    def waiting_for(self, var_id: str) -> Iterable[StepNode]:
        """The pending steps waiting for ``var_id`` (a view: do not change the graph while iterating)."""
        ...

    def upstream(self, node: StepNode) -> Iterable[StepNode]:
        """The pending steps ``node`` waits for directly, each counted in ``visits``."""
        ...


class Objectives:
    """The criteria and task groups of one session graph's pending steps, updated as calls and gets arrive."""

    def __init__(self, graph: Topology) -> None:
        self._graph = graph
        # Pending variables a get (or a submission with criteria) asked for, with the strongest objective.
        self.wanted: dict[str, Criteria | None] = {}
        # Pending steps whose criteria or task group changed since `take_reprioritised` (ordered, unique).
        self._reprioritised: dict[StepId, StepNode] = {}

    def want(self, var_id: str, criteria: Criteria | None) -> None:
        """A get of ``var_id`` with ``criteria``: remembered, the strongest objective asked winning."""
        if var_id not in self.wanted or _STRENGTH[criteria] > _STRENGTH[self.wanted[var_id]]:
            self.wanted[var_id] = criteria

    def take_reprioritised(self) -> list[StepNode]:
        """The steps whose objective changed since the last call, in the order they first changed."""
        changed = list(self._reprioritised.values())
        self._reprioritised.clear()
        return changed

    def forget(self, node: StepNode) -> None:
        """``node`` left the graph."""
        self._reprioritised.pop(node.id, None)

    def settled(self, var_id: str) -> None:
        """``var_id`` got its value or failed: nothing waits for it to be produced any more."""
        self.wanted.pop(var_id, None)

    def clear(self) -> None:
        """The graph was emptied (every step cancelled)."""
        self.wanted.clear()
        self._reprioritised.clear()

    def added(self, nodes: list[StepNode], adopted: list[StepNode]) -> None:
        """The objectives a new call's (surviving) ``nodes`` bring: task groups, then criteria.

        ``adopted`` are those of them whose output existing steps already wait for: they are new inputs of
        those consumers (which may now have parallel producers) and new upstream of whatever those
        consumers are marked for.
        """
        # Older consumers first: a step feeding several consumers joins the first one's group.
        for node in adopted:
            for consumer in self._graph.waiting_for(node.output):
                self._graph.visits += 1
                self._group_inputs(consumer)
        for node in nodes:
            self._group_inputs(node)
        for node in nodes:
            criteria = self.wanted.get(node.output)  # the call's own criteria, or an earlier get
            if criteria is not None:
                self.mark_get(node, criteria)
        for node in adopted:
            self._inherit_criteria(node)
        for node in nodes:
            self._reprioritised.pop(node.id, None)  # born with this objective: nobody queued them before

    def mark_get(self, producer: StepNode, criteria: Criteria | None) -> None:
        """A get of ``producer``'s output with ``criteria``: Figure 9's marking.

        Latency makes the producer and its immediate predecessors (the previous step of its call, the
        producers of its pending inputs) latency-critical; everything further upstream, and everything
        upstream of a throughput get, becomes at least throughput-preferred.
        """
        if criteria is None:
            return
        heads = [producer, *self._graph.upstream(producer)] if criteria == "latency" else [producer]
        # A step that already had criteria has its whole upstream marked (the invariant): walk only from
        # steps that had none, so a repeated get costs the producer's in-degree, not its upstream.
        unmarked = [node for node in heads if node.criteria is None]
        for node in heads:
            self._strengthen(node, criteria)
        self._mark_upstream(unmarked)

    def _group_inputs(self, consumer: StepNode) -> None:
        """Task groups: the pending producers of ``consumer``'s inputs from two or more calls run in
        parallel and ``consumer`` waits for the slowest, so they form a group named by ``consumer``.
        Sticky: a step already in a group stays there."""
        producers = self._input_producers(consumer)
        if len({p.id.call_id for p in producers}) < 2:  # the steps of one call are sequential, not parallel
            return
        for producer in producers:
            if producer.task_group is None:
                producer.task_group = consumer.id
                self._reprioritised.setdefault(producer.id, producer)

    def _input_producers(self, consumer: StepNode) -> list[StepNode]:
        """The distinct pending steps producing ``consumer``'s inputs, other than its own call's steps (those
        run one after the other on one context, never in parallel)."""
        seen: dict[StepId, StepNode] = {}
        for var_id in consumer.inputs:
            producer = self._graph.producer(var_id)
            if producer is not None and producer.id.call_id != consumer.id.call_id:
                self._graph.visits += 1
                seen.setdefault(producer.id, producer)
        return list(seen.values())

    def _inherit_criteria(self, node: StepNode) -> None:
        """``node`` (new) produces a variable that existing steps wait for: it is upstream of whatever they
        are marked for, and an immediate predecessor of any of them that a latency get produces for."""
        for consumer in self._graph.waiting_for(node.output):
            self._graph.visits += 1
            if consumer.criteria is None:
                continue  # nothing asked for the consumer yet: nothing to inherit
            criteria: Criteria = "latency" if self.wanted.get(consumer.output) == "latency" else "throughput"
            unmarked = node.criteria is None
            self._strengthen(node, criteria)
            if unmarked:
                self._mark_upstream([node])

    def _mark_upstream(self, start: list[StepNode]) -> None:
        """Make every pending step upstream of ``start`` at least throughput-preferred.

        Stops at steps that already have criteria: their upstream is marked already (the invariant), so over
        a step's life the walk passes it once at most.
        """
        stack = list(start)
        while stack:
            for pred in self._graph.upstream(stack.pop()):
                if pred.criteria is None:
                    self._strengthen(pred, "throughput")
                    stack.append(pred)

    def _strengthen(self, node: StepNode, criteria: Criteria) -> None:
        """Raise ``node``'s criteria to ``criteria`` unless it is as strong already: criteria never weaken."""
        if _STRENGTH[criteria] > _STRENGTH[node.criteria]:
            node.criteria = criteria
            self._reprioritised.setdefault(node.id, node)
