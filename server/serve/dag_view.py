"""What the live view (``/ui``) shows, as pure functions over the manager's plain data: one session's DAG
(its calls' steps joined with their step records, and its variables), a line per session, and each engine
with its prefix-sharing counts. No I/O, no clock: the caller passes ``now``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from parrot.protocol import DagStep, DagStepState, DagVariable, SessionDag, StepInfo
from pydantic import BaseModel

from server.engine.wire import EngineStatus
from server.serve.graph import StepNode
from server.serve.ir import CallOutline, StepOutline
from server.serve.sessions import Session
from server.serve.step_records import StepRecord, StepRecords, task_group_key
from server.serve.variables import Variable

__all__ = [
    "DAG_VALUE_CHARS",
    "ClusterView",
    "EngineView",
    "SessionSummary",
    "engine_views",
    "session_dag",
    "session_summary",
    "step_info",
]


class SessionSummary(BaseModel):
    """One live session in the cluster view: its age, and its steps and variables by state."""

    session_id: str
    age_s: float
    idle_s: float
    calls: int
    steps: dict[str, int]  # DagStepState -> count
    variables: dict[str, int]  # VariableStatus -> count


class EngineView(EngineStatus):
    """An engine in the cluster view: its status plus how often sharing saved prefill there (steps that
    forked a kept context, and the prompt tokens they did not compute)."""

    prefix_hits: int = 0
    prefill_tokens_saved: int = 0


class ClusterView(BaseModel):
    """What the live view shows the cluster token's holder (``GET /v1/view``): engines and sessions."""

    engines: list[EngineView]
    sessions: list[SessionSummary]


# The most of a value the DAG carries per variable (the view polls it; the whole value is one click away).
DAG_VALUE_CHARS = 4096


def step_info(record: StepRecord) -> StepInfo:
    """A step record as the wire answers it (``GET /v1/sessions/{sid}/steps``, and the DAG's steps)."""
    return StepInfo.model_validate({name: getattr(record, name) for name in StepInfo.model_fields})


def session_dag(session: Session, records: Sequence[StepRecord]) -> SessionDag:
    """Every step of every call ``session`` submitted (submission order) with what the server did with it,
    and every variable of the session."""
    steps = []
    for call, step, record, node, output in _walk(session, records):
        if record is not None:
            steps.append(DagStep(**step_info(record).model_dump(), inputs=list(step.inputs)))
        else:
            steps.append(_undispatched(call, step, node, output))
    return SessionDag(
        session_id=session.session_id,
        steps=steps,
        variables=[_dag_variable(v) for v in session.graph.variables],
    )


def session_summary(session: Session, records: Sequence[StepRecord], now: float) -> SessionSummary:
    """One line of the cluster view: ``session``'s age and its steps and variables counted by state."""
    steps: Counter[str] = Counter(
        record.state if record is not None else _waiting_state(node, output)[0]
        for _, _, record, node, output in _walk(session, records)
    )
    return SessionSummary(
        session_id=session.session_id,
        age_s=max(0.0, now - session.created_at),
        idle_s=max(0.0, now - session.last_seen),
        calls=len(session.calls),
        steps=dict(steps),
        variables=dict(Counter(v.status for v in session.graph.variables)),
    )


def _walk(
    session: Session, records: Sequence[StepRecord]
) -> Iterator[tuple[CallOutline, StepOutline, StepRecord | None, StepNode | None, Variable]]:
    """Every step the session submitted, in order, with its record (once dispatched), its graph node
    (while pending) and its output variable."""
    by_step = {(r.call_id, r.index): r for r in records}
    pending = {(n.id.call_id, n.id.index): n for n in session.graph.steps()}
    variables = session.graph.variables
    for call in session.calls:
        for step in call.steps:
            key = (call.call_id, step.index)
            yield call, step, by_step.get(key), pending.get(key), variables.get(step.output)


def engine_views(statuses: Iterable[EngineStatus], steps: StepRecords) -> list[EngineView]:
    """Each engine's status with the prefix hits of the steps that ran there."""
    return [
        EngineView(
            **status.model_dump(),
            prefix_hits=steps.prefix_hits[status.engine_id],
            prefill_tokens_saved=steps.prefix_tokens_saved[status.engine_id],
        )
        for status in statuses
    ]


def _waiting_state(node: StepNode | None, output: Variable) -> tuple[DagStepState, str | None]:
    """The state of a step not dispatched yet: waiting in the graph, or failed there (an input failed)."""
    if node is not None and node.status == "dispatched":
        return "queued", None  # (sent to the executor a moment before its record exists)
    if node is None and output.status == "failed":
        return "failed", output.error
    return "waiting", None


def _undispatched(call: CallOutline, step: StepOutline, node: StepNode | None, output: Variable) -> DagStep:
    state, error = _waiting_state(node, output)
    return DagStep(
        call_id=call.call_id,
        index=step.index,
        var_id=step.output,
        function=call.func_name,
        criteria=node.criteria if node is not None else call.criteria,
        task_group=task_group_key(node.task_group) if node is not None else None,
        state=state,
        engine=None,
        attempts=0,
        prompt_tokens=0,
        prefill_tokens_saved=0,
        queue_s=None,
        run_s=None,
        error=error,
        inputs=list(step.inputs),
    )


def _dag_variable(var: Variable) -> DagVariable:
    value = var.value
    truncated = value is not None and len(value) > DAG_VALUE_CHARS
    return DagVariable(
        var_id=var.var_id,
        name=var.name,
        status=var.status,
        kind=var.kind,
        producer=None if var.producer is None else f"{var.producer.call_id}:{var.producer.index}",
        value=value[:DAG_VALUE_CHARS] if value is not None else None,
        truncated=truncated,
        error=var.error,
    )
