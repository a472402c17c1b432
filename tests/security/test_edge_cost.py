"""Cheap requests stay cheap: what a client sends (a pattern, a template, a value repeated by a template, a
list of prompts times ``n``, a large prompt) is bounded before the server spends on it, answered with a typed
error that names the bound, and never stalls the event loop — ``/health`` on a fresh connection answers
within a second all the while (a bound that checks blocking, not speed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import httpx
import pytest
from parrot.template import MAX_TEMPLATE_PLACEHOLDERS

from server.http.openai_requests import MAX_GENERATIONS
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig

T = TypeVar("T")
PROMPT_CHARS = 200_000  # the manager's bound on a rendered prompt here (the default is 1 Mi)


@pytest.fixture(scope="module")
def served() -> Iterator[LaunchedServer]:
    with launch("tiny", manager_config=ManagerConfig(max_prompt_chars=PROMPT_CHARS)) as s:
        yield s


def _while_probing_health(url: str, work: Callable[[], T]) -> tuple[T, float]:
    """``work()``'s result and the slowest ``/health`` answer (fresh connections) seen while it ran."""
    slowest, done = 0.0, threading.Event()

    def probe() -> None:
        nonlocal slowest
        while not done.is_set():
            started = time.monotonic()
            httpx.get(f"{url}/health", timeout=30)
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        result = work()
    finally:
        done.set()
        prober.join(timeout=60)
    return result, slowest


def _session(url: str) -> tuple[str, dict[str, str]]:
    s = httpx.post(f"{url}/v1/sessions").json()
    return f"{url}/v1/sessions/{s['session_id']}", {"Authorization": f"Bearer {s['token']}"}


OUT = {"name": "y", "role": "output", "sampling": {"max_tokens": 2}}


def _call(url: str, template: str, placeholders: list[dict]) -> httpx.Response:
    base, auth = _session(url)
    body = {"template": template, "placeholders": placeholders}
    return httpx.post(f"{base}/calls", headers=auth, json=body, timeout=120)


@pytest.mark.parametrize(
    "pattern",
    ["|".join(f"w{i:06d}" for i in range(300_000)), "(" * 5000 + "a" + ")" * 5000],
    ids=["2MB-alternation", "5000-deep"],
)
def test_a_huge_or_deep_pattern_is_refused_by_its_size_never_compiled(
    served: LaunchedServer, pattern: str
) -> None:
    out = {**OUT, "transforms": [{"type": "regex", "pattern": pattern}]}
    r, slowest = _while_probing_health(served.url, lambda: _call(served.url, "Say {{output:y}}.", [out]))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "bad_call" and "over the 1000-char limit" in error["message"]
    assert slowest < 1.0


def test_a_template_of_many_placeholders_is_parsed_in_linear_time_and_bounded(served: LaunchedServer) -> None:
    template = "{{input:x}} " * 300_000 + "{{output:y}}"  # 3.6 MB
    x = {"name": "x", "role": "input", "value": "a"}
    r, slowest = _while_probing_health(served.url, lambda: _call(served.url, template, [x, OUT]))
    assert r.status_code == 400 and r.json()["error"]["type"] == "bad_template", r.text
    assert f"over {MAX_TEMPLATE_PLACEHOLDERS} placeholders" in r.json()["error"]["message"]
    assert slowest < 1.0


def test_a_value_repeated_by_its_template_is_refused_before_it_renders(served: LaunchedServer) -> None:
    # 4,000 uses of a 31 KiB value would render 124 M characters.
    template = "{{input:x}}" * 4000 + " {{output:y}}"
    literal = {"name": "x", "role": "input", "value": "v" * 31_000}
    r, slowest = _while_probing_health(served.url, lambda: _call(served.url, template, [literal, OUT]))
    assert r.status_code == 400 and r.json()["error"]["type"] == "bad_call", r.text
    assert f"over the server's limit of {PROMPT_CHARS}" in r.json()["error"]["message"]
    assert slowest < 1.0
    # Through a variable the value is known only when the step runs: the step fails, typed, unrendered.
    base, auth = _session(served.url)
    var = httpx.post(f"{base}/variables", headers=auth, json={"value": "v" * 31_000}).json()["var_id"]
    body = {"template": template, "placeholders": [{"name": "x", "role": "input", "var_id": var}, OUT]}
    r = httpx.post(f"{base}/calls", headers=auth, json=body)
    assert r.status_code == 200, r.text
    answer = httpx.get(
        f"{base}/variables/{r.json()['outputs']['y']}", headers=auth, params={"timeout": 60}
    ).json()
    assert answer["status"] == "failed" and answer["error_type"] == "request_too_large", answer
    assert "ManagerConfig.max_prompt_chars" in answer["error"]
    # The server still serves a call within the bound.
    within = _call(served.url, "Say {{input:x}} {{output:y}}", [{**literal, "value": "hi"}, OUT])
    assert within.status_code == 200, within.text


def test_prompts_times_n_is_bounded(served: LaunchedServer) -> None:
    body = {"model": "tiny", "prompt": ["Once"] * 500, "n": 16, "max_tokens": 1}
    r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and f"over the {MAX_GENERATIONS}" in error["message"]
    within = {"model": "tiny", "prompt": ["Once"] * 4, "n": 2, "max_tokens": 1}
    assert len(httpx.post(f"{served.url}/v1/completions", json=within, timeout=60).json()["choices"]) == 8


def test_a_large_prompt_is_tokenized_off_the_event_loop(served: LaunchedServer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 25_000  # 1.1 MB, over the window
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
    r, slowest = _while_probing_health(
        served.url, lambda: httpx.post(f"{served.url}/v1/completions", json=body, timeout=120)
    )
    assert r.status_code in (400, 413) and "context window" in r.json()["error"]["message"], r.text
    assert slowest < 1.0


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_generation_stops_when_its_non_streaming_client_leaves(served: LaunchedServer, route: str) -> None:
    engine = served.engines[0]
    before = engine.stats().decode_tokens_computed
    body: dict = {"model": "tiny", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    body |= (
        {"prompt": "Once"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + route, json=body, timeout=httpx.Timeout(30, read=0.5))
    deadline = time.monotonic() + 30
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().running == 0
    computed = engine.stats().decode_tokens_computed - before
    assert computed < 2000, f"{computed} of 3000 tokens computed after the client left"


def test_another_sessions_call_is_not_held_behind_a_flood(served: LaunchedServer) -> None:
    # One session queues 600 calls at once; another session's call, sent just after, runs in its turn: it
    # ends long before the flood does (it used to wait for the whole flood in the engine's queue).
    import parrot as P

    def fn(template: str, tokens: int) -> P.SemanticFunction:
        sampling = P.SamplingConfig(max_tokens=tokens, ignore_eos=True)
        return P.SemanticFunction.from_template(template, name="f", sampling=sampling)

    flood, victim = fn("Topic {{input:t}}: {{output:o}}", 8), fn("Quick {{input:q}}: {{output:a}}", 2)
    assert served.manager.registry.engine_states()[0].max_steps == 2 * served.engines[0].config.max_num_seqs
    with P.Session(served.url, timeout=300) as flooding:
        outputs = [flood(f"t{i}") for i in range(600)]
        flooding.flush()
        started = time.monotonic()
        with P.Session(served.url) as s:
            victim(s.variable("q")).get(timeout=300)
        victim_s = time.monotonic() - started
        for out in outputs:
            out.get(timeout=300)
        flood_s = time.monotonic() - started
    assert victim_s < flood_s / 3, (victim_s, flood_s)
