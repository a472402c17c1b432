"""The result record of one experiment run: command-line sizes, the report's header, the JSON payload and
the ``RESULT`` line (DESIGN.md, "How performance is measured").

    args = record.parser(__doc__, "8 map calls, 3 repeats (~1 min)").parse_args(argv)
    rec = Recorder(NAME, args, cfg)
    ...
    print(rec.header(model))
    rec.finish(metrics, config=cfg, settings=...)   # JSON (with --json), then the RESULT line, last
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from benchmarks.harness.flags import add_engine_flags, add_size_flags, int_list, set_threads, sized
from benchmarks.harness.machine import load_average, machine_info
from benchmarks.harness.measure import Ratio, Samples
from benchmarks.harness.output import markdown_table, result_line, write_json

__all__ = ["Recorder", "configured", "latency_table", "parser"]

Config = TypeVar("Config")


def parser(
    doc: str | None, quick_help: str, config: type | None = None, *, engine: bool = True, **flags: str
) -> argparse.ArgumentParser:
    """An experiment's argument parser: its docstring as help, ``--quick``/``--tiny``/``--json``, (for
    real-engine experiments) ``--model`` and ``--threads``, and one override per ``flags`` entry: a field
    of the ``config`` dataclass, as ``--field-name`` of the field's type, with the entry as its help."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_flags(p, quick_help)
    if engine:
        add_engine_flags(p)
    if flags:
        assert config is not None, "flags override fields of a config dataclass"
        types = {f.name: f.type for f in dataclasses.fields(config)}
        for name, help_text in flags.items():
            declared = types[name]  # a string under `from __future__ import annotations`
            kind = declared if isinstance(declared, type) else _FLAG_TYPES[str(declared)]
            p.add_argument("--" + name.replace("_", "-"), type=kind, help=help_text)
    return p


# Field types a flag can set; ``tuple[int, ...]`` takes ``"16,32,64"``.
_FLAG_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str, "tuple[int, ...]": int_list}


def configured(args: argparse.Namespace, full: Config, quick: Config, tiny: Config) -> Config:
    """The size ``args`` asks for, with every field flag of `parser` that was given."""
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(full)}  # type: ignore[arg-type]
    return sized(args, full, quick, tiny, **overrides)


class Recorder:
    """One run of an experiment: when it started, on what machine, and where its figures go."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.args = args
        self.started = time.perf_counter()
        if getattr(args, "threads", None):
            set_threads(args)  # before reading the machine: its record states the threads used
        self.machine = machine_info()

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def header(self, what: str) -> str:
        """The report's first line: the experiment, ``what`` it ran on (model, engines), the machine."""
        m = self.machine
        features = m.get("cpu_features") or {}
        flags = "/".join(features.get("flags") or ["no listed"])
        return (
            f"## {self.name} — {what}, {m['cpu_model']} ({flags} flags), {m['usable_cores']} cores, "
            f"torch {m['torch']} "
            f"({m['torch_threads']} threads), load average {m['load_average_1m']} at start\n"
        )

    def finish(self, metrics: Mapping[str, float | int], **payload: Any) -> None:
        """Write the JSON payload (with ``--json``: ``payload`` plus the benchmark's name, machine, load at
        the end and total seconds; dataclasses become dicts), then print the ``RESULT`` line, ending with
        ``total_s``."""
        total_s = self.elapsed_s
        if self.args.json:
            write_json(
                self.args.json,
                {
                    "benchmark": self.name,
                    **{k: _plain(v) for k, v in payload.items()},
                    "machine": self.machine,
                    "load_average_1m_at_end": load_average(),
                    "total_s": total_s,
                },
            )
        print(result_line(self.name, {**metrics, "total_s": total_s}))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


# One setting's row group of `latency_table`: its label (e.g. `systems.delay_label`), each system's samples,
# and each system's ratio to the reference (shown on that system's row).
LatencyRow = tuple[str, dict[str, Samples], dict[str, Ratio]]


def latency_table(
    settings: Sequence[tuple[str, Mapping[str, Samples], Mapping[str, Ratio]]],
    setting_header: str = "network delay",
) -> str:
    """Median job latency per setting and system, its range, requests per job, the engines' work per job
    and each system's ratio (``ratios`` by system name: e.g. the baseline's time over Parrot's, shown on
    Parrot's row)."""
    rows = []
    for setting, systems, ratios in settings:
        for name, s in systems.items():
            spread = s.spread
            rows.append(
                [
                    setting,
                    name,
                    f"{spread.median:.3f} ±{spread.rel_half_range:.0%}",
                    f"{spread.lo:.3f}-{spread.hi:.3f}",
                    "" if s.requests is None else str(s.requests),
                    f"{s.engine_median('steps'):.0f}",
                    f"{s.engine_median('prefill_tokens_computed'):.0f}",
                    f"{s.decode_per_step:.1f}",
                    str(ratios[name]) if name in ratios else "",
                ]
            )
    headers = [
        setting_header,
        "system",
        "latency s (median)",
        "range s",
        "requests/job",
        "engine steps",
        "prefill tokens",
        "decode tokens/step",
        "speedup",
    ]
    return markdown_table(headers, rows, [False, False, *([True] * 7)])


def setting_payload(
    delay: bool, samples: Mapping[str, Samples], ratios: Mapping[str, Ratio]
) -> dict[str, Any]:
    """One network-delay setting for the JSON payload: whether the delay was on, each ratio by system
    (`latency_table`'s speedup column) and every system's samples."""
    return {
        "network_delay": delay,
        "speedup": {name: r.as_dict() for name, r in ratios.items()},
        "clients": {name: s.as_dict() for name, s in samples.items()},
    }
