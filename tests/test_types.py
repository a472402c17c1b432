"""The type check: mypy over the service, the client, the adapters and the kernels (``[tool.mypy]`` in
pyproject.toml) finds no error. Run it alone with ``python -m mypy``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_no_error() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--no-error-summary"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
