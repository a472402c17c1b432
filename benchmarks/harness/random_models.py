"""Random-weight LLaMA models at real shapes, loaded once and shared by our engine and Hugging Face.

Speed does not depend on the weights, and a GPU machine here has no model files (nothing can be fetched
there, and a real 7B checkpoint is far over what a call can carry). So the GPU benchmarks build models from
the configs of real ones: Hugging Face initialises ``LlamaForCausalLM`` at random on the device, and our
engine is built over the *same* tensors (no copy, no file), so both run identical weights and their greedy
tokens can be compared. The tokenizer is the embedded tiny model's (prompts are token ids; ids past its
vocabulary decode to nothing, which only the engine's finished-text field sees).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from server.engine import EngineConfig, LLMEngine
from server.engine.config import ModelConfig
from server.engine.loader import build_model, load_tokenizer
from server.engine.model_runner import KVCache

# Hugging Face config.json fields of real models (their public configs), weights aside.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {  # HuggingFaceTB/SmolLM2-135M-Instruct
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {  # meta-llama/Llama-3.2-1B (its llama3 rope scaling left out: same cost)
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "llama-2-7b": {  # meta-llama/Llama-2-7b-hf: the paper's LLaMA-7B shape (no GQA: 512 KiB of KV per token)
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}


def hf_config(shape: str) -> dict[str, Any]:
    """The full config dict of ``shape`` (a key of `SHAPES`)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; use one of {', '.join(SHAPES)}")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **SHAPES[shape],
    }


def kv_bytes_per_token(shape: str, dtype: torch.dtype) -> int:
    """K and V bytes one token takes over all layers."""
    c = ModelConfig.from_hf_dict(hf_config(shape))
    return KVCache.bytes_per_block(c.num_hidden_layers, 1, c.num_key_value_heads, c.head_dim, dtype)


def parameter_count(shape: str) -> int:
    """Parameters of ``shape``: embeddings, the output head unless tied, attention, MLP and norms."""
    c = ModelConfig.from_hf_dict(hf_config(shape))
    h, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    attention = h * c.num_attention_heads * c.head_dim * 2 + 2 * h * kv
    layer = attention + 3 * h * c.intermediate_size + 2 * h
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.vocab_size * h + head + c.num_hidden_layers * layer + h


@dataclass
class ModelPair:
    """Our engine and Hugging Face's model over the same weights."""

    shape: str
    engine: LLMEngine
    hf: Any  # transformers.LlamaForCausalLM


def random_hf_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """``transformers.LlamaForCausalLM`` of ``shape`` with HF's own random init, built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**hf_config(shape))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype on the device: a 7B never exists in fp32
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def save_folder(shape: str, folder: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    """Write a random ``shape`` model as a Hugging Face folder (config, safetensors, the tiny tokenizer),
    for experiments that load models by path."""
    from server.engine.tiny.model import copy_tokenizer

    random_hf_model(shape, torch.device("cpu"), dtype, seed).save_pretrained(folder)
    copy_tokenizer(folder)
    return folder


def load_pair(shape: str, config: EngineConfig, seed: int = 0) -> ModelPair:
    """HF's random ``shape`` model on ``config``'s device and dtype, and our engine over its tensors."""
    device, dtype = config.torch_device(), config.torch_dtype()
    hf = random_hf_model(shape, device, dtype, seed)
    model_config = ModelConfig.from_hf_dict(hf_config(shape))
    # `build_model` moves each tensor to (device, dtype): already there, so ours shares HF's storage.
    state = {name: t.detach() for name, t in hf.state_dict().items()}
    model = build_model(model_config, state, config.model_len(model_config), device, dtype)
    return ModelPair(shape, LLMEngine(model, load_tokenizer("tiny"), model_config, config, shape), hf)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        description="Write a random-weight model of a real shape as a HF folder."
    )
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    print(save_folder(args.shape, args.folder, getattr(torch, args.dtype)))
