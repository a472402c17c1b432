"""The command lines, `python -m server` (``parrot-serve``) and `python -m server.engine` (``parrot-engine``):
a wrong model or a port in use is one line and exit status 2 — the port checked before any model loads —,
``--port 0`` serves on a free port it logs, ``--help`` shows the defaults, and ``/health`` says whether an
engine is in service (200) or none is (503, the process up all the same)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server import launch
from server.__main__ import main as server_main
from server.cli import ready_lines
from server.common.security import CLUSTER_TOKEN_ENV
from server.engine import LLMEngine
from server.engine.__main__ import main as engine_main
from tests.processes import served_url, spawn_logged, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
MAINS: dict[str, Callable[[list[str]], int]] = {"server": server_main, "server.engine": engine_main}


@pytest.fixture(autouse=True)
def _token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster token from the environment: no token file is written under the home folder."""
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "t" * 32)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another server listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def _error_line(err: str, prog: str) -> str:
    """The only line of ``err`` (what the command printed on stderr), which must be ``prog``'s error."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.mark.parametrize("module", sorted(MAINS))
def test_a_command_line_mistake_is_answered_before_the_heavy_imports(module: str) -> None:
    """An unknown flag, a bad value and ``--help`` are answered by a parser built from light modules: the
    process never imports torch, transformers or the web framework (each such import costs seconds)."""
    probe = (
        "import sys, runpy\n"
        f"sys.argv = [{module!r}, *sys.argv[1:]]\n"
        "try:\n"
        f"    runpy.run_module({module!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    heavy = [m for m in ('torch', 'transformers', 'fastapi', 'starlette') if m in sys.modules]\n"
        "    print('exit', e.code, 'heavy', heavy)\n"
    )
    env = {**os.environ, CLUSTER_TOKEN_ENV: "t" * 32, "PYTHONMALLOC": "malloc", "OMP_WAIT_POLICY": "PASSIVE"}
    for argv, code in ((["--no-such-flag"], 2), (["--port", "many"], 2), (["--help"], 0)):
        run = subprocess.run(
            [sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=120, env=env
        )
        assert run.stdout.strip().splitlines()[-1] == f"exit {code} heavy []", (argv, run.stdout, run.stderr)


def test_a_wrong_model_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    """As the user sees it: a real process, nothing on stderr but its log lines and the one error line."""
    env = {**os.environ, CLUSTER_TOKEN_ENV: "t" * 32}
    run = subprocess.run(
        [sys.executable, "-m", "server", "--model", "no-such-model", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    problems = [line for line in run.stderr.splitlines() if not line.startswith("INFO ")]
    assert len(problems) == 1, run.stderr
    assert problems[0].startswith("python -m server: error: model 'no-such-model' is not a known name")


@pytest.mark.parametrize("module", MAINS)
@pytest.mark.parametrize("model", ["no-such-model", "folder", "file.txt"])
def test_each_cli_names_a_model_it_cannot_load(
    module: str, model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "folder").mkdir()  # no config.json: not a Hugging Face model
    (tmp_path / "file.txt").write_text("not a model")
    name = model if model == "no-such-model" else str(tmp_path / model)
    with pytest.raises(SystemExit) as exited:
        MAINS[module](["--model", name, "--port", "0"])
    assert exited.value.code == 2
    line = _error_line(capsys.readouterr().err, f"python -m {module}")
    assert name in line


@pytest.mark.parametrize("module", MAINS)
def test_a_port_in_use_is_refused_before_the_model_loads(
    module: str, busy_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    loaded: list[Any] = []
    monkeypatch.setattr(LLMEngine, "from_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit) as exited:
        MAINS[module](["--model", "tiny", "--port", str(busy_port)])
    assert exited.value.code == 2
    line = _error_line(capsys.readouterr().err, f"python -m {module}")
    assert f"cannot listen on 127.0.0.1:{busy_port}" in line and "--port" in line
    assert not loaded, "the model loaded before the port was checked"


@pytest.mark.parametrize(("module", "port"), [("server", 9000), ("server.engine", 9100)])
def test_help_shows_the_defaults(module: str, port: int, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        MAINS[module](["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    assert f"(default: {port})" in text and "(default: 127.0.0.1)" in text
    assert "(default: None)" not in text  # an option with no default says what happens instead


def test_a_manager_with_no_engine_is_up_on_the_port_it_logs_and_health_says_503(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    env = {**os.environ, CLUSTER_TOKEN_ENV: "t" * 32}
    proc = spawn_logged([sys.executable, "-m", "server", "--engines", "0", "--port", "0"], log, env, ROOT)
    try:
        url = served_url(proc, log)
        assert not url.endswith(":0")
        wait_healthy(proc, url, statuses=(503,))
        body = httpx.get(f"{url}/health").json()
        assert body["status"] == "no_engine" and body["engines_in_service"] == 0
        assert body["error"]["type"] == "no_engine" and "--engines" in body["error"]["message"]
        # Once up, the log says where a client points and how the live view opens (its token after '#').
        text = log.read_text()
        assert f"OpenAI API: base_url={url}/v1, models: none yet, api_key: any (no --api-key given)" in text
        assert f"Parrot client: parrot.Session('{url}')" in text
        assert f"live view: {url}/ui (sign in with the cluster token: ${CLUSTER_TOKEN_ENV})" in text
        assert "t" * 32 not in text  # the token itself is never logged
    finally:
        stop(proc)


def test_the_ready_lines_name_the_keys_and_a_local_address_for_a_wildcard_host() -> None:
    lines = ready_lines("http://0.0.0.0:9000", ["smollm2"], api_keys=True, token_source="/t/cluster_token")
    assert lines == [
        "OpenAI API: base_url=http://127.0.0.1:9000/v1, models: smollm2, "
        "api_key: the key given with --api-key",
        "Parrot client: parrot.Session('http://127.0.0.1:9000')",
        "live view: http://127.0.0.1:9000/ui (sign in with the cluster token: /t/cluster_token)",
    ]


def test_health_is_200_with_an_engine_in_service_and_503_without() -> None:
    with launch("tiny", engines=0) as none:
        r = httpx.get(f"{none.url}/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "no_engine"
    with launch("tiny", engines=1) as one:
        r = httpx.get(f"{one.url}/health")
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "engines": 1, "engines_in_service": 1, "sessions": 0}
        one.manager.registry.failed.add(0)  # as after the engine's first failure: out of placement
        r = httpx.get(f"{one.url}/health")
        assert r.status_code == 503 and "of 1: failed, draining or silent" in r.json()["error"]["message"]


def test_an_engine_on_port_0_registers_the_port_it_bound(tmp_path: Path) -> None:
    """``python -m server.engine --port 0 --manager URL``: the manager calls the engine back on the port the
    engine really bound, and its /health turns 200 once the engine is in service."""
    token = "t" * 32
    log = tmp_path / "engine.log"
    with launch("tiny", engines=0, cluster_token=token) as manager:
        assert httpx.get(f"{manager.url}/health").status_code == 503
        command = [sys.executable, "-m", "server.engine", "--model", "tiny", "--port", "0"]
        with log.open("w") as out:
            proc = subprocess.Popen(
                [*command, "--manager", manager.url],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, CLUSTER_TOKEN_ENV: token},
                cwd=ROOT,
            )
        try:
            url = served_url(proc, log)
            wait_healthy(proc, manager.url)  # 200: the engine registered and serves
            (engine,) = httpx.get(f"{manager.url}/v1/engines", headers=manager.cluster_headers).json()
            assert engine["url"] == url and engine["alive"]
        finally:
            stop(proc)


def test_the_listener_turns_nagle_off_on_every_connection_it_accepts() -> None:
    # asyncio sets TCP_NODELAY only on sockets whose protocol is TCP; a listener made with protocol 0 gave
    # every kept-alive response a delayed-ACK wait (~40 ms a request).
    import asyncio

    from server.cli import bind_listener

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Record(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        listener = bind_listener("test", "127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Record, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_the_engine_flags_are_the_engine_configs_fields() -> None:
    """Both command lines build their engine flags from `EngineConfig`'s fields (`config_flags`): each flag's
    default is its field's, and the parsed values make the config that the field defaults make."""
    from server.__main__ import _parser
    from server.common.config_flags import config_values
    from server.engine.__main__ import engine_config, parse_args as engine_args
    from server.engine.config import ENGINE_FLAGS, SERVER_ENGINE_FLAGS, EngineConfig

    defaults = EngineConfig()
    assert set(SERVER_ENGINE_FLAGS) < set(ENGINE_FLAGS)
    assert engine_config(engine_args([])) == defaults
    served = _parser("parrot-serve").parse_args([])
    assert EngineConfig(**config_values(EngineConfig, served, SERVER_ENGINE_FLAGS)) == defaults
    argv = ["--enforce-eager", "--max-num-seqs", "8", "--scheduling", "sjf", "--sjf-aging-s", "5"]
    config = engine_config(engine_args(argv))
    assert (config.cuda_graphs, config.max_num_seqs, config.scheduling, config.sjf_aging_s) == (
        False,
        8,
        "sjf",
        5.0,
    )


def test_the_servers_other_flags_default_to_their_configs() -> None:
    """The parser cannot read these configs without their heavy imports: their flags are written by hand,
    and this keeps each at its field's default."""
    from server.__main__ import _parser
    from server.cluster.openai_backend_http import OpenAIBackendConfig
    from server.common.security import SecurityConfig
    from server.serve.manager_config import ManagerConfig

    served = vars(_parser("parrot-serve").parse_args([]))
    assert served["session_ttl"] == ManagerConfig().session_ttl
    assert served["max_engines"] == SecurityConfig("t" * 32).max_remote_engines
    assert served["openai_backend_capacity"] == OpenAIBackendConfig("http://x").capacity_tokens
