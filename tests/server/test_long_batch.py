"""A long batch does not hold the event loop (one 10,000-operation batch blocked /health for
1.45 s): it yields every `BATCH_SLICE` operations, counted here as loop turns another task gets."""

from __future__ import annotations

import asyncio

from parrot.protocol import BatchCreateVariable, BatchRequest

from server.launcher import launch
from server.serve.manager import BATCH_SLICE


def test_a_long_batch_lets_the_loop_turn_between_slices() -> None:
    with launch("tiny") as served:
        manager = served.manager

        async def run() -> tuple[int, int]:
            created = manager.create_session()
            session = manager.session(created.session_id, created.token)
            ops = [BatchCreateVariable(op="create_variable", name=f"v{i}") for i in range(4 * BATCH_SLICE)]
            turns = 0
            done = False

            async def ticker() -> None:
                nonlocal turns
                while not done:
                    turns += 1
                    await asyncio.sleep(0)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)  # the ticker is running
            before = turns
            applied = await manager.apply_batch(session, BatchRequest(ops=ops))
            during = turns - before
            done = True
            await task
            await manager.delete_session(session)
            return len(applied.results), during

        results, during = served.run(run())
    assert results == 4 * BATCH_SLICE
    assert during >= 3  # the loop turned at least once per slice boundary
