"""`Placement`: a request still waiting for an engine takes a new objective (a later get reached it), and
the tokens it placed are released with the objective it was placed with; a request no engine in service
can take fails at once, and one waiting for room goes to an engine that joins."""

from __future__ import annotations

import asyncio

import pytest

from server.serve.placement import NoServingEngineError, PinnedEngineGoneError, Placement
from server.serve.scheduler import EngineState, QueuedRequest


def test_a_waiting_request_is_reprioritised_and_released_exactly() -> None:
    async def run() -> None:
        engines = [EngineState(0, capacity=100, latency_cap=40)]
        placement = Placement(lambda: engines)
        big = QueuedRequest("big", "app", placement.next_seq(), tokens=90)
        first = await placement.acquire(big)  # the engine is now nearly full
        waiting = QueuedRequest("w", "app", placement.next_seq(), tokens=30)
        task = asyncio.ensure_future(placement.acquire(waiting))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not task.done()
        assert placement.reprioritise("w", criteria="latency", task_group=None)
        assert not placement.reprioritise("unknown", criteria="latency", task_group=None)
        placement.release(first, big)
        engine = await task
        assert placement.running_tokens(engine) == 30
        # Placed as latency-bound: its engine counts latency work until it is released — with the
        # caller's stale copy, which still says throughput.
        assert placement._latency[engine] == 1
        placement.release(engine, waiting)
        assert placement.running_tokens(engine) == 0 and placement._latency[engine] == 0
        assert not placement.reprioritise("w", criteria="throughput", task_group=None)

    asyncio.run(run())


def test_requests_no_engine_in_service_can_take_fail_at_once_and_new_engines_take_waiting_ones() -> None:
    async def run() -> None:
        engines = [EngineState(0, capacity=100, latency_cap=40), EngineState(1, capacity=100, latency_cap=40)]
        placement = Placement(lambda: list(engines))
        full = QueuedRequest("full", "app", placement.next_seq(), tokens=100, pinned=0)
        assert await placement.acquire(full) == 0
        pinned = asyncio.ensure_future(
            placement.acquire(QueuedRequest("pinned", "app", placement.next_seq(), tokens=10, pinned=0))
        )
        other = QueuedRequest("other", "app", placement.next_seq(), tokens=10, model="m2")
        unserved = asyncio.ensure_future(placement.acquire(other))
        await asyncio.sleep(0)
        assert not pinned.done()  # engine 0 is full: the pinned request waits for it
        # Engine 0 fails: its pinned waiter fails at once (the caller places it again, unpinned); the
        # model nobody serves fails as a 503.
        del engines[0]
        placement.engines_changed()
        with pytest.raises(PinnedEngineGoneError) as gone:
            await pinned
        assert gone.value.engine_id == 0
        with pytest.raises(NoServingEngineError, match="the model 'm2'"):
            await unserved
        # What the failed engine held is released by its requests' owners: its accounting is exact.
        placement.release(0, full)
        assert placement.running_tokens(0) == 0 and placement.running_tokens(1) == 0

        # A request waiting for room is placed as soon as an engine joins, not at the next release.
        busy = QueuedRequest("busy", "app", placement.next_seq(), tokens=100)
        assert await placement.acquire(busy) == 1
        waiting = asyncio.ensure_future(
            placement.acquire(QueuedRequest("w", "app", placement.next_seq(), 50))
        )
        await asyncio.sleep(0)
        assert not waiting.done()
        engines.append(EngineState(2, capacity=100, latency_cap=40))
        placement.engines_changed()
        assert await waiting == 2 and placement.running_tokens(2) == 50

    asyncio.run(run())


def test_a_prefix_batch_queued_while_its_first_member_runs_meets_it() -> None:
    """The first request of a prefix goes by load; a batch of that prefix placed in a later pass, while it
    runs, follows it to its busier engine (an OpenAI backend's prefix cache, or our prefix store, will hold
    the prefix there); once it is released, placement goes by load again."""

    async def run() -> None:
        engines = [EngineState(i, capacity=1000, latency_cap=300) for i in range(2)]
        placement = Placement(lambda: engines)

        def request(key: str, prefix: str | None = "sys") -> QueuedRequest:
            return QueuedRequest(key, "app", placement.next_seq(), tokens=100, shared_prefix=prefix)

        first = request("first")
        assert await placement.acquire(first) == 0  # ties go to the lower id
        assert await placement.acquire(request("a", None)) == 1
        assert await placement.acquire(request("b", None)) == 0  # engine 0 now runs 200 tokens, 1 runs 100
        batch = [request("s1"), request("s2")]
        assert await asyncio.gather(*(placement.acquire(r) for r in batch)) == [0, 0]  # not by load
        for r in (first, *batch):
            placement.release(0, r)
        assert not placement._prefixes[0]
        assert await placement.acquire(request("c", None)) == 0  # 100 and 100: a tie; then 200 on 0
        later = [request("t1"), request("t2")]
        assert await asyncio.gather(*(placement.acquire(r) for r in later)) == [1, 1]  # by load again

    asyncio.run(run())
