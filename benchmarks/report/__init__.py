"""The results page: ``docs/benchmarks.md`` and its plots, rendered from the runner's results files only.

Every figure of ours on the page is read from ``benchmarks/results/<name>.json`` (what the runner
measured); the paper's figures come from `benchmarks.experiments`, labelled as the paper's. Plots: a
summary of the headline ratios against the paper's, one bar chart of each experiment's headline metrics,
and each experiment's own figure where its script defines ``plot(payload, path)``.

Checks: a headline metric whose registry label states a goal (``"... (goal >= 1.5)"``) and a record that
stores a tolerance (``max_error`` and ``tolerance``, as ``sim_validation`` does) are flagged pass or fail in
the tables and the summary plot; nothing else is held to a goal. The summary plot is computed
(`summary_rows`, pure) apart from drawn (`draw_summary`), so what it shows is testable without pixels.

The parts, one job each: `goals` (goals, tolerances, the paper's figures), `spreads` (a ratio's min-max
over repeats found in a payload), `page` (the markdown), `headline_plot` and `summary_plot` (the figures),
`files` (writing the plots and the page).
"""

from benchmarks.report.files import DOCS_DIR, PAGE, write_plots, write_report
from benchmarks.report.goals import (
    Check,
    Goal,
    checks,
    metric_goal,
    paper_range,
    plain_label,
    tolerance_check,
)
from benchmarks.report.headline_plot import plot_headline
from benchmarks.report.page import SUMMARY_CAPTION, fmt_metric, headline, render_page
from benchmarks.report.spreads import as_printed, spread_candidates, stored_spread
from benchmarks.report.summary_plot import (
    SummaryRow,
    axis_limits,
    draw_summary,
    plot_summary,
    summary_rows,
)

__all__ = [
    "DOCS_DIR",
    "PAGE",
    "SUMMARY_CAPTION",
    "Check",
    "Goal",
    "SummaryRow",
    "as_printed",
    "axis_limits",
    "checks",
    "draw_summary",
    "fmt_metric",
    "headline",
    "metric_goal",
    "paper_range",
    "plain_label",
    "plot_headline",
    "plot_summary",
    "render_page",
    "spread_candidates",
    "stored_spread",
    "summary_rows",
    "tolerance_check",
    "write_plots",
    "write_report",
]
