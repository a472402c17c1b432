"""Tenants take turns in an engine's waiting queue: one tenant's flood of queued requests never holds back
another tenant's next request by more than one request of each tenant, under either scheduling.

The rule as pure functions (`server.engine.ordering`), on a bare `Scheduler`, then end to end: the tenant
reaches the engine over HTTP, and a server with API keys sends each key's tenant from both the session API
and the OpenAI routes.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import parrot as P
import pytest

from server.common.security import tenant_of
from server.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from server.engine.ordering import Queued, SchedulingPolicy, order_waiting, tenant_turns
from server.engine.request import Request
from server.engine.scheduler import Scheduler
from server.launcher import launch
from tests.engine.conftest import prompts
from tests.engine.remote_asgi import recorded_remote
from tests.engine.test_caps import _generate, _running, _table

AGING_S = 5.0


def _q(name: str, seq: int, tenant: str, priority: float = 0.0, at: float = 0.0, **kw: bool) -> Queued[str]:
    return Queued(name, seq, at, priority, tenant=tenant, **kw)


def _names(queue: list[Queued[str]]) -> list[str]:
    return [e.item for e in queue]


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_a_flooding_tenant_takes_turns_with_the_next_tenant(policy: SchedulingPolicy) -> None:
    queue = [_q(f"a{i}", i, "A") for i in range(4)] + [_q("b0", 4, "B"), _q("a4", 5, "A"), _q("b1", 6, "B")]
    got = _names(order_waiting(queue, now=0.0, policy=policy, aging_s=AGING_S))
    assert got == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"]


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_one_tenant_keeps_the_policys_own_order(policy: SchedulingPolicy) -> None:
    queue = [_q("long", 0, "", 90.0), _q("short", 1, "", 3.0), _q("mid", 2, "", 10.0)]
    expected = ["long", "short", "mid"] if policy == "fcfs" else ["short", "mid", "long"]
    assert _names(order_waiting(queue, now=0.0, policy=policy, aging_s=AGING_S)) == expected


def test_under_sjf_a_tenants_turns_follow_its_own_shortest_first_order() -> None:
    queue = [
        _q("a-long", 0, "A", 90.0),
        _q("a-short", 1, "A", 1.0),
        _q("b-long", 2, "B", 80.0),
        _q("b-latency", 3, "B", 50.0, latency_critical=True),
    ]
    got = _names(order_waiting(queue, now=0.0, policy="sjf", aging_s=AGING_S))
    assert got == ["b-latency", "a-short", "b-long", "a-long"]


def test_resumed_and_aged_requests_stay_first_whatever_their_tenant() -> None:
    queue = [
        _q("a-resumed", 9, "A", at=4.0, resumed=True),
        _q("a-aged", 1, "A", 80.0, at=0.0),
        _q("a-fresh", 2, "A", 1.0, at=9.0),
        _q("b-fresh", 3, "B", 1.0, at=9.0),
    ]
    got = _names(order_waiting(queue, now=9.0, policy="sjf", aging_s=AGING_S))
    assert got == ["a-resumed", "a-aged", "a-fresh", "b-fresh"]


def test_turns_count_each_tenants_entries_in_order() -> None:
    entries = [_q("x", 0, "A"), _q("y", 1, "B"), _q("z", 2, "A")]
    assert [tenant_turns(entries)[id(e)] for e in entries] == [0, 0, 1]


@pytest.mark.parametrize("policy", ["fcfs", "sjf"])
def test_the_scheduler_starts_another_tenants_request_second_behind_a_flood(policy: SchedulingPolicy) -> None:
    table = _table()
    s = Scheduler(table, max_num_batched_tokens=512, max_num_seqs=1, scheduling=policy)

    def add(cid: int, tenant: str | None) -> None:
        req: Request = _generate(table, cid, prompt=4, max_tokens=2)
        req.tenant = tenant
        s.add(req)

    for cid in range(6):
        add(cid, "flood")
    add(10, "victim")
    started = []
    while s.waiting:
        s.schedule()
        started += _running(s)
        s.remove(s.running[0])
    assert started == [0, 10, 1, 2, 3, 4, 5]


async def test_the_tenant_travels_over_http_and_a_long_one_is_refused(gqa_model: Path) -> None:
    with LLMEngine.from_pretrained(gqa_model, EngineConfig(max_num_seqs=2)) as engine:
        async with recorded_remote(engine) as (remote, client, added):
            await remote.fill(1, prompts(1, seed=13, low=8, high=9)[0], tenant="tenant-a")
            sampling = SamplingParams(max_tokens=2, ignore_eos=True)
            assert len((await remote.generate(1, sampling, tenant="tenant-b")).token_ids) == 2
            await remote.generate(1, sampling)
            bad = await client.post("/generate", json={"context_id": 1, "tenant": "t" * 129})
            assert bad.status_code == 422 and "tenant" in bad.text
        with pytest.raises(InvalidRequestError, match="tenant is 129 characters"):
            await engine.generate(1, sampling, tenant="t" * 129)
    assert [r.tenant for r in added] == ["tenant-a", "tenant-b", None]


def test_a_server_with_api_keys_sends_each_keys_tenant_from_both_apis() -> None:
    keys = ("key-of-alice", "key-of-bob")
    with launch("tiny", api_keys=list(keys)) as served:
        scheduler = served.engines[0].core.scheduler
        added: list[Request] = []
        add = scheduler.add

        def record(req: Request) -> None:
            added.append(req)
            add(req)

        scheduler.add = record  # type: ignore[method-assign]
        echo = P.SemanticFunction.from_template(
            "Say {{input:x}}: {{output:y}}", name="echo", sampling=P.SamplingConfig(max_tokens=2)
        )
        with P.Session(served.url, api_key=keys[0]) as s:
            echo(s.variable("hi")).get(timeout=120)
        session_tenants = {r.tenant for r in added}
        added.clear()
        r = httpx.post(
            f"{served.url}/v1/completions",
            headers={"Authorization": f"Bearer {keys[1]}"},
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        openai_tenants = {r.tenant for r in added}
    assert session_tenants == {tenant_of(keys[0])}
    assert openai_tenants == {tenant_of(keys[1])}
