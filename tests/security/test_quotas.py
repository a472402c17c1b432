"""Quotas over HTTP: a client at its session quota, a session at its variable or step quota, answer 429
with ``Retry-After`` and change nothing; other clients and sessions are unaffected. A session whose client
waits on a long-poll get is not idle, so the reaper never deletes it under the waiting request."""

from __future__ import annotations

import dataclasses

import httpx
import parrot as P
import pytest

from server.launcher import launch
from server.serve.manager import ManagerConfig
from server.serve.quotas import Quotas


def _session(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/sessions", json={}, timeout=30)


def test_a_client_at_its_session_quota_gets_429_until_it_deletes_one() -> None:
    config = ManagerConfig(quotas=Quotas(sessions_per_client=2))
    with launch("tiny", manager_config=config) as served:
        made = [_session(served.url).json() for _ in range(2)]
        refused = _session(served.url)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "quota_exceeded"
        assert "sessions_per_client" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        first = made[0]
        gone = httpx.delete(
            f"{served.url}/v1/sessions/{first['session_id']}",
            headers={"Authorization": f"Bearer {first['token']}"},
            timeout=30,
        )
        assert gone.status_code == 204
        assert _session(served.url).status_code == 200


@P.semantic_function(max_tokens=2)
def echo(x):
    """Say {{input:x}} then {{output:y}}"""


def test_variable_and_step_quotas_refuse_the_call_and_keep_the_session_serving() -> None:
    config = ManagerConfig(quotas=Quotas(variables_per_session=4, queued_steps_per_session=50))
    with launch("tiny", manager_config=config) as served, P.Session(served.url) as s:
        first = echo(s.variable("a"))  # an input and an output variable: 2 of 4
        second = echo(s.variable("b"))  # 4 of 4
        assert len(first.get()) > 0 and len(second.get()) > 0
        with pytest.raises(P.ParrotError, match="variables_per_session"):
            echo(s.variable("c")).get()
        assert second.get() == second.get()  # the session still answers


def test_a_step_quota_refusal_is_429_and_names_the_quota() -> None:
    config = ManagerConfig(quotas=Quotas(queued_steps_per_session=1))
    with launch("tiny", manager_config=config) as served:
        session = _session(served.url).json()
        auth = {"Authorization": f"Bearer {session['token']}"}
        calls = f"{served.url}/v1/sessions/{session['session_id']}/calls"
        body = {
            "template": "Two steps: {{output:a}} and {{output:b}}",
            "placeholders": [{"name": "a", "role": "output"}, {"name": "b", "role": "output"}],
        }
        refused = httpx.post(calls, json=body, headers=auth, timeout=30)
        assert refused.status_code == 429, refused.text
        assert "queued_steps_per_session" in refused.json()["error"]["message"]
        assert refused.headers["Retry-After"] == "1"


async def test_the_reaper_never_deletes_a_session_under_a_waiting_get() -> None:
    # TTL far below how long the get waits: without the waiting guard the reaper deletes the session and
    # the get fails; with it, the get times out normally (the variable is never set) and the session lives.
    config = dataclasses.replace(ManagerConfig(), session_ttl=0.2)
    with launch("tiny", manager_config=config) as served:
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            session = (await client.post("/v1/sessions", json={})).json()
            auth = {"Authorization": f"Bearer {session['token']}"}
            sid = session["session_id"]
            var = (
                await client.post(f"/v1/sessions/{sid}/variables", json={"name": "x"}, headers=auth)
            ).json()
            got = await client.get(f"/v1/sessions/{sid}/variables/{var['var_id']}?timeout=2", headers=auth)
            assert got.status_code == 504, got.text  # its own timeout, not a deleted session
            alive = await client.get(f"/v1/sessions/{sid}/variables/{var['var_id']}?timeout=0", headers=auth)
            assert alive.status_code == 504, alive.text  # still there: pending, not 404
