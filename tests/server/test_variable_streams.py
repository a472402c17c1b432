"""Streaming Semantic Variables: ``GET /v1/sessions/{sid}/variables/{vid}/stream`` and the client's
`Variable.stream` / `astream`. A stream's chunks join to the producing step's text (before transforms), the
first arrives while the variable is still pending (counted, not timed), a late reader gets the whole text
again, and a stream ends as a get does (the value, or the failure raised)."""

from __future__ import annotations

import re

import httpx
import parrot as P
import pytest
from parrot.protocol import VariableStreamEvent
from parrot.text_stream import StreamRestartedError, TextFollower, stream_events

from server.launcher import LaunchedServer, launch
from tests.processes import wait_until
from tests.server.conftest import BROKEN
from tests.server.test_remote_engines import remote_engine

LONG = P.SemanticFunction.from_template(
    "Tell a long story about {{input:topic}}: {{output:story}}",
    name="long",
    sampling=P.SamplingConfig(max_tokens=300, ignore_eos=True),
)
WORDS = P.SemanticFunction.from_template(
    "List words: {{output:words}}",
    name="words",
    sampling=P.SamplingConfig(max_tokens=24, ignore_eos=True),
    transforms={"words": [P.transforms.regex(r"\w+", findall=True)]},
)


def _pending(one_or_two: LaunchedServer, session: P.Session, var: P.Variable) -> bool:
    """Whether the server still has ``var`` pending (a get that does not wait)."""
    r = httpx.get(
        f"{one_or_two.url}/v1/sessions/{session.session_id}/variables/{var.var_id}",
        params={"timeout": 0},
        headers={"Authorization": f"Bearer {session._token}"},
        timeout=10,
    )
    return r.status_code == 504 or r.json()["status"] == "pending"


def test_chunks_arrive_while_pending_and_join_to_the_text(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url) as session:
        story = LONG(topic=session.variable("a lighthouse"))
        chunks, pending_after_first = [], None
        for chunk in story.stream():
            if not chunks:
                pending_after_first = _pending(one_or_two, session, story)
            chunks.append(chunk)
        assert pending_after_first is True
        assert len(chunks) > 10 and "".join(chunks) == story.get()
        assert "".join(story.stream()) == story.get()  # a late reader: the whole text again


def test_a_transformed_output_streams_its_text_and_gets_its_value(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url):
        words = WORDS()
        text = "".join(words.stream())
        assert words.get() == re.findall(r"\w+", text)


async def test_async_streams_of_a_future_and_of_a_set_variable(one_or_two: LaunchedServer) -> None:
    async with P.Session(one_or_two.url) as session:
        topic = session.variable("a harbour")
        story = LONG(topic=LONG(topic=topic))
        chunks = [c async for c in story.astream()]
        assert len(chunks) > 10 and "".join(chunks) == await story.aget()
        assert [c async for c in topic.astream()] == ["a harbour"]  # a set value is its own text


def test_a_failed_variable_streams_then_raises_its_failure(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url):
        story = LONG(topic=BROKEN())
        with pytest.raises(P.VariableFailedError, match="json transform failed"):
            list(story.stream())


def test_a_stream_waiting_past_its_timeout_raises_and_other_sessions_see_nothing(
    one_or_two: LaunchedServer,
) -> None:
    with P.Session(one_or_two.url) as session:
        story = LONG(topic=session.variable())  # an input never set
        with pytest.raises(P.GetTimeoutError, match="still pending"):
            list(story.stream(timeout=0.5))
        url = f"{one_or_two.url}/v1/sessions/{session.session_id}/variables/{story.var_id}/stream"
        assert httpx.get(url, timeout=10).status_code == 401  # no token
        with P.Session(one_or_two.url) as other:
            r = httpx.get(url, headers={"Authorization": f"Bearer {other._token}"}, timeout=10)
            assert r.status_code in (401, 403)
        missing = url.replace(story.var_id, "nope")
        r = httpx.get(missing, headers={"Authorization": f"Bearer {session._token}"}, timeout=10)
        assert r.status_code == 404


def test_a_remote_engine_streams_too() -> None:
    """The engine's HTTP API streams the tokens to the manager, which streams them on."""
    with launch("tiny", engines=0) as manager, remote_engine(manager.url, manager.cluster_token):
        wait_until(lambda: httpx.get(f"{manager.url}/health").status_code == 200, timeout=30)
        with P.Session(manager.url, timeout=60):
            story = LONG(topic="a river")
            chunks = list(story.stream(timeout=60))
            assert len(chunks) > 10 and "".join(chunks) == story.get()


def test_the_follower_skips_a_replay_and_refuses_a_different_text() -> None:
    def events(*items: dict[str, object]) -> list[VariableStreamEvent]:
        return [VariableStreamEvent.model_validate(i) for i in items]

    follower = TextFollower("variable 'v'")
    shown = [follower.feed(e) for e in events({"delta": "Once "}, {"delta": "upon"})]
    follower.reconnect()  # the server replays from the beginning
    shown += [follower.feed(e) for e in events({"delta": "Once up"}, {"delta": "on a time"})]
    assert "".join(shown) == "Once upon a time"
    assert follower.feed(VariableStreamEvent(restart=True)) == ""
    with pytest.raises(StreamRestartedError, match="different text"):
        follower.feed(VariableStreamEvent(delta="Twice"))
    lines = ["data: " + e.model_dump_json() for e in events({"delta": "a"}, {"restart": True})] + [": ping"]
    assert [e.delta for e in stream_events(lines)] == ["a", None]


# ------------------------------------------------------------------------------------------ step records
SYSTEM = "You are a careful reviewer of short documents; answer in one word. " * 4
REVIEW = P.SemanticFunction.from_template(
    SYSTEM + "Document: {{input:doc}}\nVerdict:{{output:verdict}}",
    name="review",
    sampling=P.SamplingConfig(max_tokens=4, ignore_eos=True),
)


def test_each_step_has_a_record_of_where_it_ran_and_what_sharing_saved(
    one_or_two: LaunchedServer,
) -> None:
    with P.Session(one_or_two.url) as session:
        verdicts = [REVIEW(doc=f"report {i}") for i in range(3)]
        assert all(v.get(criteria=P.THROUGHPUT) for v in verdicts)
        headers = {"Authorization": f"Bearer {session._token}"}
        steps = httpx.get(f"{one_or_two.url}/v1/sessions/{session.session_id}/steps", headers=headers).json()
        with P.Session(one_or_two.url) as other:  # another session's token sees its own steps only
            mine = f"{one_or_two.url}/v1/sessions/{session.session_id}/steps"
            assert httpx.get(mine, headers={"Authorization": f"Bearer {other._token}"}).status_code in (
                401,
                403,
            )
    assert [s["var_id"] for s in steps] == [v.var_id for v in verdicts]
    for step in steps:
        assert step["function"] == "review" and step["state"] == "done" and step["attempts"] == 1
        assert step["engine"].startswith("engine ") and step["queue_s"] >= 0 and step["run_s"] > 0
        # the shared system prompt is computed once; each step forks it (whole blocks at least)
        assert 0 < step["prefill_tokens_saved"] < step["prompt_tokens"]
    metrics = httpx.get(f"{one_or_two.url}/metrics").text
    count = next(line for line in metrics.splitlines() if line.startswith("parrot_step_run_seconds_count"))
    assert float(count.split()[-1]) >= 3
    assert "parrot_step_prefill_tokens_saved_bucket" in metrics and "parrot_step_queue_seconds_sum" in metrics
