"""Shortest-job-first ordering of the waiting queue (``EngineConfig(scheduling="sjf")``).

The rule is checked as pure functions (`server.engine.ordering`), then on a bare `Scheduler` driven by a
fake clock (aging under a steady stream of short requests, no wall clock), then on the engine: start order
with one running sequence, unchanged greedy outputs, and the priority reaching a remote engine over HTTP.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from server.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from server.engine.__main__ import engine_config, parse_args
from server.engine.block_manager import BlockAllocator
from server.engine.context import ContextTable
from server.engine.ordering import Queued, SchedulingPolicy, next_reorder_at, order_waiting
from server.engine.request import Request
from server.engine.scheduler import Scheduler
from tests.engine.conftest import prompts
from tests.engine.remote_asgi import recorded_remote
from tests.engine.test_caps import _computed, _fill_all, _generate, _running, _table, _Watch

AGING_S = 5.0


# ------------------------------------------------------------------------------------------ pure order
def _q(name: str, seq: int, priority: float, at: float = 0.0, **kw: bool) -> Queued[str]:
    return Queued(name, seq, at, priority, **kw)


def _names(queue: list[Queued[str]]) -> list[str]:
    return [e.item for e in queue]


def test_fcfs_keeps_the_queue_order_whatever_the_priorities() -> None:
    queue = [_q("a", 0, 9.0), _q("b", 1, 1.0), _q("c", 2, 5.0, latency_critical=True)]
    assert _names(order_waiting(queue, now=100.0, policy="fcfs", aging_s=AGING_S)) == ["a", "b", "c"]


def test_sjf_orders_by_priority_then_arrival_inside_objective_classes() -> None:
    queue = [
        _q("long", 0, 90.0),
        _q("short", 1, 3.0),
        _q("tie-first", 2, 10.0),
        _q("tie-second", 3, 10.0),
        _q("latency-long", 4, 50.0, latency_critical=True),
        _q("latency-short", 5, 20.0, latency_critical=True),
    ]
    got = _names(order_waiting(queue, now=1.0, policy="sjf", aging_s=AGING_S))
    assert got == ["latency-short", "latency-long", "short", "tie-first", "tie-second", "long"]


def test_sjf_puts_resumed_then_aged_requests_first() -> None:
    queue = [
        _q("resumed", 9, 99.0, at=4.0, resumed=True),  # preempted: back first, in queue order
        _q("fresh-short", 1, 1.0, at=3.0),
        _q("aged-late", 2, 80.0, at=1.0),
        _q("aged-early", 0, 70.0, at=0.0),  # aged requests go by arrival, ahead of every class
        _q("fresh-latency", 3, 2.0, at=4.0, latency_critical=True),
    ]
    got = _names(order_waiting(queue, now=6.0, policy="sjf", aging_s=AGING_S))
    assert got == ["resumed", "aged-early", "aged-late", "fresh-latency", "fresh-short"]
    # One second earlier only the first arrival has aged.
    got = _names(order_waiting(queue, now=5.0, policy="sjf", aging_s=AGING_S))
    assert got == ["resumed", "aged-early", "fresh-latency", "fresh-short", "aged-late"]


def test_the_order_next_changes_when_the_oldest_fresh_request_ages() -> None:
    queue = [_q("a", 0, 1.0, at=2.0), _q("b", 1, 1.0, at=3.5), _q("r", 2, 1.0, at=0.0, resumed=True)]
    assert next_reorder_at(queue, now=4.0, aging_s=AGING_S) == 7.0
    assert next_reorder_at(queue, now=7.0, aging_s=AGING_S) == 8.5  # a has aged
    assert next_reorder_at(queue, now=9.0, aging_s=AGING_S) == math.inf


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"scheduling": "lifo"}, "unknown scheduling 'lifo'"),
        ({"scheduling": "sjf", "sjf_aging_s": 0.0}, "sjf_aging_s"),
        ({"scheduling": "sjf", "sjf_aging_s": math.inf}, "sjf_aging_s"),
    ],
)
def test_the_config_refuses_an_unknown_policy_or_no_aging(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)  # type: ignore[arg-type]


def test_the_engine_cli_passes_the_scheduling_into_the_config() -> None:
    config = engine_config(parse_args(["--scheduling", "sjf", "--sjf-aging-s", "12.5"]))
    assert (config.scheduling, config.sjf_aging_s) == ("sjf", 12.5)
    assert engine_config(parse_args([])).scheduling == "fcfs"
    with pytest.raises(SystemExit):
        parse_args(["--sjf-aging-s", "-1"])


# ------------------------------------------------------------------------------------ the bare scheduler
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _scheduler(
    table: ContextTable, policy: SchedulingPolicy, clock: _Clock, aging_s: float = AGING_S, seqs: int = 1
) -> Scheduler:
    return Scheduler(
        table,
        max_num_batched_tokens=512,
        max_num_seqs=seqs,
        scheduling=policy,
        sjf_aging_s=aging_s,
        clock=clock,
    )


def _with_priority(req: Request, priority: float | None) -> Request:
    req.priority = priority
    return req


@pytest.mark.parametrize(("policy", "expected"), [("sjf", [0, 2, 4, 3, 1]), ("fcfs", [0, 1, 2, 3, 4])])
def test_waiting_requests_start_in_priority_order_under_sjf_only(
    policy: SchedulingPolicy, expected: list[int]
) -> None:
    table, clock = _table(), _Clock()
    s = _scheduler(table, policy, clock)
    # 3 has no priority: it ranks as the mean of those given before it (5, 40, 10): 18.33, after 4 (15).
    for cid, priority in enumerate((5.0, 40.0, 10.0, None, 15.0)):
        s.add(_with_priority(_generate(table, cid, prompt=4, max_tokens=2), priority))
    started = []
    while s.waiting:
        s.schedule()
        started += _running(s)
        s.remove(s.running[0])
    assert started == expected


def _stream_of_shorts(policy: SchedulingPolicy, aging_s: float, ticks: int) -> tuple[list[int], float | None]:
    """One request runs at a time and finishes each second, when a new short one (priority 1) arrives;
    a long one (priority 1000, context 1) is queued at t=0. The context ids in start order, and the time
    the long one started (None: never)."""
    table, clock = _table(), _Clock()
    s = _scheduler(table, policy, clock, aging_s)
    s.add(_with_priority(_generate(table, 0, prompt=2, max_tokens=1), 1.0))
    s.schedule()
    s.add(_with_priority(_generate(table, 1, prompt=2, max_tokens=1), 1000.0))
    started, long_started = [0], None
    for tick in range(1, ticks + 1):
        clock.now = float(tick)
        s.add(_with_priority(_generate(table, 100 + tick, prompt=2, max_tokens=1), 1.0))
        s.remove(s.running[0])
        s.schedule()
        started += _running(s)
        if _running(s) == [1]:
            long_started = clock.now
    return started, long_started


def test_aging_starts_a_long_request_within_the_bound_while_short_ones_keep_arriving() -> None:
    started, long_started = _stream_of_shorts("sjf", AGING_S, ticks=20)
    # Nothing was queued before it and the running request ends each second: the bound is the aging time.
    assert long_started == AGING_S
    assert started[: int(AGING_S)] == [0, 101, 102, 103, 104]  # shorter work went first until then
    # Without aging (an aging time beyond the run) the long request starves behind the stream.
    assert _stream_of_shorts("sjf", 1e9, ticks=20)[1] is None
    assert _stream_of_shorts("fcfs", AGING_S, ticks=20)[1] == 1.0


def test_an_aged_request_is_not_overtaken_even_when_it_does_not_fit() -> None:
    table, clock = _table(), _Clock()
    s = Scheduler(
        table, 512, max_num_seqs=8, max_running_tokens=40, scheduling="sjf", sjf_aging_s=AGING_S, clock=clock
    )
    s.add(_with_priority(_generate(table, 0, prompt=20, max_tokens=4), 1.0))
    s.schedule()
    s.add(_with_priority(_generate(table, 1, prompt=20, max_tokens=4), 50.0))  # 24 + 24 > 40: waits
    clock.now = AGING_S
    s.add(_with_priority(_generate(table, 2, prompt=2, max_tokens=2), 1.0))  # 4 would fit beside 0
    s.schedule()
    assert _running(s) == [0]  # 1 has aged: 2 waits behind it, as under FCFS
    assert [r.context.context_id for r in s.waiting] == [1, 2]
    s.remove(s.running[0])
    s.schedule()
    assert _running(s) == [1, 2]


def test_a_preempted_request_resumes_before_more_urgent_waiting_work() -> None:
    table, clock = ContextTable(BlockAllocator(4), 16, lambda src, dst: None), _Clock()  # 64 tokens
    s = _scheduler(table, "sjf", clock, seqs=8)
    a, b = _generate(table, 0, prompt=32, max_tokens=10), _generate(table, 1, prompt=32, max_tokens=40)
    s.add(_with_priority(b, 40.0))
    s.add(_with_priority(a, 10.0))
    for chunk in s.schedule():
        _computed(chunk)
    assert _running(s) == [0, 1]  # a is shorter
    urgent = _with_priority(_generate(table, 2, prompt=4, max_tokens=1), -100.0)
    s.add(urgent)
    a.output_ids.append(7)  # a's first sampled token needs a fifth block: b (newest) is preempted
    a.context.token_ids.append(7)
    a.decoding = True
    s.schedule()
    assert s.num_preemptions == 1
    # b went back in first (recomputing what fits of its prompt); nothing is left for the urgent request.
    assert _running(s) == [0, 1]
    assert list(s.waiting) == [urgent]


# ------------------------------------------------------------------------------------------- the engine
def _engine_config(policy: SchedulingPolicy, seqs: int) -> EngineConfig:
    return EngineConfig(
        dtype="float32", num_kv_blocks=256, max_num_batched_tokens=256, max_num_seqs=seqs, scheduling=policy
    )


async def _run_jobs(
    engine: LLMEngine, watch: _Watch | None, jobs: list[tuple[int, int, float | None]]
) -> dict[int, list[int]]:
    """Submit every ``(context id, max_tokens, priority)`` generate while the scheduler is held; their
    tokens by context id."""
    if watch is not None:
        watch.hold()
    streams = {
        cid: engine.submit_generate(
            cid, SamplingParams(max_tokens=m, ignore_eos=True), stream=False, priority=priority
        )
        for cid, m, priority in jobs
    }
    if watch is not None:
        watch.release()
    return {cid: (await s.result()).token_ids for cid, s in streams.items()}


# Context 0 goes first whatever the order (lowest priority): the first step may see it alone, and while it
# runs (the only running sequence) the others queue up. 3 has no priority: the mean of -1, 50, 10 -> 19.67.
_JOBS: list[tuple[int, int, float | None]] = [
    (0, 2, -1.0),
    (1, 3, 50.0),
    (2, 5, 10.0),
    (3, 4, None),
    (4, 2, 30.0),
    (5, 6, 20.0),
]


@pytest.mark.parametrize(("policy", "expected"), [("sjf", [0, 2, 3, 5, 4, 1]), ("fcfs", [0, 1, 2, 3, 4, 5])])
async def test_the_engine_starts_waiting_generates_in_priority_order(
    gqa_model: Path, policy: SchedulingPolicy, expected: list[int]
) -> None:
    contexts = dict(enumerate(prompts(len(_JOBS), seed=11, low=6, high=12)))
    with LLMEngine.from_pretrained(gqa_model, _engine_config(policy, seqs=1)) as engine:
        await _fill_all(engine, contexts)
        watch = _Watch(engine)
        out = await _run_jobs(engine, watch, _JOBS)
    assert sorted(contexts, key=watch.first_step) == expected
    assert [len(out[cid]) for cid, _, _ in _JOBS] == [m for _, m, _ in _JOBS]


async def test_greedy_outputs_are_the_same_under_fcfs_and_sjf(gqa_model: Path) -> None:
    contexts = dict(enumerate(prompts(len(_JOBS), seed=12, low=4, high=30)))
    outputs = []
    for policy in ("fcfs", "sjf"):
        with LLMEngine.from_pretrained(gqa_model, _engine_config(policy, seqs=2)) as engine:
            await _fill_all(engine, contexts)
            outputs.append(await _run_jobs(engine, _Watch(engine), _JOBS))
    assert outputs[0] == outputs[1]


async def test_priority_travels_from_a_remote_engine_over_http_to_the_request(gqa_model: Path) -> None:
    with LLMEngine.from_pretrained(gqa_model, _engine_config("sjf", seqs=4)) as engine:
        async with recorded_remote(engine) as (remote, client, added):
            await remote.fill(1, prompts(1, seed=13, low=8, high=9)[0], priority=2.5)
            sampling = SamplingParams(max_tokens=3, ignore_eos=True)
            assert len((await remote.generate(1, sampling, priority=17.0)).token_ids) == 3
            stream = remote.submit_generate(1, sampling, stream=True, priority=4)
            assert len([t async for t in stream]) == 3
            await remote.generate(1, sampling)
            bad = await client.post("/generate", json={"context_id": 1, "priority": "soon"})
            assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_schema"
        with pytest.raises(InvalidRequestError, match="priority must be a finite number"):
            await engine.generate(1, sampling, priority=math.nan)
    assert [r.priority for r in added] == [2.5, 17.0, 4.0, None]
