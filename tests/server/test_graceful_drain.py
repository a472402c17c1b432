"""SIGTERM drains the manager. New sessions, calls and OpenAI requests get 503 with the reason,
the step already running finishes and its value is delivered, and the process then exits. The server
runs in a subprocess (``python -m server``): the signal is the real one."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import parrot as P
import pytest

from tests.processes import free_port, wait_healthy

slow = P.SemanticFunction.from_template(
    "Tell a long story: {{output:story}}",
    name="slow",
    # Long enough to outlast the refusals checked while it runs: 400 tokens once finished first on a fast
    # machine, and the drained server was gone before the OpenAI request could be refused.
    sampling=P.SamplingConfig(max_tokens=2000, ignore_eos=True),
)


@pytest.mark.timeout(300)
def test_sigterm_refuses_new_work_and_finishes_what_runs() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "server",
        "--model",
        "tiny",
        "--port",
        str(port),
        "--drain-timeout",
        "120",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(proc, url)
        assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200
        delivered: list[str] = []
        try:
            _drain_while_running(url, proc, delivered)
        except P.ConnectionError:
            # Closing the session (its last request) may race the server's exit once the drain is done:
            # the session went with the process. Everything before that must have been answered.
            if not delivered:
                raise
        assert delivered and len(delivered[0]) > 0  # what ran finished and was delivered
        # uvicorn re-raises the signal it captured once shut down: "terminated by SIGTERM", after the drain.
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _drain_while_running(url: str, proc: subprocess.Popen[bytes], delivered: list[str]) -> None:
    """A session whose call runs while SIGTERM arrives: new work is refused; the running call's value is
    appended to ``delivered``."""
    with P.Session(url, timeout=120) as session:
        story = slow()
        session.flush()  # submitted: it runs at once (eager dispatch)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while True:  # the drain begins within moments; until then a session may still be created
            refused = httpx.post(f"{url}/v1/sessions", json={}, timeout=10)
            if refused.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "server_draining"
        assert "shutting down" in refused.json()["error"]["message"]
        # Readiness says so too, while liveness still answers (a load balancer stops routing here).
        ready = httpx.get(f"{url}/health/ready", timeout=10)
        assert ready.status_code == 503 and ready.json()["error"]["type"] == "server_draining", ready.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        completion = httpx.post(f"{url}/v1/completions", json={"prompt": "Once", "max_tokens": 4}, timeout=10)
        assert completion.status_code == 503, completion.text
        with pytest.raises(P.ParrotError, match="shutting down"):
            slow().get(timeout=10)  # a new call in the open session
        delivered.append(story.get(timeout=120))
