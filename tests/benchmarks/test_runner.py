"""The benchmark runner: every experiment runs in its tiny configuration, and the page renders from it.

This checks the harness (each script runs end to end, writes its JSON and its ``RESULT`` line, the runner
records it, the report and the plots render), not speed: tiny figures mean nothing.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks.__main__ import main
from benchmarks.experiments import EXPERIMENTS, Experiment, Metric, by_name
from benchmarks.harness.machine import REPO_ROOT
from benchmarks.harness.machine_lock import MachineBusyError, exclusive_machine
from benchmarks.report import headline, paper_range, write_report
from benchmarks.runner import (
    RunOptions,
    command,
    load_records,
    parse_result_line,
    run_all,
    run_one,
    select,
)

NAMES = [e.name for e in EXPERIMENTS]


def test_result_line_parsing_takes_the_last_line_of_that_benchmark() -> None:
    out = "RESULT other a=1\nRESULT x speedup=2.5 n=3\nnoise\nRESULT x speedup=nan\n"
    metrics = parse_result_line(out, "x")
    assert list(metrics) == ["speedup"] and math.isnan(metrics["speedup"])
    assert parse_result_line(out, "other") == {"a": 1.0}
    with pytest.raises(ValueError, match="no 'RESULT y"):
        parse_result_line(out, "y")


def test_selection_keeps_the_paper_order_and_rejects_unknown_names() -> None:
    assert [e.name for e in select([])] == NAMES == [e.name for e in select(["all"])]
    assert [e.name for e in select(["mixed", "map_reduce"])] == ["map_reduce", "mixed"]
    with pytest.raises(KeyError, match="no benchmark named 'nope'; known: chain_summary"):
        select(["nope"])


def test_command_lines_per_size_and_model(tmp_path: Path) -> None:
    mr, kernels = by_name("map_reduce"), by_name("kernels")
    out = tmp_path / "x.json"
    # A real-engine experiment runs on its own default model (SmolLM2) unless the runner names one.
    assert command(mr, RunOptions(size="quick"), out)[1:] == [
        "-m",
        "benchmarks.map_reduce",
        "--quick",
        "--model",
        "smollm2",
        "--json",
        str(out),
    ]
    assert command(mr, RunOptions(size="full", model="/m"), out)[3:5] == ["--model", "/m"]
    assert "--model" not in command(mr, RunOptions(size="quick", model="tiny"), out)
    assert "--model" not in command(mr, RunOptions(size="tiny"), out)  # harness checks stay tiny
    assert command(kernels, RunOptions(size="tiny", model="/m"), out)[3:] == ["--tiny", "--json", str(out)]
    assert "--model" not in command(kernels, RunOptions(size="quick", model="/m"), out)  # takes none


def test_only_a_tiny_run_may_run_experiments_side_by_side() -> None:
    assert RunOptions(size="tiny", jobs=2).jobs == 2
    with pytest.raises(ValueError, match="quick-size figures need the machine to themselves"):
        RunOptions(size="quick", jobs=2)
    with pytest.raises(ValueError, match="at least 1"):
        RunOptions(size="tiny", jobs=0)


def test_the_cli_refuses_jobs_for_a_measured_size_before_running_anything(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["run", "map_reduce", "--quick", "--jobs", "2", "--results", str(tmp_path / "r")])
    assert code == 2
    assert "quick-size figures need the machine to themselves" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_paper_figures_parse_as_numbers_or_ranges() -> None:
    assert paper_range("12x") == (12.0, 12.0)
    assert paper_range("1.38-1.88x") == (1.38, 1.88)
    assert paper_range("RelayAttention 8.8x at batch 32") is None and paper_range(None) is None


def test_a_failing_script_is_recorded_as_failed_with_its_log(tmp_path: Path) -> None:
    broken = Experiment(
        name="no_such_benchmark",
        title="missing",
        figure="—",
        paper="",
        metrics=(Metric("speedup", "speedup"),),
        backend="operator",
        engines=0,
        conditions="",
    )
    record = run_one(broken, RunOptions(size="tiny", results_dir=tmp_path), machine={})
    assert record["ok"] is False and record["returncode"] != 0
    assert "No module named benchmarks.no_such_benchmark" in record["log_tail"]
    assert (tmp_path / "no_such_benchmark.json").exists()
    assert headline(broken, record).startswith("**failed**")


def test_the_committed_results_carry_every_headline_metric() -> None:
    """The registry names metrics the scripts really print: checked on the committed results (quick or
    full sizes; a tiny run's sweeps are smaller, so its keys differ)."""
    records = load_records(REPO_ROOT / "benchmarks" / "results")  # the checkout's, whatever the cwd
    assert records, "no committed results: run `python -m benchmarks run --quick`"
    for name, record in records.items():
        assert record["ok"], f"{name}: {record.get('error')}"
        missing = [m.key for m in by_name(name).metrics if m.key not in record["metrics"]]
        assert not missing, f"{name}: headline metrics missing from its RESULT line: {missing}"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict[str, Any]], Path]:
    """Every experiment run once, tiny, through the runner (two at a time); then the page rendered."""
    root = tmp_path_factory.mktemp("bench")
    options = RunOptions(size="tiny", results_dir=root / "results", timeout_s=600, jobs=2)
    records = run_all(EXPERIMENTS, options)
    assert [r["name"] for r in records] == NAMES  # in the registry's order, whichever finished first
    records = load_records(options.results_dir)
    page = write_report(records, root / "docs")
    return records, page


