"""The page's files: every plot the records allow into ``docs/img``, then ``docs/benchmarks.md``."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.experiments import EXPERIMENTS
from benchmarks.harness.machine import REPO_ROOT
from benchmarks.report.headline_plot import plot_headline
from benchmarks.report.page import render_page
from benchmarks.report.summary_plot import plot_summary

DOCS_DIR = REPO_ROOT / "docs"
PAGE = "benchmarks.md"


def write_plots(records: Mapping[str, Mapping[str, Any]], img_dir: Path) -> dict[str, list[str]]:
    """Every plot the records allow, as paths relative to the docs folder, by experiment (and "summary")."""
    img_dir.mkdir(parents=True, exist_ok=True)
    rel = img_dir.name
    out: dict[str, list[str]] = {}
    if plot_summary(records, img_dir / "summary.png"):
        out["summary"] = [f"{rel}/summary.png"]
    for e in EXPERIMENTS:
        record = records.get(e.name)
        if not record or not record.get("ok"):
            continue
        images = []
        module = importlib.import_module(e.module)
        custom = getattr(module, "plot", None)
        if custom is not None and "payload" in record:
            custom(record["payload"], img_dir / f"{e.name}.png")
            images.append(f"{rel}/{e.name}.png")
        if plot_headline(e, record, img_dir / f"{e.name}_headline.png"):
            images.append(f"{rel}/{e.name}_headline.png")
        out[e.name] = images
    return out


def write_report(
    records: Mapping[str, Mapping[str, Any]],
    docs_dir: Path = DOCS_DIR,
    gpu: Mapping[str, Any] | None = None,
    cpu_kinds: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> Path:
    """Write the plots into ``docs_dir/img`` and the page into ``docs_dir/benchmarks.md`` (with the GPU
    record's section and the runs on other kinds of CPU when given); return its path."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(records, docs_dir / "img")
    page = docs_dir / PAGE
    page.write_text(render_page(records, plots, gpu, cpu_kinds))
    return page
