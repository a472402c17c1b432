"""Token caps when the engine forms batches: the FIFO cap (``EngineConfig.max_running_tokens``) and
per-request latency caps (``generate(..., latency_cap=)``), the rule of the manager's `EngineState.cap_for`.

The scheduler's rules are checked exactly on a bare `Scheduler`; the engine tests watch every step's running
requests by wrapping the engine's `Scheduler.schedule`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from server.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from server.engine.block_manager import BlockAllocator
from server.engine.context import Context, ContextTable
from server.engine.request import Request
from server.engine.scheduler import ScheduledChunk, Scheduler, reserved_tokens
from tests.engine.conftest import prompts
from tests.engine.remote_asgi import recorded_remote


# ------------------------------------------------------------------------------------ the bare scheduler
def _table() -> ContextTable:
    return ContextTable(BlockAllocator(256), 16, lambda src, dst: None)


def _request(
    ctx: Context, max_tokens: int | None = None, latency_cap: int | None = None, tokens: int = 0
) -> Request:
    """A generate of ``max_tokens`` (None: a fill) on ``ctx``, after appending ``tokens`` prompt tokens."""
    ctx.token_ids.extend(range(7, 7 + tokens))
    sampling = None if max_tokens is None else SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(ctx, lambda *_: None, sampling, latency_cap=latency_cap)


def _generate(table: ContextTable, context_id: int, prompt: int, max_tokens: int, **kw: int) -> Request:
    return _request(table.create(context_id, None), max_tokens, tokens=prompt, **kw)


def _running(s: Scheduler) -> list[int]:
    return [r.context.context_id for r in s.running]


def test_a_reservation_is_own_tokens_plus_tokens_still_to_generate() -> None:
    table = _table()
    gen = _generate(table, 0, prompt=10, max_tokens=5)
    assert reserved_tokens(gen) == 15
    for token in (7, 8):  # sampling moves tokens from "still to generate" into the context
        gen.output_ids.append(token)
        gen.context.token_ids.append(token)
    assert reserved_tokens(gen) == 15
    fill = _request(table.create(1, None), tokens=12)
    assert reserved_tokens(fill) == 12
    parent = table.get(0)  # 12 tokens now; a fork counts only what it adds
    fork_fill = _request(table.create(2, parent), tokens=3)
    assert reserved_tokens(fork_fill) == 3
    fork_gen = _request(table.create(3, parent), max_tokens=4)
    assert reserved_tokens(fork_gen) == 4


def test_fifo_cap_admits_the_head_only_while_it_fits_and_nothing_overtakes_it() -> None:
    table = _table()
    s = Scheduler(table, max_num_batched_tokens=512, max_num_seqs=8, max_running_tokens=30)
    a, b, c = (_generate(table, i, prompt=p, max_tokens=4) for i, p in enumerate((16, 16, 1)))
    for r in (a, b, c):
        s.add(r)
    s.schedule()
    assert _running(s) == [0]  # b (20) does not fit beside a (20); c (5) would, but waits behind b
    assert [r.context.context_id for r in s.waiting] == [1, 2]
    s.schedule()
    assert _running(s) == [0]
    s.remove(a)
    s.schedule()
    assert _running(s) == [1, 2]  # 25 <= 30
    assert s.running_tokens == 25


def test_a_running_latency_cap_keeps_the_batch_under_it() -> None:
    table = _table()
    s = Scheduler(table, max_num_batched_tokens=512, max_num_seqs=8)
    lat = _generate(table, 0, prompt=6, max_tokens=4, latency_cap=14)
    small, other = _generate(table, 1, prompt=2, max_tokens=2), _generate(table, 2, prompt=1, max_tokens=1)
    for r in (lat, small, other):
        s.add(r)
    s.schedule()
    assert _running(s) == [0, 1]  # 10 + 4 = 14 <= 14; + 2 would exceed the running latency cap
    s.remove(lat)
    s.schedule()
    assert _running(s) == [1, 2]  # no latency work runs: uncapped again


def test_a_latency_request_waits_until_the_total_fits_its_own_cap() -> None:
    table = _table()
    s = Scheduler(table, max_num_batched_tokens=512, max_num_seqs=8)
    bulk = _generate(table, 0, prompt=30, max_tokens=10)
    lat = _generate(table, 1, prompt=4, max_tokens=4, latency_cap=20)
    behind = _generate(table, 2, prompt=1, max_tokens=1)
    for r in (bulk, lat, behind):
        s.add(r)
    s.schedule()
    assert _running(s) == [0]  # 40 + 8 > 20: the latency request waits, and so does what is behind it
    s.remove(bulk)
    s.schedule()
    assert _running(s) == [1, 2]  # 8 + 2 <= 20


def test_a_request_larger_than_every_cap_runs_alone_when_nothing_runs() -> None:
    table = _table()
    s = Scheduler(table, max_num_batched_tokens=512, max_num_seqs=8, max_running_tokens=10)
    big = _generate(table, 0, prompt=40, max_tokens=8, latency_cap=5)
    tiny = _generate(table, 1, prompt=1, max_tokens=1)
    s.add(big)
    s.add(tiny)
    s.schedule()
    assert _running(s) == [0]
    s.remove(big)
    s.schedule()
    assert _running(s) == [1]


def test_a_preempted_request_requeued_at_the_head_is_admitted_again_under_the_cap() -> None:
    table = ContextTable(BlockAllocator(4), 16, lambda src, dst: None)  # room for 64 tokens
    s = Scheduler(table, max_num_batched_tokens=512, max_num_seqs=8, max_running_tokens=120)
    a, b = _generate(table, 0, prompt=32, max_tokens=40), _generate(table, 1, prompt=32, max_tokens=10)
    s.add(a)
    s.add(b)
    for chunk in s.schedule():  # both prefilled: 4 blocks used, 72 + 42 tokens reserved
        _computed(chunk)
    assert _running(s) == [0, 1]
    a.output_ids.append(7)  # a's first sampled token needs a fifth block: b (newest) is preempted
    a.context.token_ids.append(7)
    a.decoding = True
    batch = s.schedule()
    assert s.num_preemptions == 1
    # Requeued at the head, b is admitted again in the same step (its reservation did not change) and
    # recomputes the part of its prompt that fits in the block a left free.
    assert _running(s) == [0, 1] and not s.waiting
    assert [(c.request.context.context_id, c.num_tokens) for c in batch] == [(0, 1), (1, 16)]
    assert s.running_tokens == 72 + 42


def _computed(chunk: ScheduledChunk) -> None:
    chunk.request.context.num_cached += chunk.num_tokens


# ------------------------------------------------------------------------------------------- the engine
class _Watch:
    """Wraps ``engine.core.scheduler.schedule``: after each call, the context ids running (in admission order)
    and their total reservation. `hold` makes the next call wait for `release`, so requests posted in
    between are all queued before the scheduler looks at them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[list[int], int]] = []
        self._gate = threading.Event()
        self._gate.set()
        scheduler = engine.core.scheduler
        inner: Callable[[], list[ScheduledChunk]] = scheduler.schedule

        def schedule() -> list[ScheduledChunk]:
            self._gate.wait()
            batch = inner()
            self.steps.append(([r.context.context_id for r in scheduler.running], scheduler.running_tokens))
            return batch

        scheduler.schedule = schedule  # type: ignore[method-assign]

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def max_running(self) -> int:
        return max(len(ids) for ids, _ in self.steps)

    def first_step(self, context_id: int) -> int:
        return next(i for i, (ids, _) in enumerate(self.steps) if context_id in ids)

    def last_step(self, context_id: int) -> int:
        return max(i for i, (ids, _) in enumerate(self.steps) if context_id in ids)


