"""The engines a manager serves on, and which of them may take work now.

An engine's id is its index in ``engines``: those given at construction, `RemoteEngine`s that register over
HTTP (`register`) and OpenAI-compatible servers added as engines (`add_openai_backend`). Ids are never
reused: a remote engine that registers again is a new id. An engine leaves service when it fails
(`engine_failed`), when a remote one stops sending heartbeats (`check`) or unregisters, and a remote one
drains when it announces a graceful shutdown or an operator holds it (`set_draining`): no new work goes
there, what runs there finishes.

Whenever the set of engines in service changes, ``on_change`` runs (the placement re-examines its waiting
steps); when an engine leaves, ``forget`` takes its kept contexts out of the prefix index and returns their
ids, which are freed where the engine may still hold them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from server.cluster.openai_backend import OpenAIBackendConfig, OpenAIBackendEngine
from server.cluster.remote_engine import RemoteEngine
from server.engine import EngineError
from server.engine.errors import EngineDrainingError, engine_unavailable
from server.engine.interface import Engine
from server.engine.special_text import SpecialText
from server.engine.wire import EngineRegistered, EngineRegistration, EngineStats, EngineStatus
from server.serve.errors import (
    EngineRegistrationError,
    ModelNotFoundError,
    NoEngineError,
    UnknownEngineError,
)
from server.serve.manager_config import ManagerConfig
from server.serve.scheduler import EngineState

log = logging.getLogger(__name__)


@dataclass
class RemoteLink:
    """A registered remote engine and its liveness."""

    engine: RemoteEngine
    name: str
    url: str
    last_heartbeat: float
    alive: bool = True
    # No new work, what runs finishes: the engine announced a graceful shutdown (its heartbeat's stats, a
    # draining error), or an operator held it (`EngineRegistry.set_draining`). A heartbeat changes only the
    # first.
    announced_drain: bool = False
    held: bool = False

    @property
    def draining(self) -> bool:
        return self.announced_drain or self.held


def _nothing_kept(engine_id: int) -> list[int]:
    return []


class EngineRegistry:
    """The manager's engines, local or remote: its liveness, and its capacity as the scheduler sees it."""

    def __init__(
        self,
        engines: Sequence[Engine],
        config: ManagerConfig,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] = lambda: None,
        forget: Callable[[int], list[int]] = _nothing_kept,
    ) -> None:
        self.engines: list[Engine] = list(engines)
        self.config = config
        self.on_change = on_change
        self.forget = forget
        self._clock = clock
        self._remote: dict[int, RemoteLink] = {}
        # Engines (local or remote) taken out of service by a failure.
        self.failed: set[int] = set()
        self._cleanups: set[asyncio.Task[None]] = set()  # a retired engine's best-effort frees
        self._special_texts: dict[str, SpecialText] = {}  # per model: its tokenizer's special strings

    # ------------------------------------------------------------------------------------------ joining
    async def register(self, req: EngineRegistration, cluster_token: str | None = None) -> EngineRegistered:
        """Add the remote engine at ``req.url`` (its model and tokenizer are read from it first). An engine
        registering again under its name or at its URL (restarted, renamed) replaces its old entry, which
        goes out of service. ``cluster_token`` goes with every call the manager makes to the engine."""
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
        self._remote[engine_id] = RemoteLink(engine, req.name, engine.url, self._clock())
        self.on_change()  # steps waiting for an engine of its model may go now
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
        serving = [i for i, e in enumerate(self.engines) if e.url == url and i not in self.failed]
        if serving:
            raise EngineRegistrationError(f"the OpenAI backend at {url} is engine {serving[0]} already")
        try:
            backend = await asyncio.to_thread(OpenAIBackendEngine.connect, config)
        except (EngineError, httpx.HTTPError, ValueError) as e:
            raise EngineRegistrationError(f"cannot add the OpenAI backend at {url}: {e}") from e
        self.engines.append(backend)
        self.on_change()  # steps waiting for an engine of its model may go now
        log.info("engine %d: the OpenAI backend at %s (%s)", len(self.engines) - 1, url, backend.model_name)
        return len(self.engines) - 1

    def remote_engine(self, engine_id: int) -> RemoteEngine | None:
        """The registered remote engine ``engine_id`` (in service or not), or None for any other id."""
        link = self._remote.get(engine_id)
        return None if link is None else link.engine

    def remote_link(self, engine_id: int) -> RemoteLink | None:
        """The liveness of remote engine ``engine_id``, or None for any other id."""
        return self._remote.get(engine_id)

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
        self, engine_id: int, link: RemoteLink, *, announced: bool | None = None, held: bool | None = None
    ) -> None:
        was = link.draining
        link.announced_drain = link.announced_drain if announced is None else announced
        link.held = link.held if held is None else held
        if link.draining != was:
            what = "is draining" if link.draining else "serves again"
            log.info("engine %d (%s) %s", engine_id, link.name, what)
            self.on_change()

    async def unregister(self, engine_id: int) -> None:
        """A remote engine leaves (it is shutting down)."""
        link = self._remote.get(engine_id)
        if link is None or not link.alive:
            raise UnknownEngineError(f"engine {engine_id} is not a registered remote engine in service")
        await self._retire(engine_id, "it unregistered")

    async def check(self) -> list[int]:
        """Take out of service every remote engine silent for longer than the timeout (returns their ids),
        and put back every OpenAI backend taken out by a failure that answers again."""
        for engine_id in sorted(self.failed):
            if engine_id not in self._remote and await self.engines[engine_id].back_in_service():
                self.failed.discard(engine_id)
                self.on_change()
                log.warning("%s is back in service: it answers again", self.engine_name(engine_id))
        now = self._clock()
        silent = [
            i
            for i, link in self._remote.items()
            if link.alive and now - link.last_heartbeat > self.config.engine_timeout
        ]
        for engine_id in silent:
            await self._retire(engine_id, f"no heartbeat for {self.config.engine_timeout:g}s")
        return silent

    # ------------------------------------------------------------------------------------------ service
    def status(self) -> list[EngineStatus]:
        """Every engine, local or remote, with its liveness and stats (``GET /v1/engines``)."""
        out = []
        for i, engine in enumerate(self.engines):
            link = self._remote.get(i)
            name = link.name if link is not None else engine.name or f"local-{i}"
            url = link.url if link is not None else engine.url
            alive = (link is None or link.alive) and i not in self.failed
            out.append(EngineStatus(engine_id=i, name=name, url=url, alive=alive, stats=engine.stats()))
        return out

    def in_service_ids(self) -> list[int]:
        """The engines new work may be placed on (``GET /health`` counts them; with none, work is refused)."""
        return [i for i in range(len(self.engines)) if self.in_service(i)]

    def in_service(self, engine_id: int) -> bool:
        """Whether new work may be placed on the engine: not failed and, if remote, alive and not draining."""
        if engine_id in self.failed:
            return False
        link = self._remote.get(engine_id)
        return link is None or (link.alive and not link.draining)

    def reachable(self, engine_id: int) -> bool:
        """Whether the engine may still be called (a draining one is: what runs there finishes)."""
        link = self._remote.get(engine_id)
        return engine_id not in self.failed and (link is None or link.alive)

    def engine_name(self, engine_id: int) -> str:
        """How messages name an engine: its id, name and URL."""
        link = self._remote.get(engine_id)
        if link is not None:
            return f"engine {engine_id} ({link.name} at {link.url})"
        return f"engine {engine_id} ({self.engines[engine_id].name or f'local-{engine_id}'})"

    def index_of(self, engine: Engine) -> int:
        for i, e in enumerate(self.engines):
            if e is engine:
                return i
        raise ValueError(f"{engine!r} is not an engine of this manager")

    def models(self) -> list[str]:
        """The models the engines in service serve."""
        return sorted({e.model_name for i, e in enumerate(self.engines) if self.in_service(i)})

    def serving(self, model: str | None) -> list[int]:
        """The engines in service for ``model`` (None: any); `ModelNotFoundError` when none serves it,
        `NoEngineError` when there is no engine at all."""
        live = self.in_service_ids()
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

    def special_text(self, model: str | None) -> SpecialText:
        """The special-token strings of ``model``'s tokenizer (none while no engine serves it: the step
        fails before anything is encoded)."""
        try:
            engine = self.engines[self.serving(model)[0]]
        except (NoEngineError, ModelNotFoundError):
            return SpecialText(())
        found = self._special_texts.get(engine.model_name)
        if found is None:  # engines of one model share a tokenizer
            found = self._special_texts[engine.model_name] = SpecialText.of(engine.tokenizer)
        return found

    def engine_states(self) -> list[EngineState]:
        """The engines in service as the scheduler sees them (caps from the config and the KV cache)."""
        states = []
        for i, engine in enumerate(self.engines):
            if not self.in_service(i):
                continue
            capacity, latency_cap, max_steps = self.caps(engine)
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

    def caps(self, engine: Engine) -> tuple[int, int, int | None]:
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

    async def free(self, engine_id: int, context_id: int) -> None:
        """Free a context on the engine, best effort (an engine that cannot has lost it anyway)."""
        with contextlib.suppress(EngineError):
            await self.engines[engine_id].free_context(context_id)

    # ------------------------------------------------------------------------------------------ leaving
    async def engine_failed(self, engine_id: int, error: BaseException) -> None:
        """A request to the engine failed because of the engine (`engine_unavailable`). A draining engine
        only stops taking work; any other is taken out of service at once: nothing more is placed there,
        its cached contexts leave the prefix index, and what runs there fails over (a remote engine's
        connections are closed). A remote engine comes back only by registering again, as a new engine."""
        if getattr(error, "error_type", None) == EngineDrainingError.error_type:
            if engine_id in self._remote and self.reachable(engine_id):
                self._drain(engine_id, self._remote[engine_id], announced=True)
            return
        if engine_id in self.failed:
            return
        self.failed.add(engine_id)
        if engine_id in self._remote:
            if self._remote[engine_id].alive:  # else already retired (timed out, left): nothing more to do
                await self._retire(engine_id, f"a request to it failed: {error}", cleanup=True)
            return
        log.warning("%s is out of service: %s", self.engine_name(engine_id), error)
        forgotten = self.forget(engine_id)
        if self.engines[engine_id].frees_after_failure:  # its kept contexts live here: drop them
            for context_id in forgotten:
                await self.free(engine_id, context_id)
        self.on_change()

    async def _retire(self, engine_id: int, why: str, *, cleanup: bool = False) -> None:
        """Take a remote engine out of service. With ``cleanup`` (an engine suspected of failing, which
        may well be alive), its kept contexts are freed there in the background, best effort and bounded
        by ``engine_timeout``, before its connections close; otherwise they close at once."""
        link = self._remote[engine_id]
        link.alive = False
        log.warning("%s is out of service: %s", self.engine_name(engine_id), why)
        context_ids = self.forget(engine_id)
        self.on_change()
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

    async def shutdown(self) -> None:
        """Retire every remote engine in service and end the background frees."""
        for engine_id, link in self._remote.items():
            if link.alive:
                await self._retire(engine_id, "the manager is shutting down")
        for task in list(self._cleanups):  # their engines' connections close as the tasks end
            task.cancel()
        await asyncio.gather(*self._cleanups, return_exceptions=True)
