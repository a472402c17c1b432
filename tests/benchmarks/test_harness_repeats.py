"""Interleaved repeats without a warm-up (`measure.interleave` with `measure.FIRST_RUN`) and vLLM servers
started together (`openai_servers.vllm_backends`), on stand-ins: no engine, no vLLM."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import measure
from benchmarks.harness.openai_servers import vllm_backends


def _jobs(outputs: dict[str, list[str]]) -> dict[str, Callable[[], Awaitable[measure.Run]]]:
    """Per system, a job whose n-th run answers ``outputs[name][n]``."""

    def job(name: str) -> Callable[[], Awaitable[measure.Run]]:
        answers = iter(outputs[name])

        async def run() -> measure.Run:
            return measure.Run(seconds=0.01, output=next(answers), requests=1, engine={})

        return run

    return {name: job(name) for name in outputs}


def test_without_a_warm_up_the_first_run_is_what_every_other_must_equal() -> None:
    got = asyncio.run(measure.interleave(_jobs({"a": ["x", "x"], "b": ["x", "x"]}), 2, measure.FIRST_RUN))
    assert {name: [r.output for r in s.runs] for name, s in got.items()} == {"a": ["x", "x"], "b": ["x", "x"]}


@pytest.mark.parametrize(
    "outputs",
    [
        {"a": ["x", "x"], "b": ["y", "y"]},  # the systems disagree
        {"a": ["x", "z"], "b": ["x", "x"]},  # a system changes its answer between repeats
    ],
)
def test_without_a_warm_up_a_differing_output_still_stops_the_run(outputs: dict[str, list[str]]) -> None:
    with pytest.raises(SystemExit, match="differs"):
        asyncio.run(measure.interleave(_jobs(outputs), 2, measure.FIRST_RUN))


FAKE_VLLM = """
import argparse, http.server, json, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
args, _ = p.parse_known_args()
with open(os.environ["STARTS"], "a") as f:
    f.write(f"start {time.monotonic()}\\n")
time.sleep(1.5)  # a start: imports, weights, graphs
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": []}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
with open(os.environ["STARTS"], "a") as f:
    f.write(f"up {time.monotonic()}\\n")
http.server.HTTPServer(("127.0.0.1", args.port), H).serve_forever()
"""


def test_vllm_servers_start_together_and_stop_on_exit(tmp_path: Path) -> None:
    """Both processes are started before either is waited for: every start precedes every "up"."""
    package = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(textwrap.dedent(FAKE_VLLM))
    starts = tmp_path / "starts.txt"
    env = {"PYTHONPATH": str(tmp_path / "site"), "STARTS": str(starts), "PATH": "/usr/bin:/bin"}
    logs = [tmp_path / "vllm0.log", tmp_path / "vllm1.log"]
    with vllm_backends(
        sys.executable, tmp_path, logs, dtype="float32", max_model_len=64, max_num_seqs=2, env=env
    ) as backends:
        assert len(backends) == 2 and len({b.url for b in backends}) == 2
        for b in backends:
            assert httpx.get(f"{b.url}/v1/models", timeout=5).status_code == 200
        events = [line.split()[0] for line in starts.read_text().splitlines()]
    assert events[:2] == ["start", "start"] and events.count("up") == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # stopped on exit: nothing answers any more
        try:
            httpx.get(f"{backends[0].url}/v1/models", timeout=0.5)
        except httpx.TransportError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a backend still answers after its context exited")
