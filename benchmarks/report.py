"""The results page: ``docs/benchmarks.md`` and its plots, rendered from the runner's results files only.

Every figure of ours on the page is read from ``benchmarks/results/<name>.json`` (what the runner
measured); the paper's figures come from `benchmarks.experiments`, labelled as the paper's. Plots: a
summary of the headline ratios against the paper's, one bar chart of each experiment's headline metrics,
and each experiment's own figure where its script defines ``plot(payload, path)``.

Checks: a headline metric whose registry label states a goal (``"... (goal >= 1.5)"``) and a record that
stores a tolerance (``max_error`` and ``tolerance``, as ``sim_validation`` does) are flagged pass or fail in
the tables and the summary plot; nothing else is held to a goal. The summary plot is computed
(`summary_rows`, pure) apart from drawn (`draw_summary`), so what it shows is testable without pixels.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import gpu_report
from benchmarks.common import REPO_ROOT, markdown_table
from benchmarks.experiments import EXPERIMENTS, Experiment, Metric
from benchmarks.plotting import pyplot, save

DOCS_DIR = REPO_ROOT / "docs"
PAGE = "benchmarks.md"


def paper_range(text: str | None) -> tuple[float, float] | None:
    """The number (or ``lo-hi`` range) a paper figure like ``"1.38-1.88x"`` or ``"12x"`` states."""
    if not text:
        return None
    match = re.fullmatch(r"\s*([\d.]+)(?:\s*-\s*([\d.]+))?\s*x?\s*", text)
    if match is None:
        return None
    lo = float(match.group(1))
    return lo, float(match.group(2) or lo)


def fmt_metric(value: float | None, unit: str) -> str:
    """A metric for the tables: two decimals (none from 100 up) and its unit; ``n/a`` when it has no value."""
    if value is None or not math.isfinite(value):
        return "n/a"
    digits = 2 if abs(value) < 100 else 0
    return f"{value:.{digits}f}{unit}"


def _finite(value: Any) -> bool:
    # A metric with no value is stored as null (`write_json`), and NaN survives as NaN.
    return isinstance(value, int | float) and math.isfinite(value)


# ------------------------------------------------------------------------------------------------ checks
@dataclass(frozen=True)
class Goal:
    """A goal a headline metric is held to, as its registry label states it: ``(goal >= 1.5)``,
    ``(goal <= 1.10)``, ``(goal 1.42)`` (a figure to reach: at least it) or ``(goal 1.1-1.7)`` (a range to
    reach: at least its low end; beating a speedup range is no failure)."""

    lo: float | None  # at least this (None: no lower bound)
    hi: float | None  # at most this (None: no upper bound)
    text: str  # as stated, for the page ("≥ 1.5", "1.1-1.7")

    def met(self, value: float) -> bool:
        """Whether ``value`` meets the goal."""
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)

    @property
    def is_speedup(self) -> bool:
        """A lower bound of at least 1x: a speedup to reach, which the summary plot can draw on its axis."""
        return self.lo is not None and self.lo >= 1.0 and self.hi is None


_GOAL = re.compile(r"\(goal\s+(?:(>=|<=)\s*([\d.]+)|([\d.]+)(?:\s*-\s*([\d.]+))?)\s*\)")


def metric_goal(metric: Metric) -> Goal | None:
    """The goal ``metric``'s label states (``"... (goal >= 1.5)"``), or None: no goal is assumed."""
    match = _GOAL.search(metric.label)
    if match is None:
        return None
    op, bound, lo, hi = match.groups()
    if op == ">=":
        return Goal(float(bound), None, f"≥ {bound}")
    if op == "<=":
        return Goal(None, float(bound), f"≤ {bound}")
    return Goal(float(lo), None, f"{lo}-{hi}" if hi else f"≥ {lo}")


def plain_label(metric: Metric) -> str:
    """``metric``'s label without its ``(goal ...)`` note (the plot draws the goal instead)."""
    return _GOAL.sub("", metric.label).strip()


