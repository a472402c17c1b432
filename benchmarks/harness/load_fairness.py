"""The load tool's tenant-fairness mode: one tenant's within-quota flood, another tenant's calls meanwhile.

A server process (``python -m server --model tiny`` with two API keys: two tenants) is started here. The
victim tenant makes one short call at a time (a session, one call, its value); its latencies are measured
alone, then while the flooding tenant's session has ``flood_calls`` calls queued (one batch, within the
quotas). Reported: the victim's p50 alone and during the flood and their ratio (the fairness goal: at most
2x), its slowest call during the flood (a p50 hides a first call that waits the whole flood out), and how
long the flood took. Then the per-request latency of a kept-alive connection against a fresh
connection per request (``GET /health``): a listener without ``TCP_NODELAY`` answers every kept-alive
request ~40 ms late (delayed ACK).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import parrot as P

from benchmarks.harness.output import log
from benchmarks.harness.process_groups import wait_until_answers

_FLOOD = P.SemanticFunction.from_template(
    "Write about topic {{input:t}}: {{output:o}}",
    name="flood",
    sampling=P.SamplingConfig(max_tokens=16, ignore_eos=True),
)
_VICTIM = P.SemanticFunction.from_template(
    "Answer briefly {{input:q}}: {{output:a}}",
    name="victim",
    sampling=P.SamplingConfig(max_tokens=4, ignore_eos=True),
)
_KEYS = ("tenant-flood-key", "tenant-victim-key")


@dataclass(frozen=True)
class FairnessReport:
    victim_alone_p50_s: float
    victim_flood_p50_s: float
    victim_flood_max_s: float  # the first call sent into the flood waited it out before turns
    victim_ratio: float
    victim_calls_during_flood: int
    flood_calls: int
    flood_s: float
    keepalive_p50_ms: float
    fresh_connection_p50_ms: float


def run_fairness(flood_calls: int, port: int) -> FairnessReport:
    """Start the server on ``port``, measure (see the module docstring), stop it."""
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "server", "--model", "tiny", "--port", str(port)]
    for key in _KEYS:
        command += ["--api-key", key]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_answers(proc, f"{url}/health", "the server", timeout_s=300.0)
        keepalive, fresh = _keepalive_latency(url)
        _victim_calls(url, 3)  # warm-up
        alone = _victim_calls(url, 9)
        log(f"flood: one tenant's session submits {flood_calls} calls; the other calls meanwhile")
        during, flood_s = _during_flood(url, flood_calls)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    p50_alone, p50_during = statistics.median(alone), statistics.median(during)
    return FairnessReport(
        victim_alone_p50_s=p50_alone,
        victim_flood_p50_s=p50_during,
        victim_flood_max_s=max(during),
        victim_ratio=p50_during / p50_alone,
        victim_calls_during_flood=len(during),
        flood_calls=flood_calls,
        flood_s=flood_s,
        keepalive_p50_ms=keepalive * 1000,
        fresh_connection_p50_ms=fresh * 1000,
    )


def _keepalive_latency(url: str, n: int = 40) -> tuple[float, float]:
    """The p50 of ``GET /health`` on one kept-alive connection, and on a fresh connection each (one client,
    ``Connection: close``: the connection's cost, not a new client's)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        client.get("/health")
        kept = [_timed(lambda: client.get("/health")) for _ in range(n)]
    with httpx.Client(base_url=url, timeout=30, headers={"Connection": "close"}) as client:
        fresh = [_timed(lambda: client.get("/health")) for _ in range(n)]
    return statistics.median(kept), statistics.median(fresh)


def _timed(request: Callable[[], httpx.Response]) -> float:
    started = time.perf_counter()
    response = request()
    response.raise_for_status()
    return time.perf_counter() - started


def _victim_calls(url: str, n: int, until: threading.Event | None = None) -> list[float]:
    """Latencies of ``n`` victim calls, one at a time, each in its own session (stops early at ``until``)."""
    seconds = []
    for i in range(n):
        if until is not None and until.is_set():
            break
        with P.Session(url, api_key=_KEYS[1], timeout=600) as session:
            started = time.perf_counter()
            _VICTIM(session.variable(f"question {i}")).get(timeout=600)
            seconds.append(time.perf_counter() - started)
    return seconds


def _during_flood(url: str, calls: int) -> tuple[list[float], float]:
    """The victim's latencies while the flood runs, and the flood's duration."""
    queued, done = threading.Event(), threading.Event()
    took: list[float] = []

    def flood() -> None:
        with P.Session(url, api_key=_KEYS[0], timeout=600) as session:
            started = time.perf_counter()
            outputs = [_FLOOD(f"t{i}") for i in range(calls)]
            session.flush()
            queued.set()
            for out in outputs:
                out.get(timeout=1800)
            took.append(time.perf_counter() - started)
        done.set()

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    queued.wait(timeout=600)
    time.sleep(0.5)  # the flood's first steps are placed
    during = _victim_calls(url, 1000, until=done)
    flooder.join(timeout=1800)
    return during, took[0] if took else float("nan")


def fairness_table(r: FairnessReport) -> str:
    """The report as text lines."""
    return "\n".join(
        [
            f"victim call p50 alone: {r.victim_alone_p50_s * 1000:.0f} ms; during a {r.flood_calls}-call "
            f"flood of another tenant: {r.victim_flood_p50_s * 1000:.0f} ms ({r.victim_ratio:.1f}x; slowest "
            f"{r.victim_flood_max_s:.2f} s of {r.victim_calls_during_flood} calls; "
            f"the flood took {r.flood_s:.1f} s)",
            f"GET /health p50: kept-alive connection {r.keepalive_p50_ms:.1f} ms, fresh connection "
            f"{r.fresh_connection_p50_ms:.1f} ms",
        ]
    )
