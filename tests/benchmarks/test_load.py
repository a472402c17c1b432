"""benchmarks.load: the summary arithmetic (pure), the flags, and real runs at a tiny size against a server
the tool starts in a subprocess (with and without an engine killed under load)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import load
from benchmarks.harness.load_report import summarize
from benchmarks.harness.load_sessions import SessionOutcome
from benchmarks.harness.machine import REPO_ROOT


def outcome(seed: int, values: list[str | None], errors: tuple[str, ...] = (), seconds: float = 1.0) -> Any:
    return SessionOutcome(seed, seconds, values, list(errors), [f"{e}: boom" for e in errors])


def test_summary_counts_errors_lost_variables_and_inconsistent_chains() -> None:
    outcomes = [
        outcome(0, ["a", "b", "c"], seconds=1.0),
        outcome(0, ["a", "b", "c"], seconds=2.0),
        outcome(0, ["a", "b", "X"], seconds=3.0),  # a different chain for the same input: one wrong answer
        outcome(1, ["d", None, "f"], ("VariableFailedError 200",)),
        outcome(1, [None, None, None], ("ConnectError",)),
    ]
    s = summarize(outcomes, seconds=2.0)
    assert (s["sessions"], s["completed"], s["errors"], s["lost_variables"]) == (5, 3, 2, 4)
    assert s["errors_by_type"] == {"VariableFailedError 200": 1, "ConnectError": 1}
    assert s["error_examples"]["ConnectError"] == "ConnectError: boom"
    assert s["inconsistent_chains"] == 1
    assert (s["sessions_per_s"], s["calls_per_s"]) == (1.5, 4.5)
    assert (s["p50_s"], s["p99_s"]) == (2.0, pytest.approx(2.98))


def test_summary_of_nothing_done() -> None:
    s = summarize([outcome(0, [None, None, None], ("ReadTimeout",))], seconds=1.0)
    assert s["completed"] == 0 and math.isnan(s["p99_s"]) and s["lost_variables"] == 3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--url", "http://x", "--kill-engine-every", "5"],
            "--kill-engine-every needs a server this tool starts",
        ),
        (["--sessions", "0"], "--sessions must be at least 1"),
        (["--kill-engine-every", "0"], "--kill-engine-every must be positive"),
        (["--fairness", "0"], "--fairness needs a positive call count"),
        (["--fairness", "10", "--url", "http://x"], "a server started here"),
    ],
)
def test_bad_flags_are_refused(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        load.parse_args(argv)
    assert says in capsys.readouterr().err


def test_fault_mode_needs_a_survivor() -> None:
    with pytest.raises(SystemExit, match="needs --engines 2 or more"):
        load.build_config(load.parse_args(["--engines", "1", "--kill-engine-every", "5"]))


def run_tool(tmp_path: Path, *argv: str, result: str = "load") -> tuple[dict[str, str], dict[str, Any]]:
    out = tmp_path / "load.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.load", "--tiny", "--json", str(out), *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"RESULT {result} "), proc.stdout
    metrics = dict(kv.split("=", 1) for kv in last.split()[2:])
    return metrics, json.loads(out.read_text())


@pytest.mark.timeout(600)
def test_twenty_sessions_run_clean(tmp_path: Path) -> None:
    metrics, payload = run_tool(tmp_path, "--sessions", "20")
    assert metrics["sessions"] == "20"
    assert (metrics["errors"], metrics["lost_variables"], metrics["kv_blocks_leaked"]) == ("0", "0", "0")
    assert float(metrics["p99_s"]) > 0 and metrics["engine_kills"] == "0"
    report = payload["report"]
    assert report["completed"] == 20 and report["inconsistent_chains"] == 0
    assert report["rss_before_mb"] > 0 and report["rss_peak_mb"] >= report["rss_before_mb"]
    assert payload["config"]["sessions"] == 20 and payload["config"]["engines"] == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_killed_under_load_loses_nothing(tmp_path: Path) -> None:
    metrics, payload = run_tool(tmp_path, "--sessions", "40", "--kill-engine-every", "1")
    assert metrics["engine_kills"] != "0"
    assert (metrics["errors"], metrics["lost_variables"], metrics["kv_blocks_leaked"]) == ("0", "0", "0")
    assert payload["report"]["inconsistent_chains"] == 0


@pytest.mark.timeout(600)
def test_fairness_mode_times_a_victim_tenant_beside_a_flood(tmp_path: Path) -> None:
    _, payload = run_tool(tmp_path, "--fairness", "300", result="load_fairness")
    report = payload["report"]
    assert report["flood_calls"] == 300 and report["victim_calls_during_flood"] >= 1
    assert report["victim_alone_p50_s"] > 0 and report["victim_ratio"] > 0
    # Nagle off on the listener: a kept-alive request is not slower than a fresh connection's (it was
    # ~48 ms against ~4 ms before), a ratio that checks the socket option, not speed.
    assert report["keepalive_p50_ms"] < 2 * report["fresh_connection_p50_ms"]
