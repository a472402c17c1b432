"""Engines placed by Ray (`launch(ray=RayEngines(...))`, ``python -m server --ray``) on a local Ray cluster:
they register, serve a chain and a map-reduce, and come back when an actor's process is killed; without
``--ray`` nothing of Ray is imported."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import parrot as P
import pytest

from server.cluster.ray_engines import RayEngines, start_ray_engines
from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch
from tests.processes import free_port

ray = pytest.importorskip("ray", reason="needs the ray extra (pip install parrot-serve[ray])")

GREEDY = P.SamplingConfig(max_tokens=6, temperature=0.0, ignore_eos=True)
STEP = P.SemanticFunction.from_template("Continue: {{input:x}}{{output:y}}", name="step", sampling=GREEDY)
PART = P.SemanticFunction.from_template("Summarize {{input:part}}:{{output:s}}", name="part", sampling=GREEDY)
JOIN = P.SemanticFunction.from_template(
    "A: {{input:a}} B: {{input:b}} C: {{input:c}} All:{{output:s}}", name="join", sampling=GREEDY
)


@pytest.fixture(scope="module")
def on_ray() -> Iterator[LaunchedServer]:
    # Two engines of one CPU each, and one more for the CLI's (logical CPUs: Ray's accounting, not cores).
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        spec = RayEngines(2, max_restarts=2)
        with launch("tiny", engines=0, engine_config=EngineConfig(num_kv_blocks=128), ray=spec) as s:
            yield s
    finally:
        ray.shutdown()


def _chain_and_map_reduce(s: LaunchedServer) -> tuple[str, str]:
    """A chain from a session variable (each step's input the previous output: futures) read with a sync
    get, and a map-reduce over literal inputs read with an async get."""
    with P.Session(s.url) as session:
        x = session.variable("the river")
        for _ in range(3):
            x = STEP(x=x)
        parts = [PART(part=f"chapter {i}") for i in range(3)]
        joined = JOIN(a=parts[0], b=parts[1], c=parts[2])
        return x.get(), asyncio.run(joined.aget())


@pytest.fixture(scope="module")
def reference() -> tuple[str, str]:
    with launch("tiny", engines=1, engine_config=EngineConfig(num_kv_blocks=128)) as s:
        return _chain_and_map_reduce(s)


def test_ray_engines_register_and_serve(on_ray: LaunchedServer, reference: tuple[str, str]) -> None:
    engines = on_ray.manager.engines
    assert len(engines) == 2 and len(on_ray.ray_actors) == 2
    assert {e.name for e in engines} == {"ray-engine-0", "ray-engine-1"}  # type: ignore[union-attr]
    assert _chain_and_map_reduce(on_ray) == reference  # on Ray's engines: the server has no other


def test_a_killed_actor_comes_back_and_nothing_is_lost(
    on_ray: LaunchedServer, reference: tuple[str, str]
) -> None:
    pid = ray.get(on_ray.ray_actors[0].pid.remote())
    os.kill(pid, signal.SIGKILL)  # the process dies; Ray restarts the actor, which registers again
    assert _chain_and_map_reduce(on_ray) == reference
    deadline = time.monotonic() + 120
    while len(on_ray.manager.engines) < 3:  # registered again under its name: a new entry for it
        assert time.monotonic() < deadline, "the restarted engine did not register again"
        time.sleep(0.2)
    status = sorted((s.name, s.alive) for s in on_ray.manager.engine_status())
    assert status == [("ray-engine-0", False), ("ray-engine-0", True), ("ray-engine-1", True)]
    assert _chain_and_map_reduce(on_ray) == reference


def test_nothing_of_ray_is_imported_without_it() -> None:
    code = "import sys, server.__main__, server.launcher; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_cli_places_its_engines_on_a_ray_cluster(on_ray: LaunchedServer, tmp_path: Path) -> None:
    """``python -m server --ray auto`` joins the running cluster (the fixture's) and serves on its engine."""
    port = free_port()
    token = "t" * 32
    env = {**os.environ, "PARROT_CLUSTER_TOKEN": token, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    command = [sys.executable, "-m", "server", "--model", "tiny", "--engines", "1", "--ray", "auto"]
    command += ["--port", str(port), "--num-kv-blocks", "64", "--no-length-prediction"]
    with (tmp_path / "server.log").open("w") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                r = httpx.get(f"{url}/v1/engines", headers={"Authorization": f"Bearer {token}"}, timeout=5)
                if r.status_code == 200 and [e["alive"] for e in r.json()] == [True]:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        with P.Session(url):
            assert STEP(x="the river").get() == _chain_and_map_reduce_first_step()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _chain_and_map_reduce_first_step() -> str:
    with launch("tiny", engines=1, engine_config=EngineConfig(num_kv_blocks=64)) as s, P.Session(s.url):
        return str(STEP(x="the river").get())


def test_engines_ray_cannot_place_are_a_clear_error(on_ray: LaunchedServer) -> None:
    spec = RayEngines(1, num_gpus=1, placement_timeout_s=2)  # this cluster has no GPU
    with pytest.raises(RuntimeError, match=r"did not start 1 engine\(s\) within 2s: each asks for 1 GPU"):
        start_ray_engines(spec, "tiny", None, on_ray.url, on_ray.cluster_token)


def test_ray_vllm_needs_ray(capsys: pytest.CaptureFixture[str]) -> None:
    from server.__main__ import main

    with pytest.raises(SystemExit):
        main(["--ray-vllm", sys.executable])
    assert "give --ray [ADDRESS] too" in capsys.readouterr().err
