"""Loading LLaMA-architecture GGUF files (llama.cpp's format): config, weights and tokenizer.

The file itself (header, tensor table, dequantization) is read by `server.engine.gguf_file`. Tensors are
renamed to the Hugging Face names our model uses, and llama.cpp's q/k row permutation is undone. The
config is built as a Hugging Face dict and parsed by `ModelConfig.from_hf_dict`; the tokenizer is
transformers' GGUF conversion, cached on disk (it takes seconds), with the file's chat template.

Errors are typed: `GGUFFormatError` for files that are not valid GGUF (truncated, corrupt, inconsistent),
`UnsupportedGGUFError` for valid files this engine cannot run (architecture, quantization, rope scaling).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from server.common.settings import CACHE_DIR, cache_dir
from server.engine.config import ModelConfig
from server.engine.gguf_file import (
    GGUFError,
    GGUFFile,
    GGUFFormatError,
    GGUFTensorInfo,
    UnsupportedGGUFError,
    check_dequantizable,
    read_gguf,
)

__all__ = [  # the file's names too: callers load and catch through this module
    "GGUFError",
    "GGUFFile",
    "GGUFFormatError",
    "GGUFTensorInfo",
    "UnsupportedGGUFError",
    "gguf_hf_config",
    "gguf_model_config",
    "gguf_state_dict",
    "hf_name",
    "load_gguf_tokenizer",
    "read_gguf",
    "tensor_names",
    "tokenizer_cache_path",
    "unpermute_qk",
]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- the config
def _meta(gguf_file: GGUFFile, key: str, default: Any = ...) -> Any:
    value = gguf_file.metadata.get(key, default)
    if value is ...:
        raise GGUFFormatError(
            f"{gguf_file.path} lacks the metadata key {key!r} a LLaMA model needs; re-convert the model "
            "with llama.cpp's convert_hf_to_gguf.py"
        )
    return value


def _per_model(gguf_file: GGUFFile, key: str, default: Any = ...) -> Any:
    """A value llama.cpp may write per layer (an array); ours must be the same in every layer."""
    value = _meta(gguf_file, key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UnsupportedGGUFError(
                f"{gguf_file.path}: {key} differs between layers ({value[:8]}...); this engine runs models "
                "whose layers all have the same shape"
            )
        return value[0]
    return value


def gguf_hf_config(gguf_file: GGUFFile) -> dict[str, Any]:
    """The model's Hugging Face `config.json` equivalent, from the GGUF metadata and tensor table.

    Raises `UnsupportedGGUFError` for non-LLaMA architectures and features this engine does not run.
    """
    arch = gguf_file.architecture
    if arch != "llama":
        raise UnsupportedGGUFError(
            f"{gguf_file.path} holds a {arch or 'unnamed'!r} model (general.architecture); this engine runs "
            "LLaMA-architecture GGUF files only (LLaMA 1-3, SmolLM, TinyLlama, Mistral 7B ...): pick a GGUF "
            "whose general.architecture is 'llama', or load a Hugging Face folder of a LLaMA model"
        )
    p = "llama."
    experts = _meta(gguf_file, p + "expert_count", 0)
    if experts:
        raise UnsupportedGGUFError(
            f"{gguf_file.path} is a mixture-of-experts model ({p}expert_count={experts}); this engine runs "
            "dense LLaMA models only"
        )
    hidden = int(_meta(gguf_file, p + "embedding_length"))
    heads = int(_per_model(gguf_file, p + "attention.head_count"))
    kv_heads = int(_per_model(gguf_file, p + "attention.head_count_kv", heads))
    head_dim = int(_meta(gguf_file, p + "attention.key_length", hidden // heads))
    value_dim = int(_meta(gguf_file, p + "attention.value_length", head_dim))
    rotary_dim = int(_meta(gguf_file, p + "rope.dimension_count", head_dim))
    if value_dim != head_dim or rotary_dim != head_dim:
        raise UnsupportedGGUFError(
            f"{gguf_file.path}: key length {head_dim}, value length {value_dim} and rotary dimension "
            f"{rotary_dim} differ; this engine needs them equal (full rotary embeddings, as in LLaMA)"
        )
    embed = gguf_file.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFFormatError(f"{gguf_file.path} has no token_embd.weight tensor; it is not a LLaMA model")
    theta = float(_meta(gguf_file, p + "rope.freq_base", 10000.0))
    tok = "tokenizer.ggml."
    eos = [
        gguf_file.metadata[tok + k]
        for k in ("eos_token_id", "eot_token_id", "eom_token_id")
        if tok + k in gguf_file.metadata
    ]
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": embed.shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(_per_model(gguf_file, p + "feed_forward_length")),
        "num_hidden_layers": int(_meta(gguf_file, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(_meta(gguf_file, p + "context_length", 2048)),
        "rms_norm_eps": float(_meta(gguf_file, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(gguf_file, head_dim, theta),
        # llama.cpp writes no output.weight when the head is the embedding matrix
        "tie_word_embeddings": "output.weight" not in gguf_file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gguf_file.tensors,
        "mlp_bias": "blk.0.ffn_gate.bias" in gguf_file.tensors,
        "bos_token_id": gguf_file.metadata.get(tok + "bos_token_id"),
        # llama.cpp stops at every end-of-generation token (eos, end-of-turn, end-of-message)
        "eos_token_id": list(dict.fromkeys(eos)) if eos else None,
    }
    return cfg


def gguf_model_config(gguf_file: GGUFFile) -> ModelConfig:
    """`ModelConfig` of a LLaMA GGUF file (see `gguf_hf_config`)."""
    return ModelConfig.from_hf_dict(gguf_hf_config(gguf_file))


def _rope_scaling(gguf_file: GGUFFile, head_dim: int, theta: float) -> dict[str, Any] | None:
    kind = _meta(gguf_file, "llama.rope.scaling.type", None)
    factor = _meta(gguf_file, "llama.rope.scaling.factor", None)
    if kind is None and _meta(gguf_file, "llama.rope.scale_linear", None) is not None:
        kind, factor = "linear", _meta(gguf_file, "llama.rope.scale_linear")  # pre-2024 files
    if "rope_freqs.weight" in gguf_file.tensors:
        # LLaMA 3.1+ files store the llama3 scaling as per-frequency divisors, not as parameters.
        return _llama3_scaling(gguf_file, head_dim, theta)
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise UnsupportedGGUFError(
        f"{gguf_file.path} uses {kind!r} rope scaling (llama.rope.scaling.type); this engine supports "
        "linear and LLaMA-3 scaling only"
    )


def _llama3_scaling(gguf_file: GGUFFile, head_dim: int, theta: float) -> dict[str, Any]:
    """Recover LLaMA-3 rope-scaling parameters from the `rope_freqs` divisors llama.cpp stores.

    convert_hf_to_gguf.py computes the divisors from (factor, low/high_freq_factor, original context); we
    take factor = the largest divisor and the published low/high factors (1, 4) and original context (from
    the metadata, else 8192), then check they reproduce every divisor.
    """
    from server.engine.rope import rope_inv_freq

    divisors = torch.from_numpy(gguf_file.dequantize("rope_freqs.weight").astype(np.float32).reshape(-1))
    original = int(_meta(gguf_file, "llama.rope.scaling.original_context_length", 8192))
    scaling = {
        "rope_type": "llama3",
        "factor": float(divisors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    plain = rope_inv_freq(head_dim, theta, None)
    if divisors.shape != plain.shape or not torch.allclose(
        plain / divisors, rope_inv_freq(head_dim, theta, scaling), rtol=1e-4
    ):
        raise UnsupportedGGUFError(
            f"{gguf_file.path}: its rope_freqs tensor is not a LLaMA-3 rope scaling this engine recognises "
            "(factor, low_freq_factor=1, high_freq_factor=4); load the Hugging Face folder of the model"
        )
    return scaling


# ---------------------------------------------------------------------------------------- the weights
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors that carry no weights of ours: rope divisors (read into the config), old precomputed rope tables.
_SKIPPED = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor name; None for tensors we do not load."""
    if _SKIPPED.match(gguf_name):
        return None
    if m := _LAYER_TENSOR.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_TENSOR.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise UnsupportedGGUFError(
        f"tensor {gguf_name!r} has no place in a LLaMA model; the file is not a plain LLaMA checkpoint"
    )


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).

    llama.cpp interleaves each head's two rotary halves (rows j and j + d/2 become rows 2j, 2j+1) for its
    GPT-J-style rope; Hugging Face's rotate-half rope wants them back in halves. Rows are grouped per head.
    """
    shape = weight.shape
    return weight.reshape(n_heads, shape[0] // n_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _expected_shape(name: str, cfg: ModelConfig) -> tuple[int, ...] | None:
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    rows = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
        "embed_tokens": (cfg.vocab_size, h),
        "lm_head": (cfg.vocab_size, h),
    }
    module, kind = name.rsplit(".", 2)[-2:]
    if module.endswith("norm"):
        return (h,)
    shape = rows.get(module)
    if shape is None:
        return None
    return shape if kind == "weight" else shape[:1]


def tensor_names(gguf_file: GGUFFile, cfg: ModelConfig) -> dict[str, str]:
    """``{gguf name: Hugging Face name}`` of the tensors to load, after checking every tensor's name, shape
    and type, so a bad file fails before anything slow is done."""
    names: dict[str, str] = {}
    for info in gguf_file.tensors.values():
        target = hf_name(info.name)
        if target is None:
            continue
        expected = _expected_shape(target, cfg)
        if expected is not None and info.shape != expected:
            raise GGUFFormatError(
                f"{gguf_file.path}: tensor {info.name!r} has shape {info.shape}, but the metadata describes "
                f"a model where it is {expected}; the file is corrupt or not a LLaMA checkpoint"
            )
        layer = _LAYER_TENSOR.match(info.name)
        if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
            raise GGUFFormatError(
                f"{gguf_file.path}: tensor {info.name!r} is beyond llama.block_count={cfg.num_hidden_layers}"
            )
        check_dequantizable(info)
        names[info.name] = target
    return names


def gguf_state_dict(gguf_file: GGUFFile, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All model weights, dequantized to ``dtype`` under Hugging Face names, q/k permutation undone."""
    state: dict[str, torch.Tensor] = {}
    for gguf_name, target in tensor_names(gguf_file, cfg).items():
        values = gguf_file.dequantize(gguf_name)
        if not values.flags.writeable:  # F32 is a view of the read-only map; torch wants its own memory
            values = values.copy()
        tensor = torch.from_numpy(values).to(dtype)
        if ".attn_q." in gguf_name:
            tensor = unpermute_qk(tensor, cfg.num_attention_heads)
        elif ".attn_k." in gguf_name:
            tensor = unpermute_qk(tensor, cfg.num_key_value_heads)
        state[target] = tensor
    return state


