"""The per-session dataflow graph of the manager: pure data structures, no I/O, no clock, no locks.

Nodes are the *pending* steps of submitted calls (one step per output, `server.serve.ir.Step`) and the
variables they connect; edges run producer step -> output variable -> consumer steps, and step i -> step i+1
of the same call (step i+1 continues step i's context, so it runs after it).

A step is

* *ready* when every input variable has a value and the previous step of its call is done;
* *activated* when a ``get`` reaches it through the graph (`SessionGraph.activate`) or its call was
  submitted with ``criteria`` — so the objectives of a step are known before it is dispatched;
* *runnable* when ready, activated and not yet dispatched: what the executor dispatches.

Readiness is kept with a counter of missing inputs per step and reverse edges (variable -> waiting steps),
so settling a variable touches exactly the steps that wait for it: every operation costs O(nodes it changes),
never O(graph), and the executor is woken with exactly the steps that changed — it never polls.

Finished steps leave the graph at once (completed, failed or cancelled), and so does a variable once nothing
pending produces or waits for it; the variables themselves live on in the session's `VariableTable` until
the session dies. So the graph holds only pending work and never grows without bound.

The graph is acyclic by construction: `SessionGraph.add_call` validates a whole call (inputs exist, outputs
are fresh, no cycle) before it changes anything, so a rejected call leaves no trace.

The graph also keeps each step's *objective* (``criteria`` and ``task_group``, the rules of
`server.serve.deduction`, after Figure 9 of the Parrot paper) on its node, updated by the operations that can
change it — `SessionGraph.add_call` and `SessionGraph.activate` — through its `Objectives`
(`server.serve.graph_objectives`), at a cost proportional to the steps they touch.
`SessionGraph.take_reprioritised` reports the steps whose objective changed, so the manager re-prioritises
exactly those.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from parrot.protocol import Criteria

from server.serve.graph_checks import check_new_call
from server.serve.graph_objectives import Objectives
from server.serve.ir import CallIR, input_vars
from server.serve.step_node import (
    CycleError,
    DuplicateCallError,
    GraphError,
    StepNode,
    StepRef,
    StepStateError,
    StepStatus,
    UnknownStepError,
)
from server.serve.variables import (
    STEP_FAILED,
    StepId,
    Variable,
    VariableConflictError,
    VariableTable,
)

if TYPE_CHECKING:
    from server.serve.transforms import ValueKind

__all__ = [
    "CycleError",
    "DuplicateCallError",
    "GraphError",
    "SessionGraph",
    "StepId",
    "StepNode",
    "StepStateError",
    "StepStatus",
    "UnknownStepError",
]


def _downstream_error(error: str | None) -> str:
    # Downstream messages name the root cause once, however long the chain: a variable that failed because of
    # an upstream failure already says "upstream ...", and is passed on as is rather than nested again.
    text = error or "failed"
    return text if text.startswith("upstream ") else f"upstream {text}"


class SessionGraph:
    """The dataflow graph of one session, over its `VariableTable` (``variables``).

    Mutating operations return exactly what they changed, so a driver reacts to events instead of scanning:
    `complete_step` and `set_variable` the steps that became ready, `activate` the steps it activated,
    `fail_step` the variables that failed, `cancel_all` the steps it cancelled. `runnable_steps` is what may
    be dispatched now (maintained incrementally, in the order steps became runnable), and
    `take_reprioritised` the steps whose objective changed.

    ``visits`` counts the steps the graph's walks have examined (activation, objectives, task groups: one
    per predecessor or consumer looked at), ever: a measure of work that tests use to prove each operation
    costs what it changes, never the graph's size.
    """

    def __init__(self, variables: VariableTable | None = None) -> None:
        self.variables = variables if variables is not None else VariableTable()
        self._steps: dict[StepId, StepNode] = {}
        # Reverse edges: pending variable -> the pending steps waiting for it (dicts: ordered, O(1) removal).
        self._consumers: dict[str, dict[StepId, StepNode]] = {}
        # Variable -> its pending producer (only while the producer is in the graph).
        self._producer: dict[str, StepNode] = {}
        self._ready: dict[StepId, StepNode] = {}  # ready, not dispatched; in the order they became ready
        self._runnable: dict[StepId, StepNode] = {}  # ... and activated
        self._pending_per_call: dict[str, int] = {}
        self.visits = 0
        self.objectives = Objectives(self)  # criteria and task groups (`server.serve.graph_objectives`)

    # ============================================================================================ reading
    def __len__(self) -> int:
        """The number of pending steps in the graph."""
        return len(self._steps)

    def __contains__(self, step: object) -> bool:
        sid = step.id if isinstance(step, StepNode) else step
        return sid in self._steps

    def step(self, step: StepRef) -> StepNode:
        """The pending step ``step``; `UnknownStepError` if it is not (or no longer) in the graph."""
        sid = step.id if isinstance(step, StepNode) else step
        try:
            return self._steps[sid]
        except KeyError:
            raise UnknownStepError(
                f"{sid} is not in the graph: it finished, failed or was cancelled, or was never submitted"
            ) from None

    def steps(self) -> list[StepNode]:
        """Every pending step, in submission order."""
        return list(self._steps.values())

    def variable_nodes(self) -> set[str]:
        """The variables in the graph: those a pending step produces or waits for."""
        return set(self._producer) | set(self._consumers)

    def ready_steps(self) -> list[StepNode]:
        """Steps whose inputs are set and whose previous step is done, not yet dispatched (activated or
        not), in the order they became ready."""
        return list(self._ready.values())

    def runnable_steps(self) -> list[StepNode]:
        """Ready steps that are also activated: what the executor dispatches, in the order they became
        runnable."""
        return list(self._runnable.values())

    def depth(self, step: StepRef) -> int:
        """The topological depth of a pending step (see `StepNode`)."""
        return self.step(step).depth

    def producer(self, var_id: str) -> StepNode | None:
        """The pending step that generates ``var_id``, or None (set by the client, or already settled)."""
        return self._producer.get(var_id)

    def consumers(self, var_id: str) -> list[StepNode]:
        """The pending steps waiting for ``var_id``, in submission order (empty once it is settled)."""
        return list(self._consumers.get(var_id, {}).values())

    def waiting_for(self, var_id: str) -> Iterable[StepNode]:
        """`consumers` as a view, without the copy (for walks that do not change the graph)."""
        return self._consumers.get(var_id, {}).values()

    def upstream(self, node: StepNode) -> Iterable[StepNode]:
        """`predecessors` of a node in the graph, lazily, each counted in ``visits``."""
        return self._predecessors(node)

    def predecessors(self, step: StepRef) -> list[StepNode]:
        """The pending steps ``step`` waits for directly: the previous step of its call, then the producers
        of its pending inputs (distinct, in that order)."""
        node = self.step(step)
        return list(self._predecessors(node))

    def successors(self, step: StepRef) -> list[StepNode]:
        """The pending steps that wait for ``step`` directly: the next step of its call, then the consumers
        of its output (distinct, in that order)."""
        node = self.step(step)
        out: dict[StepId, StepNode] = {}
        nxt = self.next_step(node)
        if nxt is not None:
            out[nxt.id] = nxt
        out.update(self._consumers.get(node.output, {}))
        return list(out.values())

    def steps_upstream(self, var_id: str) -> list[StepNode]:
        """Every pending step ``var_id`` depends on — its producer first, then breadth first upstream."""
        start = self._producer.get(var_id)
        if start is None:
            return []
        seen = {start.id: start}
        queue = deque([start])
        while queue:
            for pred in self._predecessors(queue.popleft()):
                if pred.id not in seen:
                    seen[pred.id] = pred
                    queue.append(pred)
        return list(seen.values())

    def wanted(self) -> dict[str, Criteria | None]:
        """Pending variables that a ``get`` or a submission with ``criteria`` asked for, with the objective
        (latency beats throughput beats none when asked more than once). Input to objective deduction."""
        return dict(self.objectives.wanted)

    # ========================================================================================= submitting
    def add_call(self, call: CallIR) -> list[StepNode]:
        """Add a call's steps to the graph and return their nodes, in step order.

        Validates the whole call first and changes nothing when it fails:

        * `DuplicateCallError` if the call id is still pending here;
        * `UnknownVariableError` for an input variable the session does not have (the message names it);
        * `VariableConflictError` for an output variable that already has a value, has failed or is some
          other call's output (outputs are fresh variables, or pending ones the client created unset);
        * `CycleError` if an input depends on the call's own output (possible only when an output is a
          variable that other calls already consume).

        Output variables missing from the table are created (named after their placeholders). A step whose
        input has already failed fails at once, with everything downstream of it. A call with ``criteria``
        activates its steps (and everything upstream) and marks their objectives, as a ``get`` of each output
        would; so does an earlier get of one of its outputs. The call's steps get their task groups, and
        may complete those of steps already pending (see `server.serve.deduction`).
        """
        check_new_call(self, call)
        nodes: list[StepNode] = []
        adopted: list[StepNode] = []  # steps whose output variable existed before (it may have consumers)
        for step in call.steps:
            sid = StepId(call.call_id, step.index)
            node = StepNode(sid, call, tuple(input_vars(step)))
            nodes.append(node)
            self._steps[sid] = node
            out = step.gen.var_id
            if out in self.variables:
                self.variables.set_producer(out, sid)
                adopted.append(node)
            else:
                self.variables.create(step.gen.name, var_id=out, producer=sid)
            self._producer[out] = node
        self._pending_per_call[call.call_id] = len(nodes)

        first_failure: tuple[StepNode, Variable] | None = None  # the earliest step with a failed input
        for node in nodes:
            previous = nodes[node.id.index - 1] if node.id.index > 0 else None
            node.missing = 1 if previous is not None else 0
            node.depth = previous.depth + 1 if previous is not None else 0
            for var_id in node.inputs:
                var = self.variables.get(var_id)
                if var.status == "pending":
                    node.missing += 1
                    self._consumers.setdefault(var_id, {})[node.id] = node
                    producer = self._producer.get(var_id)
                    if producer is not None:
                        node.depth = max(node.depth, producer.depth + 1)
                elif var.status == "failed" and first_failure is None:
                    first_failure = (node, var)
        if nodes[0].missing == 0:  # later steps wait for their previous step at least
            self._make_ready(nodes[0])
        if adopted:
            self._relax_depths(adopted)

        to_activate = []
        for node in nodes:
            out = node.output
            if call.criteria is not None:
                self.objectives.want(out, call.criteria)
                to_activate.append(node)
            elif out in self.objectives.wanted or any(
                c.activated for c in self._consumers.get(out, {}).values()
            ):
                to_activate.append(node)  # an adopted output that a get already reaches
        self._activate(to_activate)

        if first_failure is not None:
            # The earliest step with a failed input fails; its later steps and their consumers follow.
            node, cause = first_failure
            error = _downstream_error(cause.error)
            self._fail_from(node, error, error, cause.error_type or STEP_FAILED, cause.llm_output)
        # Objectives after the failures: a step that failed at once neither names a group nor marks its
        # upstream for a variable nobody can have any more.
        self.objectives.added(
            [node for node in nodes if node.status != "failed"],
            [node for node in adopted if node.status != "failed"],
        )
        return nodes

    # ======================================================================================== activation
    def activate(self, var_id: str, criteria: Criteria | None = None) -> list[StepNode]:
        """A ``get`` of ``var_id``: activate every pending step it depends on and record the objective.

        Returns the steps activated now (those already activated are not repeated). `UnknownVariableError`
        for an unknown id. A settled variable needs nothing; a pending one without a producer yet is
        remembered, so a call that later produces it starts activated.
        """
        var = self.variables.get(var_id)
        if var.settled:
            return []
        self.objectives.want(var_id, criteria)
        producer = self._producer.get(var_id)
        if producer is None:
            return []
        self.objectives.mark_get(producer, criteria)
        return self._activate([producer])

    def _activate(self, start: Iterable[StepNode]) -> list[StepNode]:
        # Activation is closed upstream (an activated step's predecessors are all activated), so the walk
        # stops at the first activated step on every path: each step is activated once, ever.
        newly: list[StepNode] = []
        stack = [node for node in start if not node.activated]
        while stack:
            node = stack.pop()
            if node.activated:
                continue
            node.activated = True
            newly.append(node)
            if node.status == "ready":
                self._runnable[node.id] = node
            # Reversed so that the walk visits predecessors in order (the previous step of the call, then
            # the producers of the inputs in prompt order): steps become runnable in a natural order.
            stack.extend(reversed([pred for pred in self._predecessors(node) if not pred.activated]))
        return newly

    # ========================================================================================= execution
    def mark_dispatched(self, step: StepRef) -> StepNode:
        """Record that the executor sent ``step`` to an engine. It must be ready (`StepStateError`)."""
        node = self.step(step)
        if node.status != "ready":
            raise StepStateError(f"{node.id} is {node.status}: only a ready step can be dispatched")
        node.status = "dispatched"
        del self._ready[node.id]
        self._runnable.pop(node.id, None)
        return node

    def complete_step(self, step: StepRef, value: str, kind: ValueKind = "text") -> list[StepNode]:
        """A dispatched step finished: set its output variable and drop the step from the graph.

        Returns the steps that became ready because of it — the next step of the call first, then the
        output's consumers in submission order — so the executor wakes exactly those.
        """
        node = self.step(step)
        if node.status != "dispatched":
            raise StepStateError(
                f"{node.id} is {node.status}: complete a step only after mark_dispatched (and only once)"
            )
        self.variables.set(node.output, value, kind)
        node.status = "done"
        nxt = self.next_step(node)
        self._remove(node)
        woken: dict[StepId, StepNode] = {}
        if nxt is not None:
            self._satisfy(nxt, woken)
        self._settle(node.output, woken)
        return list(woken.values())

    def set_variable(self, var_id: str, value: str, kind: ValueKind = "text") -> list[StepNode]:
        """A client sets a variable (``PUT``): set it and return the steps that became ready.

        `UnknownVariableError` for an unknown id; `VariableConflictError` when it is already settled or a
        call produces it (only that call sets it).
        """
        var = self.variables.get(var_id)
        if var.status == "pending" and var.producer is not None:
            raise VariableConflictError(
                f"{var.describe()} is the output of {var.producer}: only that call sets it; "
                "create a new variable to pass a value of your own",
                var_id,
            )
        self.variables.set(var_id, value, kind)
        woken: dict[StepId, StepNode] = {}
        self._settle(var_id, woken)
        return list(woken.values())

    def fail_step(
        self, step: StepRef, message: str, *, error_type: str = STEP_FAILED, llm_output: str | None = None
    ) -> list[Variable]:
        """A pending step failed (engine error, transform error, timeout): fail its output with ``message``,
        then every step and variable downstream — the later steps of its call, their consumers, and on —
        each with a message naming the root cause (``upstream step 0 of call 'c' (output 'x') failed: ...``).

        ``error_type`` (the cause's type, e.g. ``"transform_failed"``) and ``llm_output`` (the model's text
        a transform refused, if that is the cause) go to every variable that fails, the step's own and those
        downstream alike: a downstream failure *is* the root cause's, as its message says, and a client that
        fetches only a chain's last output (a compiled LangChain chain) needs the refused text to raise the
        parser's exception with it. The text is one shared string, not a copy per variable.

        Returns the variables that failed, the step's own output first. Steps that do not depend on the
        failed one are untouched.
        """
        node = self.step(step)
        error = f"{node.describe()} failed: {message}"
        return self._fail_from(node, error, _downstream_error(error), error_type, llm_output)

    def cancel_all(self, reason: str = "the session was deleted") -> list[StepNode]:
        """Cancel every pending step (session deletion or expiry) and empty the graph.

        Returns the steps that were pending (now ``cancelled``); the executor aborts those it had
        dispatched. Their output variables fail with ``reason``, so anyone waiting on them wakes up.
        """
        cancelled = list(self._steps.values())
        for node in cancelled:
            node.status = "cancelled"
            node.error = f"cancelled: {reason}"
            if not self.variables.get(node.output).settled:
                self.variables.fail(node.output, node.error, error_type="cancelled")
        self._steps.clear()
        self._consumers.clear()
        self._producer.clear()
        self._ready.clear()
        self._runnable.clear()
        self._pending_per_call.clear()
        self.objectives.clear()
        return cancelled

    # ========================================================================================= objectives
    def take_reprioritised(self) -> list[StepNode]:
        """The pending steps whose ``criteria`` or ``task_group`` changed since the last call, in the order
        they first changed, each once; the list starts over empty.

        For the manager, to re-prioritise steps it has already queued (dispatched ones may be included).
        The steps of a call being added are not reported for the objective they start with: nothing can
        have queued them yet. Steps that left the graph are dropped from the list.
        """
        return self.objectives.take_reprioritised()

    # ========================================================================================== internals
    def next_step(self, node: StepNode) -> StepNode | None:
        """The next step of the node's call, if pending (it is, while this node is: it waits for it)."""
        return self._steps.get(StepId(node.id.call_id, node.id.index + 1))

    def _predecessors(self, node: StepNode) -> Iterable[StepNode]:
        # Every upstream walk goes through here, so this is where ``visits`` counts the steps walks look at.
        seen: set[StepId] = set()
        if node.id.index > 0:
            prev = self._steps.get(StepId(node.id.call_id, node.id.index - 1))
            if prev is not None:
                seen.add(prev.id)
                self.visits += 1
                yield prev
        for var_id in node.inputs:
            producer = self._producer.get(var_id)
            if producer is not None and producer.id not in seen:
                seen.add(producer.id)
                self.visits += 1
                yield producer

    def _make_ready(self, node: StepNode) -> None:
        node.status = "ready"
        self._ready[node.id] = node
        if node.activated:
            self._runnable[node.id] = node

    def _satisfy(self, node: StepNode, woken: dict[StepId, StepNode]) -> None:
        """One thing ``node`` waited for arrived."""
        node.missing -= 1
        if node.missing == 0:
            self._make_ready(node)
            woken[node.id] = node

    def _settle(self, var_id: str, woken: dict[StepId, StepNode]) -> None:
        """``var_id`` got its value: wake the steps waiting for it; it leaves the graph."""
        self.objectives.settled(var_id)
        for consumer in self._consumers.pop(var_id, {}).values():
            self._satisfy(consumer, woken)

    def _remove(self, node: StepNode) -> None:
        """Drop a finished step and its edges."""
        del self._steps[node.id]
        self._ready.pop(node.id, None)
        self._runnable.pop(node.id, None)
        self.objectives.forget(node)
        if self._producer.get(node.output) is node:
            del self._producer[node.output]
        for var_id in node.inputs:  # a step that fails while waiting is still some variables' consumer
            waiting = self._consumers.get(var_id)
            if waiting is not None and waiting.pop(node.id, None) is not None and not waiting:
                del self._consumers[var_id]
        left = self._pending_per_call[node.id.call_id] - 1
        if left:
            self._pending_per_call[node.id.call_id] = left
        else:
            del self._pending_per_call[node.id.call_id]

    def _fail_from(
        self, root: StepNode, error: str, downstream: str, error_type: str, llm_output: str | None
    ) -> list[Variable]:
        """Fail ``root`` with ``error`` and everything downstream of it with ``downstream``, breadth first;
        every failed variable gets the cause's ``error_type`` and ``llm_output``."""
        failed: list[Variable] = []
        queue: deque[tuple[StepNode, str]] = deque([(root, error)])
        while queue:
            node, message = queue.popleft()
            if node.id not in self._steps:  # reached twice (a diamond): already failed
                continue
            nxt = self.next_step(node)
            node.status = "failed"
            node.error = message
            self._remove(node)
            failed.append(
                self.variables.fail(node.output, message, error_type=error_type, llm_output=llm_output)
            )
            self.objectives.settled(node.output)
            if nxt is not None:
                queue.append((nxt, downstream))
            for consumer in self._consumers.pop(node.output, {}).values():
                queue.append((consumer, downstream))
        return failed

    def _relax_depths(self, start: Iterable[StepNode]) -> None:
        """Restore ``depth`` downstream of steps that gained a new producer edge (an adopted output)."""
        queue = deque(start)
        while queue:
            node = queue.popleft()
            for succ in self.successors(node):
                if succ.depth < node.depth + 1:
                    succ.depth = node.depth + 1
                    queue.append(succ)
