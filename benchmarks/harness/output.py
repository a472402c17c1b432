"""What a benchmark prints and writes: numbers and markdown tables on stdout, the ``RESULT`` line it ends
with, its JSON file, and progress on stderr — so stdout holds only the tables and the ``RESULT`` line."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def fmt_num(x: float, digits: int = 0) -> str:
    """Thousands-separated number, ``n/a`` for NaN."""
    if not math.isfinite(x):
        return "n/a"
    return f"{x:,.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A GitHub markdown table with padded columns (readable as plain text too)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        ("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(widths, right, strict=True)
    )
    return "\n".join([line(headers), rule + "|", *(line(r) for r in rows)])


def result_line(name: str, metrics: dict[str, float | int]) -> str:
    """The ``RESULT <name> k=v ...`` line every benchmark ends with."""

    def value(v: float | int) -> str:
        if isinstance(v, int):
            return str(v)
        return "nan" if not math.isfinite(v) else f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"

    return f"RESULT {name} " + " ".join(f"{k}={value(v)}" for k, v in metrics.items())


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON (NaN becomes null: strict JSON readers reject NaN)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean(payload), indent=2) + "\n")


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the tables and the RESULT line."""
    print(message, file=sys.stderr, flush=True)


def quiet_transformers() -> None:
    """Show only transformers' errors: a benchmark tokenizes long texts on purpose (whole workloads), which
    its warning about sequences longer than the model's window would otherwise flag every time."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
