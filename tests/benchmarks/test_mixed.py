"""The mixed-workload benchmark's harness in a tiny configuration: the workload is reproducible, every system
runs it to completion on the simulated cluster, and the script ends with its RESULT line (harness
correctness, not speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import mixed

TINY = ["--window", "4", "--apps", "2", "--chunks", "2", "3", "--chunk-tokens", "64", "--seeds", "1"]


def test_the_workload_is_a_function_of_the_seed() -> None:
    cfg = mixed.BenchConfig(window=10.0, apps=3, chunks=(2, 4), chunk_tokens=32)
    a, b, other = mixed.make_workload(cfg, 7), mixed.make_workload(cfg, 7), mixed.make_workload(cfg, 8)
    assert a == b
    assert a != other
    assert len(a.apps) == 3 and all(2 <= len(doc.chunks) <= 4 for _, doc in a.apps)
    assert all(0 <= arrival < cfg.window for arrival, _ in a.apps)
    assert all(0 < c.arrival < cfg.window for c in a.chats)
    reply = cfg.chat_lengths.reply
    assert all(reply.lo <= c.max_tokens <= reply.hi for c in a.chats)
    assert all(c.prompt_tokens > 0 for c in a.chats)


def test_tiny_run_reports_every_system_and_ends_with_the_result_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "mixed.json"
    mixed.main([*TINY, "--json", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("RESULT mixed ")
    metrics = dict(item.split("=", 1) for item in lines[-1].split()[2:])
    assert list(metrics) == [
        "chat_latency_vs_throughput_tuned",
        "mapreduce_jct_vs_latency_tuned",
        "chat_latency_vs_latency_tuned",
        "mapreduce_jct_vs_throughput_tuned",
        "parrot_chat_s_per_token",
        "parrot_mapreduce_jct_s",
        "total_s",
    ]
    assert all(float(v) > 0 for v in metrics.values())
    payload = json.loads(out.read_text())
    [seed] = payload["seeds"]
    assert set(seed["systems"]) == set(mixed.SYSTEMS)
    for system in seed["systems"].values():
        # Every request that arrived was served: one latency per chat turn and per app, all finite.
        assert len(system["chat_latency_s"]) == seed["workload"]["chats"]
        assert len(system["mapreduce_jct_s"]) == seed["workload"]["apps"] == 2
        assert all(math.isfinite(x) and x > 0 for x in system["chat_latency_s"] + system["mapreduce_jct_s"])
    placements = seed["systems"]["parrot"]["placements"]
    assert sum(placements.values()) > 0  # Parrot's steps went through the scheduler
    assert seed["systems"]["latency-tuned"]["placements"] == {}  # the baselines' requests did not


def test_the_profile_flag_picks_the_simulators_latency_model(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--profile`` runs the same workload on another profile: recorded, and it changes the timings."""
    jct = {}
    for name in ("a100-llama7b", "h100-llama7b"):
        out = tmp_path / f"{name}.json"
        mixed.main([*TINY, "--json", str(out), "--profile", name])
        payload = json.loads(out.read_text())
        assert payload["config"]["profile"] == name and payload["profile"]["name"] == name
        jct[name] = payload["seeds"][0]["systems"]["parrot"]["mapreduce_jct_s"]
    capsys.readouterr()
    assert jct["a100-llama7b"] != jct["h100-llama7b"]