@dataclass(frozen=True)
class Check:
    """One verdict on a record: a metric against its goal, or an error against the stored tolerance."""

    key: str  # the metric checked
    passed: bool
    text: str  # for the summary table: "✗ speedup 0.984, goal ≥ 1.42"
    short: str  # for the metric's own row: "✗ goal ≥ 1.42"


def tolerance_check(metrics: Mapping[str, Any]) -> Check | None:
    """``max_error`` against the record's own ``tolerance`` (sim_validation's convention), or None when the
    record stores no tolerance. The script's ``within`` verdict wins where stored: it compared unrounded
    figures, the RESULT line keeps three digits."""
    error, tolerance = metrics.get("max_error"), metrics.get("tolerance")
    if not (_finite(error) and _finite(tolerance)):
        return None
    within = metrics.get("within")
    passed = bool(within) if _finite(within) else error <= tolerance
    bound = f"{'within' if passed else 'above'} tolerance {tolerance * 100:.3g}%"
    return Check(
        "max_error",
        passed,
        f"{_mark(passed)} max error {error * 100:.3g}% {bound}",
        f"{_mark(passed)} {bound}",
    )


def _mark(passed: bool) -> str:
    return "✓" if passed else "✗"


def checks(e: Experiment, record: Mapping[str, Any] | None) -> list[Check]:
    """Every goal and tolerance verdict ``record`` allows: none for a missing or failed run, and none for a
    metric with no goal stated or no value measured."""
    if not record or not record.get("ok"):
        return []
    metrics = record.get("metrics", {})
    out = []
    for m in e.metrics:
        goal, value = metric_goal(m), metrics.get(m.key)
        if goal is not None and _finite(value):
            passed = goal.met(value)
            mark = _mark(passed)
            text = f"{mark} {m.key} {value:.3g}, goal {goal.text}"
            out.append(Check(m.key, passed, text, f"{mark} goal {goal.text}"))
    tolerance = tolerance_check(metrics)
    return out if tolerance is None else [*out, tolerance]


# ----------------------------------------------------------------------------------------------- spreads
# The payload keys under which the scripts store a ratio's spread over repeats; latencies in seconds carry
# the same {median, min, max} shape, so a spread counts only below a key like these.
_RATIO_KEY = re.compile(r"speedup|ratio", re.IGNORECASE)


def as_printed(value: float) -> float:
    """``value`` as a ``RESULT`` line prints it (`benchmarks.common.result_line`: 3 significant digits)."""
    return float(f"{value:.3g}") if abs(value) < 1000 else float(f"{value:.0f}")


def spread_candidates(node: Any, ratio_path: bool = False) -> Iterator[tuple[float, float, float]]:
    """Every ``(median, min, max)`` of a ratio stored in ``node``: a ``Spread`` dict (``{"median", "min",
    "max"}``, ``"n"`` at least 2 where stored) below a speedup/ratio key, or a ``"<key>": x`` with its
    ``"<key>_range": [lo, hi]``."""
    if isinstance(node, Mapping):
        stats = [node.get(k) for k in ("median", "min", "max")]
        # A "spread" of one sample (``n`` 1: one seed) has no range to show.
        repeated = not _finite(node.get("n")) or node["n"] >= 2
        if ratio_path and repeated and all(_finite(v) for v in stats):
            yield stats[0], stats[1], stats[2]
        for key, value in node.items():
            base = str(key).removesuffix("_range")
            if (
                str(key).endswith("_range")
                and _RATIO_KEY.search(base)
                and _finite(node.get(base))
                and isinstance(value, list)
                and len(value) == 2
                and all(_finite(v) for v in value)
            ):
                yield node[base], value[0], value[1]
            yield from spread_candidates(value, ratio_path or bool(_RATIO_KEY.search(str(key))))
    elif isinstance(node, list):
        for item in node:
            yield from spread_candidates(item, ratio_path)


def stored_spread(payload: Any, value: float) -> tuple[float, float] | None:
    """The min-max over repeats that ``payload`` stores for the ratio its RESULT line printed as ``value``:
    the spread whose median prints the same. None when none does, or when distinct spreads do (a wrong
    whisker would be worse than none)."""
    found = {(lo, hi) for median, lo, hi in spread_candidates(payload) if as_printed(median) == value}
    return next(iter(found)) if len(found) == 1 else None


