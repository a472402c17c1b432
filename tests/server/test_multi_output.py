"""Calls with several outputs, fed by every kind of input — a literal, a session variable, another call's
output (a future) and a failed future — sync and async, on one engine and two. Each later step renders every
input of the call and every earlier output, so its answer equals the literal case's. A transform that refuses
a long output gives its whole text back as data, to the output and to what reads it."""

from __future__ import annotations

import asyncio

import parrot as P
import pytest

from server.launcher import LaunchedServer
from tests.server.conftest import BROKEN

GREEDY = P.SamplingConfig(max_tokens=5, temperature=0.0, ignore_eos=True)
PLAN = P.SemanticFunction.from_template(
    "Task: {{input:task}}\nPlan:{{output:plan}}\nCode for {{input:task}}:{{output:code}}\nDone.",
    name="plan",
    sampling=GREEDY,
)
ECHO = P.SemanticFunction.from_template("Repeat: {{input:x}}{{output:y}}", name="echo", sampling=GREEDY)
# Long enough that the failure message quotes only the start (200 characters) of what the model wrote.
RAMBLE = "Ramble on: {{output:text}}"
LONG = P.SamplingConfig(max_tokens=96, temperature=0.0, ignore_eos=True)
RAW = P.SemanticFunction.from_template(RAMBLE, name="raw", sampling=LONG)
# The tiny model's text is neither JSON nor XML: each parser refuses it, in a transform worker process.
REFUSING = [
    P.SemanticFunction.from_template(RAMBLE, name=f"as_{t.type}", sampling=LONG, transforms={"text": [t]})
    for t in (P.transforms.json(), P.transforms.xml())
]


def test_every_input_kind_gives_the_literal_answer(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url) as s:
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


def test_a_failed_future_fails_every_output_with_the_cause(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url):
        plan, code = PLAN(task=BROKEN())
        for out in (plan, code):
            with pytest.raises(P.VariableFailedError, match="json transform failed"):
                out.get()
        ok = PLAN(task="still served")  # the session keeps serving
        assert isinstance(ok[1].get(), str)


def test_async_session_with_a_variable_input(one_or_two: LaunchedServer) -> None:
    async def run() -> tuple[tuple[str, str], tuple[str, str]]:
        async with P.Session(one_or_two.url) as s:
            plan, code = PLAN(task=s.variable("a snake game"))
            lit_plan, lit_code = PLAN(task="a snake game")
            return (await plan.aget(), await code.aget()), (await lit_plan.aget(), await lit_code.aget())

    from_variable, from_literal = asyncio.run(run())
    assert from_variable == from_literal


def check_refused(failure: P.VariableFailedError, whole: str) -> None:
    """``failure`` carries the model's whole text (``whole``), which its message only starts to quote."""
    assert len(whole) > 200 and f"... ({len(whole)} chars)" in str(failure)
    assert failure.llm_output == whole and failure.error_type == "transform_failed"


@pytest.mark.parametrize("refusing", REFUSING, ids=lambda f: f.name)
def test_a_refused_long_output_comes_back_whole_to_it_and_downstream(
    one_or_two: LaunchedServer, refusing: P.SemanticFunction
) -> None:
    with P.Session(one_or_two.url):
        out = refusing()
        plan, code = PLAN(task=out)  # both steps fail because their input did: they carry its cause
        failures = []
        for var in (out, plan, code):
            with pytest.raises(P.VariableFailedError) as info:
                var.get()
            failures.append(info.value)
        whole = RAW().get()  # the same prompt, greedy: the text the transform refused (asked for after it)
    for failure in failures:
        check_refused(failure, whole)
    assert "upstream" in str(failures[1]) and "upstream" not in str(failures[0])


@pytest.mark.parametrize("refusing", REFUSING, ids=lambda f: f.name)
def test_a_refused_long_output_comes_back_whole_to_an_async_get(
    one_or_two: LaunchedServer, refusing: P.SemanticFunction
) -> None:
    async def run() -> tuple[list[P.VariableFailedError], str]:
        async with P.Session(one_or_two.url):
            out = refusing()
            after = ECHO(x=out)
            failures = []
            for var in (out, after):
                with pytest.raises(P.VariableFailedError) as info:
                    await var.aget()
                failures.append(info.value)
            return failures, await RAW().aget()

    failures, whole = asyncio.run(run())
    for failure in failures:
        check_refused(failure, whole)