@pytest.mark.parametrize("name", NAMES)
def test_every_experiment_runs_and_is_recorded(
    tiny_run: tuple[dict[str, dict[str, Any]], Path], name: str
) -> None:
    records, _ = tiny_run
    record = records[name]
    assert record["ok"], f"{name}: {record.get('error')}\n{record.get('log_tail', '')[-2000:]}"
    experiment = by_name(name)
    assert record["size"] == "tiny" and record["engines"] == experiment.engines
    assert record["machine"]["git"]["commit"] and record["machine"]["logical_cores"]
    assert "payload" in record, "the script wrote no --json payload"
    assert record["metrics"], "an empty RESULT line"
    if experiment.backend == "engine":
        assert record["model"]["config"]["hidden_size"] > 0
    if experiment.profile is not None:
        assert record["model"]["simulated"]["profile"] == experiment.profile


def test_the_page_states_each_experiment_and_its_plots(
    tiny_run: tuple[dict[str, dict[str, Any]], Path],
) -> None:
    _, page = tiny_run
    text = page.read_text()
    for e in EXPERIMENTS:
        assert f"| [{e.name}](#{e.name})" in text and f"## {e.name}" in text
        assert e.figure in text and e.conditions in text
    img = page.parent / "img"
    assert (img / "summary.png").stat().st_size > 0
    for e in EXPERIMENTS:  # its own figure, or at least its headline bars
        drawn = [p.name for p in (img / f"{e.name}.png", img / f"{e.name}_headline.png") if p.exists()]
        assert drawn, f"no plot for {e.name}"
        assert all(f"](img/{name})" in text for name in drawn)
    assert "**failed**" not in text


def test_a_measured_run_refuses_while_another_holds_the_machine(tmp_path: Path) -> None:
    lock = tmp_path / "bench.lock"
    seen: list[str] = []
    quick = RunOptions(size="quick", results_dir=tmp_path / "r", lock_path=lock)
    with exclusive_machine(lock):
        with pytest.raises(MachineBusyError, match=rf"pid {os.getpid()}\) holds .*bench.lock"):
            run_all([by_name("mixed")], quick, lambda e, r: seen.append(e.name))
        assert seen == [] and not (tmp_path / "r").exists()  # refused before running anything
        # A tiny harness check does not take the lock (its figures mean nothing).
        assert run_all([], RunOptions(size="tiny", lock_path=lock)) == []
    assert run_all([], quick) == []  # free again once the holder is done
    with exclusive_machine(lock):  # and a run that ended (or crashed) left it free
        pass
