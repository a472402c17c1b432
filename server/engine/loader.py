"""Loading LLaMA weights from a local Hugging Face folder (single or sharded safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from server.engine.config import ModelConfig
from server.engine.model import LlamaForCausalLM
from server.engine.rope import RotaryEmbedding

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry; recomputed here


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a model folder: `model.safetensors`, or the shards named by its index file."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {folder}; "
            "save the model with save_pretrained(safe_serialization=True)"
        )
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
) -> LlamaForCausalLM:
    """Instantiate the model without a random init, then assign the checkpoint's tensors."""
    rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, rope)
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the LLaMA architecture: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model.eval()
