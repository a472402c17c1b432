"""Triton kernels for a layer's small parts on CUDA: residual add + RMSNorm, RoPE with the KV write, SwiGLU's
``silu(gate) * up``.

A 7B decode step at batch 1 on an H100 ran ~40 kernels per layer, most of them elementwise ops of a
microsecond or two: with the step replayed as a CUDA graph they were ~1.5 ms of a 6.9 ms step whose weight
reads take 4.6 ms (`benchmarks.gpu_steps`). These three kernels replace ~20 of them per layer. They are the
CUDA twins of `kernels.cpu_kernels`' C++ ops, with the same signatures (`AddRMSNorm`, `RopeWriteKV`,
`SiluMul`) and the reference's roundings: each product or sum is rounded to the activation dtype where
Hugging Face's ops round it; only the norm's mean is summed in another order.

Plain pointer arithmetic, so the interpreter (``TRITON_INTERPRET=1``) runs them on CPU for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm", "rope_write_kv", "silu_mul"]


@triton.jit
def _add_rms_norm_kernel(
    h_ptr, delta_ptr, w_ptr, out_ptr, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(h_ptr + row * n + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * n + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * n + cols, h, mask=mask)  # the residual stream, updated in place
    x = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * rstd).to(h_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + cols, out, mask=mask)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``h += delta`` (when given) in place, then the RMSNorm of ``h``'s rows times ``weight``."""
    rows, n = h.shape
    out = torch.empty_like(h)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            h, delta if delta is not None else h, weight, out, n, eps,
            HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(n),
        )  # fmt: skip
    return out


@triton.jit
def _rope_write_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, q_ptr, k_ptr,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    # One program per (token, head of q, k or v): q and k heads are rotated, k and v heads go to the cache.
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, HEAD_DIM)
    row = qkv_ptr + t * (HEADS + 2 * KV_HEADS) * HEAD_DIM + head * HEAD_DIM
    x = tl.load(row + cols)
    slot = tl.load(slots_ptr + t)
    dtype = qkv_ptr.dtype.element_ty
    if head < HEADS + KV_HEADS:
        # rotate_half without its negation (the sin table is sign-folded, `server.engine.rope`), and the
        # reference's roundings: swapped * sin and x * cos each rounded, then their sum.
        swapped = tl.load(row + (cols + half) % HEAD_DIM)
        cos = tl.load(cos_ptr + t * HEAD_DIM + cols).to(tl.float32)
        sin = tl.load(sin_ptr + t * HEAD_DIM + cols).to(tl.float32)
        a = (swapped.to(tl.float32) * sin).to(dtype)
        b = (x.to(tl.float32) * cos).to(dtype)
        rotated = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
        if head < HEADS:
            tl.store(q_ptr + (t * HEADS + head) * HEAD_DIM + cols, rotated)
        else:
            kv_head = head - HEADS
            tl.store(k_ptr + (t * KV_HEADS + kv_head) * HEAD_DIM + cols, rotated)
            tl.store(k_cache_ptr + (slot * KV_HEADS + kv_head) * HEAD_DIM + cols, rotated)
    else:
        kv_head = head - HEADS - KV_HEADS
        tl.store(v_cache_ptr + (slot * KV_HEADS + kv_head) * HEAD_DIM + cols, x)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of the fused projection ``qkv`` [T, (H + 2 KVH) D] rotated (``cos``/``sin`` [T, D] or
    [T, 1, D]); k and v written to their cache slots. Returns q [T, H, D] and k [T, KVH, D]. The head dim
    must be a power of two (every LLaMA-family model's is)."""
    t = qkv.shape[0]
    d = qkv.shape[1] // (heads + 2 * kv_heads)
    q = torch.empty(t, heads, d, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, kv_heads, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_write_kv_kernel[(t, heads + 2 * kv_heads)](
            qkv, cos.reshape(t, d), sin.reshape(t, d), k_cache, v_cache, slot_mapping, q, k,
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=d,
        )  # fmt: skip
    return q, k


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu rounds its result, then the product is rounded
    tl.store(out_ptr + row * n + cols, (act.to(tl.float32) * up).to(dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused projection ``gate_up`` [T, 2n] (gate first): [T, n]."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out
