"""The results page from a small synthetic results folder: goals and tolerances flagged pass or fail, spreads
found in the payload and drawn as whiskers, the summary plot's rows, axis and marks.

Records here are made up (no benchmark runs); they use real experiment names, so the registry's labels,
paper figures and goals apply to them as they do to the committed results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.experiments import Metric, by_name
from benchmarks.report import (
    Goal,
    SummaryRow,
    axis_limits,
    checks,
    draw_summary,
    metric_goal,
    stored_spread,
    summary_rows,
    tolerance_check,
    write_report,
)
from benchmarks.runner import load_cpu_kinds, load_records


def record(name: str, metrics: dict[str, Any], payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """A successful run's record as the runner writes it, with only what the page reads."""
    out: dict[str, Any] = {"name": name, "size": "quick", "ok": True, "metrics": metrics}
    if payload is not None:
        out["payload"] = payload
    return out


def spread(median: float, lo: float, hi: float, n: int | None = None) -> dict[str, float]:
    """A ratio's spread as `benchmarks.harness.stats.Spread.as_dict` stores it."""
    return {"median": median, "min": lo, "max": hi} | ({} if n is None else {"n": n})


# chain_dependent stores each setting's speedup as a Spread, next to latencies of the same shape.
CHAIN_PAYLOAD = {
    "settings": [
        {"network_delay": False, "speedup": {"parrot": spread(1.1676, 1.06, 1.37)}},
        {
            "network_delay": True,
            "speedup": {"parrot": spread(2.9835, 2.78, 3.17)},
            "clients": {"parrot": {"latency": spread(1.1, 1.0, 1.2)}},
        },
    ]
}
RECORDS = {
    # paper 1.38x on speedup_delay; a spread stored for it
    "chain_dependent": record(
        "chain_dependent", {"speedup_delay": 2.98, "speedup_nodelay": 1.17}, CHAIN_PAYLOAD
    ),
    # above its stored tolerance
    "sim_validation": record("sim_validation", {"max_error": 0.31, "tolerance": 0.25}),
    # one speedup goal missed (>= 1.5), one reached (1.1-1.7 counts from its low end)
    "vllm_backends": record(
        "vllm_backends",
        {"shared_speedup_nodelay": 1.2, "mapreduce_speedup": 1.15, "hit_rate_affinity": 0.8},
    ),
    # an upper-bound goal met: tables only, not a speedup for the plot
    "multi_turn": record("multi_turn", {"prefill_ratio": 1.02, "ttft_speedup": 6.4}),
}


def test_goals_parse_from_the_registry_labels_and_none_is_invented() -> None:
    assert metric_goal(Metric("k", "a ratio (goal >= 1.5)")) == Goal(1.5, None, "≥ 1.5")
    assert metric_goal(Metric("k", "a ratio (goal <= 1.10)")) == Goal(None, 1.1, "≤ 1.10")
    assert metric_goal(Metric("k", "a ratio (goal 1.42)")) == Goal(1.42, None, "≥ 1.42")
    assert metric_goal(Metric("k", "a ratio (goal 1.1-1.7)")) == Goal(1.1, None, "1.1-1.7")
    assert metric_goal(Metric("k", "speedup with network delay", paper="1.38x")) is None
    assert Goal(1.1, None, "1.1-1.7").met(2.0) and not Goal(1.5, None, "").met(1.15)
    assert Goal(None, 1.1, "").met(1.02) and not Goal(None, 1.1, "").met(1.2)
    assert not Goal(0.35, None, "").is_speedup and not Goal(None, 1.0, "").is_speedup


def test_a_tolerance_is_flagged_only_when_exceeded_and_the_scripts_verdict_wins() -> None:
    above = tolerance_check({"max_error": 0.31, "tolerance": 0.25})
    assert above is not None and not above.passed
    assert above.text == "✗ max error 31% above tolerance 25%"
    within = tolerance_check({"max_error": 0.2, "tolerance": 0.25})
    assert within is not None and within.passed and within.text.startswith("✓")
    # Rounded to 3 digits, 0.2504 prints as 0.25: the script's own unrounded verdict decides.
    rounded = tolerance_check({"max_error": 0.25, "tolerance": 0.25, "within": 0})
    assert rounded is not None and not rounded.passed
    assert tolerance_check({"speedup": 2.0}) is None
    assert tolerance_check({"max_error": None, "tolerance": 0.25}) is None  # a metric stored as null


