"""The live view's routes: a session's DAG joins its calls, steps and variables with what the
server did (state, engine, objective, task group, prefill computed and saved); ``GET /v1/view`` lists
engines and sessions for the cluster token; looking activates nothing and keeps nothing alive; nobody
without the session's token or the cluster token sees anything. The page itself: ``/ui`` (the browser test
is `test_live_view_browser.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import parrot as P
import pytest
from parrot.protocol import SessionDag
from parrot.text_stream import stream_events

from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch
from server.serve.dag_view import DAG_VALUE_CHARS, ClusterView
from server.serve.manager import ManagerConfig
from tests.server.conftest import BROKEN

SYSTEM = "You review short documents for a careful editor and answer in a few words. " * 3
REVIEW = P.SemanticFunction.from_template(
    SYSTEM + "Document: {{input:doc}}\nAspect: {{input:aspect}}\nReview:{{output:review}}",
    name="review",
    sampling=P.SamplingConfig(max_tokens=6, temperature=0.0, ignore_eos=True),
)
SUMMARISE = P.SemanticFunction.from_template(
    "Reviews:\n1. {{input:a}}\n2. {{input:b}}\n3. {{input:c}}\nSummary:{{output:summary}}",
    name="summarise",
    sampling=P.SamplingConfig(max_tokens=6, temperature=0.0, ignore_eos=True),
)


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _dag(server: LaunchedServer, session: P.Session, token: str | None = None) -> SessionDag:
    r = httpx.get(
        f"{server.url}/v1/sessions/{session.session_id}/dag", headers=_auth(token or session._token or "")
    )
    assert r.status_code == 200, r.text
    return SessionDag.model_validate(r.json())


def _chain(session: P.Session) -> tuple[P.Variable, list[P.Variable], P.Variable]:
    """Three reviews of one document, summarised: a DAG of four steps."""
    doc = session.variable("The lighthouse keeper counts ships at night. " * 4, name="doc")
    reviews = [REVIEW(doc=doc, aspect=a) for a in ("clarity", "accuracy", "style")]
    return doc, reviews, SUMMARISE(a=reviews[0], b=reviews[1], c=reviews[2])


def test_the_dag_joins_calls_steps_and_variables(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url) as session:
        doc, reviews, summary = _chain(session)
        value = summary.get()
        dag = _dag(one_or_two, session)
    assert dag.session_id == session.session_id
    assert [s.function for s in dag.steps] == ["review"] * 3 + ["summarise"]
    assert all(s.state == "done" and s.engine and s.attempts == 1 and s.run_s for s in dag.steps)
    assert [s.var_id for s in dag.steps] == [r.var_id for r in reviews] + [summary.var_id]
    assert [s.inputs for s in dag.steps[:3]] == [[doc.var_id]] * 3  # (the aspect is a literal)
    assert dag.steps[3].inputs == [r.var_id for r in reviews]
    # the reviews are the summary's parallel inputs: one task group, named by the consumer step
    assert {s.task_group for s in dag.steps[:3]} == {f"{dag.steps[3].call_id}/0"}
    # the shared system prompt and document are computed once: the other reviews fork them
    assert sum(s.prefill_tokens_saved for s in dag.steps[:3]) >= 2 * len(SYSTEM) // 8
    variables = {v.var_id: v for v in dag.variables}
    assert variables[doc.var_id].producer is None and variables[doc.var_id].name == "doc"
    assert variables[summary.var_id].producer == f"{dag.steps[3].call_id}:0"
    assert variables[summary.var_id].status == "ready" and variables[summary.var_id].value == value


def test_a_failure_shows_where_it_began_and_what_it_took_with_it(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url) as session:
        after = REVIEW(doc=BROKEN(), aspect="style")
        with pytest.raises(P.VariableFailedError):
            after.get()
        broken, downstream = _dag(one_or_two, session).steps
    assert broken.state == "failed" and broken.engine and "json transform failed" in (broken.error or "")
    assert downstream.state == "failed" and downstream.engine is None and downstream.attempts == 0
    assert downstream.inputs[0] == broken.var_id and downstream.error


@pytest.fixture(scope="module")
def lazy() -> Iterator[LaunchedServer]:
    """A server that runs a step only when a get reaches it: what 'looking activates nothing' needs."""
    config = ManagerConfig(dispatch="lazy")
    with launch("tiny", manager_config=config, engine_config=EngineConfig(num_kv_blocks=256)) as server:
        yield server


def test_looking_runs_nothing_then_shows_the_run(lazy: LaunchedServer) -> None:
    with P.Session(lazy.url) as session:
        *_, summary = _chain(session)
        session.flush()
        base = f"{lazy.url}/v1/sessions/{session.session_id}/dag/variables/{summary.var_id}"
        mine = _auth(session._token or "")
        with httpx.stream("GET", f"{base}/stream", params={"timeout": 0.3}, headers=mine) as r:
            events = list(stream_events(r.iter_lines()))
        assert [e.final.status for e in events if e.final] == ["pending"] and not any(e.delta for e in events)
        assert httpx.get(base, headers=mine).json()["status"] == "pending"
        assert [s.state for s in _dag(lazy, session).steps] == ["waiting"] * 4  # still: nothing ran
        value = summary.get()
        assert [s.state for s in _dag(lazy, session).steps] == ["done"] * 4
        with httpx.stream("GET", f"{base}/stream", headers=mine) as r:
            events = list(stream_events(r.iter_lines()))
        assert events[-1].final is not None and events[-1].final.value == value
        assert "".join(e.delta or "" for e in events) == value  # the step's text, replayed


def test_a_long_value_is_cut_in_the_dag_and_whole_on_click(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url) as session:
        long = session.variable("x" * (DAG_VALUE_CHARS + 10), name="long")
        session.flush()
        (shown,) = _dag(one_or_two, session).variables
        whole = httpx.get(
            f"{one_or_two.url}/v1/sessions/{session.session_id}/dag/variables/{long.var_id}",
            headers=_auth(session._token or ""),
        ).json()
    assert shown.truncated and len(shown.value or "") == DAG_VALUE_CHARS
    assert whole["value"] == "x" * (DAG_VALUE_CHARS + 10)


def test_only_the_sessions_token_or_the_cluster_token_may_look(one_or_two: LaunchedServer) -> None:
    url, cluster = one_or_two.url, _auth(one_or_two.cluster_token)
    with P.Session(url) as session:
        *_, summary = _chain(session)
        value = summary.get()
        sid, vid = session.session_id, summary.var_id
        with P.Session(url) as other:
            other.variable("x").get()  # (it exists on the server from its first batch)
            for route in (f"/v1/sessions/{sid}/dag", f"/v1/sessions/{sid}/dag/variables/{vid}"):
                assert httpx.get(url + route).status_code == 401
                assert httpx.get(url + route, headers=_auth(other._token or "")).status_code == 403
                assert httpx.get(url + route, headers=_auth("not-a-token")).status_code == 401
                assert httpx.get(url + route, headers=cluster).status_code == 200
            stream = f"{url}/v1/sessions/{sid}/dag/variables/{vid}/stream"
            assert httpx.get(stream, headers=_auth(other._token or "")).status_code == 403
            assert httpx.get(f"{url}/v1/view", headers=_auth(other._token or "")).status_code == 403
        with httpx.stream("GET", stream, headers=cluster) as r:  # the operator may watch it
            events = list(stream_events(r.iter_lines()))
        assert events[-1].final is not None and events[-1].final.value == value
        assert httpx.get(f"{url}/v1/sessions/nope/dag", headers=cluster).status_code == 404
        assert httpx.get(f"{url}/v1/view").status_code == 401
        view = ClusterView.model_validate(httpx.get(f"{url}/v1/view", headers=cluster).json())
        # looking with the cluster token does not keep a session alive
        seen = one_or_two.manager.sessions.find(sid).last_seen
        _dag(one_or_two, session, one_or_two.cluster_token)
        assert one_or_two.manager.sessions.find(sid).last_seen == seen
    line = next(s for s in view.sessions if s.session_id == sid)
    assert line.calls == 4 and line.steps == {"done": 4} and line.variables == {"ready": 5}
    assert len(view.engines) == len(one_or_two.engines)
    assert sum(e.prefix_hits for e in view.engines) >= 2  # (two reviews forked the first's prefix)
    assert sum(e.prefill_tokens_saved for e in view.engines) > 0


def test_the_page_is_served_with_a_strict_policy_and_holds_no_data(one_or_two: LaunchedServer) -> None:
    page = httpx.get(f"{one_or_two.url}/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "unsafe" not in policy and "frame-ancestors 'none'" in policy
    assert one_or_two.cluster_token not in page.text and '<script src="/ui/ui.js"' in page.text
    script = httpx.get(f"{one_or_two.url}/ui/ui.js")
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "innerHTML" not in script.text  # model text goes in as text, never markup
    assert httpx.get(f"{one_or_two.url}/ui/secrets.txt").status_code == 404
    assert httpx.get(f"{one_or_two.url}/ui/..%2Fui.py").status_code == 404


def test_a_session_links_to_its_view(one_or_two: LaunchedServer) -> None:
    session = P.Session(one_or_two.url)
    assert session.view_url is None
    with session:
        assert session.view_url == (
            f"{one_or_two.url}/ui#session={session.session_id}&token={session._token}"
        )
