"""Ray placing vLLM servers as the manager's engines (`RayEngines(vllm_python=...)`), on a local Ray cluster:
each actor starts vLLM's OpenAI server and adds it to the manager; answers equal our engine's; a killed actor
comes back with a new vLLM, added again. Needs vLLM (``$PARROT_VLLM_PYTHON``) and Ray; skipped otherwise."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from server.cluster.openai_backend import OpenAIBackendEngine
from server.cluster.ray_engines import RayEngines
from server.engine import EngineConfig
from server.engine.tiny.model import save_tiny
from server.launcher import LaunchedServer, launch
from tests.server.test_openai_backend_vllm import VLLM_PYTHON, _stories

ray = pytest.importorskip("ray", reason="needs the ray extra (pip install parrot-serve[ray])")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set $PARROT_VLLM_PYTHON to a python that has vLLM"),
]
VLLM_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


@pytest.fixture(scope="module")
def on_ray_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedServer]:
    folder = save_tiny(tmp_path_factory.mktemp("ray-vllm") / "tiny", seed=EngineConfig().seed)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        spec = RayEngines(1, vllm_python=VLLM_PYTHON, vllm_args=VLLM_ARGS, vllm_env=VLLM_ENV)
        with launch(str(folder), engines=0, ray=spec, startup_timeout=300) as s:
            yield s
    finally:
        ray.shutdown()


def test_ray_places_vllm_and_it_serves_as_our_engine_does(on_ray_vllm: LaunchedServer) -> None:
    (engine,) = on_ray_vllm.manager.engines
    assert isinstance(engine, OpenAIBackendEngine) and engine.max_model_len == 2048
    with launch("tiny", engines=1, engine_config=EngineConfig(num_kv_blocks=256)) as ours:
        assert _stories(on_ray_vllm) == _stories(ours)


def test_a_killed_vllm_actor_comes_back_and_is_added_again(on_ray_vllm: LaunchedServer) -> None:
    expected = _stories(on_ray_vllm)
    os.kill(ray.get(on_ray_vllm.ray_actors[0].pid.remote()), signal.SIGKILL)  # vLLM dies with it
    deadline = time.monotonic() + 300
    while len(on_ray_vllm.manager.engines) < 2:  # the restarted actor's vLLM, added as a new engine
        assert time.monotonic() < deadline, "the restarted actor did not add its vLLM again"
        time.sleep(1)
    on_ray_vllm.run(on_ray_vllm.manager.check_engines())
    assert _stories(on_ray_vllm) == expected
    alive = [s.alive for s in on_ray_vllm.manager.engine_status()]
    assert alive == [False, True]  # the old one failed when its next request found nothing there
