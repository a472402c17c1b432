"""Objective deduction: what each pending step of a session must optimise (section 5.2 of the Parrot paper).

The graph keeps each step's objective on its node (`server.serve.graph.StepNode` ``criteria``,
``task_group``, ``depth``), updated incrementally as calls and gets arrive; this module states the rules and
reads the result. The rules:

* ``get(var, criteria="latency")`` makes the pending producer of ``var`` **latency-critical**, and its
  *immediate* predecessors too: the previous step of its call and the producers of its pending inputs. That
  is Figure 9's marking — the requests that directly produce a latency-critical variable (Requests 1 and 2)
  are latency-sensitive, "as are their immediate predecessors (Request 3)" — and not the whole upstream:
  further up, what the get waits for is the completion of whole stages, which latency-sized batches would
  slow down (Figure 4's map stage).
* Every other step upstream of a latency get must still run for it, so it is at least
  **throughput-preferred**; ``get(criteria="throughput")`` makes everything upstream of ``var``
  throughput-preferred.
* A call submitted with ``criteria`` counts as a get of each of its outputs, and a get that arrives before
  the producing call is applied when that call is submitted.
* Latency beats throughput beats None, and a step's criteria only ever strengthens: a later, weaker get
  changes nothing; a later latency get strengthens only its producer and their immediate predecessors.
* Two or more pending steps from different calls feeding one consumer step directly (the map stage under a
  reduce: Figure 9's task groups) form a **task group** named by the consumer's step id: the consumer waits
  for the slowest of them, so the group is scheduled for its completion time (together, in large batches)
  rather than each member's own latency. The steps of one call are a sequence on one context, never a group.
  A group is formed when its consumer (or a late producer of one of its inputs) is submitted, and is sticky;
  a step feeding several consumers joins the first one's group.
* Steps nothing asked for have no criteria (``None``); the scheduler treats them as throughput work.
* Each step keeps its topological ``depth`` (0: nothing pending feeds it): app-level priority, lower first.
"""

from __future__ import annotations

from dataclasses import dataclass

from parrot.protocol import Criteria

from server.serve.graph import SessionGraph, StepNode
from server.serve.variables import StepId

__all__ = ["StepObjective", "deduce", "objective"]


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


def objective(node: StepNode) -> StepObjective:
    """The objective of one pending step, as its graph has deduced it so far (O(1))."""
    return StepObjective(node.criteria, node.task_group, node.depth)


def deduce(graph: SessionGraph) -> dict[StepId, StepObjective]:
    """The objective of every pending step of ``graph``, in submission order (O(steps))."""
    return {node.id: objective(node) for node in graph.steps()}
