"""Schema fuzzing: schemathesis over every operation of the live ``/openapi.json`` finds no 5xx and no hang,
and every 4xx answers the typed error body ``{"error": {"type", "message"}}``.

The real service runs (`server.launch`, the embedded tiny model). Each generated request is sent as
generated (a random or missing session id and bearer token: 401/403/404/422, never 5xx) and, for a
session-scoped route, once more inside a fresh session with its token — with, some of the time, a real
variable id (a pending one for ``PUT``, which then sets it; a ready one for ``GET``, which then answers at
once) — so that the handlers behind authentication are fuzzed too. Positive (schema-valid) and negative
(schema-violating) data both; derandomized, so CI sees the same requests every run.

Generation length: ``max_tokens`` up to the whole context window is a legitimate request (the engine stops
at the window, ``finish_reason: "length"``), but thousands of decode steps of a CPU model per example would
make this test take minutes. So the fuzzer's ``max_tokens`` / ``max_completion_tokens`` are clamped to
``_MAX_NEW_TOKENS`` when larger (values < 1 and wrong types are still sent as generated: they fuzz the
validation), and a chat request without either gets ``_MAX_NEW_TOKENS``. Long generations are exercised by
tests/server/test_service.py and tests/test_openai_api.py, not here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from hypothesis.errors import Unsatisfiable

from server import LaunchedServer, launch
from server.engine import EngineConfig

schemathesis = pytest.importorskip("schemathesis")  # the `test` extra
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core import NotSet  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402

MAX_EXAMPLES = 25  # per operation and generation mode
_MAX_NEW_TOKENS = 4
_REQUEST_TIMEOUT = 30.0  # seconds: a request slower than this is reported as a hang


@pytest.fixture(scope="module")
def served() -> Iterator[LaunchedServer]:
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=256)) as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(served: LaunchedServer) -> Any:
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


class _Sessions:
    """Fresh sessions (and variables in them) for the authenticated half of the fuzzing."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def new(self) -> tuple[str, dict[str, str]]:
        r = self.client.post("/v1/sessions")
        assert r.status_code == 200, r.text
        s = r.json()
        return s["session_id"], {"Authorization": f"Bearer {s['token']}"}

    def variable(self, sid: str, auth: dict[str, str], value: str | None) -> str:
        body = {} if value is None else {"value": value}
        r = self.client.post(f"/v1/sessions/{sid}/variables", headers=auth, json=body)
        assert r.status_code == 200, r.text
        return r.json()["var_id"]


