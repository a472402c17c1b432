"""The LlamaIndex synthesizers benchmark (paper Fig. 11, 14) in a tiny configuration: every client answers
as Parrot does, Parrot's DAG takes the same few requests while LlamaIndex sends one per call, and the
script ends with its RESULT line (harness correctness, not speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import llamaindex_synth as li
from tests.benchmarks.test_frameworks import tiny_run


def test_tiny_run_checks_answers_and_ends_with_the_result_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    metrics, payload = tiny_run(
        li.main, "llamaindex_synth", (li.CHAIN, li.MAP_REDUCE), capsys, tmp_path, "--chunks", "3"
    )
    assert list(metrics) == [
        "chain_speedup",
        "map_reduce_speedup",
        "map_reduce_speedup_async",
        "chain_speedup_nodelay",
        "map_reduce_speedup_nodelay",
        "chain_parrot_s",
        "chain_baseline_s",
        "map_reduce_parrot_s",
        "map_reduce_baseline_s",
        "total_s",
    ]
    assert payload["answers_identical"] is True
    calls = payload["calls_per_query"]
    assert calls[li.CHAIN] == 3 and calls[li.MAP_REDUCE] >= 1
    for setting in payload["settings"]:
        clients = setting["clients"]
        expected = {li.PARROT, li.BASELINE, li.SEMANTIC}
        if setting["app"] == li.MAP_REDUCE:
            expected.add(li.BASELINE_ASYNC)
        assert set(clients) == expected and set(setting["speedup"]) == expected - {li.PARROT}
        # The baseline: one completion per LLM call; Parrot: one submission (opening its session);
        # LlamaIndex on semantic calls: a submission (and session) per call (deletes not counted).
        n = calls[setting["app"]]
        assert clients[li.PARROT]["requests"] == 1
        assert clients[li.BASELINE]["requests"] == n
        assert clients[li.SEMANTIC]["requests"] == n
        if li.BASELINE_ASYNC in clients:
            assert clients[li.BASELINE_ASYNC]["requests"] == n
