"""LLaMA-family model code over the paged KV cache (RMSNorm, RoPE, GQA, SwiGLU).

Parameter names follow Hugging Face's `LlamaForCausalLM`, so a safetensors state dict loads as is. The
forward takes one flattened step (no padding) and returns final hidden states of the rows asked for; logits
are computed only for the rows that are sampled (`compute_logits`).

On CPU a decode step of a small model is ~30 layers of small ops, so per-op cost matters next to the
weight traffic: each layer launches as few kernels as possible, and its elementwise parts do the Hugging
Face reference's arithmetic op for op (the same products and sums, in place where the operand is ours):

* q/k/v and gate/up run as one GEMM each over weights concatenated once after loading
  (`LlamaForCausalLM.prepare_weights`); the separate parameters stay, as views into the fused ones, so the
  state dict keeps its Hugging Face names and layout;
* RoPE is applied to q and k together, with cos/sin looked up once per step for all layers (`rope.py`); on
  CPU in bf16/fp16 one C++ pass rotates them and writes the step's K/V to the cache, and another computes
  SwiGLU's ``silu(gate) * up`` (`kernels.cpu_kernels`);
* each sublayer's output joins the residual stream inside the next RMSNorm (`RMSNorm.forward`'s
  ``delta``): one fused C++ pass for bf16/fp16 on CPU (`kernels.cpu_kernels`), the reference's ops for fp32;
* linears call `kernels.cpu_linear.linear` on the weights directly, over weights packed once where that
  pays (our AVX512-BF16 GEMM for bf16, oneDNN's on AMX CPUs, our AVX2 GEMM for fp32 without AVX-512; no
  module call overhead); the residual stream is updated in place.

GEMM rounding differs from MKL's (what `transformers` uses) in the last bits, which the greedy parity tests
against `generate` tolerate (fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu_linear import linear, pack_weight
from kernels.layer_ops import add_rms_norm_op, rope_write_kv_op, silu_mul_op
from server.engine.attention import AttentionBackend, AttentionMetadata
from server.engine.config import ModelConfig
from server.engine.rope import RotaryEmbedding, rotate


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of ``x``; with ``delta``, ``x += delta`` first, in place (``x``: the residual stream)."""
        fused = add_rms_norm_op(x)  # bf16/fp16: one pass instead of ~9 ops
        if (
            fused is not None
            and x.is_contiguous()
            and self.weight.dtype == x.dtype
            and (delta is not None or x.device.type == "cuda")  # (the CPU op is used with a delta only)
            and (delta is None or (delta.shape == x.shape and delta.dtype == x.dtype))
        ):
            return fused(x, None if delta is None else delta.contiguous(), self.weight, self.eps)
        if delta is not None:
            x.add_(delta)
        # fp32 statistics, as the reference implementation does, whatever the activation dtype; the same ops
        # in the same order (in place where the operand is ours), so fp32 results match it bit for bit.
        h = x.float()
        h = h * h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return h.to(x.dtype).mul_(self.weight)


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) along the output dim, and turn each linear's own
    parameters into views of the result: one GEMM for all of them, no second copy of the weights."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None
    start = 0
    for m in linears:
        stop = start + m.out_features
        m.weight = nn.Parameter(weight[start:stop], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:stop], requires_grad=False)
        start = stop
    return weight, bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.qkv_weight: torch.Tensor | None = None  # set by `fuse`
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_packed: torch.Tensor | None = None  # oneDNN copies, where they pay (`pack_weight`)
        self.o_packed: torch.Tensor | None = None

    def fuse(self, invariant: bool = False) -> None:
        self.qkv_weight, self.qkv_bias = _fuse([self.q_proj, self.k_proj, self.v_proj])
        self.qkv_packed = pack_weight(self.qkv_weight, invariant)
        self.o_packed = pack_weight(self.o_proj.weight, invariant)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        assert self.qkv_weight is not None  # `fuse` ran (`LlamaForCausalLM.prepare_weights`)
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.qkv_packed)
        fused = rope_write_kv_op(qkv, d) if k_cache.is_contiguous() and qkv.is_contiguous() else None
        if fused is not None:  # one pass: q and k rotated, the step's k and v written to their cache slots
            q, k = fused(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, heads, kv_heads)
        else:
            # q and k are adjacent columns of the fused output: rotate them as one [T, H + KVH, D] tensor.
            qk = rotate(qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
        if fused is None:
            # The step's new K/V go into their cache slots first; attention then reads only the cache.
            k_cache.view(-1, kv_heads, d).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, kv_heads, d).index_copy_(0, meta.slot_mapping, v)
        o = backend(q, k, v, k_cache, v_cache, meta, self.scale, self.layer)
        return linear(o.reshape(t, heads * d), self.o_proj.weight, self.o_proj.bias, self.o_packed)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.intermediate_size = cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.gate_up_weight: torch.Tensor | None = None  # set by `fuse`
        self.gate_up_bias: torch.Tensor | None = None
        self.gate_up_packed: torch.Tensor | None = None
        self.down_packed: torch.Tensor | None = None

    def fuse(self, invariant: bool = False) -> None:
        self.gate_up_weight, self.gate_up_bias = _fuse([self.gate_proj, self.up_proj])
        self.gate_up_packed = pack_weight(self.gate_up_weight, invariant)
        self.down_packed = pack_weight(self.down_proj.weight, invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gate_up_weight is not None  # `fuse` ran (`LlamaForCausalLM.prepare_weights`)
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_packed)
        fused = silu_mul_op(gate_up) if gate_up.is_contiguous() else None
        if fused is not None:
            act = fused(gate_up)
        else:
            n = self.intermediate_size
            act = F.silu(gate_up[:, :n]).mul_(gate_up[:, n:])
        return linear(act, self.down_proj.weight, self.down_proj.bias, self.down_packed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """``layers`` as what they are (an `nn.ModuleList` is typed as holding any module)."""
        return cast(Sequence[DecoderLayer], self.layers)


class LlamaForCausalLM(nn.Module):
    """The model; `forward` runs one flattened step against the per-layer KV caches."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head_packed: torch.Tensor | None = None  # set by `prepare_weights`
        self.tie_weights()
        self.rope = rope

    def num_bytes(self) -> int:
        """Bytes of the weights (a tied matrix once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare_weights(self, invariant: bool = False) -> None:
        """Concatenate each layer's q/k/v and gate/up weights for one GEMM each, and pack the linears for
        our GEMMs or oneDNN's where that pays (`kernels.cpu_linear.pack_weight`; ``invariant``:
        `EngineConfig.batch_invariant`); call it once the weights are final (`ModelRunner` does, and the
        first forward does if nobody did). Idempotent."""
        # Outside inference mode even when called from the forward: the fused weights are ordinary tensors,
        # so a later `load_state_dict` can still copy into the views that share their storage.
        with torch.inference_mode(False), torch.no_grad():
            for layer in self.model.decoder_layers:
                if layer.self_attn.qkv_weight is None:
                    layer.self_attn.fuse(invariant)
                if layer.mlp.gate_up_weight is None:
                    layer.mlp.fuse(invariant)
            if self.lm_head_packed is None:
                self.lm_head_packed = pack_weight(self.lm_head.weight, invariant)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm of the step's rows ``rows`` ([len(rows), hidden]; all rows
        [T, hidden] if None): the final norm runs on the rows that are read, not on every prefill token."""
        layers = self.model.decoder_layers
        if layers and layers[0].self_attn.qkv_weight is None:
            self.prepare_weights()
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope.lookup(positions)  # shared by every layer
        # Each sublayer's output is added to the residual stream by the norm that reads it next.
        delta: torch.Tensor | None = None
        for i, layer in enumerate(layers):
            x = layer.input_layernorm(h, delta)
            delta = layer.self_attn(x, cos, sin, k_caches[i], v_caches[i], meta, backend)
            delta = layer.mlp(layer.post_attention_layernorm(h, delta))
        if delta is not None:
            h.add_(delta)
        return self.model.norm(h if rows is None else h.index_select(0, rows))

    def packed_linears(self) -> list[torch.Tensor | None]:
        """Every linear's packed weight (`prepare_weights`), None where it is not packed."""
        layers = self.model.decoder_layers
        attn = [(a.qkv_packed, a.o_packed) for a in (layer.self_attn for layer in layers)]
        mlp = [(m.gate_up_packed, m.down_packed) for m in (layer.mlp for layer in layers)]
        return [p for pair in attn + mlp for p in pair] + [self.lm_head_packed]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden.contiguous(), self.lm_head.weight, packed=self.lm_head_packed)
