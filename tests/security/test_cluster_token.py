"""The cluster token: engine registration, heartbeats, unregistration, the engine list and an engine's own
HTTP API refuse anyone without it (401) or with another (403); with it, everything works. Heartbeats are
sanity-checked, registration reads nothing back from the URL it is given, and engines are bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from server.engine import EngineConfig, LLMEngine
from server.engine.api import create_engine_app
from server.engine.wire import EngineStats
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig
from tests.security.conftest import AUTH, TOKEN, serving

SECRET = "SECRET-internal-answer"
WRONG = {"Authorization": "Bearer not-the-token"}


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    e = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=64))
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def engine_url(engine: LLMEngine) -> Iterator[str]:
    """The engine's HTTP API, accepting only the cluster token (registered by hand in these tests)."""
    with serving(create_engine_app(engine, cluster_token=TOKEN)) as url:
        yield url


@pytest.fixture(scope="module")
def served() -> Iterator[LaunchedServer]:
    config = ManagerConfig(engine_timeout=600.0)  # engines here send heartbeats by hand only
    with launch("tiny", engines=0, manager_config=config, cluster_token=TOKEN) as s:
        yield s


def _stats(engine: LLMEngine, **changes: Any) -> dict[str, Any]:
    return engine.stats().model_dump() | changes


def _register(served: LaunchedServer, name: str, url: str, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(
        f"{served.url}/v1/engines", json={"name": name, "url": url}, headers=headers, timeout=30
    )


GUARDED = [
    ("POST", "/v1/engines", {"name": "intruder", "url": "http://127.0.0.1:9"}),
    ("POST", "/v1/engines/0/heartbeat", {"stats": {}}),
    ("DELETE", "/v1/engines/0", None),
    ("GET", "/v1/engines", None),
]
REFUSALS = [
    ({}, 401, "missing_cluster_token"),
    ({"Authorization": f"Basic {TOKEN}"}, 401, "missing_cluster_token"),
    (WRONG, 403, "invalid_cluster_token"),
    ({"Authorization": f"Bearer {TOKEN}x"}, 403, "invalid_cluster_token"),
]


@pytest.mark.parametrize(("method", "path", "body"), GUARDED)
@pytest.mark.parametrize(("headers", "status", "error_type"), REFUSALS)
def test_engine_routes_refuse_anonymous_and_wrong_tokens(
    served: LaunchedServer,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    status: int,
    error_type: str,
) -> None:
    before = served.manager.engine_status()
    r = httpx.request(method, served.url + path, json=body, headers=headers, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["type"] == error_type
    assert "PARROT_CLUSTER_TOKEN" in error["message"] and "--cluster-token-file" in error["message"]
    assert TOKEN not in r.text
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
    assert served.manager.engine_status() == before


def test_with_the_token_register_heartbeat_list_serve_and_leave(
    served: LaunchedServer, engine: LLMEngine, engine_url: str
) -> None:
    r = _register(served, "good", engine_url)
    assert r.status_code == 200, r.text
    engine_id = r.json()["engine_id"]

    total = engine.stats().blocks_total
    beat = _stats(engine, running=3, blocks_used=5, blocks_free=total - 5)
    r = httpx.post(f"{served.url}/v1/engines/{engine_id}/heartbeat", json={"stats": beat}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"steps_running": 0}, r.text
    listed = httpx.get(f"{served.url}/v1/engines", headers=AUTH).json()
    (mine,) = [e for e in listed if e["engine_id"] == engine_id]
    assert mine["alive"] and mine["stats"]["running"] == 3 and mine["stats"]["blocks_used"] == 5

    # The manager calls the engine's guarded API with the token: a completion runs there.
    body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 3, "temperature": 0}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3

    assert httpx.delete(f"{served.url}/v1/engines/{engine_id}", headers=AUTH).status_code == 204
    listed = httpx.get(f"{served.url}/v1/engines", headers=AUTH).json()
    assert not next(e for e in listed if e["engine_id"] == engine_id)["alive"]


def test_spoofed_and_nonsensical_heartbeats_change_nothing(
    served: LaunchedServer, engine: LLMEngine, engine_url: str
) -> None:
    r = _register(served, "beating", engine_url)
    assert r.status_code == 200, r.text
    engine_id = r.json()["engine_id"]
    url = f"{served.url}/v1/engines/{engine_id}/heartbeat"
    before = served.manager.engines[engine_id].stats()
    total = before.blocks_total

    # An attack: blocks_total=0 made every call fail as too large. Without the token: 403.
    spoof = {"stats": _stats(engine, blocks_total=0, blocks_free=0)}
    assert httpx.post(url, json=spoof, headers=WRONG).status_code == 403
    assert httpx.post(url, json=spoof).status_code == 401
    assert served.manager.engines[engine_id].stats() == before

    nonsense = [
        ({"blocks_total": 0, "blocks_free": 0}, "blocks_total must be > 0"),
        ({"running": -1}, "must not be negative: running"),
        ({"blocks_used": total + 1, "blocks_free": 0}, "over blocks_total"),
        ({"blocks_used": total, "blocks_free": 1}, "over blocks_total"),
        ({"block_size": before.block_size * 2}, "block_size differ"),
        ({"max_model_len": 1}, "max_model_len differ"),
        ({"model": "another"}, "model differ"),
    ]
    for changes, why in nonsense:
        r = httpx.post(url, json={"stats": _stats(engine, **changes)}, headers=AUTH)
        assert r.status_code == 400, (changes, r.text)
        error = r.json()["error"]
        assert error["type"] == "bad_heartbeat" and why in error["message"], (changes, error)
        assert served.manager.engines[engine_id].stats() == before

    sane = _stats(engine, waiting=2)
    assert httpx.post(url, json={"stats": sane}, headers=AUTH).status_code == 200
    assert served.manager.engines[engine_id].stats() == EngineStats.model_validate(sane)
    assert httpx.delete(f"{served.url}/v1/engines/{engine_id}", headers=AUTH).status_code == 204


def test_an_engine_with_another_token_cannot_be_registered(served: LaunchedServer, engine: LLMEngine) -> None:
    before = len(served.manager.engines)
    with serving(create_engine_app(engine, cluster_token="someone-elses")) as url:
        r = _register(served, "foreign", url)
    assert r.status_code == 400
    assert "refused the manager's cluster token" in r.json()["error"]["message"]
    assert len(served.manager.engines) == before


def _impostor() -> Starlette:
    """Answers in every way an engine does not, each answer carrying SECRET (what an internal service
    reached by SSRF would hold), under a path prefix per kind: /plain, /json, /huge, /redirect, /error,
    /badtok (a valid /info, unloadable tokenizer files), /pathtok (a tokenizer file name with a path)."""
    info = {"model": "m", "max_model_len": 64, "vocab_size": 10, "block_size": 16, "blocks_total": 4}
    answers: dict[str, Response] = {
        "/plain/info": PlainTextResponse(SECRET * 10),
        "/json/info": JSONResponse({"model": {"nested": SECRET}, "max_model_len": SECRET, SECRET: 1}),
        "/huge/info": JSONResponse({"model": SECRET * 10_000}),
        "/redirect/info": RedirectResponse(f"/plain/info?{SECRET}", status_code=302),
        "/error/info": PlainTextResponse(SECRET, status_code=500),
        "/badtok/info": JSONResponse(info | {"eos_token_ids": [0]}),
        "/badtok/tokenizer": JSONResponse({"files": {"tokenizer.json": SECRET}}),
        "/pathtok/info": JSONResponse(info | {"eos_token_ids": [0]}),
        "/pathtok/tokenizer": JSONResponse({"files": {f"../{SECRET}": "{}"}}),
    }

    async def answer(request: Request) -> Response:
        return answers.get(request.url.path, PlainTextResponse(SECRET, status_code=404))

    return Starlette(routes=[Route("/{path:path}", answer)])


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("plain", "did not answer an engine's /info"),
        ("json", "wrong or missing: "),
        ("huge", "more than 65536 bytes"),
        ("redirect", "answered HTTP 302"),
        ("error", "answered HTTP 500"),
        ("badtok", "do not load as a tokenizer"),
        ("pathtok", "file name with a path"),
    ],
)
def test_registration_never_echoes_what_the_url_answered(served: LaunchedServer, kind: str, why: str) -> None:
    before = len(served.manager.engines)
    with serving(_impostor()) as url:
        r = _register(served, f"impostor-{kind}", f"{url}/{kind}")
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert why in message and SECRET not in r.text
    assert len(served.manager.engines) == before