# -------------------------------------------------------------------------------------- the tokenizer
def tokenizer_cache_path(path: str | Path) -> Path:
    """The cache folder of a GGUF file's converted tokenizer: keyed by the file's resolved path, size and
    mtime (a replaced file gets a new entry) and the transformers version that converted it."""
    import transformers

    resolved = Path(path).resolve()
    st = resolved.stat()
    key = f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir() / "tokenizers" / f"{resolved.stem}-{digest}"


def load_gguf_tokenizer(gguf_file: GGUFFile) -> Any:
    """The file's tokenizer (transformers' GGUF conversion) with its chat template.

    The conversion takes seconds for a large vocabulary, so the result is saved under `cache_dir()` and
    later starts load it from there; when the cache cannot be read or written the conversion is used as is.
    """
    from transformers import AutoTokenizer

    template = gguf_file.metadata.get("tokenizer.chat_template")
    cached = tokenizer_cache_path(gguf_file.path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
            if template is None or tokenizer.chat_template == template:
                return tokenizer
            log.warning("cached tokenizer %s lacks the GGUF chat template; converting again", cached)
        except Exception as e:  # whatever is wrong with a cache entry, converting again mends it
            log.warning("cached tokenizer %s is unusable (%s); converting again", cached, e)
    tokenizer = _convert_tokenizer(gguf_file)
    if template is not None:
        tokenizer.chat_template = template
    _save_to_cache(tokenizer, cached)
    return tokenizer


def _convert_tokenizer(gguf_file: GGUFFile) -> Any:
    from transformers import AutoTokenizer

    if not gguf_file.array_lengths.get("tokenizer.ggml.tokens"):
        raise UnsupportedGGUFError(
            f"{gguf_file.path} carries no tokenizer (no tokenizer.ggml.tokens); re-convert the model with "
            "llama.cpp's convert_hf_to_gguf.py, which embeds it"
        )
    path = gguf_file.path.resolve()
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except (KeyError, ValueError, TypeError, NotImplementedError) as e:
        raise UnsupportedGGUFError(
            f"transformers cannot build the tokenizer of {gguf_file.path} "
            f"(tokenizer.ggml.model={gguf_file.metadata.get('tokenizer.ggml.model')!r}): {e}"
        ) from e


def _save_to_cache(tokenizer: Any, target: Path) -> None:
    """Write the tokenizer to ``target`` atomically (a whole folder renamed into place), or warn."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            tokenizer.save_pretrained(str(tmp))
            tmp.chmod(0o755)  # mkdtemp makes it private; the files inside are the umask's
            if target.exists():  # an unusable entry we just converted again
                shutil.rmtree(target, ignore_errors=True)
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not target.is_dir():  # another process may have won the race; that is fine
                raise
    except OSError as e:
        log.warning(
            "could not cache the converted tokenizer in %s (%s); set %s to a writable folder to make "
            "later starts faster",
            target,
            e,
            CACHE_DIR.name,
        )
