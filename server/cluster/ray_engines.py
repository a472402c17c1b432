"""Engines placed by Ray: `python -m server --ray [ADDRESS]` (``launch(ray=RayEngines(...))``).

The manager starts each engine as a Ray actor that asks Ray for its resources (one GPU on clusters that have
GPUs, one CPU otherwise), so one command spreads engines over every machine of a Ray cluster. An actor runs
what ``python -m server.engine --manager URL`` runs — the engine, its HTTP API, and the registration and
heartbeats of `server.engine.manager_link` — so the manager drives it as any remote engine, with the cluster
token. Ray restarts an actor whose process died (``max_restarts``); the new one registers again under the
same name and replaces the dead entry, and the manager re-runs the steps that were running there (its
reliability rule). Ray is an optional dependency (``parrot-serve[ray]``), imported only here and only when
engines are placed by it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from server.cluster.ray_nodes import free_port, node_ip
from server.engine.config import EngineConfig

__all__ = ["EngineActor", "RayEngines", "manager_url_for", "start_ray_engines", "stop_ray_engines"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayEngines:
    """How many engines Ray places, and where its cluster is.

    ``address``: the Ray cluster's (``"auto"``, ``"ray://host:10001"``...); None starts a local one (or joins
    the one ``$RAY_ADDRESS`` names). ``num_gpus``: per engine; None asks for one where the cluster has GPUs.
    ``init_args``: more `ray.init` arguments (e.g. ``num_cpus`` for a local cluster).
    ``placement_timeout_s``: how long the engines may take to be placed and start.
    ``vllm_python``: each actor serves vLLM instead of our engine (`server.cluster.ray_vllm`), started with
    this interpreter (a virtualenv with vLLM on every node) and ``vllm_args`` / ``vllm_env``; the manager
    uses it as an OpenAI backend with ``tokenizer`` (None: the served model's id).
    """

    count: int
    address: str | None = None
    max_restarts: int = 3
    num_gpus: float | None = None
    placement_timeout_s: float = 300.0
    init_args: dict[str, Any] = field(default_factory=dict)
    vllm_python: str | None = None
    vllm_args: tuple[str, ...] = ()
    vllm_env: dict[str, str] = field(default_factory=dict)
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"Ray places at least one engine, got count={self.count}")


class EngineActor:
    """The body of one engine actor (wrapped by `ray.remote` in `start_ray_engines`)."""

    def __init__(
        self, model: str, config: EngineConfig, manager_url: str, name: str, cluster_token: str
    ) -> None:
        import uvicorn

        from server.engine import LLMEngine
        from server.engine.api import create_engine_app
        from server.engine.manager_link import ManagerLink

        host = node_ip()
        port = free_port(host)
        self.url = f"http://{host}:{port}"
        self.engine = LLMEngine.from_pretrained(model, config)
        link = ManagerLink(manager_url, self.url, name, self.engine.stats, cluster_token=cluster_token)
        app = create_engine_app(self.engine, link, cluster_token=cluster_token)
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name=f"engine-{name}", daemon=True)
        self._thread.start()
        while not self._server.started:  # the actor is ready once its API answers
            if not self._thread.is_alive():
                raise RuntimeError(f"engine {name}'s HTTP server did not start on {self.url}")
            time.sleep(0.02)

    def engine_url(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()


def start_ray_engines(
    spec: RayEngines, model: str, config: EngineConfig | None, manager_url: str, cluster_token: str
) -> list[Any]:
    """Start ``spec.count`` engine actors serving ``model`` that register with the manager at
    ``manager_url``; returns their handles (keep them: an actor without a handle is ended)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=spec.address, **spec.init_args)
    gpus = spec.num_gpus
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    resources: dict[str, Any] = {
        "num_cpus": 0 if gpus else 1,
        "num_gpus": gpus,
        "max_restarts": spec.max_restarts,
    }
    actors: list[Any]  # Ray's actor handles
    if spec.vllm_python is not None:
        from server.cluster.ray_vllm import VLLMActor

        vllm: Any = ray.remote(**resources, max_task_retries=0)(VLLMActor)
        args = (spec.vllm_python, model, manager_url, cluster_token, spec.vllm_args, spec.vllm_env)
        actors = [vllm.remote(*args, spec.tokenizer, spec.placement_timeout_s) for _ in range(spec.count)]
    else:
        engine: Any = ray.remote(**resources, max_task_retries=0)(EngineActor)
        config = config or EngineConfig()
        actors = [
            engine.remote(model, config, manager_url, f"ray-engine-{i}", cluster_token)
            for i in range(spec.count)
        ]
    try:
        urls = ray.get([a.engine_url.remote() for a in actors], timeout=spec.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        stop_ray_engines(actors)
        need = f"{gpus:g} GPU" if gpus else "1 CPU"
        raise RuntimeError(
            f"Ray did not start {spec.count} engine(s) within {spec.placement_timeout_s:g}s: each asks for "
            f"{need}, and the cluster has {ray.available_resources()} free"
        ) from None
    log.info("Ray placed %d engines: %s", len(urls), ", ".join(urls))
    return actors


def stop_ray_engines(actors: list[Any]) -> None:
    """End the actors (no restart)."""
    import ray

    for actor in actors:
        ray.kill(actor, no_restart=True)


def manager_url_for(host: str, port: int) -> str:
    """The URL actors reach the manager at: its bound address, or this node's IP when bound to all."""
    return f"http://{node_ip() if host in ('0.0.0.0', '::', '') else host}:{port}"
