"""Application-centric scheduling on real engines: two in-process tiny engines behind one manager."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import parrot as P
import pytest

from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch

SYSTEM = " ".join(f"Guideline {i}: answer about topic {i} briefly." for i in range(40))


@pytest.fixture(scope="module")
def two_engines() -> Iterator[LaunchedServer]:
    with launch("tiny", engines=2, engine_config=EngineConfig(num_kv_blocks=512)) as s:
        yield s


def test_a_shared_prefix_app_runs_where_its_prefix_lives(two_engines: LaunchedServer) -> None:
    ask = P.SemanticFunction.from_template(
        SYSTEM + " Question: {{input:q}} Answer: {{output:a}}",
        name="ask",
        sampling=P.SamplingConfig(max_tokens=4),
        criteria=P.THROUGHPUT,  # wanted at submit: the whole burst is runnable at once
    )
    before = [e.stats().prefill_tokens_computed for e in two_engines.engines]
    placed_before = two_engines.manager.placement.placed.copy()
    with P.Session(two_engines.url):
        first = [ask(q=f"what about topic {i}?") for i in range(8)]
        assert all(isinstance(a.get(), str) for a in first)  # one burst: placed together
        for i in range(4):  # one at a time: each goes where the prefix context lives
            assert isinstance(ask(q=f"and topic {i}?").get(), str)
    computed = [
        e.stats().prefill_tokens_computed - b for e, b in zip(two_engines.engines, before, strict=True)
    ]
    placed = two_engines.manager.placement.placed - placed_before
    (engine,) = {e for e, _ in placed}  # every step of the app on one engine
    assert computed[1 - engine] == 0
    assert placed[engine, "queue_prefix"] == 8  # the burst, placed together
    assert placed[engine, "context"] == 4  # later calls follow the prefix context


def test_independent_apps_spread_over_both_engines(two_engines: LaunchedServer) -> None:
    step = P.SemanticFunction.from_template(
        "Story {{input:x}}: {{output:y}}",
        name="step",
        sampling=P.SamplingConfig(max_tokens=4),
        criteria=P.LATENCY,
    )
    placed_before = two_engines.manager.placement.placed.copy()
    with P.Session(two_engines.url):
        outs = [step(x=f"number {i} " * (i + 1)) for i in range(6)]
        assert all(isinstance(o.get(), str) for o in outs)
    placed = two_engines.manager.placement.placed - placed_before
    # Latency work goes to the least loaded engine: the burst is spread, not piled on one engine.
    assert {e for e, _ in placed} == {0, 1}


def test_a_latency_step_reaches_its_engine_with_the_latency_cap(
    two_engines: LaunchedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    caps: list[int | None] = []
    for engine in two_engines.engines:
        submit = engine.submit_generate

        def recording(*args: Any, _submit: Any = submit, **kwargs: Any) -> Any:
            caps.append(kwargs.get("latency_cap"))
            return _submit(*args, **kwargs)

        monkeypatch.setattr(engine, "submit_generate", recording)  # the manager's path (token streams)
    config, stats = two_engines.manager.config, two_engines.engines[0].stats()
    capacity = config.engine_capacity_tokens or stats.blocks_total * stats.block_size
    with P.Session(two_engines.url):
        for criteria in (P.LATENCY, P.THROUGHPUT):
            step = P.SemanticFunction.from_template(
                "Note {{input:x}}: {{output:y}}",
                name="note",
                sampling=P.SamplingConfig(max_tokens=2),
                criteria=criteria,
            )
            assert isinstance(step(x="a short one").get(), str)
    assert caps == [min(config.latency_cap_tokens, capacity), None]


async def test_an_openai_burst_is_spread_over_both_engines(
    two_engines: LaunchedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests routed in one burst reach no engine's stats before the next is routed: the placement counts
    the ones it placed, so a burst of 8 lands 4 and 4, not 8 on engine 0."""
    generates = [0, 0]
    for i, engine in enumerate(two_engines.engines):

        def counted(*args: Any, _submit: Any = engine.submit_generate, _i: int = i, **kw: Any) -> Any:
            generates[_i] += 1
            return _submit(*args, **kw)

        monkeypatch.setattr(engine, "submit_generate", counted)
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0}
    async with httpx.AsyncClient(base_url=two_engines.url, timeout=120) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
    assert generates == [4, 4]
    placement = two_engines.manager.placement
    assert [placement.running_steps(i) for i in (0, 1)] == [0, 0]  # every request was counted out


def test_an_openai_chat_follows_its_kept_turns_to_their_engine(two_engines: LaunchedServer) -> None:
    """A chat's later turns over ``/v1`` are placed where its earlier turns' contexts are kept (the
    placement's context branch), however busy the other engine is not: each turn prefills only its new
    tokens there, the other engine computes nothing, and the live view counts the hits."""
    placement, steps = two_engines.manager.placement, two_engines.manager.steps
    before = [e.stats().prefill_tokens_computed for e in two_engines.engines]
    placed_before, hits_before = placement.placed.copy(), steps.prefix_hits.copy()
    messages = [{"role": "system", "content": SYSTEM}]
    with httpx.Client(base_url=two_engines.url, timeout=120) as http:
        for turn in range(4):
            messages.append({"role": "user", "content": f"Question {turn}: what does guideline {turn} say?"})
            body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    computed = [
        e.stats().prefill_tokens_computed - b for e, b in zip(two_engines.engines, before, strict=True)
    ]
    placed = placement.placed - placed_before
    (engine,) = {e for e, _ in placed}  # every turn on one engine
    assert computed[1 - engine] == 0
    assert placed[engine, "context"] == 3  # turns 2-4 followed the kept conversation
    assert steps.prefix_hits[engine] - hits_before[engine] == 3
    assert [placement.running_steps(i) for i in (0, 1)] == [0, 0]
