"""Run a synthesizer's plan in one Parrot session: submit its whole DAG, then get the final answer.

A *plan* is a generator that submits semantic calls (in the current session) and returns the final answer:
a `parrot.Variable`, or text it already knows. Where a packing decision needs a value the server has not
produced yet, the plan yields that variable and receives its text (`llamaindex_parrot.packing` says when);
the driver gets it — sync with ``get``, async with ``await aget`` — which is the one place the two differ.
Everything queued until then goes to the server with that ``get``; otherwise with the final one.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import parrot as P

if TYPE_CHECKING:
    from llamaindex_parrot.llm import ParrotLLM

__all__ = ["Plan", "arun_plan", "run_plan"]

Plan = Generator[P.Variable, str, "P.Variable | str | None"]


def run_plan(llm: ParrotLLM, make_plan: Callable[[], Plan]) -> str | None:
    """Run the plan in a new session of ``llm``'s server; the answer's text (None: the plan made none).

    Values are awaited with ``criteria=latency`` (the final answer is what the user waits for, and every
    call feeding it is on its critical path) and at most ``llm.get_timeout`` seconds.
    """
    with P.Session(llm.base_url, timeout=llm.timeout):
        plan = make_plan()
        try:
            needed = next(plan)
            while True:
                needed = plan.send(str(needed.get(criteria=P.LATENCY, timeout=llm.get_timeout)))
        except StopIteration as done:
            answer = done.value
        if isinstance(answer, P.Variable):
            return str(answer.get(criteria=P.LATENCY, timeout=llm.get_timeout))
        return answer


async def arun_plan(llm: ParrotLLM, make_plan: Callable[[], Plan]) -> str | None:
    """``async`` form of `run_plan` (an ``async with`` session; nothing blocks the event loop)."""
    async with P.Session(llm.base_url, timeout=llm.timeout):
        plan = make_plan()
        try:
            needed = next(plan)
            while True:
                needed = plan.send(str(await needed.aget(criteria=P.LATENCY, timeout=llm.get_timeout)))
        except StopIteration as done:
            answer = done.value
        if isinstance(answer, P.Variable):
            return str(await answer.aget(criteria=P.LATENCY, timeout=llm.get_timeout))
        return answer