def _clamp_generation(body: Any, chat: bool) -> None:
    """Bound the tokens a generated OpenAI request asks for (see the module docstring)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > _MAX_NEW_TOKENS:
            body[key] = _MAX_NEW_TOKENS
    if chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = _MAX_NEW_TOKENS
    if not chat and "max_tokens" in body and body["max_tokens"] is None:  # None: up to the window
        body["max_tokens"] = _MAX_NEW_TOKENS
    placeholders = body.get("placeholders")  # a session call's outputs carry `sampling`
    for spec in placeholders if isinstance(placeholders, list) else []:
        sampling = spec.get("sampling") if isinstance(spec, dict) else None
        if isinstance(sampling, dict):
            _clamp_generation(sampling, chat=False)


def _problem(case: Any, response: Any) -> str | None:
    """What is wrong with ``response`` (None: nothing): a 5xx, or a 4xx without the typed error body."""
    try:
        case.validate_response(response, checks=[not_a_server_error])
    except FailureGroup as e:
        return f"server error: {e.exceptions[0]}"
    if 400 <= response.status_code < 500:
        try:
            error = response.json()["error"]
            assert isinstance(error["type"], str) and isinstance(error["message"], str)
        except Exception:
            return "a 4xx without the {'error': {'type', 'message'}} body"
    return None


def _describe(case: Any, response: Any, problem: str) -> str:
    body = "-" if isinstance(case.body, NotSet) else json.dumps(case.body, default=repr)[:400]
    return (
        f"{problem}\n  {case.method} {case.formatted_path} query={case.query} headers={case.headers}\n"
        f"  body={body}\n  -> {response.status_code} {response.text[:400]}"
    )


def _fuzz_operation(op: Any, mode: GenerationMode, send: Callable[..., None], sessions: _Sessions) -> None:
    """Send ``MAX_EXAMPLES`` generated requests of one operation (twice for a session-scoped route)."""
    scoped = "{session_id}" in op.path

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # failures are collected, not raised: no shrinking
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(mode), real_var=st.booleans())
    def fuzz(case: Any, real_var: bool) -> None:
        _clamp_generation(case.body, chat=op.path == "/v1/chat/completions")
        send(case)  # as generated: no valid session
        if not scoped:
            return
        sid, auth = sessions.new()
        case.path_parameters["session_id"] = sid
        if real_var and "var_id" in case.path_parameters:
            value = "ready" if op.method.upper() == "GET" else None  # never a long poll on a pending one
            case.path_parameters["var_id"] = sessions.variable(sid, auth, value)
        if case.headers:
            case.headers = {k: v for k, v in case.headers.items() if k.lower() != "authorization"}
        send(case, headers=auth)

    fuzz()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzz_finds_no_server_error(served: LaunchedServer, api_schema: Any, mode: GenerationMode) -> None:
    problems: list[str] = []
    fuzzed: list[str] = []

    def send(case: Any, **kwargs: Any) -> None:
        try:
            response = case.call(base_url=served.url, timeout=_REQUEST_TIMEOUT, **kwargs)
        except Exception as e:  # a timeout is a hang; a dropped connection is a crash
            problems.append(f"no answer ({e!r}): {case.method} {case.formatted_path} body={case.body!r:.400}")
            return
        if (problem := _problem(case, response)) is not None:
            problems.append(_describe(case, response, problem))

    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 11, [op.label for op in operations]
    with httpx.Client(base_url=served.url, timeout=_REQUEST_TIMEOUT) as client:
        for op in operations:
            try:
                _fuzz_operation(op, mode, send, _Sessions(client))
            except Unsatisfiable:  # negative mode: nothing to violate (no parameters, no body)
                continue
            fuzzed.append(op.label)

    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:20])
    assert len(fuzzed) >= 6, fuzzed  # negative mode: every operation that takes input
    # Still serving, the engine included.
    with httpx.Client(base_url=served.url, timeout=_REQUEST_TIMEOUT) as c:
        assert c.get("/health").json()["status"] == "ok"
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------- sampling values, directly
# The schema fuzzer rarely draws the extreme numbers that used to kill the engine loop (and with it every
# request on that engine): a seed outside 64 bits (`torch.Generator.manual_seed` raised), a temperature
# below float32's range (every logit / temperature overflowed: NaN probabilities), a top_p below it (0 in
# float32: every token dropped), a NaN temperature (json accepts `NaN`). Here they are sent on purpose.
_EXTREMES: list[dict[str, Any]] = [
    {"seed": 2**64, "temperature": 1.0},
    {"seed": -(2**63) - 1, "temperature": 1.0},
    {"seed": 2**64 - 1, "temperature": 1.0},
    {"seed": -(2**63), "temperature": 1.0},
    {"temperature": 1e-308},
    {"temperature": 5e-324, "top_k": 2},
    {"temperature": 1e-40},
    {"temperature": 1e308},
    {"temperature": 1.0, "top_p": 1e-308},
    {"temperature": 1.0, "top_p": 5e-324, "top_k": 2**70},
]


def _engine_still_serves(c: httpx.Client) -> None:
    r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def _typed_4xx_or_ok(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["type"] and error["message"]


@pytest.mark.parametrize("fields", _EXTREMES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_extreme_sampling_values_answer_or_get_a_400_and_the_engine_survives(
    served: LaunchedServer, fields: dict[str, Any]
) -> None:
    with httpx.Client(base_url=served.url, timeout=_REQUEST_TIMEOUT) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **fields})
        _typed_4xx_or_ok(r)
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True, **fields},
        )
        _typed_4xx_or_ok(r)
        value = _session_call(c, {"max_tokens": 2, **fields})
        assert value["status"] in ("ready", "failed")
        assert "internal error" not in (value["error"] or ""), value
        _engine_still_serves(c)


def test_out_of_range_seed_and_nan_temperature_are_rejected_with_400(served: LaunchedServer) -> None:
    with httpx.Client(base_url=served.url, timeout=_REQUEST_TIMEOUT) as c:
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "seed": 2**64, "temperature": 1})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_sampling_params"
        assert "seed" in r.json()["error"]["message"]
        for bad in ("NaN", "Infinity"):  # what Python's json (and so the server) accepts
            body = f'{{"prompt": "Hi", "max_tokens": 2, "temperature": {bad}}}'
            r = c.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "temperature" in r.json()["error"]["message"], r.text
        value = _session_call(c, {"max_tokens": 2, "seed": -(2**63) - 1, "temperature": 1.0})
        assert value["status"] == "failed" and "seed must be" in value["error"]
        _engine_still_serves(c)


def _session_call(c: httpx.Client, sampling: dict[str, Any]) -> dict[str, Any]:
    """Run one call with ``sampling`` in a fresh session; the output variable's state."""
    s = c.post("/v1/sessions").json()
    base, auth = f"/v1/sessions/{s['session_id']}", {"Authorization": f"Bearer {s['token']}"}
    r = c.post(
        f"{base}/calls",
        headers=auth,
        json={
            "template": "Say {{output:y}}",
            "placeholders": [{"name": "y", "role": "output", "sampling": sampling}],
            "criteria": "latency",
        },
    )
    assert r.status_code == 200, r.text
    return c.get(f"{base}/variables/{r.json()['outputs']['y']}", headers=auth).json()


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    # Mostly in range, so that most requests reach the sampler; extremes of each range come often.
    fields=st.fixed_dictionaries(
        {
            "temperature": st.floats(min_value=0, allow_infinity=False),
            "top_p": st.floats(min_value=0, max_value=1),
        },
        optional={
            "top_k": st.integers(min_value=-1, max_value=2**80),
            "seed": st.integers(min_value=-(2**80), max_value=2**80),
            "stop_token_ids": st.lists(st.integers(min_value=-1, max_value=2**80), max_size=2),
        },
    )
)
def test_fuzz_sampling_fields(served: LaunchedServer, fields: dict[str, Any]) -> None:
    """Sampling values over their whole ranges: an answer or a typed 4xx, and the engine keeps serving."""
    with httpx.Client(base_url=served.url, timeout=_REQUEST_TIMEOUT) as c:
        openai_fields = {k: v for k, v in fields.items() if k != "stop_token_ids"}
        _typed_4xx_or_ok(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **openai_fields}))
        value = _session_call(c, {"max_tokens": 2, **fields})
        assert value["status"] in ("ready", "failed")
        assert "internal error" not in (value["error"] or ""), value
        _engine_still_serves(c)
