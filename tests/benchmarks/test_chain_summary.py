"""The chain-summary benchmark (paper Fig. 11-13): its sweeps, its background client, its figures, and a tiny
run end to end (harness correctness, not speed)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from benchmarks import chain_dependent as cd
from benchmarks import chain_summary as cs
from benchmarks import common


def test_sweeps_of_the_quick_and_full_configurations() -> None:
    assert cs.FULL.outs == (16, 32, 64) and cs.FULL.chunks == (64, 128, 256)
    assert cs.FULL.background == (4, 8) and cs.FULL.apps == (4, 8)
    # The fixed point (32 output, 128 chunk tokens) belongs to both sweeps and is measured once.
    assert cs.FULL.chain_points() == [(16, 128), (32, 128), (64, 128), (32, 64), (32, 256)]
    assert cs.QUICK.chain_points() == [(8, 32), (16, 32), (8, 64)]
    assert (cs.QUICK.steps, cs.QUICK.repeats, cs.QUICK.background, cs.QUICK.apps) == (5, 2, (4,), (2, 4))
    assert cs.TINY.chain_points() == [(8, 32)]
    point = cs.QUICK.point(16, 64)
    assert (point.steps, point.max_tokens, point.chunk_tokens, point.repeats) == (5, 16, 64, 2)
    assert (point.delay_low_s, point.delay_high_s) == (0.2, 0.3)
    engine = cs.QUICK.engine_config()
    assert (engine.max_running_tokens, engine.num_kv_blocks) == (512, 2048)


def test_flags_override_the_chosen_size() -> None:
    cfg = cs.build_config(cs.parse_args(["--quick", "--outs", "4,12", "--apps", "", "--repeats", "5"]))
    assert (cfg.outs, cfg.apps, cfg.repeats, cfg.chunks) == ((4, 12), (), 5, cs.QUICK.chunks)
    assert cs.build_config(cs.parse_args([])) == cs.FULL
    assert common.int_list(" 8, 16 ,") == (8, 16)


def _counting_transport(delay_s: float, status: int = 200) -> tuple[httpx.MockTransport, dict[str, int]]:
    """A fake server answering after ``delay_s``; ``seen`` counts requests at once and the most ever."""
    seen = {"now": 0, "max": 0, "total": 0}
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        with lock:
            seen["now"] += 1
            seen["total"] += 1
            seen["max"] = max(seen["max"], seen["now"])
        time.sleep(delay_s)
        with lock:
            seen["now"] -= 1
        return httpx.Response(status, json={"choices": [{"text": "x"}]})

    return httpx.MockTransport(handler), seen


def test_background_load_keeps_exactly_k_requests_in_flight() -> None:
    transport, seen = _counting_transport(0.02)
    bodies = cs.background_bodies("m", ["a", "b"], max_tokens=3)
    load = cs.BackgroundLoad(lambda: httpx.Client(transport=transport, base_url="http://x"), bodies, 3)
    with load:
        deadline = time.monotonic() + 5
        while load.completed < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert load.outstanding <= 3
    assert seen["max"] == load.max_in_flight == 3
    assert load.outstanding == 0 and seen["now"] == 0
    assert load.completed == seen["total"] >= 12
    assert bodies[1] == {
        "model": "m",
        "prompt": cs.BACKGROUND_INSTRUCTION + "b",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }


def test_background_load_reports_a_failed_request() -> None:
    transport, _ = _counting_transport(0.0, status=500)
    body = cs.background_bodies("m", ["a"], 1)
    with (
        pytest.raises(RuntimeError, match="background request failed"),
        cs.BackgroundLoad(lambda: httpx.Client(transport=transport, base_url="http://x"), body, 2),
    ):
        time.sleep(0.05)


def _setting(parrot: list[float], baseline: list[float]) -> cd.SettingResult:
    return cd.SettingResult(
        delay=True,
        clients={cs.PARROT: cd.ChainClientResult(parrot), cs.BASELINE: cd.ChainClientResult(baseline)},
        repeats=len(parrot),
    )


def test_apps_statistics_and_the_result_line() -> None:
    apps = cs.AppsPoint(
        2,
        {
            cs.PARROT: cs.AppsClient([[1.0, 2.0], [1.0, 4.0]]),
            cs.BASELINE: cs.AppsClient([[3.0, 3.0], [3.0, 5.0]]),
        },
    )
    assert apps.clients[cs.PARROT].mean.median == 2.0  # run means 1.5 and 2.5
    assert apps.clients[cs.PARROT].p90.median == pytest.approx((1.9 + 3.7) / 2)
    assert apps.speedup == pytest.approx(3.5 / 2.0)
    assert apps.per_app_difference() == [2.0, 1.0]  # per-app medians: parrot 1, 3; baseline 3, 4
    assert apps.as_dict()["apps_faster_in_parrot"] == 2

    cfg = cs.TINY
    res = cs.Results(
        chain={(8, 32): _setting([1.0], [2.0])},
        background=[cs.ChainPoint(8, 32, _setting([2.0], [3.0]), background=2)],
        apps=[apps],
        verified_steps=2,
    )
    metrics = cs.result_metrics(cfg, res, total_s=9.0)
    assert list(metrics) == [
        "speedup_min",
        "speedup_max",
        "speedup_out8",
        "speedup_chunk32",
        "speedup_bg2",
        "speedup_apps2",
        "speedup_apps2_p90",
        "total_s",
    ]
    assert metrics["speedup_out8"] == metrics["speedup_chunk32"] == 2.0
    assert metrics["speedup_bg2"] == 1.5
    assert metrics["speedup_apps2_p90"] == pytest.approx(3.9 / 2.8)  # baseline p90s 3.0, 4.8
    assert metrics["speedup_min"] == metrics["speedup_apps2_p90"] and metrics["speedup_max"] == 2.0
    # With a background load the delay counter also counts the load's requests: not reported per chain.
    assert "requests_per_chain" not in res.background[0].as_dict()["clients"][cs.PARROT]


def test_tiny_run_writes_every_sweep_and_the_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "chain_summary.json"
    cs.main(["--tiny", "--json", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT chain_summary speedup_min=")
    metrics = dict(item.split("=", 1) for item in last.split()[2:])
    assert list(metrics) == [
        "speedup_min",
        "speedup_max",
        "speedup_out8",
        "speedup_chunk32",
        "speedup_bg2",
        "speedup_apps2",
        "speedup_apps2_p90",
        "total_s",
    ]
    assert all(float(v) > 0 for v in metrics.values())

    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "chain_summary" and payload["outputs_identical"] is True
    assert payload["engine_config"]["max_running_tokens"] == "512"
    sweeps = payload["sweeps"]
    assert set(sweeps) == {"output_length", "chunk_size", "background", "apps"}
    assert all(len(s["points"]) == 1 for s in sweeps.values())
    point = sweeps["output_length"]["points"][0]
    assert set(point["clients"]) == {"parrot", "baseline"}
    assert point["clients"]["parrot"]["latency"]["n"] == 1
    # One chain of 2 steps with the delay on: the baseline makes one request per step.
    assert point["clients"]["baseline"]["requests_per_chain"] == [2]
    bg = sweeps["background"]["points"][0]
    assert bg["background_max_in_flight"] == 2 and bg["background_completed"] > 0
    assert len(sweeps["apps"]["points"][0]["per_app_difference_s"]) == 2

    png = tmp_path / "chain_summary.png"
    cs.plot(payload, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
