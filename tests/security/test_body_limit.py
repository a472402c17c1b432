"""The request-body limit holds however the body is sent: a chunked upload without Content-Length is
counted as it is read and refused (413) as soon as it passes the limit, with nothing past it kept."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

import server.http.app
from server.common.body_limit import BodyLimitMiddleware
from server.launcher import launch

LIMIT = 1000


def _chunks(total: int, size: int = 100) -> Iterator[bytes]:
    for start in range(0, total, size):
        yield b"x" * min(size, total - start)


async def _run(headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[list[Message], int, list]:
    """Drive the middleware over an app that records what it reads: (messages sent, chunks the
    middleware took from the client, bodies the app saw)."""
    taken = 0
    seen: list[bytes] = []

    async def receive() -> Message:
        nonlocal taken
        taken += 1
        return {"type": "http.request", "body": chunks[taken - 1], "more_body": taken < len(chunks)}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    await BodyLimitMiddleware(app, LIMIT)(scope, receive, send)
    return sent, taken, seen


async def test_a_chunked_body_over_the_limit_is_refused_as_soon_as_it_passes_it() -> None:
    chunks = list(_chunks(50 * LIMIT))  # 500 chunks of 100 bytes
    sent, taken, seen = await _run([(b"transfer-encoding", b"chunked")], chunks)
    assert sent[0]["status"] == 413 and seen == []
    assert json.loads(sent[1]["body"])["error"]["type"] == "body_too_large"
    assert taken == LIMIT // 100 + 1  # stopped at the first chunk past the limit


async def test_bodies_within_the_limit_reach_the_app_whole() -> None:
    chunks = list(_chunks(LIMIT))
    sent, _, seen = await _run([(b"transfer-encoding", b"chunked")], chunks)
    assert sent[0]["status"] == 200 and seen == [b"x" * LIMIT]
    sent, _, seen = await _run([(b"content-length", str(LIMIT).encode())], [b"x" * LIMIT])
    assert sent[0]["status"] == 200 and seen == [b"x" * LIMIT]
    sent, taken, seen = await _run([(b"content-length", str(LIMIT + 1).encode())], [b"x" * (LIMIT + 1)])
    assert sent[0]["status"] == 413 and taken == 0 and seen == []  # refused before reading


def test_the_server_refuses_a_chunked_upload_over_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.http.app, "MAX_BODY_BYTES", LIMIT)
    with launch("tiny") as served:
        # A generator body goes out chunked (no Content-Length): the case the header check missed.
        r = httpx.post(f"{served.url}/v1/sessions", content=_chunks(3 * LIMIT), timeout=30)
        assert r.request.headers.get("transfer-encoding") == "chunked"
        assert r.status_code == 413 and r.json()["error"]["type"] == "body_too_large"
        sessions = len(served.manager.sessions)
        body = json.dumps({"cache_salt": "s"}).encode()
        json_type = {"Content-Type": "application/json"}
        r = httpx.post(f"{served.url}/v1/sessions", content=iter([body]), headers=json_type, timeout=30)
        assert r.status_code == 200, r.text  # a chunked body within the limit is served as before
        assert len(served.manager.sessions) == sessions + 1


def test_an_engine_api_refuses_a_body_over_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # The engine's own HTTP API has the limit too (64 MiB by default: a fill is a list of token ids).
    import server.engine.api as engine_api
    from server.engine import EngineConfig, LLMEngine

    monkeypatch.setattr(engine_api, "MAX_ENGINE_BODY_BYTES", LIMIT)
    engine = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=64))
    try:
        app = engine_api.create_engine_app(engine, cluster_token="t")
        transport = httpx.ASGITransport(app=app)
        auth = {"Authorization": "Bearer t"}

        async def post(body: dict) -> httpx.Response:
            async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
                return await c.post("/fill", json=body, headers=auth)

        big = asyncio.run(post({"context_id": 1, "token_ids": [1] * LIMIT}))
        assert big.status_code == 413 and big.json()["error"]["type"] == "body_too_large", big.text
        small = asyncio.run(post({"context_id": 1, "token_ids": [1, 2, 3]}))
        assert small.status_code == 200, small.text
    finally:
        engine.shutdown()
