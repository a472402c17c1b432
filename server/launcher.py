"""`server.launch(...)`: the whole service on 127.0.0.1 in a background thread, for recipes and tests."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI

from server.cluster.disagg_engine import DisaggregatedEngine
from server.cluster.openai_backend import OpenAIBackendConfig, OpenAIBackendEngine
from server.cluster.ray_engines import RayEngines
from server.common.connection_limits import ConnectionLimits, guarded_h11
from server.common.netdelay import NetworkDelayMiddleware
from server.common.security import SecurityConfig, api_keys_from
from server.common.settings import CLUSTER_TOKEN
from server.engine import EngineConfig, LLMEngine
from server.engine.interface import Engine
from server.engine.model_names import DEFAULT_MODEL
from server.http.app import create_app
from server.serve.manager import Manager, ManagerConfig

T = TypeVar("T")


@dataclass
class LaunchedServer:
    """A running server: its base URL, and the objects behind it (for inspection in tests). Remote engines
    join with ``cluster_token``, which ``GET /v1/engines`` also needs."""

    url: str
    app: FastAPI
    manager: Manager
    engines: list[Engine]
    network_delay: NetworkDelayMiddleware | None = None  # switch with `.enabled` between measurements
    cluster_token: str = field(default="", repr=False)
    ray_actors: list[Any] = field(default_factory=list)  # engines Ray placed (`launch(ray=...)`)

    @property
    def cluster_headers(self) -> dict[str, str]:
        """The ``Authorization`` header of the cluster token's holder (engine routes, ``GET /v1/engines``)."""
        return {"Authorization": f"Bearer {self.cluster_token}"}

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run ``coro`` on the server's event loop (where the manager lives) and return its result — for
        tests and tools that drive the manager directly, e.g. ``served.run(served.manager.drop_cache())``."""
        return asyncio.run_coroutine_threadsafe(coro, self.app.state.loop).result(timeout)

    @property
    def request_counts(self) -> Counter[tuple[str, str]]:
        """Requests the server has answered, by ``(method, route template)``, e.g.
        ``("POST", "/v1/sessions/{session_id}/batch")`` — live, so take a copy to diff."""
        return self.app.state.request_counts


def build_engines(
    model: str, engines: int, engine_config: EngineConfig | None, disaggregate: bool = False
) -> list[Engine]:
    """``engines`` in-process engines; with ``disaggregate``, paired as prefill + decode engines, each pair
    one `DisaggregatedEngine` to the manager (Mutel's attention parallelism)."""
    if engines < 0:
        raise ValueError(f"engines must be >= 0 (0: only remote engines that register), got {engines}")
    if not disaggregate:
        return [LLMEngine.from_pretrained(model, engine_config) for _ in range(engines)]
    if engines % 2:
        raise ValueError(f"disaggregated engines pair prefill with decode: an even count, not {engines}")
    config = engine_config or EngineConfig()
    pairs: list[Engine] = []
    for _ in range(engines // 2):
        prefill = LLMEngine.from_pretrained(model, replace(config, role="prefill"))
        decode = LLMEngine.from_pretrained(model, replace(config, role="decode"))
        pairs.append(DisaggregatedEngine(prefill, decode))
    return pairs


def connect_openai_backends(
    backends: Sequence[str | OpenAIBackendConfig],
) -> list[OpenAIBackendEngine]:
    """Each OpenAI-compatible server (a URL, or its full configuration) as an engine."""
    configs = [b if isinstance(b, OpenAIBackendConfig) else OpenAIBackendConfig(b) for b in backends]
    return [OpenAIBackendEngine.connect(c) for c in configs]


@contextmanager
def launch(
    model: str = DEFAULT_MODEL,
    engines: int = 1,
    port: int = 0,
    host: str = "127.0.0.1",
    engine_config: EngineConfig | None = None,
    manager_config: ManagerConfig | None = None,
    startup_timeout: float = 60.0,
    network_delay: tuple[float, float] | None = None,
    network_delay_seed: int = 0,
    api_keys: Sequence[str] | None = None,
    cluster_token: str | None = None,
    max_remote_engines: int = 64,
    disaggregate: bool = False,
    openai_backends: Sequence[str | OpenAIBackendConfig] = (),
    ray: RayEngines | None = None,
    connection_limits: ConnectionLimits | None = None,
) -> Iterator[LaunchedServer]:
    """Start manager + ``engines`` in-process engines serving ``model`` (default: SmolLM2-135M-Instruct;
    ``"tiny"``, a ``.gguf`` file or a Hugging Face folder: see `server.engine.model_names`); stop everything
    on exit.

    ``network_delay=(low, high)`` puts the simulated client network delay (`server.common.netdelay`) in front
    of
    every request, as benchmarks do for both Parrot and the baseline.

    ``api_keys`` (default: ``$PARROT_API_KEY`` if set) guard the OpenAI routes. In-process engines need no
    token; remote ones join with ``cluster_token`` (default: ``$PARROT_CLUSTER_TOKEN``, else a random one,
    kept in memory only: read it from the yielded ``cluster_token``).

    ``disaggregate``: the engines serve in prefill + decode pairs (`build_engines`).

    ``openai_backends``: OpenAI-compatible servers (vLLM, SGLang, another Parrot) that serve as engines too,
    each a URL or an `OpenAIBackendConfig` (`server.cluster.openai_backend`).

    ``ray``: more engines, placed by Ray as actors that register with this server
    (`server.cluster.ray_engines`); the server is yielded once they all serve.
    """
    token = cluster_token or CLUSTER_TOKEN.get()
    settings = (
        SecurityConfig(token, api_keys_from(api_keys), max_remote_engines)
        if token
        else SecurityConfig.generated(api_keys=api_keys_from(api_keys), max_remote_engines=max_remote_engines)
    )
    pool = build_engines(model, engines, engine_config, disaggregate)
    try:
        pool += connect_openai_backends(openai_backends)
    except BaseException:
        for engine in pool:
            engine.shutdown()
        raise
    manager = Manager(pool, manager_config)
    app = create_app(manager, security=settings)
    delay = None
    if network_delay is not None:
        delay = NetworkDelayMiddleware(app, *network_delay, seed=network_delay_seed)
    served = app if delay is None else delay
    config = uvicorn.Config(
        served,
        host=host,
        port=port,
        log_level="warning",
        lifespan="on",
        http=guarded_h11(connection_limits or ConnectionLimits()),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="parrot-server", daemon=True)
    thread.start()
    launched: LaunchedServer | None = None
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port}")
            time.sleep(0.01)
        bound = server.servers[0].sockets[0].getsockname()[1]
        launched = LaunchedServer(f"http://{host}:{bound}", app, manager, pool, delay, settings.cluster_token)
        if ray is not None:
            launched.ray_actors = _place_on_ray(ray, model, engine_config, launched, host, startup_timeout)
        yield launched
    finally:
        if launched is not None and launched.ray_actors:
            from server.cluster.ray_engines import stop_ray_engines

            stop_ray_engines(launched.ray_actors)
        server.should_exit = True
        thread.join(timeout=30)
        for engine in pool:
            engine.shutdown()


def _place_on_ray(
    spec: RayEngines,
    model: str,
    config: EngineConfig | None,
    server: LaunchedServer,
    host: str,
    timeout: float,
) -> list[Any]:
    """Ray's engines, started and registered with ``server`` (its manager counts them in service)."""
    from server.cluster.ray_engines import manager_url_for, start_ray_engines

    port = int(server.url.rsplit(":", 1)[1])
    before = len(server.manager.engines)
    actors = start_ray_engines(spec, model, config, manager_url_for(host, port), server.cluster_token)
    deadline = time.monotonic() + timeout
    while len(server.manager.engines) < before + spec.count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray's {spec.count} engines did not register within {timeout:g}s")
        time.sleep(0.05)
    return actors