def headline(experiment: Experiment, record: Mapping[str, Any] | None) -> str:
    """The experiment's headline metrics as measured (``label value``), or why there are none."""
    if record is None:
        return "not run"
    if not record.get("ok"):
        return f"**failed**: {record.get('error', 'unknown error')}"
    metrics = record.get("metrics", {})
    shown = [m for m in experiment.metrics if m.key in metrics] or [
        Metric(key, key) for key in list(metrics)[:3]
    ]
    return "; ".join(f"{m.label} **{fmt_metric(metrics[m.key], m.unit)}**" for m in shown)


def _commit(record: Mapping[str, Any]) -> str:
    git = record.get("machine", {}).get("git", {})
    commit = (git.get("commit") or "unknown")[:10]
    return commit + (" (dirty)" if git.get("dirty") else "")


def _machine(record: Mapping[str, Any]) -> str:
    m = record.get("machine", {})
    device = m.get("cuda") or f"{m.get('cpu_model', '?')}, {m.get('usable_cores', '?')} cores"
    return f"{device}; torch {m.get('torch', '?')}; load {m.get('load_average_1m', '?')}"


SUMMARY_CAPTION = (
    "*The plot:* one row per headline ratio for which the paper states a figure or the registry a "
    "speedup goal, on a log axis (labelled ticks: 0.5x, 1x, 2x, 5x, 10x). Bars run from the 1x line, the "
    "baseline, to our value: left of it Parrot was slower; orange: below its goal. Black whiskers: the "
    "lowest and highest ratio over the run's repeats, where the results file stores them (a row without "
    "whiskers ran once, is a deterministic simulation, or stores no per-repeat spread). Red: the paper's "
    "figure (a diamond) or range (a bar); green tick: our goal (a range's low end). On the right: ours "
    "(min-max), the paper's, the goal and ✓ / ✗."
)


def _spread_cell(record: Mapping[str, Any], value: Any) -> str:
    spread = stored_spread(record.get("payload"), value) if _finite(value) else None
    return "" if spread is None else f"{fmt_metric(spread[0], '')}-{fmt_metric(spread[1], '')}"


def render_page(
    records: Mapping[str, Mapping[str, Any]],
    plots: Mapping[str, Sequence[str]],
    gpu: Mapping[str, Any] | None = None,
) -> str:
    """The markdown page: the summary table, a section per experiment, then the GPU run's (`gpu_report`)."""
    lines = [
        "# Benchmarks: the Parrot paper's evaluation, side by side",
        "",
        "Generated by `python -m benchmarks run` (or `python -m benchmarks report`) from",
        "`benchmarks/results/*.json`; do not edit by hand. Every figure of ours below was measured by that",
        "runner, as a ratio of Parrot against the request-centric baseline measured in the same run on",
        'the same engine code (DESIGN.md, "How performance is measured"). The *Paper* column quotes the',
        "Parrot paper (OSDI'24, section 8). Absolute times are CPU or simulated times, never GPU claims:",
        "real-engine rows run the embedded tiny LLaMA on CPU; simulator rows are virtual seconds of a",
        "latency profile. The last section, [gpu](#gpu), is the one measured on a GPU (`python -m",
        "benchmarks.gpu` on a lent H100).",
        "",
        "The *Goal / tolerance* column holds each run to what is stored for it: a goal its headline",
        "metric's label states in `benchmarks/experiments.py` (`(goal >= 1.5)`; a range counts as reached",
        "at its low end) and a tolerance its results file stores (`max_error` vs `tolerance`); ✗ marks a",
        "miss, — an experiment with neither.",
        "",
    ]
    sizes = sorted({r.get("size", "?") for r in records.values()})
    if sizes:
        lines += [
            f"Sizes in this page: {', '.join(sizes)} (`--quick` figures are smaller, noisier runs).",
            "",
        ]
    rows = []
    for e in EXPERIMENTS:
        record = records.get(e.name)
        size = record.get("size", "?") if record else "—"
        verdicts = "; ".join(c.text for c in checks(e, record)) or "—"
        rows.append(
            [f"[{e.name}](#{e.name})", e.figure, e.paper, headline(e, record), verdicts, e.conditions, size]
        )
    headers = ["Experiment", "Paper figure", "Paper", "Ours", "Goal / tolerance", "Conditions", "Size"]
    lines += [markdown_table(headers, rows, [False] * len(headers)), ""]
    if "summary" in plots:
        lines += [f"![headline ratios, ours vs the paper's]({plots['summary'][0]})", "", SUMMARY_CAPTION, ""]
    for e in EXPERIMENTS:
        lines += _section(e, records.get(e.name), plots.get(e.name, ()))
    if gpu is not None:
        lines += gpu_report.section(gpu)
    return "\n".join(lines).rstrip() + "\n"


