"""The manager: sessions, variables and calls over the dataflow graph, executed on the engines.

This is the I/O edge of `server.serve`: it owns the asyncio side (step tasks, long-poll waiters, the clock)
and drives the pure pieces — `SessionTable`, `SessionGraph`, the call IR, transforms — and the engines.

A step runs once it is ready (its inputs have values) and activated (a `get` reaches it, or its call came with
`criteria`). The executor renders the step's prompt, tokenizes it whole with the engine's tokenizer (so the
output equals `/v1/completions` on the same text), forks from the longest cached context whose tokens
prefix it (`PrefixStore`), fills the rest, generates, applies the output's transforms, sets the variable and
dispatches whatever that made runnable. Any failure fails the variable and everything downstream of it.

An engine that fails (`engine_unavailable`: unreachable, a broken stream, a dead loop) is taken out of
service at its first failure — no new work goes there, its cached contexts leave the prefix index — and the
steps that were running on it run again from their inputs on an engine in service (nothing of their output
was delivered), up to `ManagerConfig.max_step_retries` times. A draining engine gets no new work either;
what runs there finishes. The OpenAI endpoints' requests fail over the same way until they stream
(`retry_elsewhere`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from parrot.protocol import (
    BatchApplied,
    BatchCreateVariable,
    BatchGet,
    BatchRequest,
    BatchSetVariable,
    CallError,
    ClusterView,
    CreateSessionRequest,
    CreateSessionResponse,
    CreateVariableRequest,
    Criteria,
    EngineRegistered,
    EngineRegistration,
    EngineStats,
    EngineStatus,
    GetVariableResponse,
    SamplingConfig,
    SessionDag,
    SubmitCallRequest,
    SubmitCallResponse,
    VariableCreated,
)

from server.engine import EngineError, SamplingParams
from server.engine.errors import EngineDrainingError, EngineFailedError, engine_unavailable
from server.engine.interface import Engine
from server.engine.special_text import SpecialText
from server.serve.dag_view import engine_views, session_dag, session_summary
from server.serve.deduction import StepObjective, objective
from server.serve.errors import ModelNotFoundError
from server.serve.graph import SessionGraph, StepNode
from server.serve.ir import (
    CallIR,
    CallOutline,
    TextFill,
    build_call,
    input_vars,
    prefix_hashes,
    prompt_chars,
    render_prompt,
    text_before,
)
from server.serve.length_predictor import LengthPredictor
from server.serve.loop_slices import LoopSlices
from server.serve.mutel import Slo
from server.serve.openai_backend import OpenAIBackendConfig, OpenAIBackendEngine
from server.serve.output_lengths import PROMPT_TAIL_TOKENS, LengthEstimate, OutputLengths, template_key
from server.serve.placement import (
    NoServingEngineError,
    PinnedEngineGoneError,
    Placement,
    RequestTooLargeError,
)
from server.serve.prefix_store import Entry, Match, PrefixStore, common_prefix_len
from server.serve.quotas import (
    QuotaExceededError,
    Quotas,
    SessionUsage,
    check_call,
    check_session,
    check_stored,
    check_variables,
    tenant_tokens_refusal,
)
from server.serve.remote_engine import RemoteEngine
from server.serve.scheduler import EngineState, QueuedRequest, SchedulerConfig
from server.serve.sessions import Session, SessionTable, UnknownSessionError
from server.serve.slo_admission import admission
from server.serve.step_records import StepRecord, StepRecords, task_group_key
from server.serve.streams import Delta, Restart, StepTextStream
from server.serve.transform_runner import run_transforms
from server.serve.transforms import (
    TransformError,
    ValueKind,
    apply_transforms,
    render_value,
    validate_transforms,
)
from server.serve.variables import VariableTable

log = logging.getLogger(__name__)


class GetTimeoutError(Exception):
    """A `get` waited its whole timeout and the variable is still pending (504)."""

    http_status = 504
    error_type = "get_timeout"


class BatchOpError(Exception):
    """Operation ``index`` of a batch failed with ``cause`` (the answer carries the cause's status)."""

    def __init__(self, index: int, op: str, cause: Exception) -> None:
        super().__init__(f"batch operation {index} ({op}) failed: {cause}")
        self.index = index
        self.cause = cause


BATCH_SLICE = 256  # batch operations applied between two yields to the event loop
STEP_STARTS_PER_SLICE = 32  # steps that tokenize and queue in one event-loop iteration (`LoopSlices`)


class NoEngineError(Exception):
    http_status = 503
    error_type = "no_engine"


class SloRejectedError(Exception):
    """An OpenAI request refused at admission: its engine would miss the configured TTFT or TPOT objective
    (`ManagerConfig.slo`)."""

    http_status = 503
    error_type = "slo_rejected"


class ServerDrainingError(Exception):
    """The server is shutting down gracefully: it takes no new sessions, calls or OpenAI requests."""

    http_status = 503
    error_type = "server_draining"


class EngineRegistrationError(Exception):
    """A remote engine cannot be registered: its URL is not reachable or does not serve an engine."""

    http_status = 400
    error_type = "engine_registration"


class UnknownEngineError(Exception):
    """No engine by that id, or one taken out of service (the engine registers again)."""

    http_status = 404
    error_type = "unknown_engine"


class _AttemptFailed(Exception):
    """A step's attempt failed because its engine did (``cause``); the step may run again elsewhere."""

    def __init__(self, engine_index: int, cause: EngineError) -> None:
        super().__init__(str(cause))
        self.engine_index = engine_index
        self.cause = cause


@dataclass
class ManagerConfig:
    session_ttl: float = 600.0  # seconds without calls before a session and all it owns are freed
    quotas: Quotas = field(default_factory=Quotas)  # what one client / session may hold at once
    default_get_timeout: float = 60.0
    max_get_timeout: float = 300.0
    # Prompt prefixes at least this long (tokens) that several queued steps share (or a call's leading
    # constant text) become shared engine contexts.
    min_shared_prefix_tokens: int = 16
    max_cached_prefixes: int = 256  # per engine, every cache salt included; least recently used go first
    # Whether the OpenAI endpoints reuse cached prefixes and keep finished requests' KV (as vLLM's automatic
    # prefix caching does). Off: each request fills its whole prompt and frees its context — the
    # request-centric baseline of the benchmarks (the paper's vLLM without sharing).
    openai_prefix_cache: bool = True
    # Scheduling (server.serve.scheduler): tokens an engine runs at once (None: its KV cache in tokens),
    # and at most while it runs latency-critical work; rounds before a waiting step goes first.
    engine_capacity_tokens: int | None = None
    # Steps placed on one engine at once; None: twice the batch it reports (`EngineStats.max_num_seqs`),
    # enough to keep it fed, and no count cap for an engine that does not say. The rest wait in the
    # manager's queue, where tenants and apps take turns (`fair_ranks`); in the engine's, tenants take turns
    # too (each fill and generate carries its session's tenant).
    engine_max_steps: int | None = None
    latency_cap_tokens: int = 4096
    aging_rounds: int = 8
    # Whether the scheduler sees shared prefixes and cached contexts (off: an ablation, where steps go by
    # objective and load alone; engines still reuse what they happen to hold).
    prefix_affinity: bool = True
    # How much busier (tokens, and 1.5x) an OpenAI backend running a request's prefix may be and still
    # draw that request when it comes alone (`SchedulerConfig.prefix_slack_tokens`).
    prefix_slack_tokens: int = 4096
    # Whether steps share KV at all (off: an ablation, "Parrot without sharing"): no shared constant-prefix
    # contexts, no forking from cached contexts, and a finished step's context is freed at once (nothing
    # could fork it), so every step fills its whole prompt, as a request-centric service does.
    prefix_sharing: bool = True
    # "eager": a step runs as soon as its inputs are ready (throughput-preferred until a get reaches it);
    # "lazy": only once a get (or a call's criteria) activates it — the paper's behaviour, for ablations.
    dispatch: Literal["eager", "lazy"] = "eager"
    # Remote engines send a heartbeat this often; one silent for `engine_timeout` is out of service.
    heartbeat_interval: float = 2.0
    engine_timeout: float = 10.0
    # The most characters a step's rendered prompt may have: checked from its texts' and values' lengths
    # before rendering (an input repeated in a template multiplies its value), far above any model's window.
    max_prompt_chars: int = 1 << 20
    # How many times a step (or an OpenAI request that has streamed nothing) whose engine failed runs again
    # on another engine before it fails naming the engines.
    max_step_retries: int = 2
    # SSJF: predict each step's and OpenAI request's output length (`server.serve.output_lengths`) and send it
    # as the engine priority (used by engines running scheduling="sjf"); off: no priorities are sent. The
    # predictor's state is loaded from and saved (at shutdown) to `length_predictor_path` when given.
    length_prediction: bool = True
    length_predictor_path: str | None = None
    # Admission by predicted length (SSJF §6): a step counts against an engine's capacity with its predicted
    # output times this margin (at most max_tokens) instead of max_tokens; None: max_tokens, as before.
    admit_by_predicted_length: float | None = None
    # Mutel's early rejection (`server.serve.mutel.admit`): an OpenAI request whose engine's predicted time
    # to first token or time per output token misses these P90 objectives is refused at once with a 503
    # (`slo_rejected`, saying which and by how much) instead of queueing; None: every request is admitted.
    # On prefill + decode pairs it also sizes the prefill engine's chunks to the TPOT objective.
    slo: Slo | None = None

    def __post_init__(self) -> None:
        margin = self.admit_by_predicted_length
        if margin is not None and not (math.isfinite(margin) and margin >= 1.0):
            raise ValueError(
                f"admit_by_predicted_length is the margin over the predicted output length (a number >= 1, "
                f"e.g. 1.5), or None to count max_tokens; got {margin!r}"
            )
        if self.prefix_slack_tokens < 0:
            raise ValueError(
                f"prefix_slack_tokens is how many tokens busier a backend may be and still draw a request of "
                f"a prefix it runs (a number >= 0, e.g. 4096); got {self.prefix_slack_tokens!r}"
            )


@dataclass
class _RemoteLink:
    """A registered remote engine and its liveness."""

    engine: RemoteEngine
    name: str
    url: str
    last_heartbeat: float
    alive: bool = True
    # No new work, what runs finishes: the engine announced a graceful shutdown (its heartbeat's stats, a
    # draining error), or an operator held it (`Manager.set_draining`). A heartbeat changes only the first.
    announced_drain: bool = False
    held: bool = False

    @property
    def draining(self) -> bool:
        return self.announced_drain or self.held


@dataclass
class _Prepared:
    """A dispatched step's prompt, rendered at dispatch: its text, its cache namespace ("" shared by all
    sessions, else a salt's), the namespaced prefix hash at each segment boundary (counted in flight while
    the step runs) and, for a later step of a call, what the earlier steps left."""

    prompt: str
    namespace: str
    boundaries: list[tuple[int, str]]
    progress: _CallProgress | None
    specials: SpecialText  # the model's special-token strings, masked in the values (`SpecialText.mask`)
    refusal: str | None = None  # why the step fails instead of running (its prompt was not rendered)


@dataclass
class _CallProgress:
    """What a multi-step call's next step needs from the steps before it."""

    engine: int
    raw_outputs: dict[str, str]  # var_id -> generated text of every step of the call so far


class Manager:
    """Serves sessions on its engines (`Engine`, any kind): those given at construction, `RemoteEngine`s
    that register over HTTP (`register_engine`) and OpenAI-compatible servers added as engines
    (`add_openai_backend`). An engine's id is its index in ``engines``; a remote engine that stops sending
    heartbeats stays in the list, out of service."""

    def __init__(
        self,
        engines: Sequence[Engine],
        config: ManagerConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engines: list[Engine] = list(engines)
        self._remote: dict[int, _RemoteLink] = {}
        self.config = config or ManagerConfig()
        self._clock = clock
        self.sessions = SessionTable(self.config.session_ttl)
        self._context_ids = itertools.count(1)
        # Every context the manager keeps (shared constant prefixes, finished steps) is an entry here, so a
        # request forks from the longest one its tokens extend; least recently used ones are freed.
        self._prefixes = PrefixStore(engines[0].block_size if engines else 16)
        self.placement = Placement(
            self._engine_states, SchedulerConfig(self.config.aging_rounds, self.config.prefix_slack_tokens)
        )
        self._prefix_fills: dict[tuple[str, tuple[int, ...]], asyncio.Future[None]] = {}
        # Prefix hash -> dispatched steps (not finished) whose prompt has a segment boundary there.
        self._inflight: Counter[str] = Counter()
        self._special_texts: dict[str, SpecialText] = {}  # per model: its tokenizer's special strings
        # Engine index -> OpenAI requests' contexts routed there and not finished: an engine's stats lag
        # behind a burst (a request counts there only once its fill reaches the engine).
        self._openai_routed: Counter[int] = Counter()
        self._openai_tokens: Counter[str] = Counter()  # tenant -> tokens of its running OpenAI requests
        self._step_starts = LoopSlices(STEP_STARTS_PER_SLICE)
        self._dispatch_pending: set[str] = set()
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}
        self.draining = False  # `drain` began: new work is refused, running steps finish
        self._waiters: dict[tuple[str, str], asyncio.Event] = {}
        # Each generated variable's text as it is written, by (session, variable): `variable_text`.
        self._texts: dict[tuple[str, str], StepTextStream] = {}
        # What happened to each step (`step_records`), and the records of the steps running now.
        self.steps = StepRecords()
        self._records: dict[tuple[str, int], StepRecord] = {}
        self._calls: dict[tuple[str, str], _CallProgress] = {}  # (session, call) of multi-step calls
        # Engines (local or remote) taken out of service by a failure; ids are never reused, so a remote
        # engine that registers again is a new id and serves as new.
        self._failed: set[int] = set()
        self._cleanups: set[asyncio.Task[None]] = set()  # a retired engine's best-effort frees
        self.lengths = (
            OutputLengths(self.config.length_predictor_path) if self.config.length_prediction else None
        )

    # ------------------------------------------------------------------------------------------ engines
    async def register_engine(
        self, req: EngineRegistration, cluster_token: str | None = None
    ) -> EngineRegistered:
        """Add the remote engine at ``req.url`` (its model and tokenizer are read from it first). An engine
        registering again under its name or at its URL (restarted, renamed) replaces its old entry, which
        goes out of service.
        ``cluster_token`` goes with every call the manager makes to the engine."""
        try:
            engine = await RemoteEngine.connect(req.url, req.name, token=cluster_token)
        except (EngineError, httpx.InvalidURL, httpx.UnsupportedProtocol, ValueError) as e:
            raise EngineRegistrationError(
                f"cannot register engine {req.name!r}: {e} — give a URL where this manager reaches the "
                "engine's HTTP API (python -m server.engine --public-url)"
            ) from e
        for engine_id, link in list(self._remote.items()):
            if (link.name == req.name or link.url == engine.url) and link.alive:
                await self._retire(engine_id, "it registered again")
        self.engines.append(engine)
        engine_id = len(self.engines) - 1
        self._remote[engine_id] = _RemoteLink(engine, req.name, engine.url, self._clock())
        self.placement.engines_changed()  # steps waiting for an engine of its model may go now
        log.info("engine %d (%s, %s) registered from %s", engine_id, req.name, engine.model_name, req.url)
        return EngineRegistered(
            engine_id=engine_id,
            heartbeat_interval_s=self.config.heartbeat_interval,
            timeout_s=self.config.engine_timeout,
        )

    async def add_openai_backend(self, config: OpenAIBackendConfig) -> int:
        """Add the OpenAI-compatible server ``config`` names as an engine (its model and context window are
        read from it, its tokenizer checked against it first); returns its engine id. One already in service
        at that URL is refused (`EngineRegistrationError`), as is one that cannot be reached or used."""
        url = config.url.rstrip("/")
        serving = [i for i, e in enumerate(self.engines) if e.url == url and i not in self._failed]
        if serving:
            raise EngineRegistrationError(f"the OpenAI backend at {url} is engine {serving[0]} already")
        try:
            backend = await asyncio.to_thread(OpenAIBackendEngine.connect, config)
        except (EngineError, httpx.HTTPError, ValueError) as e:
            raise EngineRegistrationError(f"cannot add the OpenAI backend at {url}: {e}") from e
        self.engines.append(backend)
        self.placement.engines_changed()  # steps waiting for an engine of its model may go now
        log.info("engine %d: the OpenAI backend at %s (%s)", len(self.engines) - 1, url, backend.model_name)
        return len(self.engines) - 1

    def remote_engine(self, engine_id: int) -> RemoteEngine | None:
        """The registered remote engine ``engine_id`` (in service or not), or None for any other id."""
        link = self._remote.get(engine_id)
        return None if link is None else link.engine

    def heartbeat(self, engine_id: int, stats: EngineStats) -> None:
        """A remote engine is alive; record its load. An engine out of service must register again."""
        link = self._remote.get(engine_id)
        if link is None or not link.alive:
            raise UnknownEngineError(
                f"engine {engine_id} is not registered (or was taken out of service): register again "
                "with POST /v1/engines"
            )
        link.last_heartbeat = self._clock()
        link.engine.update_stats(stats)
        # An engine announces a graceful shutdown in its stats (`server.engine.draining`): it gets no new
        # work from now on.
        if stats.draining != link.announced_drain:
            self._drain(engine_id, link, announced=stats.draining)

    def set_draining(self, engine_id: int, draining: bool = True) -> None:
        """Hold a remote engine (no new work is placed there; what runs there finishes), or release it: an
        operator's decision, which the engine's heartbeats do not undo."""
        link = self._remote.get(engine_id)
        if link is None or not link.alive:
            raise UnknownEngineError(f"engine {engine_id} is not a registered remote engine in service")
        self._drain(engine_id, link, held=draining)

    def _drain(
        self, engine_id: int, link: _RemoteLink, *, announced: bool | None = None, held: bool | None = None
    ) -> None:
        was = link.draining
        link.announced_drain = link.announced_drain if announced is None else announced
        link.held = link.held if held is None else held
        if link.draining != was:
            what = "is draining" if link.draining else "serves again"
            log.info("engine %d (%s) %s", engine_id, link.name, what)
            self.placement.engines_changed()

    async def unregister_engine(self, engine_id: int) -> None:
        """A remote engine leaves (it is shutting down)."""
        link = self._remote.get(engine_id)
        if link is None or not link.alive:
            raise UnknownEngineError(f"engine {engine_id} is not a registered remote engine in service")
        await self._retire(engine_id, "it unregistered")

    async def check_engines(self) -> list[int]:
        """Take out of service every remote engine silent for longer than the timeout (returns their ids),
        and put back every OpenAI backend taken out by a failure that answers again."""
        await self._recover_backends()
        now = self._clock()
        silent = [
            i
            for i, link in self._remote.items()
            if link.alive and now - link.last_heartbeat > self.config.engine_timeout
        ]
        for engine_id in silent:
            await self._retire(engine_id, f"no heartbeat for {self.config.engine_timeout:g}s")
        return silent

    async def _recover_backends(self) -> None:
        for engine_id in sorted(self._failed):
            if engine_id not in self._remote and await self.engines[engine_id].back_in_service():
                self._failed.discard(engine_id)
                self.placement.engines_changed()
                log.warning("%s is back in service: it answers again", self.engine_name(engine_id))

    def engine_status(self) -> list[EngineStatus]:
        """Every engine, local or remote, with its liveness and stats (``GET /v1/engines``)."""
        out = []
        for i, engine in enumerate(self.engines):
            link = self._remote.get(i)
            name = link.name if link is not None else engine.name or f"local-{i}"
            url = link.url if link is not None else engine.url
            alive = (link is None or link.alive) and i not in self._failed
            out.append(EngineStatus(engine_id=i, name=name, url=url, alive=alive, stats=engine.stats()))
        return out

    def engines_in_service(self) -> list[int]:
        """The engines new work may be placed on (``GET /health`` counts them; with none, work is refused)."""
        return [i for i in range(len(self.engines)) if self._in_service(i)]

    def _in_service(self, engine_id: int) -> bool:
        """Whether new work may be placed on the engine: not failed and, if remote, alive and not draining."""
        if engine_id in self._failed:
            return False
        link = self._remote.get(engine_id)
        return link is None or (link.alive and not link.draining)

    def _reachable(self, engine_id: int) -> bool:
        """Whether the engine may still be called (a draining one is: what runs there finishes)."""
        link = self._remote.get(engine_id)
        return engine_id not in self._failed and (link is None or link.alive)

    def engine_name(self, engine_id: int) -> str:
        """How messages name an engine: its id, name and URL."""
        link = self._remote.get(engine_id)
        if link is not None:
            return f"engine {engine_id} ({link.name} at {link.url})"
        return f"engine {engine_id} ({self.engines[engine_id].name or f'local-{engine_id}'})"

    async def engine_failed(self, engine_id: int, error: BaseException) -> None:
        """A request to the engine failed because of the engine (`engine_unavailable`). A draining engine
        only stops taking work; any other is taken out of service at once: nothing more is placed there,
        its cached contexts leave the prefix index, and what runs there fails over (a remote engine's
        connections are closed). A remote engine comes back only by registering again, as a new engine."""
        if getattr(error, "error_type", None) == EngineDrainingError.error_type:
            if engine_id in self._remote and self._reachable(engine_id):
                self._drain(engine_id, self._remote[engine_id], announced=True)
            return
        if engine_id in self._failed:
            return
        self._failed.add(engine_id)
        if engine_id in self._remote:
            if self._remote[engine_id].alive:  # else already retired (timed out, left): nothing more to do
                await self._retire(engine_id, f"a request to it failed: {error}", cleanup=True)
            return
        log.warning("%s is out of service: %s", self.engine_name(engine_id), error)
        forgotten = self._forget_contexts(engine_id)
        engine = self.engines[engine_id]
        if engine.frees_after_failure:  # its kept contexts live here: drop them
            for context_id in forgotten:
                with contextlib.suppress(EngineError):
                    await engine.free_context(context_id)
        self.placement.engines_changed()

    def _forget_contexts(self, engine_id: int) -> list[int]:
        """Take the engine's kept contexts out of the prefix index (every namespace); returns their ids."""
        entries = [e for key in self._store_keys(engine_id) for e in self._prefixes.remove_engine(key)]
        return [e.context_id for e in entries]

    async def _retire(self, engine_id: int, why: str, *, cleanup: bool = False) -> None:
        """Take a remote engine out of service. With ``cleanup`` (an engine suspected of failing, which
        may well be alive), its kept contexts are freed there in the background, best effort and bounded
        by ``engine_timeout``, before its connections close; otherwise they close at once."""
        link = self._remote[engine_id]
        link.alive = False
        log.warning("%s is out of service: %s", self.engine_name(engine_id), why)
        context_ids = self._forget_contexts(engine_id)
        self.placement.engines_changed()
        engine = link.engine
        if not cleanup or not context_ids:
            await engine.aclose()
            return
        task = asyncio.get_running_loop().create_task(self._free_then_close(engine, context_ids))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _free_then_close(self, engine: RemoteEngine, context_ids: list[int]) -> None:
        try:
            async with asyncio.timeout(self.config.engine_timeout):
                for context_id in context_ids:
                    try:
                        await engine.free_context(context_id)
                    except EngineError as e:
                        if engine_unavailable(e):
                            return  # the engine is gone: so is what it held
        except TimeoutError:
            pass
        finally:
            await engine.aclose()  # closing aborts whatever still runs there: it fails over

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
        self._refuse_if_draining("sessions")
        check_session(self.config.quotas, client or "(unknown)", self.sessions.open_by(client))
        now = self._clock()
        session = self.sessions.create(now, cache_salt, client, session_id=session_id, token=token)
        self._tasks[session.session_id] = set()
        return session

    def session(self, session_id: str, token: str | None) -> Session:
        return self.sessions.authenticate(session_id, token, self._clock())

    async def delete_session(self, session: Session) -> None:
        """Cancel the session's pending work, fail its pending variables and free its engine contexts."""
        self.sessions.remove(session.session_id)
        tasks = self._tasks.pop(session.session_id, set())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        session.graph.cancel_all("the session was deleted")
        for key in [k for k in self._calls if k[0] == session.session_id]:
            del self._calls[key]
        for key in [k for k in self._waiters if k[0] == session.session_id]:
            self._waiters.pop(key).set()
        for key in [k for k in self._texts if k[0] == session.session_id]:
            self._texts.pop(key).close()
        self.steps.drop_session(session.session_id)

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
        self._settled(session, var_id)
        self._dispatch(session)
        return _response(session.graph.variables, var_id)

    async def get_variable(
        self, session: Session, var_id: str, criteria: Criteria | None, timeout: float | None
    ) -> GetVariableResponse:
        """Long poll: activate what ``var_id`` needs, then wait until it is ready or failed."""
        graph = session.graph
        graph.activate(var_id, criteria)
        self._dispatch(session)
        if not graph.variables.get(var_id).settled:
            wait = self.config.default_get_timeout if timeout is None else timeout
            event = self._waiters.setdefault((session.session_id, var_id), asyncio.Event())
            try:
                with self.sessions.waiting(session, self._clock):  # not idle while a get waits on it
                    await asyncio.wait_for(event.wait(), min(wait, self.config.max_get_timeout))
            except TimeoutError:
                raise GetTimeoutError(
                    f"variable {var_id!r} is still pending after {wait:g}s: its producer has not finished "
                    "(or an input it needs was never set); get it again or set the missing input"
                ) from None
        return _response(graph.variables, var_id)

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
        graph = session.graph
        graph.variables.get(var_id)  # an unknown variable is a 404 before the stream starts
        if not watch:
            graph.activate(var_id, criteria)
            self._dispatch(session)
        key = (session.session_id, var_id)
        text = self._texts.setdefault(key, StepTextStream())
        if graph.variables.get(var_id).settled:
            text.close()  # (a value set by the client, or a failure before any step ran: no text)
        wait = min(
            self.config.default_get_timeout if timeout is None else timeout, self.config.max_get_timeout
        )
        return self._follow(session, var_id, text, wait, hold=not watch)

    async def _follow(
        self, session: Session, var_id: str, text: StepTextStream, wait: float, hold: bool
    ) -> AsyncIterator[Delta | Restart | GetVariableResponse]:
        var = session.graph.variables.get(var_id)
        if not text.started and var.status == "ready" and var.kind == "text" and var.value:
            yield Delta(var.value)  # a value the client set: no step wrote it, it is its own text
        deltas = text.deltas()
        deadline = time.monotonic() + wait
        busy = self.sessions.waiting(session, self._clock) if hold else contextlib.nullcontext()
        with busy:  # not idle while its client reads it
            try:
                while True:
                    yield await asyncio.wait_for(anext(deltas), max(0.0, deadline - time.monotonic()))
            except (StopAsyncIteration, TimeoutError):
                pass  # ended, or still pending at the deadline: the answer below says which
            finally:
                await deltas.aclose()
        yield _response(session.graph.variables, var_id)

    def session_dag(self, session: Session) -> SessionDag:
        """``session``'s calls, steps and variables as the live view shows them (`dag_view`)."""
        return session_dag(session, self.steps.by_session.get(session.session_id, []))

    def variable_snapshot(self, session: Session, var_id: str) -> GetVariableResponse:
        """``var_id``'s state now, activating nothing (the live view's click on a variable)."""
        return _response(session.graph.variables, var_id)

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
        self._refuse_if_draining("calls")
        graph = session.graph
        self._serving(req.model)  # an unknown model is the submitter's error, not a failed variable
        for placeholder in req.placeholders:  # a pattern RE2 cannot run is the submitter's error (400)
            validate_transforms(placeholder.transforms)
        outputs = {p.name: p.var_id or VariableTable.new_id() for p in req.placeholders if p.role == "output"}
        call = build_call(req, outputs)
        chars = prompt_chars(call, len(call.steps) - 1, {})  # its text and literal values: known now
        if chars > self.config.max_prompt_chars:
            raise CallError(self._prompt_too_long(chars))
        self._check_call_quota(session, call)
        graph.add_call(call)
        session.calls.append(CallOutline.of(call))
        for var_id in call.outputs.values():  # a step whose input had failed fails at once
            if graph.variables.get(var_id).settled:
                self._settled(session, var_id)
        self._dispatch(session)
        return SubmitCallResponse(call_id=call.call_id, outputs=call.outputs)

    def _prompt_too_long(self, chars: int) -> str:
        return (
            f"the prompt renders to {chars} characters (or more), over the server's limit of "
            f"{self.config.max_prompt_chars} (ManagerConfig.max_prompt_chars): shorten the values, or "
            "repeat a long input fewer times in the template"
        )

    def _check_call_quota(self, session: Session, call: CallIR) -> None:
        """Refuse ``call`` beyond the session's quotas (variables, unfinished steps, their max_tokens).

        The tokens of unfinished steps are summed only when a running estimate (what was submitted since
        the last exact count) would refuse: the count is exact where it decides, and O(1) otherwise."""
        quotas, graph = self.config.quotas, session.graph
        tokens = sum(step.gen.sampling.max_tokens for step in call.steps)
        check_variables(quotas, SessionUsage(variables=len(graph.variables)), len(call.outputs))
        usage = SessionUsage(queued_steps=len(graph), queued_tokens=session.queued_tokens)
        if usage.queued_tokens + tokens > quotas.queued_tokens_per_session:
            usage.queued_tokens = _queued_tokens(session)
            self.sessions.set_queued(session, usage.queued_tokens)
        check_call(quotas, usage, len(call.steps), tokens)
        refusal = self._tenant_tokens_refusal(session.client, tokens)
        if refusal is not None:
            raise QuotaExceededError(refusal)
        self.sessions.set_queued(session, usage.queued_tokens + tokens)

    def _tenant_tokens_refusal(self, client: str, tokens: int) -> str | None:
        """Why ``client`` may not have ``tokens`` more in flight (`Quotas.queued_tokens_per_tenant`), or
        None. Its sessions' running estimates are summed as they change (O(1)); recounted exactly only where
        they would refuse."""
        quotas = self.config.quotas
        queued = self._openai_tokens[client] + self.sessions.queued_by(client)
        refusal = tenant_tokens_refusal(quotas, client, queued, tokens)
        if refusal is not None:
            for s in self.sessions.of(client):
                self.sessions.set_queued(s, _queued_tokens(s))
            queued = self._openai_tokens[client] + self.sessions.queued_by(client)
            refusal = tenant_tokens_refusal(quotas, client, queued, tokens)
        return refusal

    def hold_tokens(self, tenant: str, tokens: int) -> str | None:
        """Count an OpenAI request's ``tokens`` (each generation's prompt and max_tokens) as ``tenant``'s
        in flight until `release_tokens`; or refuse them, with the reason
        (`Quotas.queued_tokens_per_tenant`)."""
        refusal = self._tenant_tokens_refusal(tenant, tokens)
        if refusal is None:
            self._openai_tokens[tenant] += tokens
        return refusal

    def release_tokens(self, tenant: str, tokens: int) -> None:
        """An OpenAI request `hold_tokens` counted is over."""
        self._openai_tokens[tenant] -= tokens
        if self._openai_tokens[tenant] <= 0:
            del self._openai_tokens[tenant]

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
                if session.session_id not in self._tasks:
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
            return _response(session.graph.variables, get.var_id)

    # ------------------------------------------------------------------------------------------ executor
    def _dispatch(self, session: Session) -> None:
        """Dispatch what became runnable, once the operations of this loop iteration are all applied.

        Deferred (and coalesced per session) so that a batch's calls and its get — or calls submitted one
        after another without awaiting — are all in the graph before anything is dispatched: deduction sees
        the get first, and parallel steps see each other's prefix boundaries."""
        if session.session_id in self._dispatch_pending:
            return
        self._dispatch_pending.add(session.session_id)
        asyncio.get_running_loop().call_soon(self._dispatch_now, session)

    def _dispatch_now(self, session: Session) -> None:
        self._dispatch_pending.discard(session.session_id)
        if session.session_id not in self._tasks:  # deleted meanwhile
            return
        graph = session.graph
        self._reprioritise(session)
        eager = self.config.dispatch == "eager"
        steps = graph.ready_steps() if eager else graph.runnable_steps()
        # Render every step first and count its prefix boundaries as in flight, so that steps dispatched
        # together (six reviewers of one document) find their common prefix before any of them is placed.
        prepared = []
        for node in steps:
            graph.mark_dispatched(node)
            prepared.append((node, self._prepare(session, node)))
        tasks = self._tasks.setdefault(session.session_id, set())
        for node, prep in prepared:
            task = asyncio.get_running_loop().create_task(self._run_step(session, node, prep))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def _reprioritise(self, session: Session) -> None:
        """A get that reached steps already waiting for an engine changes their objective there."""
        for node in session.graph.take_reprioritised():
            if node.status != "dispatched":
                continue  # not queued yet: it is dispatched with its new objective
            goal = objective(node)
            self.placement.reprioritise(
                _request_key(session, node),
                criteria=goal.criteria,
                task_group=task_group_key(goal.task_group),
            )

    def _prepare(self, session: Session, node: StepNode) -> _Prepared:
        """Render a step's prompt and count its prefix boundaries as in flight (`_release_prepared`)."""
        call = node.call
        progress = self._calls.pop((session.session_id, call.call_id), None)
        specials = SpecialText(()) if call.parse_special_tokens else self._special_text(call.model)
        values = self._values(session.graph, node, progress, specials)
        namespace = _namespace(call.cache_salt or session.cache_salt)
        chars = prompt_chars(call, node.id.index, values)
        if chars > self.config.max_prompt_chars:
            return _Prepared("", namespace, [], progress, specials, refusal=self._prompt_too_long(chars))
        prompt = render_prompt(call, node.id.index, values)
        boundaries: list[tuple[int, str]] = []
        if self.config.prefix_sharing:
            boundaries = [(off, namespace + h) for off, h in prefix_hashes(call, node.id.index, values)]
            self._inflight.update(h for _, h in boundaries)
        return _Prepared(prompt, namespace, boundaries, progress, specials)

    def _release_prepared(self, prep: _Prepared) -> None:
        for _, digest in prep.boundaries:
            self._inflight[digest] -= 1
            if self._inflight[digest] <= 0:
                del self._inflight[digest]
        prep.boundaries = []

    async def _run_step(self, session: Session, node: StepNode, prep: _Prepared) -> None:
        graph = session.graph
        goal = objective(node)
        record = self.steps.add(
            StepRecord(
                session.session_id,
                node.call.call_id,
                node.step.index,
                node.output,
                node.call.func_name,
                goal.criteria,
                task_group_key(goal.task_group),
                self._clock(),
            )
        )
        key = (node.call.call_id, node.step.index)
        self._records[key] = record
        try:
            value, kind = await self._execute(session, node, prep)
        except asyncio.CancelledError:
            self.steps.ended(record, self._clock(), "cancelled")
            raise
        except TransformError as e:  # the refused text travels as data: the message quotes only its start
            self.steps.ended(record, self._clock(), str(e))
            self._fail(session, node, str(e), e.error_type, e.text)
            return
        except (
            EngineError,
            RequestTooLargeError,
            NoEngineError,
            NoServingEngineError,
            ModelNotFoundError,
        ) as e:
            self.steps.ended(record, self._clock(), str(e))
            self._fail(session, node, str(e), e.error_type)
            return
        except Exception as e:  # a bug must not leave the variable pending forever
            log.exception("step %s failed", node.id)
            self.steps.ended(record, self._clock(), f"internal error: {e!r}")
            self._fail(session, node, f"internal error: {e!r}", "internal_error")
            return
        finally:
            self._release_prepared(prep)
            self._records.pop(key, None)
        if session.session_id not in self._tasks:  # deleted while the step ran
            return
        self.steps.ended(record, self._clock())
        graph.complete_step(node, value, kind)
        self._settled(session, node.output)
        self._dispatch(session)

    async def _execute(self, session: Session, node: StepNode, prep: _Prepared) -> tuple[str, ValueKind]:
        """Run one step on an engine; returns its output variable's value and kind (after transforms).

        A step whose engine fails (`engine_unavailable`) runs again from its inputs on an engine in service
        — nothing of its output was delivered — up to ``max_step_retries`` times; then it fails with
        `EngineFailedError` naming the engines. A later step of a call runs where the call's context is,
        unless that engine left service: its prompt (the earlier steps' raw outputs included) is then
        filled whole on another engine, which gives the same tokens the context held."""
        if prep.refusal is not None:
            raise RequestTooLargeError(prep.refusal)
        failures: list[str] = []
        pinned = prep.progress.engine if prep.progress is not None else None
        while True:
            if pinned is not None and not self._in_service(pinned):
                pinned = None
            try:
                return await self._attempt(session, node, prep, pinned)
            except PinnedEngineGoneError:
                pinned = None  # it left while the step waited: nothing ran, not a failure of the step
            except _AttemptFailed as e:
                failures.append(f"{self.engine_name(e.engine_index)}: {e.cause}")
                if len(failures) > self.config.max_step_retries:
                    raise EngineFailedError(
                        f"the step's engine failed {len(failures)} times (retry limit "
                        f"{self.config.max_step_retries}): " + "; ".join(failures)
                    ) from e.cause
                log.warning("%s runs again: %s", node.id, failures[-1])
                pinned = None

    async def _attempt(
        self, session: Session, node: StepNode, prep: _Prepared, pinned: int | None
    ) -> tuple[str, ValueKind]:
        """One placement and run of a step (on ``pinned`` if given). An engine failure takes the engine out
        of service and raises `_AttemptFailed`."""
        # A call's steps share one context chain, so one engine; engines of one model share a tokenizer.
        # A burst of ready steps starts over several loop iterations, tenants taking turns.
        await self._step_starts.turn(session.client)
        serving = [pinned] if pinned is not None else self._serving(node.call.model)
        tokenizer = self.engines[serving[0]].tokenizer
        token_ids = await _encode(tokenizer, prep.specials, prep.prompt)
        shared: list[int] = []
        shared_key: str | None = None
        if self.config.prefix_sharing and pinned is None:
            shared, shared_key = self._shared_prefix(tokenizer, node, prep, token_ids)
        estimate = self._estimate(node, prep, len(token_ids))
        request = self._queued(
            session, node, objective(node), token_ids, shared, shared_key, serving, prep, pinned is not None
        )
        if estimate is not None and self.config.admit_by_predicted_length is not None:
            request = self._admitted_by_prediction(request, node, estimate)
        engine_index = await self.placement.acquire(request)
        try:
            return await self._run_on(engine_index, session, node, prep, token_ids, shared, request, estimate)
        except EngineError as e:
            if not engine_unavailable(e):
                raise
            await self.engine_failed(engine_index, e)
            raise _AttemptFailed(engine_index, e) from e
        finally:
            self.placement.release(engine_index, request)

    def _shared_prefix(
        self, tokenizer: Any, node: StepNode, prep: _Prepared, token_ids: list[int]
    ) -> tuple[list[int], str | None]:
        """The tokens of the longest prompt prefix this step should share, and its key, or ``([], None)``.

        Candidates are the step's segment boundaries (constant text and variable values alike) that
        another dispatched step also has — the shared part is prefilled once and every step forks it — and,
        for a call's first step, the end of its leading constant text (a system prompt later calls will
        share). The prefix's tokens are those of its text that truly prefix ``token_ids`` (whole-prompt
        tokenization may merge tokens across the boundary), short of the whole prompt."""
        candidates = [(off, h) for off, h in prep.boundaries if self._inflight[h] >= 2]
        first = node.step.fills[0] if node.id.index == 0 and node.step.fills else None
        if isinstance(first, TextFill) and first.name is None and prep.boundaries:
            candidates.append(prep.boundaries[0])
        for offset, digest in sorted(candidates, reverse=True):
            prefix = prep.specials.encode(tokenizer, prep.prompt[:offset])
            while prefix and (token_ids[: len(prefix)] != prefix or len(prefix) >= len(token_ids)):
                prefix.pop()
            if len(prefix) >= self.config.min_shared_prefix_tokens:
                return prefix, digest
        return [], None

    def _queued(
        self,
        session: Session,
        node: StepNode,
        goal: StepObjective,
        token_ids: list[int],
        shared: list[int],
        shared_key: str | None,
        serving: list[int],
        prep: _Prepared,
        pinned: bool,
    ) -> QueuedRequest:
        """The scheduler's view of a step: its tokens beyond its shared prefix, objective, group, shared
        prefix key and how much of its prompt each engine holds."""
        cached = {}
        for i in serving:
            match = self._cached_match(i, prep.namespace, token_ids)
            if match is not None:
                cached[i] = match.length
        affinity = self.config.prefix_affinity
        return QueuedRequest(
            key=_request_key(session, node),
            app=session.session_id,
            tenant=session.client,
            seq=self.placement.next_seq(),
            tokens=len(token_ids) - len(shared) + node.step.gen.sampling.max_tokens,
            criteria=goal.criteria,
            task_group=task_group_key(goal.task_group),
            depth=goal.depth,
            shared_prefix=shared_key if affinity else None,
            cached=cached if affinity else {},
            pinned=serving[0] if pinned else None,
            model=None if pinned else node.call.model,
        )

    def _estimate(self, node: StepNode, prep: _Prepared, prompt_tokens: int) -> LengthEstimate | None:
        """The step's predicted output length and engine priority (None with prediction off)."""
        if self.lengths is None:
            return None
        step = node.step
        return self.lengths.estimate(
            template_key(node.call.func_name, step.index),
            prep.prompt,
            prompt_tokens,
            _sampling(step.gen.sampling),
            group=task_group_key(objective(node).task_group),
        )

    def _admitted_by_prediction(
        self, request: QueuedRequest, node: StepNode, estimate: LengthEstimate
    ) -> QueuedRequest:
        """``request`` counted with its predicted output (times the configured margin) instead of
        ``max_tokens`` (SSJF §6): more requests fit an engine's capacity; when one writes more than that,
        the engine's preemption makes room, as for any request that outgrows the KV cache."""
        margin = self.config.admit_by_predicted_length or 1.0
        max_tokens = node.step.gen.sampling.max_tokens
        reserved = min(max_tokens, math.ceil(estimate.predicted * margin))
        return dataclasses.replace(request, tokens=request.tokens - max_tokens + reserved)

    async def _run_on(
        self,
        engine_index: int,
        session: Session,
        node: StepNode,
        prep: _Prepared,
        token_ids: list[int],
        shared: list[int],
        request: QueuedRequest,
        estimate: LengthEstimate | None,
    ) -> tuple[str, ValueKind]:
        call, step = node.call, node.step
        key = (session.session_id, call.call_id)
        engine = self.engines[engine_index]
        namespace = prep.namespace
        await self._share_prefix(engine_index, namespace, shared)
        context_id = next(self._context_ids)
        sampling = _sampling(step.gen.sampling)
        priority = None if estimate is None else estimate.priority
        record = self._records.get((call.call_id, step.index))
        if record is not None:
            self.steps.started(record, engine_index, self.engine_name(engine_index), self._clock())
            record.prompt_tokens = len(token_ids)
        try:
            saved = await self._fill_from_cache(
                engine_index, namespace, context_id, token_ids, priority, session.client
            )
            if record is not None:
                record.prefill_tokens_saved = saved
            # A latency-bound step carries the engine's latency cap, so the engine keeps its batch under
            # it against traffic the placement does not see (the OpenAI endpoints).
            latency_cap = self._caps(engine)[1] if request.latency_bound else None
            text = StepTextStream()  # a deleted session's step keeps no text for anyone
            if session.session_id in self._tasks:
                text = self._texts.setdefault((session.session_id, step.gen.var_id), text)
            text.start(engine.tokenizer, sampling.stop)
            stream = engine.submit_generate(
                context_id,
                sampling,
                stream=True,
                latency_cap=latency_cap,
                priority=priority,
                tenant=session.client,
            )
            async for token_id in stream:  # readers of the variable's text see each token as it comes
                text.push(token_id)
            result = await stream.result()
            text.finish(result.text)
        except BaseException:  # failed or cancelled (session deleted): the step's context goes too
            await self._free(engine_index, context_id)
            raise
        if estimate is not None and self.lengths is not None:
            self.lengths.observe(estimate, len(result.token_ids))
        held = token_ids + result.token_ids
        last = step.index + 1 == len(call.steps)
        if not last:  # the next step continues this context with the raw output
            raw = {**(prep.progress.raw_outputs if prep.progress else {}), step.gen.var_id: result.text}
            self._calls[key] = _CallProgress(engine_index, raw)
        try:
            if step.gen.transforms:  # parsers may be slow on hostile text: off the event loop
                transformed = await asyncio.to_thread(run_transforms, step.gen.transforms, result.text)
            else:
                transformed = apply_transforms((), result.text)
        except BaseException:
            await self._free(engine_index, context_id)
            raise
        if not self.config.prefix_sharing:
            await self._free(engine_index, context_id)
        elif last and self._continued(session, node, prep.prompt, prep.specials):
            # What a consumer continuing this prompt renders is the prompt, then the variable's value.
            value_text = prep.specials.mask(render_value(transformed.value, transformed.kind))
            canonical = prep.specials.encode(engine.tokenizer, prep.prompt + value_text)
            await self._keep_as_value(engine_index, namespace, context_id, held, canonical)
        else:
            await self._keep(engine_index, namespace, context_id, held)
        return transformed.value, transformed.kind

    @staticmethod
    def _continued(session: Session, node: StepNode, prompt: str, specials: SpecialText) -> bool:
        """Whether a pending consumer of the step's output continues its prompt: the consumer's text before
        the value is exactly ``prompt`` (a reviewer quoting the writer's prompt and answer)."""
        graph = session.graph
        for consumer in graph.consumers(node.output):
            values = {}
            for var_id in consumer.call.input_vars:
                var = graph.variables.get(var_id)
                if var.value is not None:
                    values[var_id] = specials.mask(render_value(var.value, var.kind))
            if text_before(consumer.call, node.output, values) == prompt:
                return True
        return False

    async def _keep_as_value(
        self, engine_index: int, namespace: str, context_id: int, held: list[int], canonical: list[int]
    ) -> None:
        """Keep a finished step's context so that it holds what a consumer continuing its prompt renders.

        The context holds the prompt and the generated tokens, EOS and any stop string included; a consumer
        renders the prompt and the *value*, tokenized whole. Where the two part within the last block of the
        value (a stop string cut mid-token, a re-tokenized ending), a fork of the agreeing part filled with
        the value's own tokens replaces the context — one short fill here instead of one per consumer. An
        earlier parting (a transform rewrote the value) keeps the context as it is: consumers fork from the
        part that agrees (`PrefixStore.longest_common_prefix`)."""
        common = common_prefix_len(held, canonical)
        engine = self.engines[engine_index]
        refill = len(canonical) - common
        if refill == 0 or refill > engine.block_size or common == 0:
            await self._keep(engine_index, namespace, context_id, held)
            return
        fresh = next(self._context_ids)
        try:
            await engine.fill(fresh, canonical[common:], context_id, parent_len=common)
        except EngineError:
            await self._free(engine_index, fresh)
            await self._keep(engine_index, namespace, context_id, held)
            return
        await self._free(engine_index, context_id)
        await self._keep(engine_index, namespace, fresh, canonical)

    def _values(
        self, graph: SessionGraph, node: StepNode, progress: _CallProgress | None, specials: SpecialText
    ) -> dict[str, str]:
        """The text of every variable the step's prompt renders: the inputs of this step *and* of the
        call's earlier steps (the prompt repeats them), and the earlier outputs as generated. Input values
        are a user's text: their special-token strings are masked, so they encode as text."""
        values: dict[str, str] = {}
        for step in node.call.steps[: node.id.index + 1]:
            for var_id in input_vars(step):
                var = graph.variables.get(var_id)
                assert var.value is not None, "a ready step has every input, and its earlier steps had theirs"
                values[var_id] = specials.mask(render_value(var.value, var.kind))
        # Earlier outputs of the same call enter the prompt as generated (before transforms): the prompt
        # then continues the previous step's context exactly.
        if progress is not None:
            values.update(progress.raw_outputs)
        return values

    async def _share_prefix(self, engine_index: int, namespace: str, prefix: list[int]) -> None:
        """Make ``prefix`` (`_shared_prefix`) one shared context on the engine, unless a kept context
        already holds it: every step starting with it forks it instead of prefilling it again (steps of
        one session or of many)."""
        if len(prefix) < self.config.min_shared_prefix_tokens:
            return
        match = self._cached_match(engine_index, namespace, prefix)
        if match is not None and match.length >= len(prefix):
            return
        key = (self._store_key(engine_index, namespace), tuple(prefix))
        pending = self._prefix_fills.get(key)
        if pending is not None:  # another step is filling this very prefix: wait for it
            await asyncio.shield(pending)
            return
        pending = self._prefix_fills[key] = asyncio.get_running_loop().create_future()
        context_id = next(self._context_ids)
        try:
            await self._fill_from_cache(engine_index, namespace, context_id, prefix)
            await self._keep(engine_index, namespace, context_id, prefix)
        except BaseException:
            await self._free(engine_index, context_id)
            raise
        finally:
            del self._prefix_fills[key]
            pending.set_result(None)

    def _cached_match(self, engine_index: int, namespace: str, token_ids: list[int]) -> Match | None:
        """The kept context sharing the most leading tokens with ``token_ids`` on the engine, if worth a
        fork: a whole context, or a leading part of at least one KV block (a shorter part would cost a
        block copy to save less than a block of prefill)."""
        if not self.config.prefix_sharing:
            return None
        match = self._prefixes.longest_common_prefix(self._store_key(engine_index, namespace), token_ids)
        if match is None or (not match.whole and match.length < self.engines[engine_index].block_size):
            return None
        return match

    async def _fill_from_cache(
        self,
        engine_index: int,
        namespace: str,
        context_id: int,
        token_ids: list[int],
        priority: float | None = None,
        tenant: str | None = None,
    ) -> int:
        """Make ``context_id`` hold ``token_ids``: a fork of the leading tokens they share with a kept
        context (held against eviction while the fork is made), filled with the rest; returns how many
        were forked (not computed). ``priority``, ``tenant``: the request's place in the engine's queue
        (its prefill is ordered as its generation is)."""
        match = self._cached_match(engine_index, namespace, token_ids)
        engine = self.engines[engine_index]
        if match is None:
            await engine.fill(context_id, token_ids, priority=priority, tenant=tenant)
            return 0
        self._prefixes.acquire(match.entry)
        try:
            await engine.fill(
                context_id,
                token_ids[match.length :],
                match.entry.context_id,
                parent_len=None if match.whole else match.length,
                priority=priority,
                tenant=tenant,
            )
        finally:
            self._prefixes.release(match.entry)
        return match.length

    async def _keep(self, engine_index: int, namespace: str, context_id: int, token_ids: list[int]) -> None:
        """Store a finished context as a shareable prefix; beyond the engine's cap (all namespaces together,
        so that many salts cannot hold more), free the least recently used ones nothing forks from."""
        if not self._in_service(engine_index):  # failed or draining: nothing will fork from it there
            await self._free(engine_index, context_id)
            return
        entry = self._prefixes.insert(self._store_key(engine_index, namespace), context_id, token_ids)
        if entry.context_id != context_id:  # the same tokens are already held by another context
            await self._free(engine_index, context_id)
        keys = self._store_keys(engine_index)
        excess = sum(len(self._prefixes.entries(k)) for k in keys) - self.config.max_cached_prefixes
        if excess <= 0:
            return
        idle = [e for k in keys for e in self._prefixes.evict_candidates(k)]
        stale: list[Entry] = sorted(idle, key=lambda e: e.last_used)[:excess]
        for old in stale:
            self._prefixes.remove(old)
            await self._free(engine_index, old.context_id)

    def _store_keys(self, engine_index: int) -> list[str]:
        """The prefix store's keys of an engine: its shared namespace and every salted one."""
        return [k for k in self._prefixes.engines() if k.split("#", 1)[0] == str(engine_index)]

    @staticmethod
    def _store_key(engine_index: int, namespace: str) -> str:
        """The prefix store's key of an engine's contexts in a cache namespace (salted ones apart)."""
        return f"{engine_index}{namespace}"

    # ------------------------------------------------------------------------------------------ OpenAI API
    # The request-centric endpoints (`server.openai_api`) run on the same engines: the baseline of every
    # benchmark is served by the same engine code as Parrot.
    def models(self) -> list[str]:
        return sorted({e.model_name for i, e in enumerate(self.engines) if self._in_service(i)})

    def engine_for(self, model: str | None) -> Engine:
        self._refuse_if_draining("requests")
        return self.engines[self._pick_engine(self._serving(model))]

    def _special_text(self, model: str | None) -> SpecialText:
        """The special-token strings of ``model``'s tokenizer (none while no engine serves it: the step
        fails before anything is encoded)."""
        try:
            engine = self.engines[self._serving(model)[0]]
        except (NoEngineError, ModelNotFoundError):
            return SpecialText(())
        found = self._special_texts.get(engine.model_name)
        if found is None:  # engines of one model share a tokenizer
            found = self._special_texts[engine.model_name] = SpecialText.of(engine.tokenizer)
        return found

    def _serving(self, model: str | None) -> list[int]:
        """The engines in service for ``model`` (None: any); `ModelNotFoundError` when none serves it,
        `NoEngineError` when there is no engine at all."""
        live = self.engines_in_service()
        if not live:
            raise NoEngineError(
                "no engine is in service: start one (python -m server.engine --manager URL) or run the "
                "server with --engines N"
            )
        serving = [i for i in live if model is None or self.engines[i].model_name == model]
        if not serving:
            if any(e.model_name == model for e in self.engines):  # it was served: its engines are out now
                raise NoEngineError(
                    f"no engine serving {model!r} is in service now (failed, draining or timed out); retry "
                    "once one is back"
                )
            raise ModelNotFoundError(model, self.models())
        return serving

    def open_context(self, engine: Engine) -> int:
        """A new context id for an OpenAI request routed to ``engine``: it counts against the engine's load
        (`_pick_engine`) until `finish_context`."""
        self._openai_routed[self._index_of(engine)] += 1
        return next(self._context_ids)

    async def fill_prompt(
        self,
        engine: Engine,
        context_id: int,
        token_ids: list[int],
        cache_salt: str | None,
        priority: float | None = None,
        *,
        tenant: str | None = None,
    ) -> None:
        """An OpenAI request's prompt: forked from the longest cached token prefix, the rest filled; refused
        first if the engine would miss the SLOs (`ManagerConfig.slo`), whose TPOT objective also resizes a
        prefill + decode pair's prefill chunks (`Engine.tune_for_tpot`)."""
        if self.config.slo is not None:
            self._admit(engine, token_ids, cache_salt)
            await engine.tune_for_tpot(self.config.slo.tpot_s)
        if not self.config.openai_prefix_cache:
            await engine.fill(context_id, token_ids, priority=priority, tenant=tenant)
            return
        index = self._index_of(engine)
        await self._fill_from_cache(index, _namespace(cache_salt), context_id, token_ids, priority, tenant)

    def _admit(self, engine: Engine, token_ids: list[int], cache_salt: str | None) -> None:
        """Mutel's early rejection, from the engine's measured step times and queued prompt work (no
        measurement yet: admitted). Only the tokens past a cached prefix count as prefill."""
        assert self.config.slo is not None
        index = self._index_of(engine)
        cached = 0
        if self.config.openai_prefix_cache:
            match = self._cached_match(index, _namespace(cache_salt), token_ids)
            cached = 0 if match is None else match.length
        rejection = admission(engine.stats(), index, len(token_ids) - cached, self.config.slo)
        if rejection is not None:
            raise SloRejectedError(f"request refused at admission: {rejection.message}; retry later")

    def estimate_length(
        self, engine: Engine, token_ids: list[int], sampling: SamplingParams
    ) -> LengthEstimate | None:
        """An OpenAI request's predicted output length (no template: it comes as a whole prompt)."""
        if self.lengths is None:
            return None
        try:
            tail = engine.tokenizer.decode(token_ids[-PROMPT_TAIL_TOKENS:])
        except (OverflowError, ValueError, TypeError):  # ids outside the vocabulary: the engine refuses
            tail = ""  # them with a clear error when the fill is validated, which is not this step's job
        return self.lengths.estimate(None, tail, len(token_ids), sampling)

    def observe_length(self, estimate: LengthEstimate, length: int) -> None:
        if self.lengths is not None:
            self.lengths.observe(estimate, length)

    @property
    def length_predictor(self) -> LengthPredictor | None:
        """The live output-length predictor (None with ``length_prediction`` off)."""
        return None if self.lengths is None else self.lengths.predictor

    async def finish_context(
        self, engine: Engine, context_id: int, token_ids: list[int] | None, cache_salt: str | None
    ) -> None:
        """An OpenAI request is over: a completed one's context is kept as a cached prefix (the next turn
        of a chat repeats it), anything else freed."""
        index = self._index_of(engine)
        self._openai_routed -= Counter([index])  # drops the engine at zero
        keep = self.config.prefix_sharing and self.config.openai_prefix_cache
        if token_ids is None or not token_ids or not keep:
            await self._free(index, context_id)
            return
        await self._keep(index, _namespace(cache_salt), context_id, token_ids)

    async def retry_elsewhere(self, engine: Engine, error: EngineError, attempt: int) -> bool:
        """An OpenAI request failed on ``engine`` on its ``attempt``-th try, before streaming anything.
        When the engine is at fault (`engine_unavailable`) it leaves service (`engine_failed`) and the
        answer is whether the request may run again on another engine (``max_step_retries``)."""
        if not engine_unavailable(error):
            return False
        await self.engine_failed(self._index_of(engine), error)
        return attempt <= self.config.max_step_retries

    async def drop_cache(self) -> int:
        """Free every kept context no request is forking from (all prefixes and finished steps); returns
        how many went. KV blocks then count only what runs."""
        dropped = 0
        for key in self._prefixes.engines():
            engine_index = int(key.split("#", 1)[0])
            for entry in self._prefixes.evict_candidates(key):
                self._prefixes.remove(entry)
                await self._free(engine_index, entry.context_id)
                dropped += 1
        return dropped

    def _index_of(self, engine: Engine) -> int:
        for i, e in enumerate(self.engines):
            if e is engine:
                return i
        raise ValueError(f"{engine!r} is not an engine of this manager")

    def _engine_states(self) -> list[EngineState]:
        """The engines in service as the scheduler sees them (caps from the config and the KV cache)."""
        states = []
        for i, engine in enumerate(self.engines):
            if not self._in_service(i):
                continue
            capacity, latency_cap, max_steps = self._caps(engine)
            states.append(
                EngineState(
                    i,
                    capacity,
                    latency_cap,
                    model=engine.model_name,
                    cache_routed=engine.cache_routed,
                    max_steps=max_steps,
                )
            )
        return states

    def _caps(self, engine: Engine) -> tuple[int, int, int | None]:
        """An engine's token capacity (the config's, else its KV cache in tokens), latency cap (an OpenAI
        backend's own where configured, else the config's) and most steps at once (`engine_max_steps`)."""
        stats = engine.stats()
        capacity = self.config.engine_capacity_tokens or stats.blocks_total * stats.block_size
        cap = self.config.latency_cap_tokens
        if engine.latency_cap_tokens is not None:
            cap = engine.latency_cap_tokens
        steps = self.config.engine_max_steps
        if steps is None and stats.max_num_seqs > 0:
            steps = 2 * stats.max_num_seqs
        return capacity, min(cap, capacity), steps

    def _pick_engine(self, candidates: list[int]) -> int:
        """The least loaded engine (lowest index on ties). Its load: the requests it reports, or the OpenAI
        requests routed to it and not finished where more (a burst routed before any fill arrives there
        would otherwise all land on one engine)."""

        def load(i: int) -> int:
            stats = self.engines[i].stats()
            return max(stats.running + stats.waiting, self._openai_routed[i])

        return min(candidates, key=lambda i: (load(i), i))

    async def _free(self, engine_index: int, context_id: int) -> None:
        with contextlib.suppress(EngineError):
            await self.engines[engine_index].free_context(context_id)

    def _fail(
        self, session: Session, node: StepNode, message: str, error_type: str, llm_output: str | None = None
    ) -> None:
        """Fail ``node`` and everything downstream (see `SessionGraph.fail_step`) and wake their waiters."""
        if session.session_id not in self._tasks or node.id not in session.graph:
            return
        for var in session.graph.fail_step(node, message, error_type=error_type, llm_output=llm_output):
            self._settled(session, var.var_id)
        self._calls.pop((session.session_id, node.call.call_id), None)

    def _settled(self, session: Session, var_id: str) -> None:
        event = self._waiters.pop((session.session_id, var_id), None)
        if event is not None:
            event.set()
        text = self._texts.get((session.session_id, var_id))
        if text is not None:
            text.close()

    async def drain(self, grace: float) -> int:
        """Graceful shutdown: refuse new sessions, calls and OpenAI requests (503) from now on, and wait up
        to ``grace`` seconds for the steps already dispatched to finish; returns how many were still running
        (0: all finished)."""
        self.draining = True
        log.info("draining: no new work; waiting up to %gs for running steps", grace)
        deadline = time.monotonic() + grace
        while (running := sum(len(tasks) for tasks in self._tasks.values())) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return running

    def _refuse_if_draining(self, what: str) -> None:
        if self.draining:
            raise ServerDrainingError(
                f"the server is shutting down: it takes no new {what} (what runs finishes); "
                "retry on another server or once it is back"
            )

    async def shutdown(self) -> None:
        if self.lengths is not None:
            try:
                self.lengths.save()
            except OSError as e:  # the state is an optimization: losing it must not stop the shutdown
                log.warning("could not save the length predictor's state: %s", e)
        for session in list(self.sessions):
            await self.delete_session(session)
        for engine_id, link in self._remote.items():
            if link.alive:
                await self._retire(engine_id, "the manager is shutting down")
        for task in list(self._cleanups):  # their engines' connections close as the tasks end
            task.cancel()
        await asyncio.gather(*self._cleanups, return_exceptions=True)


# Prompts longer than this are tokenized on a worker thread (the tokenizer releases the GIL): a 1 MB prompt
# takes ~1.5 s to encode, which on the event loop would stall every session and /health.
ENCODE_OFF_LOOP_CHARS = 32 * 1024


async def _encode(tokenizer: Any, specials: SpecialText, text: str) -> list[int]:
    if len(text) <= ENCODE_OFF_LOOP_CHARS:
        return specials.encode(tokenizer, text)
    return await asyncio.to_thread(specials.encode, tokenizer, text)


def _namespace(cache_salt: str | None) -> str:
    """The prefix-cache namespace of a salt: contexts and prefix hashes of different salts never meet."""
    if cache_salt is None:
        return ""
    return "#" + hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _request_key(session: Session, node: StepNode) -> str:
    return f"{session.session_id}/{node.id.call_id}/{node.id.index}"


def _sampling(sp: SamplingConfig) -> SamplingParams:
    return SamplingParams(**sp.model_dump())


def _queued_tokens(session: Session) -> int:
    """The max_tokens of ``session``'s unfinished steps, counted exactly."""
    return sum(node.step.gen.sampling.max_tokens for node in session.graph.steps())


def _response(variables: VariableTable, var_id: str) -> GetVariableResponse:
    var = variables.get(var_id)
    return GetVariableResponse(
        var_id=var_id,
        status=var.status,
        value=var.value,
        kind=var.kind,
        error=var.error,
        error_type=var.error_type,
        llm_output=var.llm_output,
    )
