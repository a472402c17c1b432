"""The Mutel benchmark's harness: a tiny run ends with its RESULT line, every policy gave the same answers on
real engines, and Mutel moved less KV per turn than Splitwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import multi_turn_pd
from benchmarks.experiments import by_name


def test_tiny_run_ends_with_the_result_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "multi_turn_pd.json"
    multi_turn_pd.main([*by_name("multi_turn_pd").tiny_args, "--json", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT multi_turn_pd speedup_vs_splitwise=")
    metrics = dict(kv.split("=") for kv in last.split()[2:])
    assert metrics["answers_identical"] == "1"
    assert float(metrics["mutel_kv_mib_per_turn"]) < float(metrics["splitwise_kv_mib_per_turn"])
    assert float(metrics["mutel_moved_over_new_kv"]) <= 1
    payload = json.loads(out.read_text())
    turns = payload["real"]["per_turn"]
    assert all(t["kv_bytes_moved"] == 0 and t["exchange_bytes"] == 0 for t in turns["colocated"])
    assert all(t["exchange_bytes"] > 0 for t in turns["mutel"])
    (setting,) = payload["simulator"]["settings"]
    assert set(setting["rates"]) == set(multi_turn_pd.policies(multi_turn_pd.TINY))
