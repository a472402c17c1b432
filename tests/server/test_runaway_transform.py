"""One client's catastrophic regex must not stall anyone else.

The server runs in a subprocess (``python -m server --model tiny``), so a transform that held the
interpreter would show as another session's request timing out — a failure — never as a hung test.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import parrot as P
import pytest

from tests.processes import free_port, stop, wait_healthy

# Client-side bounds: well above what the calls need, so a stalled server fails the test instead.
REQUEST_TIMEOUT_S = 60.0
CATASTROPHIC = "(.*.*)*QQQ"  # with Python's `re`, exponential backtracking on any text without "QQQ"

runaway = P.SemanticFunction.from_template(
    "Write anything at all: {{output:o}}",
    name="runaway",
    sampling=P.SamplingConfig(max_tokens=24, ignore_eos=True),
    transforms={"o": [P.transforms.regex(CATASTROPHIC)]},
    criteria=P.LATENCY,  # dispatched at submit: it runs while the other session works
)
plain = P.SemanticFunction.from_template(
    "Continue the story: {{input:text}} Next: {{output:next}}",
    name="plain",
    sampling=P.SamplingConfig(max_tokens=8, ignore_eos=True),
)
backref = P.SemanticFunction.from_template(
    "Say it twice: {{output:o}}", name="backref", transforms={"o": [P.transforms.regex(r"(\w+) \1")]}
)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", "--model", "tiny", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        stop(proc)


@pytest.mark.timeout(300)
def test_catastrophic_regex_fails_its_own_variable_while_another_session_completes(server_url: str) -> None:
    failures: list[BaseException] = []

    def attack() -> None:
        try:
            with P.Session(server_url, timeout=REQUEST_TIMEOUT_S):
                with pytest.raises(P.VariableFailedError) as info:
                    runaway().get(timeout=REQUEST_TIMEOUT_S)
                # RE2 ran the pattern to its end (linear time): an ordinary no-match, not a stall.
                assert f"regex transform failed: pattern {CATASTROPHIC!r} does not match" in str(info.value)
                # The text it ran on comes back as data, whole; the message quotes (at most) its start.
                refused = info.value.llm_output
                assert info.value.error_type == "transform_failed" and refused
                assert repr(refused[:200]) in str(info.value)
        except BaseException as e:  # reported on the main thread
            failures.append(e)

    attacker = threading.Thread(target=attack)
    attacker.start()
    with P.Session(server_url, timeout=REQUEST_TIMEOUT_S):
        value = plain(text="The fox ran home.").get(timeout=REQUEST_TIMEOUT_S)
    attacker.join(timeout=2 * REQUEST_TIMEOUT_S)
    assert not attacker.is_alive() and not failures, failures
    # The other session's value is exactly what the engine gives for the same text.
    completion = httpx.post(
        f"{server_url}/v1/completions",
        json={
            "model": "tiny",
            "prompt": "Continue the story: The fox ran home. Next: ",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=REQUEST_TIMEOUT_S,
    )
    assert completion.status_code == 200, completion.text
    assert value == completion.json()["choices"][0]["text"]
    assert httpx.get(f"{server_url}/health", timeout=REQUEST_TIMEOUT_S).status_code == 200


@pytest.mark.timeout(300)
def test_a_pattern_re2_cannot_run_is_refused_at_submit(server_url: str) -> None:
    with P.Session(server_url, timeout=REQUEST_TIMEOUT_S):
        out = backref()
        with pytest.raises(P.BadRequestError) as refused:  # refused when the call is submitted
            out.get(timeout=REQUEST_TIMEOUT_S)
        assert r"pattern '(\\w+) \\1' cannot be used: invalid escape sequence: \1" in str(refused.value)
