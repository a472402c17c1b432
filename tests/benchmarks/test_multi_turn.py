"""The multi-turn benchmark in its tiny configuration: exact prefill counts per turn (the recompute server
prefills every prompt whole, the cached one little more than what is new), the RESULT line's keys in the
registry's order, the JSON payload and the plot (harness correctness, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import multi_turn
from benchmarks.experiments import by_name

TINY = multi_turn.TINY
KEYS = ["prefill_ratio", "prefill_saving", "ttft_speedup", "turns", "conversations", "answers_identical"]


def test_fewer_than_two_turns_is_refused_before_any_server_starts() -> None:
    with pytest.raises(SystemExit, match="at least 2"):
        multi_turn.main(["--tiny", "--turns", "1"])


def test_tiny_run_counts_prefill_exactly_and_ends_with_the_result_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out, png = tmp_path / "multi_turn.json", tmp_path / "multi_turn.png"
    multi_turn.main([*by_name("multi_turn").tiny_args, "--json", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT multi_turn ")
    assert [kv.split("=")[0] for kv in last.split()[2:]] == [*KEYS, "total_s"]
    assert f"turns={TINY.turns} conversations={TINY.conversations}" in last

    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "multi_turn" and payload["config"]["turns"] == TINY.turns
    (run,) = payload["runs"]  # one repeat
    for system in multi_turn.SYSTEMS:
        assert len(run[system]) == TINY.turns
        assert all(len(turn["answers"]) == TINY.conversations for turn in run[system])
    for t, (cached, recompute) in enumerate(zip(run["cached"], run["recompute"], strict=True)):
        # Without sharing every prompt is prefilled whole: the engine's counter says exactly that.
        assert recompute["prefill"] == sum(a["prompt_tokens"] for a in recompute["answers"])
        new = sum(a["new_tokens"] for a in cached["answers"])
        if t == 0:
            assert new == sum(a["prompt_tokens"] for a in cached["answers"])
        else:  # the conversation so far comes from the cache: only the new tokens (and a few) are computed
            assert new <= cached["prefill"] < recompute["prefill"]
    summary = payload["summary"]
    assert summary["prefill_ratio"] >= 1 and summary["prefill_saving"] > 1
    assert 0 <= summary["answers_identical"] <= 1

    multi_turn.plot(payload, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
