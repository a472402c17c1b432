"""Loading a model: config, weights and tokenizer of "tiny", a GGUF file or a Hugging Face folder.

`load_checkpoint` resolves a model name (`server.engine.model_names`) and reads it; `build_model` turns the
weights into our `LlamaForCausalLM`. Hugging Face folders hold single or sharded safetensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from server.engine.config import ModelConfig
from server.engine.model import LlamaForCausalLM
from server.engine.model_names import ModelSource, resolve_model
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


@dataclass
class Checkpoint:
    """A model as read from disk (or, for "tiny", generated), before it is placed on a device."""

    name: str  # the name the engine reports: "tiny", "smollm2", a file's stem or a folder's name
    config: ModelConfig
    state: dict[str, torch.Tensor]  # Hugging Face parameter names
    tokenizer: Any  # a Hugging Face tokenizer, carrying the model's chat template when it has one


def load_checkpoint(name_or_path: str | Path, dtype: torch.dtype, seed: int = 0) -> Checkpoint:
    """Read the model ``name_or_path`` names (see `server.engine.model_names`); GGUF weights are
    dequantized to ``dtype``, safetensors keep theirs. ``seed`` seeds the "tiny" model's weights.

    Raises `FileNotFoundError` (a missing model, file, package or tokenizer) or `ValueError` (a checkpoint
    this engine cannot run; `server.engine.gguf_loader.GGUFError` for GGUF files).
    """
    source = resolve_model(name_or_path)
    if source.kind == "tiny":
        return _load_tiny(seed)
    assert source.path is not None
    if source.kind == "gguf":
        return _load_gguf(source, dtype)
    return Checkpoint(
        source.name,
        ModelConfig.from_pretrained(source.path),
        load_safetensors(source.path),
        _folder_tokenizer(source.path),
    )


def load_tokenizer(name_or_path: str | Path) -> Any:
    """The tokenizer of the model ``name_or_path`` names, without reading its weights (the tokenizer of a
    model another server runs). Raises as `load_checkpoint` does."""
    source = resolve_model(name_or_path)
    if source.kind == "tiny":
        from server.engine.tiny import TOKENIZER_DIR

        return _folder_tokenizer(TOKENIZER_DIR)
    assert source.path is not None
    if source.kind == "gguf":
        from server.engine import gguf_loader

        return gguf_loader.load_gguf_tokenizer(gguf_loader.read_gguf(source.path))
    return _folder_tokenizer(source.path)


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """The configuration of the model ``name_or_path`` names, without reading its weights (sizing a KV cache
    before an engine starts). Raises as `load_checkpoint` does."""
    source = resolve_model(name_or_path)
    if source.kind == "tiny":
        from server.engine.tiny.model import TINY_CONFIG

        return ModelConfig.from_hf_dict(TINY_CONFIG)
    assert source.path is not None
    if source.kind == "gguf":
        from server.engine import gguf_loader

        return gguf_loader.gguf_model_config(gguf_loader.read_gguf(source.path))
    return ModelConfig.from_pretrained(source.path)


def _load_tiny(seed: int) -> Checkpoint:
    from server.engine.tiny import TOKENIZER_DIR
    from server.engine.tiny.model import TINY_CONFIG, tiny_state_dict

    return Checkpoint(
        "tiny", ModelConfig.from_hf_dict(TINY_CONFIG), tiny_state_dict(seed), _folder_tokenizer(TOKENIZER_DIR)
    )


def _load_gguf(source: ModelSource, dtype: torch.dtype) -> Checkpoint:
    from server.engine import gguf_loader

    assert source.path is not None
    gguf_file = gguf_loader.read_gguf(source.path)
    config = gguf_loader.gguf_model_config(gguf_file)
    # Check the tensors (cheap) before converting the tokenizer (seconds, when not cached) and dequantizing.
    gguf_loader.tensor_names(gguf_file, config)
    tokenizer = gguf_loader.load_gguf_tokenizer(gguf_file)
    state = gguf_loader.gguf_state_dict(gguf_file, config, dtype)
    return Checkpoint(source.name, config, state, tokenizer)


def _folder_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"no usable tokenizer in {folder}: {e}") from e


class _SkipRandomInit(TorchFunctionMode):
    """Skips the modules' random initialisation while the model is built on the meta device.

    The checkpoint's tensors are assigned right after, so the init is wasted work; worse, a meta-device
    ``normal_`` imports ``torch._dynamo`` (seconds) on first use. A function mode is thread-local, unlike
    patching ``torch.nn.init``.
    """

    _SKIPPED = frozenset(
        {
            torch.nn.init.normal_,
            torch.nn.init.uniform_,
            torch.nn.init.kaiming_uniform_,
            torch.nn.init.constant_,
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
        }
    )

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in self._SKIPPED:
            return args[0] if args else kwargs["tensor"]  # the in-place target, left as it is
        return func(*args, **kwargs)


def build_model(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
) -> LlamaForCausalLM:
    """Instantiate the model without a random init, then assign the checkpoint's tensors."""
    rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, device, dtype)
    with torch.device("meta"), _SkipRandomInit():
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
