"""Calls with several outputs, fed by every kind of input — a literal, a session variable, another call's
output (a future) and a failed future — sync and async, on one engine and two. Each later step renders every
input of the call and every earlier output, so its answer equals the literal case's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import parrot as P
import pytest

from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch

GREEDY = P.SamplingConfig(max_tokens=5, temperature=0.0, ignore_eos=True)
PLAN = P.SemanticFunction.from_template(
    "Task: {{input:task}}\nPlan:{{output:plan}}\nCode for {{input:task}}:{{output:code}}\nDone.",
    name="plan",
    sampling=GREEDY,
)
ECHO = P.SemanticFunction.from_template("Repeat: {{input:x}}{{output:y}}", name="echo", sampling=GREEDY)
BROKEN = P.SemanticFunction.from_template(
    "Give JSON: {{output:j}}", name="broken", sampling=GREEDY, transforms={"j": [P.transforms.json()]}
)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-engine", "two-engines"])
def served(request: pytest.FixtureRequest) -> Iterator[LaunchedServer]:
    with launch("tiny", engines=request.param, engine_config=EngineConfig(num_kv_blocks=256)) as s:
        yield s


def test_every_input_kind_gives_the_literal_answer(served: LaunchedServer) -> None:
    with P.Session(served.url) as s:
        task = ECHO(x=s.variable("a snake game"))
        literal = PLAN(task="a snake game")
        variable = PLAN(task=s.variable("a snake game"))
        future = PLAN(task=task)
        got = {
            k: (p.get(), c.get()) for k, (p, c) in {"lit": literal, "var": variable, "fut": future}.items()
        }
        task_text = task.get()
        again = PLAN(task=task_text)
        expected_future = (again[0].get(), again[1].get())
    assert got["var"] == got["lit"]
    assert got["fut"] == expected_future
    assert all(isinstance(t, str) for pair in got.values() for t in pair)


def test_a_failed_future_fails_every_output_with_the_cause(served: LaunchedServer) -> None:
    with P.Session(served.url):
        plan, code = PLAN(task=BROKEN())
        for out in (plan, code):
            with pytest.raises(P.VariableFailedError, match="json transform failed"):
                out.get()
        ok = PLAN(task="still served")  # the session keeps serving
        assert isinstance(ok[1].get(), str)


def test_async_session_with_a_variable_input(served: LaunchedServer) -> None:
    async def run() -> tuple[tuple[str, str], tuple[str, str]]:
        async with P.Session(served.url) as s:
            plan, code = PLAN(task=s.variable("a snake game"))
            lit_plan, lit_code = PLAN(task="a snake game")
            return (await plan.aget(), await code.aget()), (await lit_plan.aget(), await lit_code.aget())

    from_variable, from_literal = asyncio.run(run())
    assert from_variable == from_literal
