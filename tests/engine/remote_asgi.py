"""An engine behind its own HTTP API in-process, driven through `RemoteEngine`, recording what reaches its
scheduler: for tests that a request field (latency cap, priority) travels over the wire intact."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from server.cluster.remote_engine import RemoteEngine
from server.engine import LLMEngine
from server.engine.api import create_engine_app
from server.engine.request import Request
from server.engine.wire import EngineInfo


@asynccontextmanager
async def recorded_remote(
    engine: LLMEngine,
) -> AsyncIterator[tuple[RemoteEngine, httpx.AsyncClient, list[Request]]]:
    """A `RemoteEngine` of ``engine`` over ASGI (no network), the raw HTTP client, and every request the
    engine's scheduler is given meanwhile, in order."""
    added: list[Request] = []
    add = engine.core.scheduler.add

    def record(req: Request) -> None:
        added.append(req)
        add(req)

    engine.core.scheduler.add = record  # type: ignore[method-assign]
    app = create_engine_app(engine, cluster_token=None)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as client:
            info = EngineInfo.model_validate((await client.get("/info")).json())
            yield RemoteEngine("http://e", "e", info, engine.tokenizer, client), client, added
    finally:
        engine.core.scheduler.add = add  # type: ignore[method-assign]
