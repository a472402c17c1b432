"""Remote engines: an engine process registers with the manager over HTTP, heartbeats, serves Parrot calls
and the OpenAI API exactly like an in-process engine, and goes out of service when it falls silent."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import parrot as P
import pytest
import uvicorn

from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.api import create_engine_app
from server.engine.manager_link import ManagerLink
from server.engine.wire import EngineStats
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig
from tests.processes import free_port, wait_until
from tests.security.conftest import serving


@contextmanager
def remote_engine(
    manager_url: str, token: str, name: str = "remote-a"
) -> Iterator[tuple[LLMEngine, ManagerLink]]:
    """An engine's HTTP API in a background thread, joined to the manager like `--manager URL` does, with
    the manager's cluster ``token``."""
    engine = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=256))
    port = free_port()
    link = ManagerLink(manager_url, f"http://127.0.0.1:{port}", name, engine.stats, cluster_token=token)
    app = create_engine_app(engine, link, cluster_token=token)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield engine, link
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.shutdown()


@P.semantic_function(max_tokens=8)
def continue_story(text):  # type: ignore[no-untyped-def]
    """Continue the story: {{input:text}} Next: {{output:next}}"""


def _reference(engine: LLMEngine, prompt: str, max_tokens: int) -> str:
    async def run() -> str:
        await engine.fill(10**9, engine.tokenizer.encode(prompt))
        out = await engine.generate(10**9, SamplingParams(max_tokens=max_tokens))
        await engine.free_context(10**9)
        return out.text

    return asyncio.run(run())


@pytest.fixture(scope="module")
def manager_only() -> Iterator[LaunchedServer]:
    config = ManagerConfig(heartbeat_interval=0.2, engine_timeout=1.0)
    with launch("tiny", engines=0, manager_config=config) as s:
        yield s


def test_no_engine_is_a_clear_503(manager_only: LaunchedServer) -> None:
    with P.Session(manager_only.url):
        out = continue_story("x")
        with pytest.raises(P.ServiceUnavailableError, match="no engine is in service"):
            out.get()
    r = httpx.post(f"{manager_only.url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["type"] == "no_engine"


def test_a_remote_engine_registers_serves_and_times_out(manager_only: LaunchedServer) -> None:
    url, auth = manager_only.url, manager_only.cluster_headers

    def engines() -> list[dict]:
        return httpx.get(f"{url}/v1/engines", headers=auth).json()

    with remote_engine(url, manager_only.cluster_token) as (engine, link):
        wait_until(lambda: any(e["alive"] for e in engines()), timeout=30)
        (status,) = [e for e in engines() if e["alive"]]
        assert status["name"] == "remote-a" and status["url"].startswith("http://127.0.0.1:")
        assert status["stats"]["model"] == "tiny" and link.engine_id == status["engine_id"]

        # A chain of dependent calls runs on the remote engine: same text as the engine alone gives.
        with P.Session(url) as s:
            first = continue_story(s.variable("Once upon a time"))
            second = continue_story(first)
            got = [first.get(), second.get()]
        text1 = _reference(engine, "Continue the story: Once upon a time Next: ", 8)
        assert got[0] == text1
        assert got[1] == _reference(engine, f"Continue the story: {text1} Next: ", 8)
        assert engine.stats().contexts > 0  # the manager keeps finished contexts as prefixes there

        # The OpenAI API, streaming included, through the same remote engine.
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 5, "temperature": 0}, timeout=30
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == _reference(engine, "Once", 5)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 3

        # A prompt over the remote engine's window: OpenAI's context_length_exceeded, from its info.
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "word " * 5000, "max_tokens": 1}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

        # Heartbeats stop (a frozen or partitioned engine): taken out of service, then it registers again.
        old_id = link.engine_id
        link.manager_url = f"http://127.0.0.1:{free_port()}"  # the manager is out of reach
        wait_until(lambda: not engines()[old_id]["alive"], timeout=30)
        link.manager_url = url
        wait_until(lambda: link.engine_id != old_id and link.registered.is_set(), timeout=30)
        with P.Session(url):
            assert continue_story("again").get() == _reference(engine, "Continue the story: again Next: ", 8)
    # The engine left (unregistered on shutdown): out of service at once.
    assert not any(e["alive"] for e in engines())


def test_registration_of_an_unreachable_engine_names_its_url(manager_only: LaunchedServer) -> None:
    dead, auth = f"http://127.0.0.1:{free_port()}", manager_only.cluster_headers
    body = {"name": "ghost", "url": dead}
    r = httpx.post(f"{manager_only.url}/v1/engines", json=body, headers=auth, timeout=30)
    assert r.status_code == 400 and dead in r.json()["error"]["message"]
    r = httpx.post(f"{manager_only.url}/v1/engines/99/heartbeat", json={"stats": _stats()}, headers=auth)
    assert r.status_code == 404 and "register again" in r.json()["error"]["message"]


def _stats() -> dict:
    fields = EngineStats.model_fields
    return {
        name: "tiny" if name == "model" else 0 if field.is_required() else field.default
        for name, field in fields.items()
    }


def _draining_manager(answers: list[int]) -> tuple[httpx.AsyncClient, list[dict]]:
    """A manager that answers heartbeats with ``steps_running`` from ``answers`` (the last repeats)."""
    beats: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        beats.append(json.loads(request.content))
        left = answers[min(len(beats), len(answers)) - 1]
        return httpx.Response(200, json={"steps_running": left})

    return httpx.AsyncClient(transport=httpx.MockTransport(handle)), beats


def _registered_link(client: httpx.AsyncClient) -> ManagerLink:
    stats = EngineStats.model_validate(_stats())
    link = ManagerLink("http://manager", "http://engine", "e", lambda: stats, client, cluster_token="t")
    link.engine_id = 0
    link.registered.set()
    return link


def test_a_draining_engine_waits_until_the_manager_runs_nothing_there() -> None:
    # A step sends an engine several requests (fills, then the generation): the engine must not stop
    # between them, or the step runs again elsewhere. It heartbeats `draining` until the manager says 0.
    client, beats = _draining_manager([2, 1, 0])
    asyncio.run(_registered_link(client).drain(timeout=30, poll=0.01))
    assert len(beats) == 3 and all(b["stats"]["draining"] for b in beats)


def test_a_drain_that_never_empties_ends_at_its_timeout() -> None:
    client, beats = _draining_manager([5])
    asyncio.run(_registered_link(client).drain(timeout=0.1, poll=0.01))
    assert 2 <= len(beats) < 100


def test_an_engine_registering_again_at_its_url_under_another_name_replaces_its_entry() -> None:
    engine = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=64))
    # Registered by hand (no heartbeats): a manager that waits long enough for them.
    with launch("tiny", engines=0, manager_config=ManagerConfig(engine_timeout=120)) as manager:
        url, auth = manager.url, manager.cluster_headers
        app = create_engine_app(engine, None, cluster_token=manager.cluster_token)
        with serving(app) as engine_url:
            _register_twice(url, auth, engine_url)
    engine.shutdown()


def _register_twice(url: str, auth: dict[str, str], engine_url: str) -> None:
    ids = []
    for name in ("first-name", "second-name"):
        r = httpx.post(f"{url}/v1/engines", json={"url": engine_url, "name": name}, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        ids.append(r.json()["engine_id"])
    alive = [e for e in httpx.get(f"{url}/v1/engines", headers=auth).json() if e["alive"]]
    # One engine at one address: the old entry went out of service.
    assert [(e["engine_id"], e["name"]) for e in alive] == [(ids[1], "second-name")]