def _config(**kw: int) -> EngineConfig:
    return EngineConfig(num_kv_blocks=256, max_num_batched_tokens=256, **kw)


async def _generate_all(
    engine: LLMEngine,
    watch: _Watch | None,
    jobs: list[tuple[int, int, int | None]],
    parent: int | None = None,
) -> list[list[int]]:
    """Start every ``(context id, max_tokens, latency_cap)`` generate before the scheduler looks; their
    tokens, in order."""
    if watch is not None:
        watch.hold()
    streams = [
        engine.submit_generate(
            cid, SamplingParams(max_tokens=m, ignore_eos=True), parent, stream=False, latency_cap=cap
        )
        for cid, m, cap in jobs
    ]
    if watch is not None:
        watch.release()
    return [(await s.result()).token_ids for s in streams]


async def _fill_all(engine: LLMEngine, contexts: dict[int, list[int]]) -> None:
    await asyncio.gather(*(engine.fill(cid, ids) for cid, ids in contexts.items()))


async def test_the_fifo_cap_bounds_the_batch_and_changes_no_token(gqa_model: Path) -> None:
    p, m, n = 12, 8, 6  # each generate reserves p + m = 20 tokens; the cap holds exactly two
    contexts = dict(enumerate(prompts(n, seed=3, low=p, high=p + 1)))
    jobs: list[tuple[int, int, int | None]] = [(cid, m, None) for cid in contexts]
    with LLMEngine.from_pretrained(gqa_model, _config()) as free:
        await _fill_all(free, contexts)
        expected = await _generate_all(free, None, jobs)
    with LLMEngine.from_pretrained(gqa_model, _config(max_running_tokens=2 * (p + m))) as capped:
        await _fill_all(capped, contexts)
        watch = _Watch(capped)
        got = await _generate_all(capped, watch, jobs)
    assert got == expected
    assert all(len(t) == m for t in got)
    assert watch.max_running() == 2
    assert all(total <= 2 * (p + m) for _, total in watch.steps)
    assert sorted(range(n), key=watch.first_step) == list(range(n))  # admitted in arrival order


