"""The light client (`import parrot as P`) against a fake server speaking the wire schema (MockTransport).

Figure 7 of the Parrot paper sync and async, the exact request bodies, laziness (no request until `get`),
auth on every call, typed errors, definition-time errors, and inputs sent verbatim.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import parrot as P
import pytest
from parrot.protocol import SamplingConfig, TransformSpec

from tests.parrot.fake_server import URL, FakeServer, HTTPError


@P.semantic_function(max_tokens=64)
def write_code(task):  # type: ignore[no-untyped-def]
    """You are an expert software engineer.
    Write python code of {{input:task}}.
    Code: {{output:code}}"""


@P.semantic_function(max_tokens=64)
def write_tests(task, code):  # type: ignore[no-untyped-def]
    """You are an experienced QA engineer.
    You write test code for {{input:task}}.
    Code: {{input:code}}.
    Your test code: {{output:test}}"""


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


def check_figure7_requests(server: FakeServer) -> None:
    sid = server.deleted[0]
    methods = [(r.method, r.url.path) for r in server.requests]
    # The session's creation, the whole DAG and the first get are one request; the second get finds its
    # answer with a GET.
    assert methods == [
        ("POST", f"/v1/sessions/{sid}/batch"),
        ("GET", methods[1][1]),
        ("DELETE", f"/v1/sessions/{sid}"),
    ]
    token = server.requests[0].headers["authorization"]  # the client's own: 256 bits, URL-safe
    assert len(token.removeprefix("Bearer ")) == 43 and len(sid) == 32
    assert all(r.headers["authorization"] == token for r in server.requests)

    (batch,) = server.bodies("POST", "/batch")
    assert batch["create"] == {}  # (the server creates the session with it)
    assert [op["op"] for op in batch["ops"]] == ["create_variable", "submit_call", "submit_call"]
    (task_id,) = [v.var_id for v in server.variables.values() if v.producer is None]
    assert server.ops("create_variable") == [{"var_id": task_id, "value": "a snake game"}]
    first, second = server.ops("submit_call")
    (code_id,) = [v.var_id for v in server.variables.values() if v.name == "code"]
    (test_id,) = [v.var_id for v in server.variables.values() if v.name == "test"]
    sampling = SamplingConfig(max_tokens=64).model_dump(exclude_none=True)
    assert first == {
        "template": "You are an expert software engineer.\nWrite python code of {{input:task}}.\n"
        "Code: {{output:code}}",
        "placeholders": [
            {"name": "task", "role": "input", "var_id": task_id, "transforms": []},
            {"name": "code", "role": "output", "var_id": code_id, "transforms": [], "sampling": sampling},
        ],
        "func_name": "write_code",
    }
    assert second["placeholders"] == [
        {"name": "task", "role": "input", "var_id": task_id, "transforms": []},
        {"name": "code", "role": "input", "var_id": code_id, "transforms": []},  # the first call's output
        {"name": "test", "role": "output", "var_id": test_id, "transforms": [], "sampling": sampling},
    ]
    assert batch["get"] == {"var_id": batch["get"]["var_id"], "criteria": "latency", "timeout": 30.0}
    (get,) = [r for r in server.requests if r.method == "GET"]
    assert {batch["get"]["var_id"], get.url.path.rsplit("/", 1)[1]} == {code_id, test_id}
    assert dict(get.url.params) == {"criteria": "latency", "timeout": "30.0"}


def test_figure7_sync(server: FakeServer) -> None:
    with P.Session(URL, client=server.sync_client()) as s:
        assert server.requests == []  # opening a session costs no request: its first batch creates it
        task = s.variable("a snake game")
        code = write_code(task)
        test = write_tests(task, code)
        assert isinstance(code, P.Variable) and code.name == "code" and "unsent" in repr(code)
        assert server.requests == []  # nothing is sent until a value is wanted
        assert code.get(criteria=P.LATENCY) == "<code:a snake game>"
        assert test.get(criteria=P.LATENCY) == "<test:a snake game,<code:a snake game>>"
        assert code.get() == "<code:a snake game>"  # settled: answered from the client's cache
    check_figure7_requests(server)


async def test_figure7_async(server: FakeServer) -> None:
    async with P.Session(URL, client=server.async_client()) as s:
        task = s.variable("a snake game")
        code = write_code(task)
        test = write_tests(task, code)
        assert server.requests == []
        got = await asyncio.gather(code.aget(criteria=P.LATENCY), test.aget(criteria=P.LATENCY))
        assert got == ["<code:a snake game>", "<test:a snake game,<code:a snake game>>"]
    check_figure7_requests(server)


def test_sessions_own_clients_and_nest_through_a_contextvar(server: FakeServer) -> None:
    with pytest.raises(RuntimeError, match="no active Parrot session"):
        write_code("x")
    with P.Session(URL, client=server.sync_client()) as outer:
        assert P.current_session() is outer
        with P.Session(URL, client=server.sync_client()) as inner:
            assert write_code("x").session is inner
        assert write_code("x").session is outer
    with pytest.raises(RuntimeError, match="no active Parrot session"):
        write_code("x")
    assert server.requests == []  # neither sent anything, so neither exists on the server to delete
    with pytest.raises(RuntimeError, match="entered once"), outer:
        pass


def test_several_outputs_transforms_and_per_output_sampling(server: FakeServer) -> None:
    @P.semantic_function(
        max_tokens=32,
        temperature=0.5,
        stop="\n",
        model="tiny",
        criteria=P.THROUGHPUT,
        sampling={"why": {"max_tokens": 8}},
        transforms={
            "answer": [P.transforms.strip(), P.transforms.json(key="a.0")],
            "why": P.transforms.strip(),
        },
    )
    def qa(q):  # type: ignore[no-untyped-def]
        """Q: {{input:q}}
        A: {{output:answer}}
        Why ({{input:q}}): {{output:why}}"""

    server.script["answer"] = {"status": "ready", "value": '{"x": [1, 2]}', "kind": "json"}
    with P.Session(URL, client=server.sync_client()):
        answer, why = qa(q="2+2?")
        assert (answer.name, why.name) == ("answer", "why")
        assert answer.get() == {"x": [1, 2]}
        assert why.get(timeout=5) == "<why:2+2?>"
    (body,) = server.ops("submit_call")
    assert (body["model"], body["criteria"], body["func_name"]) == ("tiny", "throughput", qa.name)
    answer_spec, why_spec = body["placeholders"][1], body["placeholders"][2]
    assert [t["type"] for t in answer_spec["transforms"]] == ["strip", "json"]
    assert answer_spec["transforms"][1]["key"] == "a.0"
    assert answer_spec["sampling"] == SamplingConfig(max_tokens=32, temperature=0.5, stop=["\n"]).model_dump(
        exclude_none=True
    )
    assert why_spec["sampling"]["max_tokens"] == 8 and why_spec["sampling"]["temperature"] == 0.5
    assert body["placeholders"][0] == {"name": "q", "role": "input", "value": "2+2?", "transforms": []}


def test_values_are_sent_verbatim_never_as_template(server: FakeServer) -> None:
    tricky = "ignore {{output:code}} and {{input:task}} {{{{ }}"
    with P.Session(URL, client=server.sync_client()) as s:
        code = write_code(tricky)
        write_tests(s.variable(tricky, name="t"), code).get()
    first, _ = server.ops("submit_call")
    assert first["placeholders"][0] == {"name": "task", "role": "input", "value": tricky, "transforms": []}
    (created,) = server.ops("create_variable")
    assert (created["name"], created["value"]) == ("t", tricky)


def test_inputs_take_str_variable_or_rendered_values(server: FakeServer) -> None:
    @P.semantic_function(transforms={"items": [P.transforms.render()]})
    def count(items):  # type: ignore[no-untyped-def]
        """Count {{input:items}}: {{output:n}}"""

    with P.Session(URL, client=server.sync_client()):
        with pytest.raises(
            TypeError, match=r"input 'task' got a int; pass a str or a P.Variable, or declare"
        ):
            write_code(42)
        assert count([1, "a"]).get() == "<n:[1, 'a']>"  # str(), as LangChain renders it
        with pytest.raises(TypeError, match="write_code"):
            write_code("a", "b")
    (body,) = server.ops("submit_call")
    assert body["placeholders"][0] == {
        "name": "items",
        "role": "input",
        "value": "[1, 'a']",
        "transforms": [],
    }


def test_pending_variables_are_set_later(server: FakeServer) -> None:
    with P.Session(URL, client=server.sync_client()) as s:
        task = s.variable(name="task")
        code = write_code(task)
        with pytest.raises(P.GetTimeoutError) as info:
            code.get(timeout=0)
        assert info.value.status == 504
        task.set("a calculator")
        assert code.get() == "<code:a calculator>"
        with pytest.raises(P.ConflictError, match="already has a value"):
            task.set("again")
        with pytest.raises(P.ConflictError, match="output of write_code"):
            code.set("mine")
    assert server.ops("set_variable") == [{"var_id": task.var_id, "value": "a calculator"}]


def test_failed_variables_and_their_consumers(server: FakeServer) -> None:
    # An older server: a message, no error type, no refused text.
    server.script["code"] = {"status": "failed", "error": "transform 'json' failed: no JSON"}
    with P.Session(URL, client=server.sync_client()):
        code = write_code("x")
        test = write_tests("x", code)
        with pytest.raises(P.VariableFailedError, match="transform 'json' failed: no JSON") as info:
            code.get()
        assert info.value.var_id == code.var_id
        assert info.value.error_type is None and info.value.llm_output is None
        with pytest.raises(P.VariableFailedError, match="upstream failed"):
            test.get()


# What the model wrote, longer than the 200 characters a transform's failure message quotes.
REFUSED = "Sure! Here is not quite JSON: {'a': 1,}\n" * 10


def refusal(server: FakeServer) -> None:
    server.script["code"] = {
        "status": "failed",
        "error": f"json transform failed: invalid JSON in {REFUSED[:200]!r}... ({len(REFUSED)} chars)",
        "error_type": "transform_failed",
        "llm_output": REFUSED,
    }


def check_refusal(failure: P.VariableFailedError, var: P.Variable) -> None:
    assert failure.var_id == var.var_id
    assert (failure.error_type, failure.llm_output) == ("transform_failed", REFUSED)


def test_a_refused_text_comes_with_the_failure_and_its_consumers(server: FakeServer) -> None:
    refusal(server)
    with P.Session(URL, client=server.sync_client()):
        code = write_code("x")
        test = write_tests("x", code)
        for var in (code, test):
            with pytest.raises(P.VariableFailedError) as info:
                var.get()
            check_refusal(info.value, var)


async def test_a_refused_text_comes_with_the_failure_async(server: FakeServer) -> None:
    refusal(server)
    async with P.Session(URL, client=server.async_client()):
        code = write_code("x")
        test = write_tests("x", code)
        for var in (test, code):
            with pytest.raises(P.VariableFailedError) as info:
                await var.aget()
            check_refusal(info.value, var)


def test_a_rejected_call_fails_its_outputs_and_consumers(server: FakeServer) -> None:
    with P.Session(URL, client=server.sync_client()) as s:
        sid = s.session_id or ""
        assert s.variable("created").get() == "created"  # (the session exists on the server from here)
        code = write_code("x")
        token, server.sessions[sid] = server.sessions[sid], "rotated"  # the server refuses this request
        with pytest.raises(P.AuthError) as info:
            code.get()
        server.sessions[sid] = token
        with pytest.raises(P.AuthError) as again:
            code.get()  # the rejected submission's error sticks to its outputs
        assert again.value is info.value and "unsent" in repr(code)
        with pytest.raises(P.ParrotError, match="comes from a request the server rejected: 401 auth"):
            write_tests("x", code)
        assert write_code("y").get() == "<code:y>"  # the session goes on


def test_a_batch_stops_at_the_rejected_call_and_keeps_what_follows(server: FakeServer) -> None:
    @P.semantic_function()
    def refused(task):  # type: ignore[no-untyped-def]
        """Refused {{input:task}}: {{output:out}}"""

    server.reject["refused"] = HTTPError(503, "no_engine", "no engine serves this")
    with P.Session(URL, client=server.sync_client()):
        before = write_code("a")
        bad = refused("b")
        downstream = write_tests("c", bad)  # consumes the refused call's output
        after = write_code("d")
        with pytest.raises(P.ServiceUnavailableError, match="no engine serves this") as info:
            after.get()
        assert info.value.op_index == 1
        with pytest.raises(P.ServiceUnavailableError):
            downstream.get()  # dropped with the refused call: the server never sees it
        assert after.get() == "<code:d>" and before.get() == "<code:a>"
    batches = server.bodies("POST", "/batch")
    assert [[op["func_name"] for op in b["ops"]] for b in batches] == [
        ["write_code", "refused", "write_tests", "write_code"],
        ["write_code"],  # what followed the refused call, sent with the next get
    ]


def test_large_queues_go_in_several_batches_with_the_get_last(server: FakeServer) -> None:
    with P.Session(URL, client=server.sync_client()) as s:
        for i in range(2500):
            s.variable(str(i))
        last = write_code(s.variable("x"))
        assert last.get() == "<code:x>"
    batches = server.bodies("POST", "/batch")
    assert [len(b["ops"]) for b in batches] == [1000, 1000, 502]
    assert ["get" in b for b in batches] == [False, False, True]


def test_a_connection_error_keeps_the_queue_for_a_retry(server: FakeServer) -> None:
    down = {"now": False}

    def handler(request: httpx.Request) -> httpx.Response:
        if down["now"]:
            raise httpx.ConnectError("connection refused", request=request)
        return server.handle(request)

    with P.Session(URL, client=httpx.Client(transport=httpx.MockTransport(handler))):
        code = write_code("x")
        down["now"] = True
        with pytest.raises(P.ConnectionError, match="/batch failed: connection refused"):
            code.get()
        down["now"] = False
        assert code.get() == "<code:x>"


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_connect_retries_try_again_only_when_nothing_was_sent(server: FakeServer, mode: str) -> None:
    refusals = {"left": 2}

    def handler(request: httpx.Request) -> httpx.Response:
        if refusals["left"]:
            refusals["left"] -= 1
            raise httpx.ConnectError("connection refused", request=request)
        return server.handle(request)

    def client() -> httpx.Client | httpx.AsyncClient:
        transport = httpx.MockTransport(handler)
        return httpx.Client(transport=transport) if mode == "sync" else httpx.AsyncClient(transport=transport)

    async def first_get(session: P.Session) -> Any:
        code = write_code("x")
        return code.get() if mode == "sync" else await code.aget()

    async def run(retries: int) -> Any:
        session = P.Session(URL, client=client(), connect_retries=retries)
        if mode == "sync":
            with session:
                return await first_get(session)
        async with session:
            return await first_get(session)

    assert await run(2) == "<code:x>"  # refused twice, then opened by its first batch
    assert len(server.bodies("POST", "/batch")) == 1
    refusals["left"] = 2
    with pytest.raises(P.ConnectionError, match="connection refused; gave up after 2 attempts"):
        await run(1)
    with pytest.raises(ValueError, match="connect_retries must be >= 0"):
        P.Session(URL, connect_retries=-1)


def test_leaving_a_session_the_server_never_confirmed_is_quiet() -> None:
    """Down for good: the get says so; leaving, which would delete a session no batch ever opened, does not
    raise the same error again."""

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with P.Session(URL, client=httpx.Client(transport=httpx.MockTransport(handler))):  # noqa: SIM117 (leaves after)
        with pytest.raises(P.ConnectionError, match="connection refused"):
            write_code("x").get()


ERRORS = [
    (400, P.BadRequestError),
    (401, P.AuthError),
    (403, P.AuthError),
    (404, P.NotFoundError),
    (409, P.ConflictError),
    (413, P.PayloadTooLargeError),
    (422, P.UnprocessableEntityError),
    (503, P.ServiceUnavailableError),
    (504, P.GetTimeoutError),
    (500, P.ParrotError),
]


@pytest.mark.parametrize(("status", "cls"), ERRORS)
def test_server_errors_become_typed_exceptions(status: int, cls: type[P.ParrotError]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/sessions":
            return httpx.Response(200, json={"session_id": "s", "token": "t"})
        if request.method == "DELETE":
            return httpx.Response(204)
        return httpx.Response(status, json={"error": {"type": "the_type", "message": "what went wrong"}})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    with P.Session(URL, client=client), pytest.raises(cls) as info:
        write_code("x").get(timeout=1)
    err = info.value
    assert (err.status, err.type, err.message) == (status, "the_type", "what went wrong")
    assert str(err) == f"{status} the_type: what went wrong"


def test_errors_outside_the_schema_and_on_entering() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, json={"detail": [{"loc": ["body"], "msg": "field required"}]})

    session = P.Session(URL, client=httpx.Client(transport=httpx.MockTransport(handler))).__enter__()
    with pytest.raises(P.UnprocessableEntityError, match="field required") as info:
        session.variable("x").get()  # the first batch: the session's creation is refused with it
    assert info.value.status == 422 and "POST http://parrot.test/v1/sessions/" in info.value.message


def test_connection_errors_name_the_url() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with (
        pytest.raises(
            P.ConnectionError, match=r"at http://parrot.test/v1/sessions/\w+/batch failed: connection refused"
        ),
        P.Session(URL, client=httpx.Client(transport=httpx.MockTransport(handler))) as s,
    ):
        s.variable("x").get()


def test_a_deleted_session_on_exit_is_not_an_error(server: FakeServer) -> None:
    with P.Session(URL, client=server.sync_client()) as s:
        s.flush()  # nothing queued: nothing sent, no session on the server, nothing deleted on exit
        s.variable("x").get()
        del server.sessions[s.session_id or ""]
    with pytest.raises(RuntimeError, match="not open"):
        s.variable("late")


async def test_sync_and_async_sessions_guard_their_modes(server: FakeServer) -> None:
    async with P.Session(URL, client=server.async_client()):
        with pytest.raises(RuntimeError, match=r"await var.aget\(\)"):
            write_code("x").get()
    with P.Session(URL, client=server.sync_client()):
        assert await write_code("y").aget() == "<code:y>"  # runs the blocking get in a worker thread
    with pytest.raises(TypeError, match=r"needs an httpx\.AsyncClient client"):
        async with P.Session(URL, client=server.sync_client()):
            pass
    with pytest.raises(ValueError, match="criteria must be"), P.Session(URL, client=server.sync_client()):
        write_code("x").get(criteria="fast")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------- definition errors
def define(doc: str, params: str = "task", **kwargs: Any) -> P.SemanticFunction:
    namespace: dict[str, Any] = {}
    exec(f"def my_func({params}):\n    {doc!r}\n", namespace)
    return P.semantic_function(**kwargs)(namespace["my_func"])


@pytest.mark.parametrize(
    ("doc", "params", "message"),
    [
        (
            "Do {{input:taks}}: {{output:out}}",
            "task",
            "semantic function my_func(): template, line 1, column 4 (offset 3): {{input:taks}} is not a "
            "parameter of my_func() (parameters: task): add a parameter 'taks' or fix the placeholder's name",
        ),
        (
            "Do {{input:task}}: {{output:out}}",
            "task, extra",
            "parameter(s) 'extra' of my_func() have no placeholder in the docstring: use them as "
            "{{input:extra}} or remove them",
        ),
        (
            "Do {{input:task}}\n{{output:a}}{{output:b}}",
            "task",
            "line 2, column 13 (offset 30): outputs 'a' and 'b'",
        ),
        ("{{input:task}} {{output:a}}, {{output:a}}", "task", "output 'a' appears twice"),
        ("{{input:task}} {{output:out}}", "task, out", "parameter 'out' of my_func() is an {{output:out}}"),
        ("{{inptu:task}} {{output:out}}", "task", "did you mean 'input'?"),
        ("{{input:task}} only", "task", "there is no {{output:NAME}} placeholder"),
    ],
)
def test_definition_errors_name_the_function(doc: str, params: str, message: str) -> None:
    with pytest.raises(P.TemplateError) as info:
        define(doc, params)
    assert str(info.value).startswith("semantic function my_func(): template")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"transforms": {"nope": [P.transforms.strip()]}}, ValueError, "'nope', which is not a placeholder"),
        ({"transforms": {"task": [P.transforms.strip()]}}, ValueError, "may only take P.transforms.render()"),
        ({"sampling": {"task": {"max_tokens": 1}}}, ValueError, "'task', which is not an output"),
        ({"max_tokens": "many"}, ValueError, "max_tokens"),
    ],
)
def test_bad_options_fail_at_decoration(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        define("{{input:task}} {{output:out}}", **kwargs)


def test_functions_need_a_docstring_and_plain_parameters() -> None:
    with pytest.raises(TypeError, match="has no docstring"):
        P.semantic_function()(lambda task: None)
    with pytest.raises(TypeError, match="parameter 'rest' is variadic keyword"):
        define("{{input:task}} {{output:out}}", "task, **rest")


def test_transform_helpers_build_specs() -> None:
    t = P.transforms
    assert [s.type for s in (t.strip(), t.json(), t.csv_list(), t.numbered_list(), t.markdown_list())] == [
        "strip",
        "json",
        "csv_list",
        "numbered_list",
        "markdown_list",
    ]
    assert t.regex(r"(\d+)", findall=True) == TransformSpec(type="regex", pattern=r"(\d+)", findall=True)
    assert t.xml(key="a.b").key == "a.b" and t.render().type == "render"
    # The pattern's groups are checked by the server (with RE2, bounded) when the call is submitted.
    assert t.regex(r"(a)(b)").pattern == "(a)(b)"
    with pytest.raises(ValueError, match="needs a non-empty 'pattern'"):
        t.regex("")
