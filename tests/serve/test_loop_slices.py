"""`LoopSlices`: a burst of tasks passes its turn at most ``per_slice`` per event-loop iteration, first come
first served, and the loop runs other callbacks between slices."""

from __future__ import annotations

import asyncio

import pytest

from server.serve.loop_slices import LoopSlices


async def test_a_burst_passes_in_slices_in_arrival_order_with_the_loop_free_between() -> None:
    slices, iteration, passed = LoopSlices(per_slice=4), 0, []
    ticking = True

    def tick() -> None:  # counts loop iterations: one call per iteration
        nonlocal iteration
        iteration += 1
        if ticking:
            asyncio.get_running_loop().call_soon(tick)

    async def task(i: int) -> None:
        await slices.turn()
        passed.append((i, iteration))

    asyncio.get_running_loop().call_soon(tick)
    await asyncio.gather(*(task(i) for i in range(18)))
    ticking = False
    assert [i for i, _ in passed] == list(range(18))
    per_iteration: dict[int, int] = {}
    for _, it in passed:
        per_iteration[it] = per_iteration.get(it, 0) + 1
    assert max(per_iteration.values()) <= 4
    assert len(per_iteration) >= 5  # 18 turns, 4 a slice


async def test_a_cancelled_waiter_takes_no_place() -> None:
    slices = LoopSlices(per_slice=1)
    tasks = [asyncio.ensure_future(slices.turn()) for _ in range(3)]
    await asyncio.sleep(0)  # the three ran: the first passed, the others wait for later slices
    assert [t.done() for t in tasks] == [True, False, False]
    tasks[1].cancel()
    await asyncio.sleep(0)  # the next slice: its one place goes to the third, not the cancelled second
    await asyncio.sleep(0)
    assert tasks[1].cancelled() and tasks[2].done() and not tasks[2].cancelled()


def test_a_slice_holds_at_least_one() -> None:
    with pytest.raises(ValueError, match="per_slice must be at least 1"):
        LoopSlices(0)


async def test_keys_take_turns_so_one_burst_does_not_hold_another_keys_turn() -> None:
    slices, passed = LoopSlices(per_slice=2), []

    async def task(key: str, i: int) -> None:
        await slices.turn(key)
        passed.append(f"{key}{i}")

    flood = [asyncio.ensure_future(task("a", i)) for i in range(40)]
    await asyncio.sleep(0)  # a0, a1 pass; the rest of the burst waits
    victim = asyncio.ensure_future(task("b", 0))
    await asyncio.gather(*flood, victim)
    # In the first slice after it came (a's next and b's first), not after the burst (index 40 first come
    # first served).
    assert passed.index("b0") <= 5
    assert [p for p in passed if p.startswith("a")] == [f"a{i}" for i in range(40)]