async def test_a_latency_capped_generate_keeps_others_out(gqa_model: Path) -> None:
    contexts = dict(enumerate(prompts(4, seed=5, low=10, high=11)))
    with LLMEngine.from_pretrained(gqa_model, _config()) as engine:
        await _fill_all(engine, contexts)
        watch = _Watch(engine)
        # 0 reserves 10 + 6 = 16 = its cap: nothing fits beside it; the others (16 each) run together after.
        out = await _generate_all(engine, watch, [(0, 6, 16), (1, 6, None), (2, 6, None), (3, 6, None)])
    assert [len(t) for t in out] == [6, 6, 6, 6]
    assert all(ids == [0] for ids, _ in watch.steps if 0 in ids)
    assert watch.first_step(1) > watch.last_step(0)
    assert watch.max_running() == 3


async def test_a_latency_generate_waits_for_room_under_its_own_cap(gqa_model: Path) -> None:
    contexts = dict(enumerate(prompts(3, seed=6, low=10, high=11)))
    with LLMEngine.from_pretrained(gqa_model, _config()) as engine:
        await _fill_all(engine, contexts)
        watch = _Watch(engine)
        # 0 (no cap) runs first; 1 (10 + 4 with cap 20) cannot join it; 2 is small but must not overtake 1.
        await _generate_all(engine, watch, [(0, 8, None), (1, 4, 20), (2, 1, None)])
    assert watch.first_step(1) > watch.last_step(0)
    assert watch.first_step(2) >= watch.first_step(1)


async def test_a_request_larger_than_the_cap_runs_alone(gqa_model: Path) -> None:
    contexts = {0: prompts(1, seed=7, low=40, high=41)[0], 1: prompts(1, seed=8, low=4, high=5)[0]}
    with LLMEngine.from_pretrained(gqa_model, _config(max_running_tokens=16)) as engine:
        await _fill_all(engine, contexts)
        watch = _Watch(engine)
        out = await _generate_all(engine, watch, [(0, 8, None), (1, 4, None)])  # 48 > 16, then 8
    assert [len(t) for t in out] == [8, 4]
    assert all(ids == [0] for ids, _ in watch.steps if 0 in ids)
    assert watch.first_step(1) > watch.last_step(0)


async def test_a_forked_prefix_is_not_counted_per_fork(gqa_model: Path) -> None:
    k, m = 4, 6
    with LLMEngine.from_pretrained(gqa_model, _config(max_running_tokens=k * m)) as engine:
        await engine.fill(100, prompts(1, seed=9, low=64, high=65)[0])  # 64 shared tokens, idle
        watch = _Watch(engine)
        out = await _generate_all(engine, watch, [(i, m, None) for i in range(k)], parent=100)
    assert [len(t) for t in out] == [m] * k
    assert watch.max_running() == k  # each fork reserves only its m new tokens
    assert max(total for _, total in watch.steps) == k * m


async def test_latency_cap_travels_from_a_remote_engine_over_http_to_the_request(gqa_model: Path) -> None:
    with LLMEngine.from_pretrained(gqa_model, _config()) as engine:
        async with recorded_remote(engine) as (remote, client, added):
            await remote.fill(1, prompts(1, seed=10, low=8, high=9)[0])
            sampling = SamplingParams(max_tokens=3, ignore_eos=True)
            assert len((await remote.generate(1, sampling, latency_cap=64)).token_ids) == 3
            await remote.generate(1, sampling)
            bad = await client.post("/generate", json={"context_id": 1, "latency_cap": 0})
            assert bad.status_code == 422
        with pytest.raises(InvalidRequestError, match="latency_cap"):
            await engine.generate(1, sampling, latency_cap=0)
    assert [r.latency_cap for r in added] == [None, 64, None]  # the fill, then each generate