def test_checks_cover_goals_with_a_value_and_skip_failed_runs() -> None:
    found = {c.key: c for c in checks(by_name("vllm_backends"), RECORDS["vllm_backends"])}
    assert set(found) == {"shared_speedup_nodelay", "mapreduce_speedup"}  # the hit rates have no goal
    assert (
        found["shared_speedup_nodelay"].passed and found["shared_speedup_nodelay"].short == "✓ goal 1.1-1.7"
    )
    assert not found["mapreduce_speedup"].passed
    assert found["mapreduce_speedup"].text == "✗ mapreduce_speedup 1.15, goal ≥ 1.5"
    assert checks(by_name("chain_dependent"), RECORDS["chain_dependent"]) == []  # no goal stated
    failed = {**RECORDS["vllm_backends"], "ok": False}
    assert checks(by_name("vllm_backends"), failed) == []


def test_the_spread_is_the_one_whose_median_prints_as_the_metric() -> None:
    assert stored_spread(CHAIN_PAYLOAD, 2.98) == (2.78, 3.17)
    assert stored_spread(CHAIN_PAYLOAD, 1.17) == (1.06, 1.37)
    assert stored_spread(CHAIN_PAYLOAD, 1.1) is None  # a latency (seconds) is not a ratio's spread
    assert stored_spread(None, 2.98) is None
    # langchain_apps' shape: a ratio with its "_range" beside it
    assert stored_spread({"results": [{"speedup": 1.4154, "speedup_range": [1.39, 1.64]}]}, 1.42) == (
        1.39,
        1.64,
    )
    # one seed is no spread; two distinct spreads of the same printed median are ambiguous: no whisker
    assert stored_spread({"ratios": {"a": spread(2.37, 2.37, 2.37, n=1)}}, 2.37) is None
    twins = {"speedup": [spread(2.371, 2.0, 2.5), spread(2.368, 2.2, 2.4)]}
    assert stored_spread(twins, 2.37) is None


def test_summary_rows_hold_the_speedups_with_a_paper_figure_or_a_speedup_goal() -> None:
    rows = {(r.experiment, r.label): r for r in summary_rows(RECORDS)}
    assert list(rows) == [
        ("chain_dependent", "speedup with network delay"),
        (
            "vllm_backends",
            "shared prompt, baseline / Parrot, both on vLLM",
        ),  # the goal note is drawn, not said
        ("vllm_backends", "map-reduce with delay, baseline / Parrot"),
    ]
    delay = rows["chain_dependent", "speedup with network delay"]
    assert delay.value == 2.98 and delay.spread == (2.78, 3.17) and delay.paper == (1.38, 1.38)
    assert delay.goal is None and delay.passed is None
    missed = rows["vllm_backends", "map-reduce with delay, baseline / Parrot"]
    assert missed.spread is None and missed.goal == Goal(1.5, None, "≥ 1.5") and missed.passed is False
    assert summary_rows({"chain_dependent": {**RECORDS["chain_dependent"], "ok": False}}) == []


def test_the_summary_plot_draws_whiskers_from_the_spreads_a_labelled_log_axis_and_the_baseline() -> None:
    rows = [
        SummaryRow("a", "with spread", 2.0, (1.5, 2.6), (1.38, 1.38), None),
        SummaryRow("a", "no spread", 0.8, None, (1.8, 2.4), None),
        SummaryRow("b", "below goal", 1.15, (1.1, 1.3), None, Goal(1.5, None, "≥ 1.5")),
    ]
    fig = draw_summary(rows)
    ax = fig.axes[0]
    [whiskers] = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    segments = [[tuple(p) for p in seg] for seg in whiskers.lines[2][0].get_segments()]
    assert segments == [[(1.5, 0.0), (2.6, 0.0)], [(1.1, 2.0), (1.3, 2.0)]]  # only rows with a spread
    assert ax.get_xscale() == "log"
    labels = {t.get_text() for t in ax.get_xticklabels()}
    assert {"0.5x", "1x", "2x"} <= labels
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.get_lines())  # the 1x baseline
    assert any(t.get_text().strip() == "baseline" for t in ax.texts)
    bars = [p for p in ax.patches if p.get_height() > 0]
    assert [p.get_facecolor() for p in bars][2] != bars[0].get_facecolor()  # below its goal: its own colour
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [
        "ours",
        "ours, below its goal",
        "min-max over repeats",
        "paper",
        "paper's range",
        "our goal",
        "1x: the baseline",
    ]
    right = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert right[0] == "2.00x (1.50-2.60) · paper 1.38x" and right[2].endswith("goal ≥ 1.5 ✗")
    assert axis_limits(rows)[0] == 0.5  # down to a labelled tick below 0.8x
    import matplotlib.pyplot as plt

    plt.close(fig)


