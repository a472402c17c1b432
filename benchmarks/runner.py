"""Run benchmark scripts and keep what they measured: one results file per experiment.

Each experiment (`benchmarks.experiments`) runs as its own process — ``python -m benchmarks.<name>`` with
the size flag and ``--json`` — so one that crashes or leaks memory cannot take the others down, and every
figure comes from the script's own ``RESULT`` line and JSON. The runner wraps them in a record: when and
where it ran (machine, commit), at what size, the model (its config, or the simulator's profile), engine
count, the ``RESULT`` metrics, and the script's whole payload (medians, spreads, raw times). A failed
experiment is recorded as failed with the tail of its log, never skipped silently.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from benchmarks.experiments import EXPERIMENTS, Experiment, by_name
from benchmarks.harness.machine import REPO_ROOT, machine_info, output_root
from benchmarks.harness.machine_lock import LOCK_PATH, exclusive_machine
from benchmarks.harness.output import write_json

Size = Literal["full", "quick", "tiny"]
RESULTS_DIR = output_root() / "benchmarks" / "results"  # `--results` changes it
SIZE_FLAGS: dict[Size, tuple[str, ...]] = {"full": (), "quick": ("--quick",), "tiny": ()}


@dataclass(frozen=True)
class RunOptions:
    """How to run: the size, where results go, and the model for real-engine experiments (None: each
    experiment's own `Experiment.default_model`; tiny-size runs always use the tiny model)."""

    size: Size = "full"
    results_dir: Path = RESULTS_DIR
    model: str | None = None
    timeout_s: float = 3600.0
    # Experiments side by side: only a tiny run, whose figures mean nothing, may share the machine.
    jobs: int = 1
    lock_path: Path = LOCK_PATH  # the machine's benchmark lock (`machine_lock`), held by measured sizes

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise ValueError(f"jobs must be at least 1, got {self.jobs}")
        if self.jobs > 1 and self.size != "tiny":
            raise ValueError(
                f"jobs={self.jobs} runs experiments side by side, which only a tiny harness check may do: "
                f"{self.size}-size figures need the machine to themselves (use jobs=1)"
            )

    def model_for(self, experiment: Experiment) -> str:
        """The model ``experiment`` runs on."""
        if self.size == "tiny":
            return "tiny"
        return self.model or experiment.default_model


def select(names: Sequence[str]) -> list[Experiment]:
    """The experiments ``names`` asks for, in the paper's order; ``all`` (or nothing) is every one."""
    if not names or "all" in names:
        return list(EXPERIMENTS)
    wanted = {by_name(n).name for n in names}
    return [e for e in EXPERIMENTS if e.name in wanted]


def command(experiment: Experiment, options: RunOptions, json_path: Path) -> list[str]:
    """The script's command line for ``options``."""
    args = list(experiment.tiny_args if options.size == "tiny" else SIZE_FLAGS[options.size])
    model = options.model_for(experiment)
    if experiment.takes_model and model != "tiny":
        args += ["--model", model]
    return [sys.executable, "-m", experiment.module, *args, "--json", str(json_path)]


def parse_result_line(output: str, name: str) -> dict[str, float]:
    """The metrics of the last ``RESULT <name> k=v ...`` line of ``output`` (``nan`` stays NaN)."""
    for line in reversed(output.splitlines()):
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "RESULT" and parts[1] == name:
            metrics: dict[str, float] = {}
            for item in parts[2:]:
                key, _, value = item.partition("=")
                metrics[key] = float(value)
            return metrics
    raise ValueError(f"no 'RESULT {name} ...' line in the output")


def model_record(experiment: Experiment, model: str) -> dict[str, Any]:
    """What model the figures are of: the real engine's config, or the simulator's latency profile."""
    record: dict[str, Any] = {}
    if experiment.backend == "engine":
        record["engine_model"] = model
        record["config"] = _model_config(model)
    if experiment.profile is not None:
        from server.sim.latency import load_profile

        profile = load_profile(experiment.profile)
        record["simulated"] = {"profile": experiment.profile, "source": profile.source}
    if experiment.backend == "operator":
        record["operator"] = "decode attention only (see the payload's shape)"
    return record


def _model_config(model: str) -> dict[str, Any]:
    if model == "tiny":
        from server.engine.tiny.model import TINY_CONFIG

        return dict(TINY_CONFIG)
    path = Path(model) / "config.json"
    if path.exists():
        return json.loads(path.read_text())
    try:  # a named model or a GGUF file: the config its metadata gives
        from server.engine.gguf_loader import gguf_hf_config, read_gguf
        from server.engine.model_names import resolve_model

        source = resolve_model(model)
        if source.kind == "gguf":
            # The file's name and size, never its absolute path: results are compared across machines.
            file = {"file": source.path.name, "file_bytes": source.path.stat().st_size}
            return {**file, **gguf_hf_config(read_gguf(source.path))}
    except (OSError, ValueError):
        pass
    return {"path": model}


def run_one(experiment: Experiment, options: RunOptions, machine: dict[str, Any]) -> dict[str, Any]:
    """Run one experiment's script; return (and write) its record, failed or not."""
    results_dir = options.results_dir.resolve()  # the script runs in REPO_ROOT: a relative path would move
    results_dir.mkdir(parents=True, exist_ok=True)
    json_path = results_dir / f"{experiment.name}.payload.json"
    log_path = results_dir / f"{experiment.name}.log"
    json_path.unlink(missing_ok=True)
    argv = command(experiment, options, json_path)
    started = datetime.datetime.now(datetime.UTC)
    clock = time.perf_counter()
    record: dict[str, Any] = {
        "name": experiment.name,
        "figure": experiment.figure,
        "size": options.size,
        "command": " ".join(["python", *argv[1:-2]]),
        "started_at": started.isoformat(timespec="seconds"),
        "machine": machine,
        "engines": experiment.engines,
        "model": model_record(experiment, options.model_for(experiment)),
    }
    try:
        with log_path.open("w") as log_file:
            done = subprocess.run(
                argv,
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=log_file,
                text=True,
                timeout=options.timeout_s,
                check=False,
            )
        output, returncode = done.stdout, done.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout  # bytes even under text=True on some Pythons
        output = partial.decode(errors="replace") if isinstance(partial, bytes) else (partial or "")
        returncode = -1
        record["error"] = f"timed out after {options.timeout_s:g} s"
    with log_path.open("a") as log_file:
        log_file.write("\n--- stdout ---\n" + output)
    record["wall_s"] = round(time.perf_counter() - clock, 2)
    record["returncode"] = returncode
    try:
        record["metrics"] = parse_result_line(output, experiment.name)
    except ValueError as exc:
        record.setdefault("error", str(exc))
    if returncode != 0:
        record.setdefault("error", f"exit code {returncode}")
    if "error" in record:
        record["log_tail"] = log_path.read_text()[-4000:]
    if json_path.exists():
        record["payload"] = json.loads(json_path.read_text())
        json_path.unlink()
    record["ok"] = "error" not in record
    write_json(results_dir / f"{experiment.name}.json", record)
    return record


def run_all(
    experiments: Sequence[Experiment],
    options: RunOptions,
    on_progress: Callable[[Experiment, dict[str, Any] | None], None] | None = None,
) -> list[dict[str, Any]]:
    """Run ``experiments`` one after the other, each owning the machine while it runs (``options.jobs`` at
    a time for a tiny run); ``on_progress`` is called before each (record None) and after it (its record).
    The records come back in the order of ``experiments``. A measured size holds the machine
    (`machine_lock.exclusive_machine`: `MachineBusyError` when another measured run does)."""
    with contextlib.nullcontext() if options.size == "tiny" else exclusive_machine(options.lock_path):
        return _run_all(experiments, options, on_progress)


def _run_all(
    experiments: Sequence[Experiment],
    options: RunOptions,
    on_progress: Callable[[Experiment, dict[str, Any] | None], None] | None,
) -> list[dict[str, Any]]:
    machine = machine_info()

    def run(experiment: Experiment) -> dict[str, Any]:
        if on_progress is not None:
            on_progress(experiment, None)
        record = run_one(experiment, options, machine)
        if on_progress is not None:
            on_progress(experiment, record)
        return record

    if options.jobs == 1:
        return [run(e) for e in experiments]
    # Threads only wait on the scripts' processes; each script is its own process.
    with ThreadPoolExecutor(max_workers=options.jobs, thread_name_prefix="bench-run") as pool:
        return list(pool.map(run, experiments))


CPU_KINDS_DIR = "cpu_kinds"  # under the results folder: runs of an experiment on other kinds of CPU


def load_cpu_kinds(results_dir: Path = RESULTS_DIR) -> dict[str, list[dict[str, Any]]]:
    """Records of experiments run on other kinds of CPU than their main record's (AVX2-only, AMX, ...):
    ``<results>/cpu_kinds/<experiment>-<kind>.json``, each a runner record copied there, by experiment
    name and in file name order. The main record keeps one machine's figures; these sit beside it."""
    folder = results_dir / CPU_KINDS_DIR
    kinds: dict[str, list[dict[str, Any]]] = {}
    for experiment in EXPERIMENTS:
        for path in sorted(folder.glob(f"{experiment.name}-*.json")):
            kinds.setdefault(experiment.name, []).append(json.loads(path.read_text()))
    return kinds


def load_records(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """Every experiment's latest record in ``results_dir``, by name (experiments never run are absent)."""
    records = {}
    for experiment in EXPERIMENTS:
        path = results_dir / f"{experiment.name}.json"
        if path.exists():
            records[experiment.name] = json.loads(path.read_text())
    return records
