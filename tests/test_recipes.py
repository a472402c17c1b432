"""The recipes as a user runs them: one whose optional extra is missing says which pip command to run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_llamaindex_recipe_without_its_extra_names_the_pip_command() -> None:
    hide = "import sys, runpy; sys.modules['llama_index'] = None; "  # as if llama-index-core were absent
    run = f"runpy.run_path({str(ROOT / 'recipes' / 'llamaindex_query.py')!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", hide + run], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "pip install 'parrot-serve[llamaindex]'" in done.stderr
    assert "Traceback" not in done.stderr
