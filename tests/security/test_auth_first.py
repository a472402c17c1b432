"""Nothing expensive before auth: a request without its route's credential is answered from its headers
alone — the body it announces is never read (an anonymous client could otherwise make the server buffer and
parse up to its body limit first) — and its connection is closed."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from server.common.auth_first import AuthFirstMiddleware
from server.engine import EngineConfig, LLMEngine
from server.engine.api import create_engine_app
from server.launcher import LaunchedServer, launch
from tests.security.conftest import TOKEN, serving

KEY = "key-under-test"


def _announce(url: str, method: str, path: str, length: int, headers: dict[str, str] | None = None) -> str:
    """Send only the head of a request announcing a ``length``-byte body; the status line of the answer,
    which must come while the body is still unsent."""
    parts = urlsplit(url)
    head = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json"]
    head += [f"Content-Length: {length}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            answer = sock.recv(65536).decode(errors="replace")
        except TimeoutError:
            pytest.fail(f"{method} {path}: no answer while the body was unsent (it waited for the body)")
    return answer.split("\r\n", 1)[0]


@pytest.fixture(scope="module")
def served() -> Iterator[LaunchedServer]:
    with launch("tiny", api_keys=[KEY]) as s:
        yield s


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/v1/completions", {}, 401),
        ("/v1/chat/completions", {"Authorization": "Bearer wrong"}, 403),
        ("/v1/sessions", {}, 401),
        ("/v1/sessions/nobody/batch", {}, 401),  # would create a session: needs the key
        ("/v1/sessions/nobody/calls", {"Authorization": "Bearer t"}, 404),
        ("/v1/engines", {}, 401),
        ("/v1/backends", {"Authorization": "Bearer wrong"}, 403),
    ],
)
def test_the_manager_refuses_from_the_headers(
    served: LaunchedServer, path: str, headers: dict[str, str], status: int
) -> None:
    assert _announce(served.url, "POST", path, 7_000_000, headers).split(" ")[1] == str(status)


def test_an_open_session_is_reached_with_its_token_and_refused_with_another(served: LaunchedServer) -> None:
    import httpx

    opened = httpx.post(f"{served.url}/v1/sessions", json={}, headers={"X-API-Key": KEY}).json()
    path = f"/v1/sessions/{opened['session_id']}/variables"
    wrong = {"Authorization": "Bearer wrong"}
    assert _announce(served.url, "POST", path, 7_000_000, wrong).endswith("401 Unauthorized")
    r = httpx.post(
        served.url + path, json={"value": "x"}, headers={"Authorization": f"Bearer {opened['token']}"}
    )
    assert r.status_code == 200, r.text


def test_an_engine_refuses_from_the_headers() -> None:
    engine = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=16))
    try:
        with serving(create_engine_app(engine, cluster_token=TOKEN)) as url:
            for path in ("/fill", "/generate", "/free_context"):
                assert _announce(url, "POST", path, 60_000_000).endswith("401 Unauthorized"), path
            wrong = {"Authorization": "Bearer wrong"}
            assert _announce(url, "POST", "/fill", 60_000_000, wrong).endswith("403 Forbidden")
    finally:
        engine.shutdown()


def test_every_route_but_the_open_ones_has_header_guards(served: LaunchedServer) -> None:
    # Every route the app serves is in the middleware's table (a route missing there would have its
    # credential checked only after its body is parsed), and every one but the open ones is guarded.
    open_routes = {"/health", "/health/ready", "/metrics", "/ui", "/ui/{name}"}
    (middleware,) = [m for m in served.app.user_middleware if m.cls is AuthFirstMiddleware]
    routes = middleware.kwargs["routes"]
    table = {(method, g.route.path_format): g.guards for g in routes for method in g.route.methods}
    served_routes = {
        (method.upper(), path)
        for path, operations in served.app.openapi()["paths"].items()
        for method in operations
    }
    assert served_routes - set(table) == set()
    assert [key for key, guards in table.items() if not guards and key[1] not in open_routes] == []