@pytest.fixture()
def page(tmp_path: Path) -> str:
    """The page rendered from the synthetic records, written and read back as the runner's files."""
    results = tmp_path / "results"
    results.mkdir()
    for name, rec in RECORDS.items():
        (results / f"{name}.json").write_text(json.dumps(rec))
    path = write_report(load_records(results), tmp_path / "docs")
    assert (tmp_path / "docs" / "img" / "summary.png").stat().st_size > 0
    return path.read_text()


def summary_line(page: str, name: str) -> str:
    return next(line for line in page.splitlines() if line.startswith(f"| [{name}](#{name})"))


def test_the_page_flags_a_failing_tolerance_and_goal_and_not_a_passing_one(page: str) -> None:
    assert "✗ max error 31% above tolerance 25%" in summary_line(page, "sim_validation")
    vllm = summary_line(page, "vllm_backends")
    assert "✓ shared_speedup_nodelay 1.2, goal 1.1-1.7" in vllm
    assert "✗ mapreduce_speedup 1.15, goal ≥ 1.5" in vllm
    turns = summary_line(page, "multi_turn")
    assert "✓ prefill_ratio 1.02, goal ≤ 1.10" in turns and "✗" not in turns
    assert "✓" not in summary_line(page, "chain_dependent") and "| —" in summary_line(page, "chain_dependent")
    # each metric's own row: its spread and its verdict
    assert any(
        line.startswith("| speedup_delay") and "2.78-3.17" in line and "1.38x" in line
        for line in page.splitlines()
    )
    assert any(
        line.startswith("| max_error") and "✗ above tolerance 25%" in line for line in page.splitlines()
    )
    assert "![headline ratios, ours vs the paper's](img/summary.png)" in page
    assert "*The plot:*" in page


def test_runs_on_other_kinds_of_cpu_sit_beside_the_main_record(tmp_path: Path) -> None:
    """A record under ``results/cpu_kinds/<name>-<kind>.json`` gets a column of its own in its experiment's
    section, its machine (with the CPU's features) named; experiments without one get no such table."""
    results = tmp_path / "results"
    (results / "cpu_kinds").mkdir(parents=True)
    main = record("engine_throughput", {"decode_vs_vllm_b64": 1.32, "mem_bw_gbs": 49.5})
    main["machine"] = {"cpu_model": "AMD EPYC", "usable_cores": 2, "cpu_features": {"flags": ["avx512_bf16"]}}
    avx2 = record("engine_throughput", {"decode_vs_vllm_b64": 0.88, "peak_gflops": 104.0})
    avx2["machine"] = {"cpu_model": "AMD EPYC", "usable_cores": 2, "cpu_features": {"flags": ["avx2", "fma"]}}
    (results / "engine_throughput.json").write_text(json.dumps(main))
    (results / "cpu_kinds" / "engine_throughput-avx2.json").write_text(json.dumps(avx2))
    (results / "multi_turn.json").write_text(json.dumps(RECORDS["multi_turn"]))
    kinds = load_cpu_kinds(results)
    assert list(kinds) == ["engine_throughput"]
    assert kinds["engine_throughput"][0]["metrics"] == avx2["metrics"]
    page = write_report(load_records(results), tmp_path / "docs", None, kinds).read_text()
    assert page.count("**On other kinds of CPU**") == 1
    assert "1. AMD EPYC (avx512_bf16), 2 cores" in page and "2. AMD EPYC (avx2/fma), 2 cores" in page
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| ")}
    assert "1.32" in rows["decode_vs_vllm_b64"] and "0.88" in rows["decode_vs_vllm_b64"]
    assert "n/a" in rows["peak_gflops"] and "104" in rows["peak_gflops"]  # a metric only one run has