def _section(e: Experiment, record: Mapping[str, Any] | None, images: Sequence[str]) -> list[str]:
    lines = [
        f"## {e.name}",
        "",
        f"**{e.title}** — paper {e.figure}: {e.paper}.",
        "",
        f"Conditions: {e.conditions}.",
    ]
    if record is None:
        return [*lines, "", "Not run yet: `python -m benchmarks run " + e.name + "`.", ""]
    lines += [
        "",
        f"Command: `{record.get('command', '?')}` · size {record.get('size')} · "
        f"{record.get('started_at', '?')} · commit `{_commit(record)}` · "
        f"wall {record.get('wall_s', '?')} s · engines {record.get('engines', '?')}",
        "",
        f"Machine: {_machine(record)}.",
        "",
    ]
    model = record.get("model", {})
    if "simulated" in model:
        lines += [
            f"Simulated GPU: profile `{model['simulated']['profile']}` ({model['simulated']['source']}).",
            "",
        ]
    if "config" in model:
        c = model["config"]
        keys = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
        desc = ", ".join(f"{k}={c[k]}" for k in keys if k in c)
        lines += [f"Model: `{model.get('engine_model')}` ({desc}).", ""]
    if not record.get("ok"):
        tail = "\n".join(str(record.get("log_tail", "")).splitlines()[-15:])
        return [*lines, f"**Failed**: {record.get('error')}", "", "```", tail, "```", ""]
    metrics = record.get("metrics", {})
    paper = {m.key: m.paper for m in e.metrics}
    verdicts = {c.key: c.short for c in checks(e, record)}
    table = [
        [k, fmt_metric(v, ""), _spread_cell(record, v), paper.get(k) or "", verdicts.get(k, "")]
        for k, v in metrics.items()
    ]
    headers = ["RESULT metric", "Ours", "Spread (min-max)", "Paper", "Goal / tolerance"]
    lines += [markdown_table(headers, table, [False, True, True, True, False]), ""]
    lines += [f"![{e.name}]({image})" for image in images]
    return [*lines, ""]


# ----------------------------------------------------------------------------------------------- plots
def plot_headline(e: Experiment, record: Mapping[str, Any], path: Path) -> bool:
    """Bars of the experiment's headline metrics, with the paper's value (or range) where it states one."""
    metrics = record.get("metrics", {})
    # A metric with no value is stored as null (`write_json`): not plotted.
    shown = [m for m in e.metrics if metrics.get(m.key) is not None and math.isfinite(metrics[m.key])]
    if not shown:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(shown), 3.2))
    xs = range(len(shown))
    ax.bar(xs, [metrics[m.key] for m in shown], color="tab:blue", label="ours")
    for x, m in zip(xs, shown, strict=True):
        span = paper_range(m.paper)
        if span is not None:
            ax.plot(
                [x - 0.4, x + 0.4], [span[1]] * 2, color="tab:red", lw=2, label="paper" if x == 0 else None
            )
            if span[0] != span[1]:
                ax.fill_between([x - 0.4, x + 0.4], span[0], span[1], color="tab:red", alpha=0.2)
    ax.set_xticks(list(xs), [m.label for m in shown], rotation=20, ha="right", fontsize=8)
    ax.set_title(f"{e.name} ({e.figure})", fontsize=9)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.legend(fontsize=7)
    save(fig, path)
    return True


