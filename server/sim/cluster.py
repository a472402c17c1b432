"""A whole simulated deployment: the real manager and HTTP app over `SimEngine`s, on virtual time.

`sim_cluster` builds what `server.launch` builds — `Manager`, `create_app`, the optional network-delay
middleware — over ``n`` simulated engines, and hands out an ``httpx.AsyncClient`` that talks to the app
in-process (ASGI, no sockets). Clients written for a real server (the `parrot` frontend with
``Session(url, client=...)``, plain ``/v1/completions`` calls) run unchanged against it. Run it inside
`server.sim.run` so every wait is virtual:

    async def main():
        async with sim_cluster(4, load_profile("a100-llama7b")) as cluster:
            ...  # drive cluster.client; cluster.now() is the simulated time

    server.sim.run(main())
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx
from fastapi import FastAPI

from server.common.netdelay import NetworkDelayMiddleware
from server.engine.config import EngineConfig, ModelConfig
from server.http.app import create_app
from server.serve.manager import Manager, ManagerConfig
from server.sim.clock import VirtualTimeLoop
from server.sim.engine import SimEngine
from server.sim.latency import LatencyModel

__all__ = ["SIM_URL", "SimCluster", "sim_cluster", "tiny_tokenizer"]

SIM_URL = "http://sim"


@cache
def tiny_tokenizer() -> Any:
    """The embedded model's tokenizer: simulated engines count and decode tokens with it."""
    from transformers import AutoTokenizer

    from server.engine.tiny import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)


def sim_model_config(latency: LatencyModel) -> ModelConfig:
    """The tiny model's shape (vocabulary, special tokens) with the profile's context window."""
    from server.engine.tiny.model import TINY_CONFIG

    return ModelConfig.from_hf_dict({**TINY_CONFIG, "max_position_embeddings": latency.max_model_len})


@dataclass
class SimCluster:
    """A running simulated deployment (see the module docstring)."""

    manager: Manager
    engines: list[SimEngine]
    app: FastAPI
    client: httpx.AsyncClient
    network_delay: NetworkDelayMiddleware | None = None
    url: str = SIM_URL

    def now(self) -> float:
        """Simulated seconds since the loop started."""
        return asyncio.get_running_loop().time()


@contextlib.asynccontextmanager
async def sim_cluster(
    engines: int,
    latency: LatencyModel,
    *,
    engine_config: EngineConfig | None = None,
    manager_config: ManagerConfig | None = None,
    network_delay: tuple[float, float] | None = None,
    network_delay_seed: int = 0,
    model_name: str = "sim",
) -> AsyncIterator[SimCluster]:
    """``engines`` simulated engines behind the real manager and app (see the module docstring)."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualTimeLoop):
        raise RuntimeError(
            "sim_cluster needs virtual time: run the coroutine with server.sim.run(...), not asyncio.run"
        )
    if engines < 1:
        raise ValueError(f"a simulated cluster needs at least one engine, got {engines}")
    tokenizer = tiny_tokenizer()
    config = engine_config or EngineConfig(device="cpu")
    pool = [
        SimEngine(latency, tokenizer, sim_model_config(latency), config, model_name) for _ in range(engines)
    ]
    manager = Manager(list(pool), manager_config, clock=loop.time)
    app = create_app(manager)
    delay = None
    if network_delay is not None:
        delay = NetworkDelayMiddleware(app, *network_delay, seed=network_delay_seed)
    transport = httpx.ASGITransport(app=delay or app)
    client = httpx.AsyncClient(transport=transport, base_url=SIM_URL, timeout=None)
    try:
        yield SimCluster(manager, pool, app, client, delay)
    finally:
        await client.aclose()
        await manager.shutdown()
        for engine in pool:
            engine.shutdown()
