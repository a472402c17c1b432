"""The whole service end to end: parrot client -> HTTP -> manager -> real engine (embedded tiny model)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import httpx
import parrot as P
import pytest

from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.http.app import openai_path_hint
from server.launcher import LaunchedServer, launch

_ids = itertools.count(10**9)  # engine context ids far from the manager's own


@pytest.fixture(scope="module")
def served() -> Iterator[LaunchedServer]:
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=1024)) as s:
        yield s


def reference(engine: LLMEngine, prompt: str, max_tokens: int) -> str:
    """What the engine alone gives for the same text, tokenized whole (as /v1/completions does)."""

    async def run() -> str:
        cid = next(_ids)
        await engine.fill(cid, engine.tokenizer.encode(prompt))
        out = await engine.generate(cid, SamplingParams(max_tokens=max_tokens))
        await engine.free_context(cid)
        return out.text

    return asyncio.run(run())


@P.semantic_function(max_tokens=12)
def write_code(task):
    """You are an expert software engineer. Write python code for {{input:task}}.
    Code: {{output:code}}"""


@P.semantic_function(max_tokens=10)
def write_tests(task, code):
    """You are an experienced QA engineer. Given the task {{input:task}} and the code {{input:code}},
    write unit tests. Tests: {{output:test}}"""


def test_figure_7_runs_server_side(served: LaunchedServer) -> None:
    with P.Session(served.url) as s:
        task = s.variable("a snake game")
        code = write_code(task)
        test = write_tests(task, code)
        code_text, test_text = code.get(criteria=P.LATENCY), test.get(criteria=P.LATENCY)
    engine = served.engines[0]
    prompt1 = write_code.template.replace("{{input:task}}", "a snake game").split("{{output:code}}")[0]
    assert code_text == reference(engine, prompt1, 12)
    prompt2 = (
        write_tests.template.replace("{{input:task}}", "a snake game")
        .replace("{{input:code}}", code_text)
        .split("{{output:test}}")[0]
    )
    assert test_text == reference(engine, prompt2, 10)


async def test_figure_7_async(served: LaunchedServer) -> None:
    async with P.Session(served.url) as s:
        task = s.variable("a todo app")
        code = write_code(task)
        test = write_tests(task, code)
        assert isinstance(await code.aget(criteria=P.LATENCY), str)
        assert isinstance(await test.aget(), str)


@P.semantic_function(max_tokens=6)
def step(previous):
    """Continue the story: {{input:previous}} Next: {{output:next}}"""


def test_chain_of_10_dependent_calls(served: LaunchedServer) -> None:
    with P.Session(served.url) as s:
        before = served.request_counts.copy()
        v: P.Variable = s.variable("Once upon a time")
        outs = []
        for _ in range(10):
            v = step(v)
            outs.append(v)
        last = outs[-1].get()
        # The input, the 10 calls and the get: one round trip, counted at the server.
        assert served.request_counts - before == {("POST", "/v1/sessions/{session_id}/batch"): 1}
        values = [o.get() for o in outs]
        assert served.request_counts - before == {
            ("POST", "/v1/sessions/{session_id}/batch"): 1,
            ("GET", "/v1/sessions/{session_id}/variables/{var_id}"): 9,  # one per get; the last was cached
        }
    assert values[-1] == last
    engine = served.engines[0]
    text = "Once upon a time"
    for got in values:
        text = reference(engine, f"Continue the story: {text} Next: ", 6)
        assert got == text


def test_shared_system_prompt_is_prefilled_once(served: LaunchedServer) -> None:
    engine = served.engines[0]
    system = " ".join(f"rule {i}: be precise about item {i}." for i in range(120))
    prefix_len = len(engine.tokenizer.encode(f"{system} Question: "))

    template = f"{system} Question: {{{{input:q}}}} Answer: {{{{output:a}}}}"
    fn = P.SemanticFunction.from_template(template, name="ask", sampling=P.SamplingConfig(max_tokens=3))
    questions = [f"what is item {i}?" for i in range(50)]
    before = engine.stats().prefill_tokens_computed
    with P.Session(served.url) as s:
        answers = [fn(s.variable(q)) for q in questions]
        got = [a.get() for a in answers]
    computed = engine.stats().prefill_tokens_computed - before
    full = [len(engine.tokenizer.encode(f"{system} Question: {q} Answer: ")) for q in questions]
    assert prefix_len > 1000
    # The system prompt is computed once, not 50 times; each call computes at most its own tail (one token
    # more where whole-prompt tokenization merges across the boundary; less where it shares the start of
    # its question with a call that finished before it, "item 1" and "item 10").
    assert computed <= prefix_len + sum(n - prefix_len + 1 for n in full)
    assert computed < 2 * prefix_len
    assert got == [reference(engine, f"{system} Question: {q} Answer: ", 3) for q in questions]


def test_sessions_are_isolated(served: LaunchedServer) -> None:
    with httpx.Client(base_url=served.url) as c:
        a = c.post("/v1/sessions").json()
        b = c.post("/v1/sessions").json()
        va = c.post(
            f"/v1/sessions/{a['session_id']}/variables",
            json={"value": "secret"},
            headers={"Authorization": f"Bearer {a['token']}"},
        ).json()["var_id"]
        as_b = {"Authorization": f"Bearer {b['token']}"}
        r = c.get(f"/v1/sessions/{a['session_id']}/variables/{va}", headers=as_b)
        assert r.status_code == 403 and r.json()["error"]["message"]
        r = c.get(f"/v1/sessions/{b['session_id']}/variables/{va}", headers=as_b, params={"timeout": 0})
        assert r.status_code == 404
        assert c.delete(f"/v1/sessions/{a['session_id']}", headers=as_b).status_code == 403
        assert c.get(f"/v1/sessions/{a['session_id']}/variables/{va}").status_code == 401
        as_a = {"Authorization": f"Bearer {a['token']}"}
        assert (
            c.get(f"/v1/sessions/{a['session_id']}/variables/{va}", headers=as_a).json()["value"] == "secret"
        )
        assert c.delete(f"/v1/sessions/{b['session_id']}", headers=as_b).status_code == 204
        assert c.get(f"/v1/sessions/{a['session_id']}/variables/{va}", headers=as_a).status_code == 200


def _session(c: httpx.Client) -> tuple[str, dict[str, str]]:
    s = c.post("/v1/sessions").json()
    return s["session_id"], {"Authorization": f"Bearer {s['token']}"}


def test_bad_input_gets_typed_errors_and_the_server_keeps_serving(served: LaunchedServer) -> None:
    with httpx.Client(base_url=served.url) as c:
        sid, auth = _session(c)
        base = f"/v1/sessions/{sid}"

        def call(template: str, placeholders: list[dict]) -> httpx.Response:
            return c.post(
                f"{base}/calls", headers=auth, json={"template": template, "placeholders": placeholders}
            )

        out = {"name": "y", "role": "output", "sampling": {"max_tokens": 2}}
        r = call("Hi {{input:x} {{output:y}}", [{"name": "x", "role": "input", "value": "a"}, out])
        assert r.status_code == 400 and r.json()["error"]["type"] == "bad_template"
        r = call("Hi {{input:x}} {{output:y}}", [{"name": "x", "role": "input", "var_id": "nope"}, out])
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "unknown_variable"
        var = c.post(f"{base}/variables", headers=auth, json={}).json()["var_id"]
        assert c.put(f"{base}/variables/{var}", headers=auth, json={"value": "v"}).status_code == 200
        r = c.put(f"{base}/variables/{var}", headers=auth, json={"value": "w"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "variable_conflict"
        never = c.post(f"{base}/variables", headers=auth, json={}).json()["var_id"]
        r = call("Hi {{input:x}} {{output:y}}", [{"name": "x", "role": "input", "var_id": never}, out])
        y = r.json()["outputs"]["y"]
        r = c.get(f"{base}/variables/{y}", headers=auth, params={"timeout": 0.2})
        assert r.status_code == 504 and r.json()["error"]["type"] == "get_timeout"
        # A failing transform fails its variable, and its consumer fails with the cause.
        bad = {**out, "transforms": [{"type": "json"}]}
        r = call("Say {{input:x}} {{output:y}}", [{"name": "x", "role": "input", "value": "a"}, bad])
        y = r.json()["outputs"]["y"]
        r = call(
            "Use {{input:x}} {{output:z}}",
            [{"name": "x", "role": "input", "var_id": y}, {**out, "name": "z"}],
        )
        z = r.json()["outputs"]["z"]
        got = c.get(f"{base}/variables/{z}", headers=auth, params={"criteria": "latency"}).json()
        assert got["status"] == "failed" and "json transform failed" in got["error"]
        assert c.get(f"{base}/variables/{y}", headers=auth).json()["status"] == "failed"
        r = c.get(f"{base}/variables/{y}", headers=auth, params={"criteria": "fastest"})
        assert r.status_code == 422
        r = c.post(f"{base}/calls", headers=auth, content=b"x" * (9 * 1024 * 1024))
        assert r.status_code == 413
        long_text = "word " * 5000
        r = call("{{input:x}} {{output:y}}", [{"name": "x", "role": "input", "value": long_text}, out])
        got = c.get(f"{base}/variables/{r.json()['outputs']['y']}", headers=auth).json()
        assert got["status"] == "failed" and "context window" in got["error"]
        assert c.get("/health").json()["status"] == "ok"
        r = call("Hi {{input:x}} {{output:y}}", [{"name": "x", "role": "input", "value": "ok"}, out])
        ok = c.get(f"{base}/variables/{r.json()['outputs']['y']}", headers=auth).json()
        assert ok["status"] == "ready"
        assert c.get("/v1/sessions/nope/variables/x", headers=auth).status_code in (403, 404)
        metrics = c.get("/metrics").text
        assert "parrot_sessions" in metrics and "parrot_engine_blocks_used" in metrics


def test_openai_endpoints_on_the_same_server(served: LaunchedServer) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    prompt = "Continue the story: Once upon a time Next: "
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    assert out.choices[0].text == reference(served.engines[0], prompt, 6)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x", max_tokens=1)


def test_batches_apply_in_order_and_stop_at_the_first_error(served: LaunchedServer) -> None:
    with httpx.Client(base_url=served.url) as c:
        sid, auth = _session(c)
        base = f"/v1/sessions/{sid}"
        out = {"name": "y", "role": "output", "sampling": {"max_tokens": 2}}

        def batch(ops: list[dict], get: dict | None = None) -> httpx.Response:
            body = {"ops": ops, **({"get": get} if get is not None else {})}
            return c.post(f"{base}/batch", headers=auth, json=body)

        ops = [
            {"op": "create_variable", "var_id": "a", "value": "x"},
            {"op": "submit_call", "template": "Hi {{input:x} {{output:y}}", "placeholders": []},
            {"op": "create_variable", "var_id": "b", "value": "x"},
        ]
        r = batch(ops)
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "bad_template" and r.json()["error"]["op_index"] == 1
        assert c.get(f"{base}/variables/a", headers=auth).json()["value"] == "x"  # applied before
        assert c.get(f"{base}/variables/b", headers=auth).status_code == 404  # not applied after
        r = batch([{"op": "create_variable", "var_id": "a"}])
        assert r.status_code == 409 and r.json()["error"]["op_index"] == 0
        r = batch([{"op": "create_variable", "var_id": "c"}], get={"var_id": "nope"})
        assert r.status_code == 404 and r.json()["error"]["op_index"] == 1  # the get is after every op
        # A cycle needs an output adopting a variable that is already consumed: x -> y -> x.
        r = batch(
            [
                {"op": "create_variable", "var_id": "x"},
                {
                    "op": "submit_call",
                    "template": "{{input:x}} {{output:y}}",
                    "placeholders": [{"name": "x", "role": "input", "var_id": "x"}, {**out, "var_id": "y"}],
                },
                {
                    "op": "submit_call",
                    "template": "{{input:y}} {{output:x}}",
                    "placeholders": [
                        {"name": "y", "role": "input", "var_id": "y"},
                        {**out, "name": "x", "var_id": "x"},
                    ],
                },
            ]
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "cycle"
        assert r.json()["error"]["op_index"] == 2
        r = c.post(
            f"{base}/calls",
            headers=auth,
            json={"template": "{{output:y}}", "placeholders": [out], "model": "gpt-9"},
        )
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"
        # A good batch answers NDJSON: the operations applied, then the get's answer.
        r = batch(
            [
                {
                    "op": "submit_call",
                    "template": "Say {{output:y}}",
                    "placeholders": [{**out, "var_id": "said"}],
                    "model": "tiny",
                }
            ],
            get={"var_id": "said", "criteria": "latency"},
        )
        applied, answer = (line for line in r.text.splitlines() if line)
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        assert httpx.Response(200, content=applied).json()["results"][0]["outputs"] == {"y": "said"}
        assert httpx.Response(200, content=answer).json()["get"]["status"] == "ready"
        assert c.get("/health").json()["status"] == "ok"


async def test_a_failing_or_deleted_session_never_disturbs_another(served: LaunchedServer) -> None:
    engine = served.engines[0]
    async with P.Session(served.url) as a:
        v: P.Variable = a.variable("In a land far away")
        chain = []
        for _ in range(5):
            v = step(v)
            chain.append(v)
        first = asyncio.create_task(chain[-1].aget(criteria=P.LATENCY))
        b = P.Session(served.url)
        await b.__aenter__()
        # Work of B that runs at once (criteria at submit), so it is in flight when B goes.
        busy = P.SemanticFunction.from_template(
            "Doomed {{input:q}}: {{output:o}}",
            name="busy",
            sampling=P.SamplingConfig(max_tokens=40, ignore_eos=True),
            criteria=P.LATENCY,
        )
        doomed = [busy(q="x " * i) for i in range(1, 6)]
        failing = P.SemanticFunction.from_template(
            "{{input:q}} {{output:o}}", name="failing", transforms={"o": [P.transforms.json()]}
        )(q="not json")
        with pytest.raises(P.VariableFailedError):
            await failing.aget()
        assert len(doomed) == 5 and engine.stats().running > 0  # 40 tokens each vs the failing call's 16
        await b.__aexit__(None, None, None)  # deleted while its other calls still run
        values = [await first] + [await c.aget() for c in chain[:-1]]
    text = "In a land far away"
    expected = []
    for _ in range(5):
        text = await asyncio.to_thread(reference, engine, f"Continue the story: {text} Next: ", 6)
        expected.append(text)
    assert values[0] == expected[-1] and values[1:] == expected[:-1]


def test_an_openai_route_without_v1_says_where_it_is(served: LaunchedServer) -> None:
    """A client whose base URL lacks ``/v1`` gets a 404 that says where the route is, not a bare one."""
    with httpx.Client(base_url=served.url) as c:
        r = c.post("/chat/completions", json={"model": "tiny", "messages": []})
        message = r.json()["error"]["message"]
        assert r.status_code == 404 and "(/v1/chat/completions)" in message
        assert "base URL http://HOST:PORT/v1" in message
        r = c.get("/somewhere-else")
        assert r.status_code == 404 and "/v1" not in r.json()["error"]["message"]
    assert openai_path_hint("/models/tiny") is not None and openai_path_hint("/completions/") is not None
    assert openai_path_hint("/completionsx") is None and openai_path_hint("/v1/chat/completions") is None
