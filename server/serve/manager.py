"""The manager: the service's one object, a façade over parts with one job each.

- `EngineRegistry` (`engine_registry`): the engines, local or remote, and which may take work now.
- `KeptContexts` (`kept_contexts`): contexts kept after their request, forked by later ones.
- `Placement` (`placement`): which engine a step waits for and gets (the scheduler's decisions).
- `StepExecutor` (`executor`): runs a session's steps as they become runnable.
- `OpenAIServing` (`openai_serving`): the request-centric calls' (OpenAI endpoints') engines, contexts and
  retries; `request_run` runs one.
- `SessionTable`, `VariableWaits`, `TenantTokens`: sessions, the clients waiting on their variables, and the
  token quotas of their tenants.

What is here is the session API itself — sessions, variables, calls, batches — and the server's lifetime
(drain, shutdown). The HTTP edge (`server.http.app`) calls only this object and its parts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from parrot.protocol import (
    BatchApplied,
    BatchCreateVariable,
    BatchGet,
    BatchRequest,
    BatchSetVariable,
    CallError,
    CreateSessionRequest,
    CreateSessionResponse,
    CreateVariableRequest,
    Criteria,
    GetVariableResponse,
    SessionDag,
    SubmitCallRequest,
    SubmitCallResponse,
    VariableCreated,
)

from server.engine.interface import Engine
from server.engine.wire import EngineStatus
from server.serve.dag_view import ClusterView, engine_views, session_dag, session_summary
from server.serve.drain_gate import DrainGate
from server.serve.engine_registry import EngineRegistry
from server.serve.errors import BatchOpError, GetTimeoutError
from server.serve.executor import StepExecutor, prompt_too_long
from server.serve.ir import CallOutline, build_call, prompt_chars
from server.serve.kept_contexts import KeptContexts
from server.serve.length_predictor import LengthPredictor
from server.serve.manager_config import ManagerConfig
from server.serve.openai_serving import OpenAIServing
from server.serve.output_lengths import OutputLengths
from server.serve.placement import Placement
from server.serve.quotas import SessionUsage, check_session, check_stored, check_variables
from server.serve.scheduler import SchedulerConfig
from server.serve.sessions import Session, SessionTable, UnknownSessionError
from server.serve.step_records import StepRecords
from server.serve.streams import Delta, Restart
from server.serve.tenant_tokens import TenantTokens
from server.serve.transforms import validate_transforms
from server.serve.variable_waits import VariableWaits, variable_response
from server.serve.variables import VariableTable

__all__ = ["BATCH_SLICE", "Manager", "ManagerConfig"]

log = logging.getLogger(__name__)

BATCH_SLICE = 256  # batch operations applied between two yields to the event loop


class Manager:
    """Serves sessions and OpenAI requests on its engines (`Engine`, any kind): those given here, remote
    ones that register over HTTP and OpenAI-compatible servers added as engines (`registry`)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        config: ManagerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config = config or ManagerConfig()
        self._clock = clock
        self.sessions = SessionTable(config.session_ttl)
        self.gate = DrainGate()
        self.lengths = OutputLengths(config.length_predictor_path) if config.length_prediction else None
        self.registry = EngineRegistry(
            engines,
            config,
            clock,
            on_change=lambda: self.placement.engines_changed(),  # waiting steps may go elsewhere now
            forget=lambda engine_id: self.kept.forget(engine_id),
        )
        self.kept = KeptContexts(self.registry, config)
        self.placement = Placement(
            self.registry.engine_states, SchedulerConfig(config.aging_rounds, config.prefix_slack_tokens)
        )
        self.waits = VariableWaits(self.sessions, config.default_get_timeout, config.max_get_timeout, clock)
        self.tokens = TenantTokens(self.sessions, config.quotas)
        self.executor = StepExecutor(
            self.registry, self.kept, self.placement, self.waits, config, self.lengths, clock
        )
        self.openai = OpenAIServing(
            self.registry,
            self.kept,
            self.placement,
            self.executor.steps,
            config,
            self.lengths,
            self.tokens,
            self.gate,
            clock,
        )

    @property
    def engines(self) -> list[Engine]:
        """Every engine, by id (its index), in service or not."""
        return self.registry.engines

    @property
    def steps(self) -> StepRecords:
        """What happened to each step (the live view and ``/steps``)."""
        return self.executor.steps

    @property
    def draining(self) -> bool:
        """Whether a graceful shutdown began (new work is refused)."""
        return self.gate.closed

    @property
    def length_predictor(self) -> LengthPredictor | None:
        """The live output-length predictor (None with ``length_prediction`` off)."""
        return self.openai.length_predictor

    def engine_status(self) -> list[EngineStatus]:
        """Every engine with its liveness and stats (``GET /v1/engines``)."""
        return self.registry.status()

    async def check_engines(self) -> list[int]:
        """Retire silent remote engines (returns their ids) and put back recovered backends."""
        return await self.registry.check()

    async def drop_cache(self) -> int:
        """Free every kept context no request is forking from; returns how many went. KV blocks then count
        only what runs."""
        return await self.kept.drop()

    # ------------------------------------------------------------------------------------------ sessions
    def create_session(self, cache_salt: str | None = None, client: str = "") -> CreateSessionResponse:
        """A new session for ``client`` (its address: the sessions_per_client quota); with ``cache_salt``
        its prompts share KV only with requests of the same salt."""
        session = self._new_session(cache_salt, client)
        return CreateSessionResponse(session_id=session.session_id, token=session.token)

    def open_session(
        self, session_id: str, token: str | None, create: CreateSessionRequest | None, client: str = ""
    ) -> Session:
        """A batch's session: authenticated by ``token``, or — with ``create``, when no session has that id
        yet — created with the client's id and token (`BatchRequest.create`)."""
        if create is None or session_id in self.sessions or token is None:
            return self.session(session_id, token)
        return self._new_session(create.cache_salt, client, session_id=session_id, token=token)

    def _new_session(
        self, cache_salt: str | None, client: str, session_id: str | None = None, token: str | None = None
    ) -> Session:
        self.gate.check("sessions")
        check_session(self.config.quotas, client or "(unknown)", self.sessions.open_by(client))
        now = self._clock()
        session = self.sessions.create(now, cache_salt, client, session_id=session_id, token=token)
        self.executor.open_session(session.session_id)
        return session

    def session(self, session_id: str, token: str | None) -> Session:
        return self.sessions.authenticate(session_id, token, self._clock())

    async def delete_session(self, session: Session) -> None:
        """Cancel the session's pending work, fail its pending variables and free its engine contexts."""
        self.sessions.remove(session.session_id)
        await self.executor.close_session(session)
        session.graph.cancel_all("the session was deleted")
        self.waits.drop_session(session.session_id)

    async def expire_sessions(self) -> int:
        """Delete every session idle for longer than the TTL; returns how many went."""
        expired = self.sessions.expired(self._clock())
        for session in expired:
            await self.delete_session(session)
        return len(expired)

    # ------------------------------------------------------------------------------------------ variables
    def create_variable(self, session: Session, req: CreateVariableRequest) -> VariableCreated:
        check_variables(self.config.quotas, SessionUsage(variables=len(session.graph.variables)), 1)
        chars = len(req.value or "")
        check_stored(self.config.quotas, session.client, self.sessions.stored_by(session.client), chars)
        var = session.graph.variables.create(req.name, req.value, var_id=req.var_id)
        self.sessions.store(session, chars)
        return VariableCreated(var_id=var.var_id)

    def set_variable(self, session: Session, var_id: str, value: str) -> GetVariableResponse:
        check_stored(self.config.quotas, session.client, self.sessions.stored_by(session.client), len(value))
        session.graph.set_variable(var_id, value)
        self.sessions.store(session, len(value))
        self.waits.settled(session, var_id)
        self.executor.dispatch(session)
        return variable_response(session.graph.variables, var_id)

    async def get_variable(
        self, session: Session, var_id: str, criteria: Criteria | None, timeout: float | None
    ) -> GetVariableResponse:
        """Long poll: activate what ``var_id`` needs, then wait until it is ready or failed."""
        session.graph.activate(var_id, criteria)
        self.executor.dispatch(session)
        return await self.waits.wait(session, var_id, timeout)

    async def variable_text(
        self,
        session: Session,
        var_id: str,
        criteria: Criteria | None,
        timeout: float | None,
        *,
        watch: bool = False,
    ) -> AsyncIterator[Delta | Restart | GetVariableResponse]:
        """The text of ``var_id``'s producing step as it is written (from the beginning, whenever this is
        called), then the variable's final answer (its value after transforms, or its failure). Activates
        what it needs, as `get_variable` does — unless ``watch`` (the live view: looking neither runs a step
        nor keeps the session alive). An unknown variable raises here, before anything is sent; when
        ``timeout`` (bounded by ``max_get_timeout``) passes first, the answer says it is pending."""
        session.graph.variables.get(var_id)  # an unknown variable is a 404 before the stream starts
        if not watch:
            session.graph.activate(var_id, criteria)
            self.executor.dispatch(session)
        return self.waits.follow(session, var_id, self.waits.timeout(timeout), hold=not watch)

    def session_dag(self, session: Session) -> SessionDag:
        """``session``'s calls, steps and variables as the live view shows them (`dag_view`)."""
        return session_dag(session, self.steps.by_session.get(session.session_id, []))

    def variable_snapshot(self, session: Session, var_id: str) -> GetVariableResponse:
        """``var_id``'s state now, activating nothing (the live view's click on a variable)."""
        return variable_response(session.graph.variables, var_id)

    def cluster_view(self) -> ClusterView:
        """Every engine and session, as the live view shows the cluster token's holder."""
        now = self._clock()
        return ClusterView(
            engines=engine_views(self.engine_status(), self.steps),
            sessions=[
                session_summary(s, self.steps.by_session.get(s.session_id, []), now) for s in self.sessions
            ],
        )

    # ------------------------------------------------------------------------------------------ calls
    def submit_call(self, session: Session, req: SubmitCallRequest) -> SubmitCallResponse:
        """Register a call's steps in the session graph (validated first: nothing changes on error)."""
        self.gate.check("calls")
        graph = session.graph
        self.registry.serving(req.model)  # an unknown model is the submitter's error, not a failed variable
        for placeholder in req.placeholders:  # a pattern RE2 cannot run is the submitter's error (400)
            validate_transforms(placeholder.transforms)
        outputs = {p.name: p.var_id or VariableTable.new_id() for p in req.placeholders if p.role == "output"}
        call = build_call(req, outputs)
        chars = prompt_chars(call, len(call.steps) - 1, {})  # its text and literal values: known now
        if chars > self.config.max_prompt_chars:
            raise CallError(prompt_too_long(chars, self.config.max_prompt_chars))
        self.tokens.check_call(session, call)
        graph.add_call(call)
        session.calls.append(CallOutline.of(call))
        for var_id in call.outputs.values():  # a step whose input had failed fails at once
            if graph.variables.get(var_id).settled:
                self.waits.settled(session, var_id)
        self.executor.dispatch(session)
        return SubmitCallResponse(call_id=call.call_id, outputs=call.outputs)

    async def apply_batch(self, session: Session, req: BatchRequest) -> BatchApplied:
        """Apply ``req``'s operations in order and check its ``get`` names a variable (`answer_get` waits).

        A long batch yields to the event loop every ``BATCH_SLICE`` operations, so thousands of operations
        never hold up other sessions or ``/health`` (steps made ready by an earlier slice may then start
        before the get is applied; the get re-prioritises them where they wait).

        The first operation that fails stops the batch: `BatchOpError` carries its index (``len(ops)`` for
        the get) and cause; the operations before it stay applied (their ids are the client's, so it knows
        what exists).
        """
        results: list[VariableCreated | GetVariableResponse | SubmitCallResponse] = []
        for index, op in enumerate(req.ops):
            if index and index % BATCH_SLICE == 0:
                await asyncio.sleep(0)
                if not self.executor.has_session(session.session_id):
                    raise BatchOpError(index, op.op, UnknownSessionError("the session was deleted meanwhile"))
            try:
                if isinstance(op, BatchCreateVariable):
                    results.append(self.create_variable(session, op))
                elif isinstance(op, BatchSetVariable):
                    results.append(self.set_variable(session, op.var_id, op.value))
                else:
                    results.append(self.submit_call(session, op))
            except Exception as e:
                raise BatchOpError(index, op.op, e) from e
        if req.get is not None:
            try:
                # Activated now, before the deferred dispatch runs: the batch's steps start with the
                # objective the get gives them.
                session.graph.activate(req.get.var_id, req.get.criteria)
            except Exception as e:
                raise BatchOpError(len(req.ops), "get", e) from e
        return BatchApplied(results=results)

    async def answer_get(self, session: Session, get: BatchGet) -> GetVariableResponse:
        """A batch's get: `get_variable`, but a timeout answers the pending variable instead of a 504."""
        try:
            return await self.get_variable(session, get.var_id, get.criteria, get.timeout)
        except GetTimeoutError:
            return variable_response(session.graph.variables, get.var_id)

    # ------------------------------------------------------------------------------------------ lifetime
    async def drain(self, grace: float) -> int:
        """Graceful shutdown: refuse new sessions, calls and OpenAI requests (503) from now on, and wait up
        to ``grace`` seconds for the steps already dispatched to finish; returns how many were still running
        (0: all finished)."""
        self.gate.close()
        log.info("draining: no new work; waiting up to %gs for running steps", grace)
        deadline = time.monotonic() + grace
        while (running := self.executor.running()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return running

    async def shutdown(self) -> None:
        if self.lengths is not None:
            try:
                self.lengths.save()
            except OSError as e:  # the state is an optimization: losing it must not stop the shutdown
                log.warning("could not save the length predictor's state: %s", e)
        for session in list(self.sessions):
            await self.delete_session(session)
        await self.registry.shutdown()
