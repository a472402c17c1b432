"""The map-reduce benchmark's harness in a tiny configuration: both clients give the same final summary, and
the script ends with its RESULT line (harness correctness, not speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from benchmarks import map_reduce
from benchmarks.workloads import map_reduce_app
from server.launcher import launch

TINY_JOB = [
    *["--chunks", "2", "--chunk-tokens", "16", "--map-tokens", "4", "--reduce-tokens", "4"],
    *["--sim-chunks", "2"],
]


async def test_the_two_clients_write_the_same_summary_on_one_server() -> None:
    """`parrot_map_reduce` and `baseline_map_reduce` are interchangeable apps: same prompts, same answer."""
    with launch("tiny") as served:
        tokenizer = served.engines[0].tokenizer
        doc = map_reduce_app.make_doc(tokenizer, chunks=3, chunk_tokens=12, map_tokens=3, reduce_tokens=5)
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            seen: list[str] = []
            parrot = await map_reduce_app.parrot_map_reduce(client, doc, on_result=seen.append)
            baseline = await map_reduce_app.baseline_map_reduce(client, doc, on_result=seen.append)
    assert parrot == baseline
    assert seen == [parrot, baseline]
    assert len(tokenizer.encode(parrot, add_special_tokens=False)) > 0
    assert doc.reduce_template.count("{{input:") == 3


def test_tiny_run_checks_outputs_and_ends_with_the_result_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "map_reduce.json"
    map_reduce.main([*TINY_JOB, "--repeats", "1", "--no-delay-only", "--json", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("RESULT map_reduce ")
    metrics = dict(item.split("=", 1) for item in lines[-1].split()[2:])
    assert list(metrics) == [
        "speedup",
        "speedup_nodelay",
        "parrot_s",
        "baseline_s",
        "parrot_nodelay_s",
        "baseline_nodelay_s",
        "sim_speedup_out50",
        "sim_speedup_out100",
        "sim_parrot_out50_s",
        "sim_parrot_out100_s",
        "sim_baseline_out50_s",
        "sim_baseline_out100_s",
        "total_s",
    ]
    assert metrics["speedup"] == "nan"  # the delay setting was not measured
    assert float(metrics["speedup_nodelay"]) > 0
    assert float(metrics["parrot_nodelay_s"]) > 0 and float(metrics["baseline_nodelay_s"]) > 0
    payload = json.loads(out.read_text())
    [setting] = payload["settings"]
    assert setting["network_delay"] is False
    clients = setting["clients"]
    assert clients["parrot"]["requests"] == 1  # one batch, which opens the session
    assert clients["baseline"]["requests"] == 3  # two map completions + the reduce
    assert all(math.isfinite(s) for c in clients.values() for s in c["seconds"])
    simulated = payload["simulator"]
    # Two 1k-token parts fit the 4096-token cap together: the simulated baseline is not slower for
    # want of batching here, and both clients' final summaries were checked identical.
    assert set(simulated) == {"50", "100"}
    assert all(s[c]["seconds"] > 0 for s in simulated.values() for c in ("parrot", "baseline"))
