"""The package as users install it: a wheel (not the editable install the tests otherwise run on) works the
same, its console scripts included, and an install without an extra says in one line what to install.

The wheel is built from a copy of this checkout (so that no ``build/`` lands in it) and installed with
``--no-deps`` into a fresh virtualenv that also sees this interpreter's packages, as with
``--system-site-packages`` (torch & co. are not installed again). Everything then runs from a temporary
folder outside the checkout, with the venv's own interpreter and scripts: the installed package, never the
checkout, must be what is imported and what finds its data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import parrot as P
import pytest

from server.common.security import CLUSTER_TOKEN_ENV
from tests.processes import served_url, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("parrot-serve", "parrot-engine")


class Venv:
    """A virtualenv holding the wheel, and a clean environment to run its programs in."""

    def __init__(self, path: Path, home: Path) -> None:
        self.path = path
        self.bin = path / "bin"
        self.python = self.bin / "python"
        self.site_packages = Path(
            subprocess.check_output(
                [self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
            ).strip()
        )
        # No PYTHONPATH (it could put the checkout first); a token from the environment, no token file
        # written under the home folder.
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env |= {CLUSTER_TOKEN_ENV: "t" * 32, "PARROT_CACHE_DIR": str(home / "cache")}

    def run(self, code: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run ``code`` with the venv's interpreter in ``cwd``; fail the test on a non-zero exit."""
        done = subprocess.run(
            [self.python, "-c", textwrap.dedent(code)],
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    # Dot folders (.git, caches), build outputs and bytecode stay behind: the wheel is what pyproject.toml
    # packages, from the files as they are.
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "dist")
    )
    pip = [sys.executable, "-m", "pip"]
    # An absolute path: pip takes a bare relative name for a package to look up in the index.
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"), str(source)],
        check=True,
        timeout=300,
    )
    (wheel,) = (root / "dist").glob("parrot_serve-*.whl")
    path = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    venv = Venv(path, root)
    # The venv sees this interpreter's packages after its own, as --system-site-packages would — but those
    # of this interpreter whether it is the system's or itself a venv's (then the flag would skip them).
    # addsitedir also runs their .pth files, the editable install's included: the venv must win over it.
    ours = [entry for entry in sys.path if entry.endswith(("site-packages", "dist-packages"))]
    (venv.site_packages / "parent_packages.pth").write_text(
        "".join(f"import site; site.addsitedir({entry!r})\n" for entry in ours)
    )
    subprocess.run(
        [*pip, "--python", str(venv.python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=300,
    )
    return venv


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working folder outside the checkout."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


def test_the_wheel_not_the_checkout_is_imported(venv: Venv, elsewhere: Path) -> None:
    """The editable install is in the system site-packages this venv also sees: the venv's own comes first."""
    out = venv.run(
        """
        import importlib

        for name in ("benchmarks", "kernels", "langchain_parrot", "llamaindex_parrot", "parrot", "server"):
            print(importlib.import_module(name).__file__)
        print(importlib.import_module("workload_text").__file__)
        """,
        elsewhere,
    ).stdout.split()
    assert len(out) == 7
    for file in out:
        assert Path(file).is_relative_to(venv.site_packages), file
    for script in SCRIPTS:
        assert (venv.bin / script).is_file()


def test_the_console_script_serves_the_tiny_model(venv: Venv, elsewhere: Path) -> None:
    """``parrot-serve --model tiny --port 0`` from a folder whose own ``server.py`` `python -m server` would
    run instead: the script serves, on the port it logs, its worker processes (transforms) start too, and the
    live view's page is there."""
    (elsewhere / "server.py").write_text("raise SystemExit('the wrong server.py ran')\n")
    log = elsewhere / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [venv.bin / "parrot-serve", "--model", "tiny", "--port", "0"],
            cwd=elsewhere,
            env=venv.env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        # The engine builds the C++ kernels from the wheel's own sources before it serves: a cold build,
        # 75-90 s on two cores.
        url = served_url(proc, log, timeout=300)
        wait_healthy(proc, url)
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        say = P.SemanticFunction.from_template(
            "Say: {{output:o}}",
            sampling=P.SamplingConfig(max_tokens=4, ignore_eos=True),
            transforms={"o": [P.transforms.strip()]},
        )
        with P.Session(url, timeout=60):
            assert isinstance(say().get(), str)  # the transform worker process did not import server.py
        for page in ("/ui", "/ui/ui.js", "/ui/ui.css"):  # the live view's files ship in the wheel
            assert httpx.get(f"{url}{page}", timeout=10).status_code == 200, page
    finally:
        stop(proc)


def test_the_simulator_loads_its_shipped_profile_and_runs(venv: Venv, elsewhere: Path) -> None:
    out = venv.run(
        """
        from pathlib import Path

        import parrot as P
        from server.sim import load_profile, profile_names, run, sim_cluster
        from server.sim.latency import PROFILES_DIR

        print(PROFILES_DIR)
        assert {"a100-llama7b", "a100-llama13b"} <= set(profile_names())
        gpu = load_profile("a100-llama7b")
        write = P.SemanticFunction.from_template(
            "Write about {{input:x}}: {{output:y}}", sampling=P.SamplingConfig(max_tokens=8, ignore_eos=True)
        )

        async def main():
            async with sim_cluster(1, gpu) as cluster, P.Session(cluster.url, client=cluster.client):
                return await write(x="rivers").aget()

        assert run(main())
        """,
        elsewhere,
    ).stdout
    assert Path(out.strip()).is_relative_to(venv.site_packages)


def test_the_tiny_chat_format_is_found_in_the_installed_package(venv: Venv, elsewhere: Path) -> None:
    out = venv.run(
        """
        from langchain_parrot import TINY_MODEL_DIR, ChatFormat

        print(TINY_MODEL_DIR)
        rendered = ChatFormat.from_pretrained(TINY_MODEL_DIR).render([{"role": "user", "content": "hi"}])
        assert "hi" in rendered, rendered
        """,
        elsewhere,
    ).stdout
    assert Path(out.strip()).is_relative_to(venv.site_packages)


def test_the_benchmark_runner_writes_under_the_current_folder(venv: Venv, elsewhere: Path) -> None:
    venv.run("import sys; from benchmarks.__main__ import main; sys.exit(main(['report']))", elsewhere)
    assert (elsewhere / "docs" / "benchmarks.md").is_file()
    assert not (venv.site_packages / "docs").exists()


# A meta-path finder hiding packages named in $HIDE, as if not installed; loaded at start-up by `site`.
_HIDE = """
import os, sys

class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in os.environ["HIDE"].split(","):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hide())
"""


@pytest.mark.parametrize(
    ("hidden", "command", "extra"),
    [
        ("fastapi", ["parrot-serve", "--model", "tiny"], "server"),
        ("torch", ["parrot-serve"], "server"),
        ("torch", ["parrot-engine", "--model", "tiny"], "server"),
        ("torch", ["-m", "server"], "server"),
        # imported as a package before its __main__ runs: an ImportError whose message says what to install
        ("torch", ["-m", "server.engine", "--model", "tiny"], "server"),
        ("langchain_core", ["-c", "import langchain_parrot"], "langchain"),
        ("llama_index", ["-c", "import llamaindex_parrot"], "llamaindex"),
    ],
)
def test_a_missing_extra_is_one_line_naming_what_to_install(
    venv: Venv, elsewhere: Path, hidden: str, command: list[str], extra: str
) -> None:
    (elsewhere / "hide").mkdir()
    (elsewhere / "hide" / "sitecustomize.py").write_text(_HIDE)
    argv = (
        [str(venv.bin / command[0]), *command[1:]] if command[0] in SCRIPTS else [str(venv.python), *command]
    )
    env = venv.env | {"PYTHONPATH": str(elsewhere / "hide"), "HIDE": hidden}
    done = subprocess.run(argv, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert f"pip install 'parrot-serve[{extra}]'" in lines[-1] and repr(hidden) in lines[-1], done.stderr
    if extra == "server" and command[:2] != ["-m", "server.engine"]:  # a command line: one line, no traceback
        assert len(lines) == 1, done.stderr
