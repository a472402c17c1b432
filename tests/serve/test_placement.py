"""`Placement`: a request still waiting for an engine takes a new objective (a later get reached it), and
the tokens it placed are released with the objective it was placed with."""

from __future__ import annotations

import asyncio

from server.serve.placement import Placement
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
