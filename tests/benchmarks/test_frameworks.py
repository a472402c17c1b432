"""The framework experiments' harness (`benchmarks.harness.frameworks`) on plain Python runs: every app's
clients must agree before they are timed, each setting runs with the delay switched as it says, and the
ratios are each client's time over the reference's."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks.experiments import by_name
from benchmarks.harness import frameworks, systems
from benchmarks.harness.systems import Served
from benchmarks.runner import parse_result_line


def tiny_run(
    main: Callable[[list[str]], None],
    name: str,
    apps: Sequence[str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    *argv: str,
) -> tuple[dict[str, float], dict[str, Any]]:
    """A framework experiment's ``main`` at its registry tiny size (and ``argv``): the metrics of its RESULT
    line (checked last and positive) and its JSON payload (checked: every app without, then with the delay,
    the answers identical)."""
    out = tmp_path / f"{name}.json"
    main([*by_name(name).tiny_args, *argv, "--json", str(out)])
    printed = capsys.readouterr().out.strip()
    assert printed.splitlines()[-1].startswith(f"RESULT {name} ")  # the last line, for the runner
    metrics = parse_result_line(printed, name)
    assert all(v > 0 for v in metrics.values())
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == name
    assert [(s["app"], s["network_delay"]) for s in payload["settings"]] == [
        (app, delay) for app in apps for delay in (False, True)
    ]
    return metrics, payload


def served() -> Served:
    """A system with no engines and a bare delay switch: enough for `frameworks.compare` to time runs."""
    return Served(systems.baseline(frameworks.SERVER), "http://unused", [], SimpleNamespace(enabled=False))  # type: ignore[arg-type]


def test_compare_times_each_app_per_setting_with_the_delay_switched_and_ratios_to_the_reference() -> None:
    s = served()
    seen: list[tuple[str, bool]] = []

    def run(name: str, seconds: float) -> Any:
        def go() -> str:
            seen.append((name, s.delay.enabled))  # type: ignore[union-attr]
            time.sleep(seconds)
            return "answer"

        return go

    apps = {"a": {"fast": run("fast", 0.01), "slow": run("slow", 0.05)}, "b": {"fast": run("fast", 0.01)}}
    runs = frameworks.compare(s, apps, repeats=2, reference="fast")
    assert list(runs) == ["a", "b"] and all(list(c.settings) == [False, True] for c in runs.values())
    # One warm-up run per client, then 2 repeats per setting, the delay on only in the second setting.
    assert seen[:2] == [("fast", False), ("slow", False)]
    assert [d for n, d in seen[2:10]] == [False] * 4 + [True] * 4
    a = runs["a"]
    assert set(a.speedups(True)) == {"slow"} and a.speedup(True, "slow") > 2
    assert all(
        len(samples.runs) == 2 for c in runs.values() for by in c.settings.values() for samples in by.values()
    )
    payload = frameworks.payload(runs)
    assert [(x["app"], x["network_delay"]) for x in payload] == [
        ("a", False),
        ("a", True),
        ("b", False),
        ("b", True),
    ]
    assert set(payload[1]["clients"]) == {"fast", "slow"} and set(payload[1]["speedup"]) == {"slow"}
    assert s.delay.enabled is False  # type: ignore[union-attr]


def test_compare_stops_when_clients_disagree_or_an_answer_changes() -> None:
    with pytest.raises(SystemExit, match="outputs differ"):
        frameworks.compare(served(), {"a": {"x": lambda: "1", "y": lambda: "2"}}, 1, "x")
    answers = iter(["1", "1", "2"])
    with pytest.raises(SystemExit, match="differs from the other runs"):
        frameworks.compare(served(), {"a": {"x": lambda: next(answers)}}, 2, "x")
