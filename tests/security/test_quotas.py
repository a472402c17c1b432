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


_KEYS = ("key-of-alice", "key-of-bob")


class _Tenant:
    """One API key's HTTP client: sessions, variables and calls."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key

    def session(self) -> tuple[str, dict[str, str]]:
        made = httpx.post(f"{self.url}/v1/sessions", json={}, headers={"X-API-Key": self.key}, timeout=30)
        assert made.status_code == 200, made.text
        s = made.json()
        return f"{self.url}/v1/sessions/{s['session_id']}", {"Authorization": f"Bearer {s['token']}"}

    def variable(self, session: tuple[str, dict[str, str]], value: str | None = None) -> httpx.Response:
        base, auth = session
        body = {"name": "x"} if value is None else {"name": "x", "value": value}
        return httpx.post(f"{base}/variables", json=body, headers=auth, timeout=30)

    def waiting_call(self, session: tuple[str, dict[str, str]], max_tokens: int) -> httpx.Response:
        """A call whose input is never set: its step stays unfinished, its max_tokens in flight."""
        base, auth = session
        var_id = self.variable(session).json()["var_id"]
        placeholders = [
            {"name": "x", "role": "input", "var_id": var_id},
            {"name": "y", "role": "output", "sampling": {"max_tokens": max_tokens}},
        ]
        body = {"template": "Say {{input:x}}: {{output:y}}", "placeholders": placeholders}
        return httpx.post(f"{base}/calls", json=body, headers=auth, timeout=30)


def _refused(r: httpx.Response, quota: str) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "quota_exceeded" and quota in r.json()["error"]["message"]


def test_a_tenants_stored_values_are_bounded_across_its_sessions() -> None:
    config = ManagerConfig(quotas=Quotas(stored_chars_per_tenant=1000))
    with launch("tiny", manager_config=config, api_keys=list(_KEYS)) as served:
        alice, bob = (_Tenant(served.url, k) for k in _KEYS)
        first, second = alice.session(), alice.session()
        assert alice.variable(first, "a" * 400).status_code == 200
        assert alice.variable(second, "b" * 400).status_code == 200
        _refused(alice.variable(second, "c" * 400), "stored_chars_per_tenant")
        base, auth = second  # a set is counted as a create is
        unset = alice.variable(second).json()["var_id"]
        put = httpx.put(f"{base}/variables/{unset}", json={"value": "d" * 400}, headers=auth, timeout=30)
        _refused(put, "stored_chars_per_tenant")
        assert bob.variable(bob.session(), "e" * 900).status_code == 200  # another tenant: its own bound
        assert httpx.delete(first[0], headers=first[1], timeout=30).status_code == 204
        assert alice.variable(second, "c" * 400).status_code == 200  # the deleted session's values freed


def test_a_tenants_tokens_in_flight_are_bounded_across_sessions_and_the_openai_routes() -> None:
    config = ManagerConfig(quotas=Quotas(queued_tokens_per_tenant=100))
    with launch("tiny", manager_config=config, api_keys=list(_KEYS)) as served:
        alice, bob = (_Tenant(served.url, k) for k in _KEYS)
        assert alice.waiting_call(alice.session(), 60).status_code == 200
        _refused(alice.waiting_call(alice.session(), 60), "queued_tokens_per_tenant")
        completion = {"model": "tiny", "prompt": "Hello there", "max_tokens": 50}
        refused = httpx.post(
            f"{served.url}/v1/completions",
            json=completion,
            headers={"Authorization": f"Bearer {_KEYS[0]}"},
            timeout=60,
        )
        _refused(refused, "queued_tokens_per_tenant")
        for _ in range(3):  # bob's in-flight tokens are his own, and a finished request gives them back
            served_ok = httpx.post(
                f"{served.url}/v1/completions",
                json=completion,
                headers={"Authorization": f"Bearer {_KEYS[1]}"},
                timeout=60,
            )
            assert served_ok.status_code == 200, served_ok.text
        assert bob.waiting_call(bob.session(), 40).status_code == 200
