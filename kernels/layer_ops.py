"""Which fused kernels run a layer's small parts (residual add + RMSNorm, RoPE with the KV write, SwiGLU's
activation) for a given activation tensor: our C++ ops on CPU (`kernels.cpu_kernels`) for fp32, bf16 and
fp16, the Triton twins on CUDA (`kernels.triton_layer_ops`) for bf16 and fp16 — fp32 on CUDA keeps the
reference's torch ops. None means: run the torch ops. On CPU in fp32 (the engine's dtype where the CPU has
no native bf16) the ops do the reference's arithmetic but not always its bits (a norm's sum in another
order, an FMA where the compiler contracts a product and a sum); SmolLM2's fp32 decode on an AVX2 EPYC,
the three against the torch ops interleaved in one process: 1.19x / 1.05x / 1.07x at batch 1 / 16 / 64.

``PARROT_LAYER_KERNELS=0`` turns the CUDA ones off (an A/B switch for measurements; the CPU ones have their
own, ``PARROT_CPU_KERNELS``). Importing this module never imports triton.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from kernels import cpu_kernels
from kernels.cpu_kernels import AddRMSNorm, RopeWriteKV, SiluMul
from kernels.settings import LAYER_KERNELS

__all__ = ["add_rms_norm_op", "clear_cache", "rope_write_kv_op", "silu_mul_op"]

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _triton_ops() -> ModuleType | None:
    if not LAYER_KERNELS.get():
        return None
    from kernels import triton_available

    if not triton_available():
        return None
    from kernels import triton_layer_ops  # deferred: importing triton is slow and optional

    return triton_layer_ops


def _cuda_ops(x: torch.Tensor) -> ModuleType | None:
    return _triton_ops() if x.device.type == "cuda" and x.dtype in _HALF else None


def _cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, *_HALF)


def add_rms_norm_op(x: torch.Tensor) -> AddRMSNorm | None:
    """The fused residual add + RMSNorm for activations like ``x``, or None."""
    if _cpu(x):
        return cpu_kernels.add_rms_norm_kernel()
    ops = _cuda_ops(x)
    return None if ops is None else ops.add_rms_norm


def rope_write_kv_op(qkv: torch.Tensor, head_dim: int) -> RopeWriteKV | None:
    """RoPE of q and k with the step's K/V written to the cache, for the fused projection ``qkv``, or None
    (the Triton kernel needs a power-of-two head dim)."""
    if _cpu(qkv):
        return cpu_kernels.rope_write_kv_kernel()
    ops = _cuda_ops(qkv)
    return None if ops is None or head_dim & (head_dim - 1) else ops.rope_write_kv


def silu_mul_op(gate_up: torch.Tensor) -> SiluMul | None:
    """SwiGLU's ``silu(gate) * up`` over the fused projection ``gate_up``, or None."""
    if _cpu(gate_up):
        return cpu_kernels.silu_mul_kernel()
    ops = _cuda_ops(gate_up)
    return None if ops is None else ops.silu_mul


def clear_cache() -> None:
    """Forget the environment switch's value (tests that set it)."""
    _triton_ops.cache_clear()