@dataclass(frozen=True)
class SummaryRow:
    """One headline ratio in the summary plot: ours, its stored spread, the paper's figure, our goal."""

    experiment: str
    label: str
    value: float
    spread: tuple[float, float] | None  # min-max over the run's repeats, where the results file stores it
    paper: tuple[float, float] | None  # the paper's figure (lo == hi) or range
    goal: Goal | None  # a speedup goal (at least ``goal.lo``)

    @property
    def passed(self) -> bool | None:
        """Whether ours meets the goal; None without one."""
        return None if self.goal is None else self.goal.met(self.value)


def summary_rows(
    records: Mapping[str, Mapping[str, Any]], experiments: Sequence[Experiment] = EXPERIMENTS
) -> list[SummaryRow]:
    """The summary plot's rows, in the paper's order: every headline ratio (unit ``x``) measured by a
    successful run for which the paper states a figure or the registry a speedup goal. Goals below 1x or
    upper bounds (a fraction, a ratio to stay under) are not speedups over a baseline: tables only."""
    rows = []
    for e in experiments:
        record = records.get(e.name)
        if not record or not record.get("ok"):
            continue
        metrics = record.get("metrics", {})
        for m in e.metrics:
            value, paper, goal = metrics.get(m.key), paper_range(m.paper), metric_goal(m)
            speedup_goal = goal if goal is not None and goal.is_speedup else None
            if m.unit != "x" or not _finite(value) or (paper is None and speedup_goal is None):
                continue
            spread = stored_spread(record.get("payload"), value)
            rows.append(SummaryRow(e.name, plain_label(m), value, spread, paper, speedup_goal))
    return rows


# Labelled ticks of the log axis: the reader reads 0.5x, 1x, 2x off it without counting minor ticks.
_TICKS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


def axis_limits(rows: Sequence[SummaryRow]) -> tuple[float, float]:
    """The x range that holds every bar, whisker, paper mark and goal, and the 1x baseline, with margin."""
    xs = [1.0]
    for r in rows:
        xs += [r.value, *(r.spread or ()), *(r.paper or ())]
        if r.goal is not None and r.goal.lo is not None:
            xs.append(r.goal.lo)
    lo, hi = min(xs) / 1.15, max(xs) * 1.3
    # Down to a labelled tick, so a ratio below 1x is read against one (0.5x) as well as the 1x line.
    return max([t for t in _TICKS if t <= lo] or [lo]), hi


def _right_label(r: SummaryRow) -> str:
    text = f"{r.value:.2f}x"
    if r.spread is not None:
        text += f" ({r.spread[0]:.2f}-{r.spread[1]:.2f})"
    if r.paper is not None:
        lo, hi = r.paper
        text += f" · paper {lo:g}x" if lo == hi else f" · paper {lo:g}-{hi:g}x"
    if r.goal is not None:
        text += f" · goal {r.goal.text} {_mark(bool(r.passed))}"
    return text


