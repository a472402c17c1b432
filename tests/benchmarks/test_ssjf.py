"""The SSJF benchmark in its tiny configuration (harness correctness, not speed): a deterministic workload
split on disjoint topics, the three systems answering identically, predictions restored per run, the RESULT
line's keys in order, the JSON payload and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import ssjf
from benchmarks.experiments import by_name
from benchmarks.workloads.natural_lengths import CHAT_MIX, EVEN_MIX, KINDS, split

KEYS = [
    "jct_reduction_vs_fcfs",
    "share_of_oracle",
    "oracle_reduction",
    "p90_reduction",
    "throughput_ratio",
    "mae",
    "bucket_accuracy",
    "jct_reduction_sim",
    "share_of_oracle_sim",
    "max_ttft_s",
    "outputs_identical",
]


def test_the_workload_is_deterministic_mixed_as_asked_and_split_on_disjoint_topics() -> None:
    train, test = split(40, 32, seed=3)
    assert (train, test) == split(40, 32, seed=3) and split(40, 32, seed=4) != (train, test)
    assert {r.topic for r in train}.isdisjoint({r.topic for r in test})
    weight = sum(CHAT_MIX.values())
    for part in (train, test):  # each kind in proportion to its weight (up to one)
        for kind in KINDS:
            count = sum(r.kind == kind for r in part)
            assert abs(count - len(part) * CHAT_MIX[kind] / weight) < 1
    assert [sum(r.kind == k for r in split(0, 24, mix=EVEN_MIX)[1]) for k in KINDS] == [3] * len(KINDS)
    assert {r.kind for r in split(0, 5, mix={"story": 1})[1]} == {"story"}
    assert all(r.topic in r.message and r.messages == [{"role": "user", "content": r.message}] for r in test)
    with pytest.raises(ValueError, match="test >= 1"):
        split(4, 0)
    with pytest.raises(ValueError, match="weights >= 0"):
        split(4, 4, mix={"poem": 1})


def test_tiny_run_ends_with_the_result_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out, png = tmp_path / "ssjf.json", tmp_path / "ssjf.png"
    ssjf.main([*by_name("ssjf").tiny_args, "--json", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT ssjf ")
    assert [kv.split("=")[0] for kv in last.split()[2:]] == [*KEYS, "total_s"]
    assert "outputs_identical=1 " in last  # ordering changes when requests run, not what they write

    payload = json.loads(out.read_text())
    (result,) = payload["by_batch"].values()
    assert len(result["lengths"]) == len(result["predicted"]) == ssjf.TINY.test
    assert set(result["patterns"]) == {ssjf.BURST, "1x"}
    for row in result["patterns"].values():
        assert all(row[s]["mean_jct_s"] > 0 for s in ssjf.SYSTEMS)
    for row in payload["simulator"].values():  # every simulated request completed, on every system
        assert all(row[s]["completed"] == ssjf.TINY.sim_requests for s in ssjf.SYSTEMS)
    ssjf.plot(payload, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
