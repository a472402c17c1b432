"""Fixtures: tiny random LLaMA checkpoints saved the Hugging Face way, loaded by our engine and by HF."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kernels  # noqa: F401  (imported before transformers so TRITON_INTERPRET from conftest applies)
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.tiny.model import copy_tokenizer

BASE_CONFIG: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.1,  # peaked logits: greedy argmax is far from ties, so parity is meaningful
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}


def save_hf_model(path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a random `transformers.LlamaForCausalLM` with the tiny tokenizer next to it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**BASE_CONFIG, **overrides})
    model = LlamaForCausalLM(config).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    copy_tokenizer(path)
    return path


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from Hugging Face's own `generate` (EOS ignored, so lengths match)."""
    from transformers import LlamaForCausalLM

    model = _hf_model(path)
    assert isinstance(model, LlamaForCausalLM)
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=2,
    )
    return out[0, len(prompt) :].tolist()


_HF_CACHE: dict[Path, Any] = {}


def _hf_model(path: Path) -> Any:
    from transformers import LlamaForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[str, Path] = {}

    def make(name: str, **overrides: Any) -> Path:
        if name not in made:
            made[name] = save_hf_model(tmp_path_factory.mktemp(name), **overrides)
        return made[name]

    return make


@pytest.fixture(scope="session")
def gqa_model(model_factory: Callable[..., Path]) -> Path:
    return model_factory("gqa")


@pytest.fixture(scope="module")
def engine(gqa_model: Path) -> Iterator[LLMEngine]:
    # fp32 here and wherever tokens are compared with HF or across code paths: only fp32 is exact, and the
    # CPU default is bf16 where the CPU has it natively.
    eng = LLMEngine.from_pretrained(
        gqa_model, EngineConfig(dtype="float32", num_kv_blocks=512, max_num_batched_tokens=256)
    )
    yield eng
    eng.shutdown()


def prompts(n: int, seed: int = 0, low: int = 3, high: int = 40) -> list[list[int]]:
    """Random prompts of varied lengths over the non-special vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=gen).tolist()
    return [torch.randint(7, 4096, (n_,), generator=gen).tolist() for n_ in lengths]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
context_ids = itertools.count(1)  # every engine test module's contexts (one engine may serve several)


async def run_prompt(engine: LLMEngine, prompt: list[int], sampling: SamplingParams = GREEDY) -> list[int]:
    """Fill a fresh context with ``prompt``, generate from it, free it: the generated token ids."""
    cid = next(context_ids)
    await engine.fill(cid, prompt)
    result = await engine.generate(cid, sampling)
    await engine.free_context(cid)
    return result.token_ids
