"""`--api-key`: with keys configured, every generating route refuses requests without one (401) or with
another (403) and accepts any configured key: the OpenAI routes, and the opening of a session (whose token
then guards its routes); health needs none. The clients (`parrot.Session`, the OpenAI-style HTTP call,
LangChain's models and runnables, LlamaIndex's LLM) pass a key through."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import parrot as P
import pytest
from langchain_parrot import ChatParrot, ParrotLLM as LangChainLLM
from llamaindex_parrot import ParrotLLM as LlamaIndexLLM
from llamaindex_parrot.server_info import served_model

from server.launcher import LaunchedServer, launch

KEYS = ("key-one", "key-two")

OPENAI_ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Once", "max_tokens": 2}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
]


@pytest.fixture(scope="module")
def served() -> Iterator[LaunchedServer]:
    with launch("tiny", api_keys=list(KEYS)) as s:
        yield s


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(("method", "path", "body"), OPENAI_ROUTES)
def test_the_openai_routes_need_a_configured_key(
    served: LaunchedServer, method: str, path: str, body: dict[str, Any] | None
) -> None:
    refusals = [({}, 401, "missing_api_key"), (_bearer("key-three"), 403, "invalid_api_key")]
    refusals.append((_bearer(KEYS[0][:-1]), 403, "invalid_api_key"))  # a prefix of a key is wrong too
    for headers, status, error_type in refusals:
        r = httpx.request(method, served.url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["type"] == error_type and "--api-key" in error["message"]
        assert all(key not in r.text for key in KEYS)
    for key in KEYS:  # every configured key is accepted
        r = httpx.request(method, served.url + path, json=body, headers=_bearer(key), timeout=60)
        assert r.status_code == 200, r.text


def test_opening_a_session_needs_a_key_too_and_health_needs_none(served: LaunchedServer) -> None:
    assert httpx.get(f"{served.url}/health").status_code == 200

    @P.semantic_function(max_tokens=2)
    def echo(x):  # type: ignore[no-untyped-def]
        """Say {{input:x}}: {{output:y}}"""

    with pytest.raises(P.AuthError, match="--api-key"), P.Session(served.url, api_key=None) as s:
        echo("a").get()
    assert not s.session_id or s.session_id not in served.manager.sessions  # nothing was created
    with pytest.raises(P.AuthError), P.Session(served.url, api_key="key-three"):
        echo("a").get()
    with P.Session(served.url, api_key=KEYS[1]):  # the key rides beside the session's own token
        assert isinstance(echo("a").get(), str)
    r = httpx.post(f"{served.url}/v1/sessions", json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "missing_api_key"
    r = httpx.post(f"{served.url}/v1/sessions", json={}, headers=_bearer(KEYS[0]))
    assert r.status_code == 200, r.text
    session = r.json()
    # An open session's routes take its token alone: the key opened it.
    auth = _bearer(session["token"])
    r = httpx.get(f"{served.url}/v1/sessions/{session['session_id']}/steps", headers=auth)
    assert r.status_code == 200, r.text


async def test_an_async_session_passes_the_key_too(served: LaunchedServer) -> None:
    @P.semantic_function(max_tokens=2)
    def echo(x):  # type: ignore[no-untyped-def]
        """Say {{input:x}}: {{output:y}}"""

    async with P.Session(served.url, api_key=KEYS[0]):
        first = echo("a")
        assert isinstance(await echo(first).aget(), str)  # a literal, then a future as input
    with pytest.raises(P.AuthError):
        async with P.Session(served.url, api_key=None):
            await echo("a").aget()


def test_the_key_comes_from_the_environment(served: LaunchedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARROT_API_KEY", KEYS[0])

    @P.semantic_function(max_tokens=2)
    def echo(x):  # type: ignore[no-untyped-def]
        """Say {{input:x}}: {{output:y}}"""

    with P.Session(served.url):
        assert isinstance(echo("a").get(), str)


def test_without_keys_the_openai_routes_stay_open() -> None:
    with launch("tiny", api_keys=[]) as served:
        assert httpx.get(f"{served.url}/v1/models").status_code == 200


def test_clients_pass_the_key(served: LaunchedServer) -> None:
    assert served_model(served.url, "tiny", 30, api_key=KEYS[1]).context_window > 0
    with pytest.raises(P.AuthError):
        served_model(served.url, "tiny", 30)
    llm = LlamaIndexLLM(served.url, model="tiny", api_key=KEYS[0], max_tokens=2)
    assert llm.metadata.context_window == served.engines[0].max_model_len
    assert "api_key" not in llm.model_dump()  # a secret is not serialized
    assert llm.complete("Once").text is not None  # its OpenAI-style calls carry the key
    assert "".join(r.delta or "" for r in llm.stream_complete("Once")) is not None
    with pytest.raises(P.AuthError):
        LlamaIndexLLM(served.url, model="tiny", api_key=KEYS[0], max_tokens=2).model_copy(
            update={"api_key": "nope"}
        ).complete("Once")
    assert LangChainLLM(base_url=served.url, api_key=KEYS[0], max_tokens=2).invoke("Once") is not None
    chat = ChatParrot(base_url=served.url, api_key=KEYS[1], max_tokens=2)
    assert chat.invoke("hi").content is not None
    with pytest.raises(P.AuthError):
        ChatParrot(base_url=served.url, api_key="nope", max_tokens=2, max_retries=0).invoke("hi")


def test_cached_prefixes_are_shared_within_a_key_and_never_across_keys(served: LaunchedServer) -> None:
    # Another tenant could otherwise tell from a fast answer that a prompt's prefix was sent before.
    engine = served.engines[0]
    prompt = " ".join(f"fact {i} is private to one tenant." for i in range(60))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}

    def computed(key: str, **extra: str) -> int:
        before = engine.stats().prefill_tokens_computed
        r = httpx.post(f"{served.url}/v1/completions", json=body | extra, headers=_bearer(key), timeout=60)
        assert r.status_code == 200, r.text
        return engine.stats().prefill_tokens_computed - before

    full = len(engine.tokenizer.encode(prompt))
    assert computed(KEYS[0]) == full
    assert computed(KEYS[0]) < full  # the same key reuses its cached prefix
    assert computed(KEYS[1]) == full  # another key does not see it
    assert computed(KEYS[1], cache_salt="shared-by-choice") == full
    assert computed(KEYS[0], cache_salt="shared-by-choice") < full  # crossing keys is an explicit opt-in
