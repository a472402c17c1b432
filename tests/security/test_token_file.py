"""Where the cluster token comes from: an explicit file, ``$PARROT_CLUSTER_TOKEN``, or a default file that
the first process creates (0600) and logs — and, end to end, a manager and an engine started with no
setting at all agree on it, while the OpenAI routes take ``--api-key``."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from server.common.security import CLUSTER_TOKEN_ENV, load_cluster_token
from tests.processes import free_port


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CLUSTER_TOKEN_ENV, raising=False)
    monkeypatch.setenv("PARROT_CACHE_DIR", str(tmp_path / "cache"))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_missing_file_is_created_readable_only_by_its_owner_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "secrets" / "token"
    with caplog.at_level(logging.INFO, logger="server.common.security"):
        token = load_cluster_token(path)
    assert path.read_text().strip() == token.value and len(token.value) >= 32
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert token.source == str(path) and str(path) in caplog.text
    assert token.value not in caplog.text  # the secret itself is never logged
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="server.common.security"):
        assert load_cluster_token(path) == token  # read back, not replaced
    assert "generated" not in caplog.text


def test_the_default_file_is_in_the_cache_folder(tmp_path: Path) -> None:
    token = load_cluster_token()
    path = tmp_path / "cache" / "cluster_token"
    assert token.source == str(path) and path.read_text().strip() == token.value
    assert _mode(path) == 0o600


def test_the_variable_comes_before_the_default_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CLUSTER_TOKEN_ENV, "from-the-environment")
    token = load_cluster_token()
    assert token.value == "from-the-environment" and token.source == f"${CLUSTER_TOKEN_ENV}"
    assert not (tmp_path / "cache").exists()
    given = tmp_path / "given"
    given.write_text("from-the-file\n")
    given.chmod(0o600)
    assert load_cluster_token(given).value == "from-the-file"  # an explicit file comes first


def test_bad_files_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=f"cluster token file {empty} is empty"):
        load_cluster_token(empty)
    shared = tmp_path / "shared"
    shared.write_text("abc")
    shared.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="server.common.security"):
        assert load_cluster_token(shared).value == "abc"
    assert f"{shared} is readable by other users" in caplog.text


# ------------------------------------------------------------------------------------- the CLIs
@contextmanager
def _process(args: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            yield proc
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def _wait(condition: Callable[[], bool], what: str, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def test_a_manager_and_an_engine_agree_on_the_default_token_with_no_setting(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != CLUSTER_TOKEN_ENV}
    env["PARROT_CACHE_DIR"] = str(tmp_path / "cache")
    token_file = tmp_path / "cache" / "cluster_token"
    port, engine_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    manager_log, engine_log = tmp_path / "manager.log", tmp_path / "engine.log"
    manager_args = ["server", "--engines", "0", "--port", str(port), "--api-key", "k1", "--api-key", "k2"]
    with _process(manager_args, env, manager_log):
        # Up, with no engine in service yet: /health answers 503 until one joins.
        _wait(lambda: httpx.get(f"{url}/health").status_code == 503, "the manager start", manager_log)
        assert str(token_file) in manager_log.read_text()  # where the generated token is
        assert _mode(token_file) == 0o600
        token = token_file.read_text().strip()
        assert token not in manager_log.read_text()
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.get(f"{url}/v1/engines").status_code == 401
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200

        engine_args = ["server.engine", "--model", "tiny", "--port", str(engine_port), "--manager", url]
        with _process(engine_args, env, engine_log):

            def joined() -> bool:
                return any(e["alive"] for e in httpx.get(f"{url}/v1/engines", headers=auth).json())

            _wait(joined, "the engine's registration", engine_log)
            assert httpx.get(f"{url}/health").status_code == 200  # an engine in service now
            assert httpx.get(f"http://127.0.0.1:{engine_port}/stats").status_code == 401
            body = {"model": "tiny", "prompt": "Once", "max_tokens": 2}
            r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer k1"})
            assert r.status_code == 200, r.text