def draw_summary(rows: Sequence[SummaryRow]) -> Any:
    """The summary figure of ``rows``: one horizontal bar each, top to bottom, from the 1x baseline to ours,
    with the stored spread as whiskers, the paper's figure and our goal as marks, the values on the right."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import NullFormatter

    n = len(rows)
    # Sized to the rows, so labels never overlap: about a third of an inch a row, plus title and legend.
    fig, ax = plt.subplots(figsize=(12, 1.9 + 0.34 * n))
    ys = list(range(n))
    # Bars start at the 1x baseline: a ratio below 1x (Parrot slower than what it is compared with) points
    # left of it instead of looking like a shorter win.
    colors = ["tab:orange" if r.passed is False else "tab:blue" for r in rows]
    ax.barh(ys, [r.value - 1.0 for r in rows], left=1.0, height=0.55, color=colors, zorder=2)
    spread = [(y, r.value, r.spread) for y, r in zip(ys, rows, strict=True) if r.spread is not None]
    if spread:
        ax.errorbar(
            [value for _, value, _ in spread],
            [y for y, _, _ in spread],
            # The printed value has three digits, so it may sit a hair outside a narrow spread: clamp.
            xerr=[[max(0.0, v - s[0]) for _, v, s in spread], [max(0.0, s[1] - v) for _, v, s in spread]],
            fmt="none",
            ecolor="black",
            elinewidth=1,
            capsize=3,
            zorder=4,
        )
    for y, r in zip(ys, rows, strict=True):
        if r.paper is not None and r.paper[0] == r.paper[1]:
            ax.plot([r.paper[0]], [y], "D", color="tab:red", ms=6, zorder=5)
        elif r.paper is not None:
            ax.plot(r.paper, [y, y], "|-", color="tab:red", lw=2.5, ms=10, mew=2.5, zorder=5)
        if r.goal is not None and r.goal.lo is not None:
            ax.plot([r.goal.lo], [y], "|", color="tab:green", ms=18, mew=3, zorder=5)
    for y in range(1, n):  # a thin rule where the experiment changes keeps each one's rows together
        if rows[y].experiment != rows[y - 1].experiment:
            ax.axhline(y - 0.5, color="0.85", lw=0.8, zorder=1)
    ax.axvline(1.0, color="black", lw=1.2, zorder=3)
    ax.set_xscale("log")
    lo, hi = axis_limits(rows)
    ax.set_xlim(lo, hi)
    ticks = [t for t in _TICKS if lo <= t <= hi]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(axis="x", which="major", color="0.9", zorder=0)
    # Rows run top to bottom; the extra room above the first row holds the baseline's label.
    ax.set_ylim(n - 0.5, -1.3)
    ax.text(1.0, -0.85, " baseline", fontsize=8, va="center", ha="left")
    ax.set_yticks(ys, [f"{r.experiment}: {r.label}" for r in rows], fontsize=8)
    right = ax.twinx()
    right.set_ylim(ax.get_ylim())
    right.set_yticks(ys, [_right_label(r) for r in rows], fontsize=8)
    ax.set_xlabel("Parrot vs what it is compared with (x, log scale; right of 1x: Parrot better)", fontsize=9)
    # The legend names only the marks this figure has, each once.
    marks = [
        (True, Patch(color="tab:blue", label="ours")),
        (any(r.passed is False for r in rows), Patch(color="tab:orange", label="ours, below its goal")),
        (bool(spread), Line2D([], [], color="black", lw=1, marker="|", ms=8, label="min-max over repeats")),
        (
            any(r.paper and r.paper[0] == r.paper[1] for r in rows),
            Line2D([], [], color="tab:red", marker="D", ls="", label="paper"),
        ),
        (
            any(r.paper and r.paper[0] != r.paper[1] for r in rows),
            Line2D([], [], color="tab:red", lw=2.5, marker="|", ms=10, mew=2.5, label="paper's range"),
        ),
        (
            any(r.goal for r in rows),
            Line2D([], [], color="tab:green", marker="|", ms=14, mew=3, ls="", label="our goal"),
        ),
        (True, Line2D([], [], color="black", lw=1.2, label="1x: the baseline")),
    ]
    handles = [handle for shown, handle in marks if shown]
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Headline ratios: ours, the paper's figure, our goals", fontsize=10)
    return fig


def plot_summary(records: Mapping[str, Mapping[str, Any]], path: Path) -> bool:
    """Draw `summary_rows` of ``records`` to ``path``; False (nothing written) when there are none."""
    rows = summary_rows(records)
    if not rows:
        return False
    save(draw_summary(rows), path)
    return True


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
) -> Path:
    """Write the plots into ``docs_dir/img`` and the page into ``docs_dir/benchmarks.md`` (with the GPU
    record's section when given); return its path."""
    docs_dir.mkdir(parents=True, exist_ok=True)
    plots = write_plots(records, docs_dir / "img")
    page = docs_dir / PAGE
    page.write_text(render_page(records, plots, gpu))
    return page
