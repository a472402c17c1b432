"""The model a loaded `server.engine.LLMEngine` runs, as other systems read it: its torch module
(`engine_model`), a Hugging Face ``config.json`` for its `ModelConfig` (`hf_config_dict`) and its weights
as a Hugging Face folder (`export_hf_folder`), so that baselines run exactly our weights.

The engine is taken as a value (``Any``), never imported: reading its model must not load the service.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def engine_model(engine: Any) -> Any:
    """The ``torch.nn.Module`` a loaded `server.engine.LLMEngine` runs (its parameters are the weights)."""
    # The engine's core holds the runner, which holds the model (`EngineCore.runner`, `ModelRunner.model`).
    model = getattr(getattr(getattr(engine, "core", None), "runner", None), "model", None)
    if model is None:
        raise TypeError(f"{type(engine).__name__} has no loaded torch model to read weights from")
    return model


def hf_config_dict(model_config: Any, dtype: str, pad_token_id: int | None = None) -> dict[str, Any]:
    """A Hugging Face ``LlamaForCausalLM`` ``config.json`` for an engine `ModelConfig`.

    Rope settings are written in both forms (transformers 5's ``rope_parameters``, 4.x's ``rope_theta`` +
    ``rope_scaling``), so every transformers (and vLLM, which reads configs through it) version reads them.
    """
    cfg = model_config
    scaling = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    eos = list(cfg.eos_token_ids)
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if pad_token_id is not None:
        out["pad_token_id"] = pad_token_id
    return out


def export_hf_folder(engine: Any, folder: str | Path) -> Path:
    """Write the weights a `server.engine.LLMEngine` has loaded as a Hugging Face model folder.

    For baselines (transformers, vLLM) that load only Hugging Face folders, when our engine loaded a model
    from something else (a GGUF file, a name): they then run exactly our weights, in our engine's dtype.
    The engine's parameter names are Hugging Face ``LlamaForCausalLM``'s; a tied ``lm_head`` is one
    parameter and is written once, as HF expects. Writes ``config.json`` (from the engine's `ModelConfig`),
    ``model.safetensors`` and the tokenizer (``save_pretrained``).
    """
    import torch
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model = engine_model(engine)
    # named_parameters() yields a shared (tied) tensor once, under its first name (the embedding).
    state = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    odd = sorted(name for name, t in state.items() if not torch.is_floating_point(t))
    if odd:
        raise ValueError(f"cannot export non-floating-point (quantized?) weights as a HF folder: {odd[:5]}")
    dtypes = {t.dtype for t in state.values()}
    dtype = str(max(dtypes, key=lambda d: d.itemsize)).removeprefix("torch.")
    tokenizer = engine.tokenizer
    pad = getattr(tokenizer, "pad_token_id", None)
    config = hf_config_dict(engine.model_config, dtype, pad if isinstance(pad, int) else None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out))
    return out
