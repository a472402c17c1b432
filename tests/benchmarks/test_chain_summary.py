"""The chain-summary benchmark (paper Fig. 11-13): its sweeps, its background load and concurrent apps
(`benchmarks.harness.chains`), its figures, and a tiny run end to end (harness correctness, not speed)."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import chain_summary as cs
from benchmarks.harness import chains, systems
from benchmarks.harness.flags import int_list
from benchmarks.harness.measure import Job, Run, Samples

ZERO_WORK = dict.fromkeys(systems.ENGINE_COUNTERS, 0)


def test_sweeps_of_the_quick_and_full_configurations() -> None:
    assert cs.FULL.outs == (16, 32, 64) and cs.FULL.chunks == (64, 128, 256)
    assert cs.FULL.background == (4, 8) and cs.FULL.apps == (4, 8)
    # The fixed point (32 output, 128 chunk tokens) belongs to both sweeps and is measured once.
    assert cs.FULL.chain_points() == [(16, 128), (32, 128), (64, 128), (32, 64), (32, 256)]
    assert cs.QUICK.chain_points() == [(8, 32), (16, 32), (8, 64)]
    assert (cs.QUICK.steps, cs.QUICK.repeats, cs.QUICK.background, cs.QUICK.apps) == (5, 2, (4,), (2, 4))
    assert (cs.QUICK.background_prompt_tokens, cs.QUICK.background_max_tokens) == (128, 32)
    assert (cs.QUICK.max_running_tokens, cs.QUICK.num_kv_blocks) == (512, 2048)
    assert cs.TINY.chain_points() == [(8, 32)]
    assert (cs.TINY.steps, cs.TINY.repeats, cs.TINY.background_max_tokens) == (2, 1, 8)


def test_flags_override_the_chosen_size() -> None:
    _, cfg = cs.configure(["--quick", "--outs", "4,12", "--apps", "", "--repeats", "5"])
    assert (cfg.outs, cfg.apps, cfg.repeats, cfg.chunks) == ((4, 12), (), 5, cs.QUICK.chunks)
    assert cs.configure([])[1] == cs.FULL
    assert cs.configure(["--max-running-tokens", "300"])[1].max_running_tokens == 300
    assert int_list(" 8, 16 ,") == (8, 16)


async def test_background_load_keeps_exactly_k_requests_in_flight() -> None:
    seen = {"now": 0, "max": 0, "total": 0}
    slots: list[int] = []

    async def send(slot: int) -> None:
        seen["now"] += 1
        seen["total"] += 1
        seen["max"] = max(seen["max"], seen["now"])
        slots.append(slot)
        await asyncio.sleep(0.01)
        seen["now"] -= 1

    async with chains.BackgroundLoad(send, 3) as load:
        while load.completed < 12:
            await asyncio.sleep(0.01)
        assert load.outstanding == 3  # each slot sends its next request at once
    assert seen["max"] == load.max_in_flight == 3
    assert load.outstanding == 0 and seen["now"] == 0  # leaving waits for the requests in flight
    assert load.completed == seen["total"] >= 12
    assert set(slots) == {0, 1, 2}


async def test_background_load_reports_a_failed_request() -> None:
    sent = 0

    async def send(slot: int) -> None:
        nonlocal sent
        sent += 1
        await asyncio.sleep(0)
        raise ValueError("HTTP 500")

    with pytest.raises(RuntimeError, match=r"background request failed.*HTTP 500"):
        async with chains.BackgroundLoad(send, 2):
            await asyncio.sleep(0.05)
    assert sent <= 2  # one failure stops every slot: none sends again
    with pytest.raises(ValueError, match="at least one slot"):
        chains.BackgroundLoad(send, 0)


async def test_together_starts_every_job_at_once_and_times_each_to_its_answer() -> None:
    engine = SimpleNamespace(stats=lambda: SimpleNamespace(**ZERO_WORK))
    served = systems.Served(systems.parrot(), "http://x", [engine])
    started: list[float] = []
    loop = asyncio.get_running_loop()

    def job(answer_s: float, return_s: float, output: str) -> Job:
        async def run(done: Callable[[], None]) -> str:
            started.append(loop.time())
            await asyncio.sleep(answer_s)
            done()
            await asyncio.sleep(return_s)  # after the answer: not timed
            return output

        return run

    run = await chains.together(served, [job(0.05, 0.0, "a"), job(0.01, 0.1, "b")], clock=loop.time)
    assert run.output == ("a", "b")
    assert max(started) - min(started) < 0.01
    assert run.each[0] == pytest.approx(0.05, abs=0.02) and run.each[1] == pytest.approx(0.01, abs=0.02)
    assert run.seconds == pytest.approx(statistics.fmean(run.each))
    assert run.requests == 0 and run.engine == ZERO_WORK


def _chain(parrot: list[float], baseline: list[float]) -> dict[str, Samples]:
    def samples(seconds: list[float]) -> Samples:
        return Samples([Run(s, "summary", 2, ZERO_WORK) for s in seconds])

    return {cs.PARROT: samples(parrot), cs.BASELINE: samples(baseline)}


def _apps(runs: list[list[float]]) -> Samples:
    return Samples([chains.Together(statistics.fmean(r), ("a", "b"), 4, ZERO_WORK, tuple(r)) for r in runs])


def test_apps_statistics_and_the_result_line() -> None:
    apps = cs.Point(
        "apps",
        2,
        {cs.PARROT: _apps([[1.0, 2.0], [1.0, 4.0]]), cs.BASELINE: _apps([[3.0, 3.0], [3.0, 5.0]])},
    )
    assert apps.samples[cs.PARROT].spread.median == 2.0  # run means 1.5 and 2.5
    assert apps.p90(cs.PARROT).median == pytest.approx((1.9 + 3.7) / 2)
    assert apps.ratio.median == pytest.approx(3.5 / 2.0)
    assert apps.per_job_difference() == [2.0, 1.0]  # per-app medians: parrot 1, 3; baseline 3, 4
    assert apps.as_dict()["apps_faster_in_parrot"] == 2
    assert apps.as_dict()["clients"][cs.PARROT]["per_app_median"] == [1.0, 3.0]

    load = {"background_completed": 7, "background_max_in_flight": 2}
    points = [
        cs.Point("out", 8, _chain([1.0], [2.0])),
        cs.Point("chunk", 32, _chain([1.0], [2.0])),
        cs.Point("bg", 2, _chain([2.0], [3.0]), load),
        apps,
    ]
    metrics = cs.result_metrics(points)
    assert list(metrics) == [
        "speedup_min",
        "speedup_max",
        "speedup_out8",
        "speedup_chunk32",
        "speedup_bg2",
        "speedup_apps2",
        "speedup_apps2_p90",
    ]
    assert metrics["speedup_out8"] == metrics["speedup_chunk32"] == 2.0
    assert metrics["speedup_bg2"] == 1.5
    assert metrics["speedup_apps2_p90"] == pytest.approx(3.9 / 2.8)  # baseline p90s 3.0, 4.8
    assert metrics["speedup_min"] == metrics["speedup_apps2_p90"] and metrics["speedup_max"] == 2.0
    # With a background load the request counter also counts the load's requests: not reported per chain.
    bg = points[2].as_dict()
    assert "requests" not in bg["clients"][cs.PARROT] and bg["background_completed"] == 7
    assert points[0].as_dict()["clients"][cs.PARROT]["requests"] == 2
    p90_row = cs.table(points).splitlines()[-1]
    assert p90_row.split("|")[1:3] == [" 12b/13 apps (p90)  ", " 2 apps      "] and "1.39x" in p90_row


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
    assert payload["verified_steps"] == 2
    assert payload["systems"][cs.SERVER]["engine_config"]["max_running_tokens"] == "512"
    sweeps = payload["sweeps"]
    assert set(sweeps) == {"out", "chunk", "bg", "apps"}
    assert all(len(s["points"]) == 1 for s in sweeps.values())
    point = sweeps["out"]["points"][0]
    assert set(point["clients"]) == {"parrot", "baseline"}
    assert point["clients"]["parrot"]["latency"]["n"] == 1
    # One chain of 2 steps: the baseline makes one request per step, Parrot one batch (opening its session).
    assert point["clients"]["baseline"]["requests"] == 2
    assert point["clients"]["parrot"]["requests"] == 1
    bg = sweeps["bg"]["points"][0]
    assert bg["background_max_in_flight"] == 2 and bg["background_completed"] > 0
    apps = sweeps["apps"]["points"][0]
    assert len(apps["per_app_difference_s"]) == 2
    # Two apps of 2 steps each, started together: twice a lone chain's requests.
    assert apps["clients"]["baseline"]["requests"] == 4 and apps["clients"]["parrot"]["requests"] == 2

    png = tmp_path / "chain_summary.png"
    cs.plot(payload, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
