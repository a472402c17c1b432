"""The FastAPI app of Parrot serve: sessions, variables, calls, engines, health and metrics.

Routes follow DESIGN.md's wire protocol (`parrot.protocol` bodies). Every error is
`{"error": {"type", "message"}}` with the status code of its class; nothing a client sends can make the
server stop serving others.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from parrot.protocol import (
    BatchGetAnswer,
    BatchRequest,
    CallError,
    CreateSessionRequest,
    CreateSessionResponse,
    CreateVariableRequest,
    Criteria,
    GetVariableResponse,
    SetVariableRequest,
    StepInfo,
    SubmitCallRequest,
    SubmitCallResponse,
    VariableCreated,
)
from parrot.template import TemplateError
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.cluster.openai_backend import OpenAIBackendConfig
from server.common.auth_first import AuthFirstMiddleware, GuardedRoute, guarded_routes, header_guard
from server.common.body_limit import BodyLimitMiddleware
from server.common.malloc_tuning import release_free_memory
from server.common.security import (
    AuthError,
    SecurityConfig,
    api_key_guard,
    auth_error_response,
    bearer_token,
    check_api_key,
    cluster_token_guard,
    install_auth_handler,
    requester,
)
from server.engine import EngineError
from server.engine.api import error_response
from server.engine.wire import (
    BackendRegistered,
    BackendRegistration,
    EngineHeartbeat,
    EngineHeartbeatAnswer,
    EngineRegistered,
    EngineRegistration,
    EngineStatus,
)
from server.http.openai_api import OpenAIAPIError, create_openai_router
from server.http.registration import EngineLimitError, HeartbeatError, heartbeat_problem, registration_refusal
from server.http.ui import create_ui_router
from server.serve.dag_view import step_info
from server.serve.errors import (
    BatchOpError,
    EngineRegistrationError,
    GetTimeoutError,
    NoEngineError,
    ServerDrainingError,
    SloRejectedError,
    UnknownEngineError,
)
from server.serve.graph import GraphError
from server.serve.manager import Manager
from server.serve.sessions import Session, SessionError
from server.serve.step_records import Histogram
from server.serve.streams import STREAM_ANSWER, server_sent_events
from server.serve.variables import VariableError

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
# How often the server checks whether it went idle (then returns freed memory to the OS), and the routes
# whose answers count as work besides open sessions (heartbeats and health probes do not).
IDLE_CHECK_S = 2.0
_COMPLETION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})
_BATCH_ANSWER = (
    "NDJSON: a BatchApplied line once every operation is applied, then (with a get) a BatchGetAnswer line"
)

# Each error class knows its status (``http_status``, ``error_type``); the template errors get theirs here.
_TYPED: tuple[type[Exception], ...] = (
    SessionError,
    VariableError,
    GraphError,
    EngineError,
    GetTimeoutError,
    NoEngineError,
    ServerDrainingError,
    SloRejectedError,
    UnknownEngineError,
    EngineRegistrationError,
    OpenAIAPIError,
    TemplateError,
    CallError,
    EngineLimitError,
    HeartbeatError,
)


# The OpenAI API's routes, as a client whose base URL lacks ``/v1`` asks for them.
_OPENAI_ROUTES = ("/chat/completions", "/completions", "/models", "/embeddings", "/responses")


def openai_path_hint(path: str) -> str | None:
    """For a path that is an OpenAI route without its ``/v1`` prefix (a client's base URL that lacks it),
    the 404's message: where the route is and what base URL to give; None for any other path."""
    route = path.rstrip("/")
    if not any(route == r or route.startswith(r + "/") for r in _OPENAI_ROUTES):
        return None
    return (
        f"no route {path}: the OpenAI-compatible API is under /v1 ({'/v1' + route}); give clients the "
        "base URL http://HOST:PORT/v1"
    )


def _with_retry_after(response: JSONResponse, exc: BaseException) -> JSONResponse:
    """A refusal that passes with time (a quota: ``retry_after`` seconds) says when to retry."""
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return response


def _classify(exc: Exception) -> tuple[int, str]:
    """The status code and error type answering ``exc`` (500 for anything untyped: a server bug)."""
    if isinstance(exc, TemplateError):
        return 400, "bad_template"
    if isinstance(exc, CallError):
        return 400, "bad_call"
    if isinstance(exc, _TYPED):
        return exc.http_status, getattr(exc, "error_type", type(exc).__name__)  # type: ignore[attr-defined]
    return 500, "internal_error"


def _refusal(exc: Exception) -> JSONResponse | None:
    """The answer to a guard's refusal before the route runs (None: not a typed refusal)."""
    if isinstance(exc, AuthError):
        return auth_error_response(exc)
    if isinstance(exc, _TYPED):
        return _with_retry_after(error_response(*_classify(exc), str(exc)), exc)
    return None


def _histogram(name: str, documentation: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation)
    family.add_metric([], histogram.buckets(), histogram.total)
    return family


class _ManagerCollector(Collector):
    """Prometheus gauges read from the manager and engines at scrape time (no global registry)."""

    def __init__(self, manager: Manager, requests: Counter[tuple[str, str]]) -> None:
        self.manager = manager
        self.requests = requests

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        served = CounterMetricFamily(
            "parrot_http_requests", "HTTP requests answered, by method and route", labels=["method", "route"]
        )
        for (method, route), n in sorted(self.requests.items()):
            served.add_metric([method, route], n)
        yield served
        sessions = GaugeMetricFamily("parrot_sessions", "Live sessions")
        sessions.add_metric([], len(self.manager.sessions))
        yield sessions
        steps = self.manager.steps
        yield _histogram(
            "parrot_step_queue_seconds", "Steps' time from dispatch to their engine", steps.queue_s
        )
        yield _histogram("parrot_step_run_seconds", "Steps' time on their engine", steps.run_s)
        yield _histogram(
            "parrot_step_prefill_tokens_saved",
            "Prompt tokens a step forked instead of computing",
            steps.prefill_saved,
        )
        fields = {
            "blocks_used": "KV blocks in use",
            "blocks_total": "KV blocks in the cache",
            "running": "Requests running",
            "waiting": "Requests waiting",
            "prefill_tokens_computed": "Prompt tokens computed since start",
            "decode_tokens_computed": "Generated tokens computed since start",
        }
        families = {
            k: GaugeMetricFamily(f"parrot_engine_{k}", v, labels=["engine"]) for k, v in fields.items()
        }
        for i, engine in enumerate(self.manager.engines):
            stats = engine.stats()
            for k, family in families.items():
                family.add_metric([str(i)], getattr(stats, k))
        yield from families.values()


@header_guard
async def _session(request: Request) -> Session:
    """The authenticated session of a session-scoped route (401/403/404 otherwise), checked before the
    body is read (`server.common.auth_first`).

    ``async`` although it does no I/O: FastAPI would run a plain function on its thread pool, a thread hop
    per request for a dictionary lookup (and one the simulator's virtual clock cannot see).
    """
    token = bearer_token(request.headers.get("authorization"))
    return request.app.state.manager.session(request.path_params["session_id"], token)


SessionDep = Annotated[Session, Depends(_session)]


class RequestCounter:
    """Counts every HTTP request by method and route path into ``counts`` (``/metrics``). Plain ASGI: no
    task and no copy of the response stream per request, as a ``BaseHTTPMiddleware`` costs."""

    def __init__(self, app: ASGIApp, counts: Counter[tuple[str, str]]) -> None:
        self.app, self.counts = app, counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":  # counted as it answers, before its body
                route = scope.get("route")  # set by the router while it handled the request
                self.counts[scope["method"], getattr(route, "path", "<unrouted>")] += 1
            await send(message)

        await self.app(scope, receive, counted)


def _owner(request: Request) -> tuple[str, str | None]:
    """Who opens a session, for the sessions-per-client quota — its tenant where the server has API keys,
    else the client's address — and that tenant (None without keys), whose sessions share cached prefixes
    by default and with no other tenant's (`tenant_of`: the salt a session without its own gets)."""
    return requester(request), getattr(request.state, "tenant", None)


@header_guard
async def _batch_session(request: Request) -> None:
    """A batch reaches its session with that session's token; one that would create the session (no session
    has its id yet) needs an API key too when the server has keys (`--api-key`), sent as ``X-API-Key``
    beside the client-chosen session token."""
    if request.path_params["session_id"] in request.app.state.manager.sessions:
        await _session(request)
    else:
        request.state.tenant = check_api_key(request, request.app.state.security.api_keys)


def create_app(
    manager: Manager, reap_interval: float | None = None, security: SecurityConfig | None = None
) -> FastAPI:
    """The service app over ``manager``; expired sessions are reaped in the background.

    ``security`` holds the cluster token that engine routes require and the API keys of the OpenAI routes;
    None: a fresh random cluster token (no remote engine can join unless given it: ``app.state.security``)
    and open OpenAI routes.
    """
    security = security if security is not None else SecurityConfig.generated()
    interval = (
        reap_interval if reap_interval is not None else max(1.0, min(30.0, manager.config.session_ttl / 4))
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()  # the manager's loop, for `LaunchedServer.run`

        async def reap() -> None:
            while True:
                await asyncio.sleep(interval)
                await manager.expire_sessions()

        async def watch_engines() -> None:
            while True:
                await asyncio.sleep(manager.config.heartbeat_interval)
                await manager.check_engines()

        async def release_memory_when_idle() -> None:
            # Work frees memory that the tuned allocator keeps (`server.common.malloc_tuning`); once the
            # server is
            # idle again (no session open, no completion answered for a while) it goes back to the OS.
            busy, answered = False, 0
            while True:
                await asyncio.sleep(IDLE_CHECK_S)
                now = sum(n for (_, path), n in requests.items() if path in _COMPLETION_ROUTES)
                if len(manager.sessions) or now != answered:
                    busy, answered = True, now
                elif busy:
                    busy = False
                    gc.collect()  # cycles (tasks, tracebacks) of the finished work, before the trim
                    await asyncio.to_thread(release_free_memory)

        background = [
            asyncio.create_task(reap()),
            asyncio.create_task(watch_engines()),
            asyncio.create_task(release_memory_when_idle()),
        ]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await manager.shutdown()

    app = FastAPI(title="Parrot serve", version="1", lifespan=lifespan)
    app.state.manager = manager
    app.state.security = security
    cluster_only = [Depends(cluster_token_guard(security.cluster_token))]
    joining = 0  # registrations under way (they count against the engine limit while they fetch)
    # Requests answered per (method, route template): what "one round trip per get" is counted with.
    app.state.request_counts = requests = Counter[tuple[str, str]]()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_ManagerCollector(manager, requests))

    @app.exception_handler(RequestValidationError)
    async def _schema(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(422, "invalid_schema", details)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        hint = openai_path_hint(request.url.path) if exc.status_code == 404 else None
        return error_response(exc.status_code, "http_error", hint or str(exc.detail))

    for cls in _TYPED:

        @app.exception_handler(cls)
        async def _typed(_: Request, exc: Exception) -> JSONResponse:
            return _with_retry_after(error_response(*_classify(exc), str(exc)), exc)

    install_auth_handler(app)

    @app.exception_handler(BatchOpError)
    async def _batch_op(_: Request, exc: BatchOpError) -> JSONResponse:
        status, error_type = _classify(exc.cause)
        if status >= 500:  # not the client's fault: keep the traceback in the server log
            log.error("batch operation %d failed", exc.index, exc_info=exc.cause)
        return _with_retry_after(error_response(status, error_type, str(exc), op_index=exc.index), exc.cause)

    app.add_middleware(RequestCounter, counts=requests)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES)  # chunked bodies too
    # Outermost: a request without its route's credential is refused before any body is read.
    guarded: list[GuardedRoute] = []  # every route with its guards: filled below, once all exist
    app.add_middleware(AuthFirstMiddleware, routes=guarded, refusal=_refusal)
    # The API key guards every generating route: the OpenAI routes here, where they are mounted, and the
    # opening of a session (whose token then guards the session's routes); none configured: open.
    require_api_key = api_key_guard(security.api_keys)
    with_api_key = [Depends(require_api_key)]
    openai_router = create_openai_router(manager.openai)
    app.include_router(openai_router, dependencies=with_api_key)

    ui_router = create_ui_router(manager, security.cluster_token)
    app.include_router(ui_router)  # /ui and the routes it reads

    @app.get("/health", responses={503: {"description": "the process is up but no engine is in service"}})
    async def health() -> JSONResponse:
        """200 while an engine is in service; else 503 with the typed error body (``no_engine``) — the
        process answers either way, so a manager started with ``--engines 0`` is up before engines join."""
        serving = len(manager.registry.in_service_ids())
        body: dict[str, Any] = {
            "status": "ok" if serving else "no_engine",
            "engines": len(manager.engines),
            "engines_in_service": serving,
            "sessions": len(manager.sessions),
        }
        if serving:
            return JSONResponse(body)
        known = f" (of {len(manager.engines)}: failed, draining or silent)" if manager.engines else ""
        message = (
            f"no engine is in service{known}: start one (python -m server.engine --manager URL) or run the "
            "server with --engines N"
        )
        body["error"] = {"type": NoEngineError.error_type, "message": message}
        return JSONResponse(body, status_code=503)

    @app.get(
        "/health/ready",
        responses={503: {"description": "draining (shutting down), or no engine is in service"}},
    )
    async def ready() -> JSONResponse:
        """Readiness, for a load balancer: 503 once the server drains (it finishes what runs and takes no
        new work) or while no engine is in service; else `health`'s 200. ``/health`` stays liveness."""
        if manager.draining:
            message = "the server is draining: it finishes what runs and takes no new work"
            error = {"type": ServerDrainingError.error_type, "message": message}
            return JSONResponse({"status": "draining", "error": error}, status_code=503)
        return await health()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/engines", dependencies=cluster_only)
    async def engines() -> list[EngineStatus]:
        """Every engine with its stats (for the cluster token's holder)."""
        return manager.engine_status()

    @app.post("/v1/engines", dependencies=cluster_only)
    async def register_engine(req: EngineRegistration) -> EngineRegistered:
        """A remote engine joins (``python -m server.engine --manager URL``); the manager calls it back."""
        nonlocal joining
        refusal = registration_refusal(
            manager.engine_status(), req.name, joining, security.max_remote_engines
        )
        if refusal is not None:
            raise EngineLimitError(refusal)
        joining += 1
        try:
            return await manager.registry.register(req, cluster_token=security.cluster_token)
        finally:
            joining -= 1

    @app.post("/v1/backends", dependencies=cluster_only)
    async def add_backend(req: BackendRegistration) -> BackendRegistered:
        """An OpenAI-compatible server joins as an engine (`server.cluster.openai_backend`); the manager reads
        its model and checks its tokenizer before answering."""
        nonlocal joining
        refusal = registration_refusal(manager.engine_status(), "", joining, security.max_remote_engines)
        if refusal is not None:
            raise EngineLimitError(refusal)
        joining += 1
        try:
            config = OpenAIBackendConfig(
                req.url,
                model=req.model,
                tokenizer=req.tokenizer,
                capacity_tokens=req.capacity_tokens,
                latency_cap_tokens=req.latency_cap_tokens,
                max_model_len=req.max_model_len,
                priority=req.priority,
            )
            engine_id = await manager.registry.add_openai_backend(config)
        finally:
            joining -= 1
        return BackendRegistered(engine_id=engine_id, model=manager.engines[engine_id].model_name)

    @app.post("/v1/engines/{engine_id}/heartbeat", dependencies=cluster_only)
    async def heartbeat(engine_id: int, req: EngineHeartbeat) -> EngineHeartbeatAnswer:
        engine = manager.registry.remote_engine(engine_id)
        if engine is not None:  # any other id is the manager's 404
            problem = heartbeat_problem(req.stats, engine.stats())
            if problem is not None:
                raise HeartbeatError(f"heartbeat of engine {engine_id} refused: {problem}")
        manager.registry.heartbeat(engine_id, req.stats)
        return EngineHeartbeatAnswer(steps_running=manager.placement.running_steps(engine_id))

    @app.delete("/v1/engines/{engine_id}", status_code=204, dependencies=cluster_only)
    async def unregister_engine(engine_id: int) -> Response:
        await manager.registry.unregister(engine_id)
        return Response(status_code=204)

    @app.post("/v1/sessions", dependencies=with_api_key)
    async def create_session(
        request: Request, req: CreateSessionRequest | None = None
    ) -> CreateSessionResponse:
        client, tenant = _owner(request)
        salt = req.cache_salt if req is not None and req.cache_salt is not None else tenant
        return manager.create_session(salt, client=client)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete_session(s: SessionDep) -> Response:
        await manager.delete_session(s)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/variables")
    async def create_variable(s: SessionDep, req: CreateVariableRequest) -> VariableCreated:
        return manager.create_variable(s, req)

    @app.put("/v1/sessions/{session_id}/variables/{var_id}")
    async def set_variable(s: SessionDep, var_id: str, req: SetVariableRequest) -> GetVariableResponse:
        return manager.set_variable(s, var_id, req.value)

    @app.get("/v1/sessions/{session_id}/variables/{var_id}")
    async def get_variable(
        s: SessionDep,
        var_id: str,
        criteria: Criteria | None = None,
        timeout: Annotated[float | None, Query(ge=0)] = None,
    ) -> GetVariableResponse:
        return await manager.get_variable(s, var_id, criteria, timeout)

    @app.get(
        "/v1/sessions/{session_id}/variables/{var_id}/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": STREAM_ANSWER}},
    )
    async def stream_variable(
        s: SessionDep,
        var_id: str,
        criteria: Criteria | None = None,
        timeout: Annotated[float | None, Query(ge=0)] = None,
    ) -> StreamingResponse:
        """The producing step's text as it is written (from the beginning), then the variable's answer."""
        items = await manager.variable_text(s, var_id, criteria, timeout)  # errors: a status, not a stream
        return StreamingResponse(server_sent_events(items), media_type="text/event-stream")

    @app.get("/v1/sessions/{session_id}/steps")
    async def steps(s: SessionDep) -> list[StepInfo]:
        """Every step the session dispatched, in order: where it ran, for which objective, how long it
        queued and ran, how many prompt tokens sharing saved it."""
        return [step_info(r) for r in manager.steps.by_session.get(s.session_id, [])]

    @app.post("/v1/sessions/{session_id}/calls")
    async def submit_call(s: SessionDep, req: SubmitCallRequest) -> SubmitCallResponse:
        return manager.submit_call(s, req)

    @app.post(
        "/v1/sessions/{session_id}/batch",
        dependencies=[Depends(_batch_session)],
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}, "description": _BATCH_ANSWER}},
    )
    async def batch(
        request: Request,
        session_id: str,
        req: BatchRequest,
        authorization: Annotated[str | None, Header()] = None,
    ) -> StreamingResponse:
        """Apply operations in order, then wait for one variable: a whole DAG in one round trip — the
        session's creation too, with ``create`` (the client chose its id and token)."""
        client, tenant = _owner(request)
        create = req.create
        if create is not None and create.cache_salt is None and tenant is not None:
            create = create.model_copy(update={"cache_salt": tenant})
        s = manager.open_session(session_id, bearer_token(authorization), create, client=client)
        applied = await manager.apply_batch(s, req)  # before the answer starts: an error gets its own status

        async def lines() -> AsyncIterator[str]:
            yield applied.model_dump_json() + "\n"  # the client may send more as soon as it reads this
            if req.get is not None:
                answer = await manager.answer_get(s, req.get)
                yield BatchGetAnswer(get=answer).model_dump_json() + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    guarded += guarded_routes(app.router) + guarded_routes(openai_router, require_api_key)
    guarded += guarded_routes(ui_router)
    return app
