"""The embedded default model "tiny": a small LLaMA with deterministic random weights.

It is a systems demo that runs with no network at all: the weights come from a fixed seed, the byte-level
BPE tokenizer is the file shipped beside this module. `save_tiny` writes the same model as a Hugging Face
folder, so it can be loaded by `transformers` too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from server.engine.tiny import TOKENIZER_DIR

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_state_dict(seed: int = 0, config: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face-named LLaMA weights drawn from N(0, 0.02) with a fixed seed; norms are ones."""
    cfg = config or TINY_CONFIG
    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    state = {"model.embed_tokens.weight": normal(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = normal(q_out, h)
        state[p + "self_attn.k_proj.weight"] = normal(kv_out, h)
        state[p + "self_attn.v_proj.weight"] = normal(kv_out, h)
        state[p + "self_attn.o_proj.weight"] = normal(h, q_out)
        state[p + "mlp.gate_proj.weight"] = normal(inter, h)
        state[p + "mlp.up_proj.weight"] = normal(inter, h)
        state[p + "mlp.down_proj.weight"] = normal(h, inter)
        state[p + "input_layernorm.weight"] = torch.ones(h)
        state[p + "post_attention_layernorm.weight"] = torch.ones(h)
    state["model.norm.weight"] = torch.ones(h)
    state["lm_head.weight"] = normal(vocab, h)
    return state


def copy_tokenizer(folder: str | Path) -> None:
    """Write the tiny model's tokenizer files into ``folder`` (a model folder that uses its tokenizer)."""
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, Path(folder) / name)


def save_tiny(path: str | Path, seed: int = 0) -> Path:
    """Write "tiny" as a Hugging Face model folder (config.json, model.safetensors, tokenizer files)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    save_file(tiny_state_dict(seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(out)
    return out
