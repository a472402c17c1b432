"""A session opens with its first batch (`BatchRequest.create`): the client chooses its id and token, so a
fresh session's first ``get`` is one request, sync and async, on one engine and two; the server checks
what a client chooses (format, ids and tokens in use) and what would refuse a session (quotas), and a
refusal loses nothing queued."""

from __future__ import annotations

import secrets
import uuid
from collections import Counter

import httpx
import parrot as P
import pytest

from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig
from server.serve.quotas import Quotas

SAY = P.SemanticFunction.from_template(
    "Say {{input:x}}: {{output:y}}",
    name="say",
    sampling=P.SamplingConfig(max_tokens=3, temperature=0.0, ignore_eos=True),
)
BATCH = ("POST", "/v1/sessions/{session_id}/batch")


def _requests(server: LaunchedServer, before: Counter[tuple[str, str]]) -> Counter[tuple[str, str]]:
    return Counter(server.request_counts) - before


def test_a_sessions_first_get_is_one_request(one_or_two: LaunchedServer) -> None:
    before = Counter(one_or_two.request_counts)
    with P.Session(one_or_two.url) as session:
        assert _requests(one_or_two, before) == Counter()  # opening sends nothing
        value = SAY(x=SAY(x="hello")).get()
        assert _requests(one_or_two, before) == Counter({BATCH: 1})  # created, submitted, answered
        assert session.session_id in one_or_two.manager.sessions and isinstance(value, str)
    assert session.session_id not in one_or_two.manager.sessions  # deleted on leaving


async def test_an_async_sessions_first_get_is_one_request(one_or_two: LaunchedServer) -> None:
    before = Counter(one_or_two.request_counts)
    async with P.Session(one_or_two.url, cache_salt="tenant-a") as session:
        await SAY(x="hello").aget()
        assert _requests(one_or_two, before) == Counter({BATCH: 1})
        assert one_or_two.manager.sessions.find(session.session_id or "").cache_salt == "tenant-a"


def test_a_session_that_sends_nothing_never_exists(one_or_two: LaunchedServer) -> None:
    before = Counter(one_or_two.request_counts)
    with P.Session(one_or_two.url) as session:
        session.flush()  # an empty queue: nothing to send
    assert _requests(one_or_two, before) == Counter()


def _open(server: LaunchedServer, sid: str, token: str, **create: str) -> httpx.Response:
    body = {"ops": [{"op": "create_variable", "value": "v"}], "create": create}
    return httpx.post(
        f"{server.url}/v1/sessions/{sid}/batch", json=body, headers={"Authorization": f"Bearer {token}"}
    )


def test_what_a_client_chooses_is_checked(one_or_two: LaunchedServer) -> None:
    sid, token = uuid.uuid4().hex, secrets.token_urlsafe(32)
    assert _open(one_or_two, sid, token).status_code == 200
    assert _open(one_or_two, sid, token).status_code == 200  # a retry: the session exists, same token
    assert _open(one_or_two, sid, secrets.token_urlsafe(32)).status_code == 401  # another's id
    taken = _open(one_or_two, uuid.uuid4().hex, token)  # another session's token
    assert taken.status_code == 409 and taken.json()["error"]["type"] == "session_conflict"
    weak = _open(one_or_two, uuid.uuid4().hex, "short")
    assert weak.status_code == 400 and "token_urlsafe(32)" in weak.json()["error"]["message"]
    assert _open(one_or_two, "bad id!", secrets.token_urlsafe(32)).status_code in (400, 404)
    assert _open(one_or_two, "short", secrets.token_urlsafe(32)).status_code == 400
    no_token = httpx.post(f"{one_or_two.url}/v1/sessions/{uuid.uuid4().hex}/batch", json={"create": {}})
    assert no_token.status_code == 401
    without_create = _open(one_or_two, sid, token).json()  # (a plain batch to the existing session works)
    assert without_create["results"][0]["var_id"]


def test_a_refused_opening_keeps_the_queue() -> None:
    config = ManagerConfig(quotas=Quotas(sessions_per_client=1))
    with launch("tiny", manager_config=config) as server:
        first = httpx.post(f"{server.url}/v1/sessions").json()  # the client's one session
        with P.Session(server.url) as session:
            late = SAY(x="later")
            with pytest.raises(P.ParrotError, match="sessions_per_client") as refused:
                late.get()
            assert refused.value.status == 429 and session.session_id not in server.manager.sessions
            auth = {"Authorization": f"Bearer {first['token']}"}
            httpx.delete(f"{server.url}/v1/sessions/{first['session_id']}", headers=auth)  # room again
            assert isinstance(late.get(), str)  # the same queue, sent again: nothing was lost
            assert session.session_id in server.manager.sessions