def test_registered_engines_are_bounded(engine_url: str) -> None:
    with launch("tiny", engines=0, cluster_token=TOKEN, max_remote_engines=1) as served:
        assert _register(served, "first", engine_url).status_code == 200
        r = _register(served, "second", engine_url)
        assert r.status_code == 429
        error = r.json()["error"]
        assert error["type"] == "too_many_engines" and "its limit is 1" in error["message"]
        # The same engine registering again (restarted) replaces itself: not refused.
        assert _register(served, "first", engine_url).status_code == 200
        alive = [e for e in served.manager.engine_status() if e.alive]
        assert [e.name for e in alive] == ["first"]


# ------------------------------------------------------------------------------ the engine's own API
@pytest.fixture
async def engine_client(engine: LLMEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_engine_app(engine, cluster_token=TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        yield c


ENGINE_ROUTES = [
    ("GET", "/info", None),
    ("GET", "/tokenizer", None),
    ("GET", "/stats", None),
    ("POST", "/fill", {"context_id": 901, "token_ids": [1, 2, 3]}),
    ("POST", "/generate", {"context_id": 902, "parent_context_id": 900, "sampling": {"max_tokens": 1}}),
    ("POST", "/free_context", {"context_id": 900}),
]


async def test_the_engine_api_answers_only_the_token_holder(
    engine_client: httpx.AsyncClient, engine: LLMEngine
) -> None:
    # A context of someone's: anonymous calls must neither read, extend, fork nor free it.
    r = await engine_client.post("/fill", json={"context_id": 900, "token_ids": [5, 6, 7]}, headers=AUTH)
    assert r.status_code == 200, r.text
    contexts = engine.stats().contexts
    for method, path, body in ENGINE_ROUTES:
        for headers, status, error_type in REFUSALS:
            r = await engine_client.request(method, path, json=body, headers=headers)
            assert r.status_code == status, (path, headers, r.text)
            assert r.json()["error"]["type"] == error_type
            assert "PARROT_CLUSTER_TOKEN" in r.json()["error"]["message"]
    assert engine.stats().contexts == contexts
    assert (await engine_client.get("/health")).status_code == 200  # liveness stays open

    # With the token, the same calls go through.
    assert (await engine_client.get("/stats", headers=AUTH)).json()["contexts"] == contexts
    r = await engine_client.post("/free_context", json={"context_id": 900}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert engine.stats().contexts == contexts - 1
