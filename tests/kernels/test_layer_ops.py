"""The Triton layer kernels (`kernels.triton_layer_ops`) equal the torch ops they replace in the model.

Through the interpreter on CPU (fp32 and fp16: it computes bf16 wrongly), on the GPU where there is one
(bf16 too). The references are the model's own torch paths (`RMSNorm`'s ops, `rope.rotate` with
``index_copy_``, ``F.silu(gate) * up``), which follow Hugging Face's roundings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import layer_ops
from kernels.settings import LAYER_KERNELS
from server.engine.model import RMSNorm
from server.engine.rope import RotaryEmbedding, rotate

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="no triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3}}
TOL[torch.bfloat16] = {"rtol": 1.6e-2, "atol": 1.6e-2}


def _ops():  # type: ignore[no-untyped-def]
    from kernels import triton_layer_ops

    return triton_layer_ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a row narrower than its power-of-two block
def test_add_rms_norm_equals_the_model_norm(dtype: torch.dtype, with_delta: bool, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    h = torch.randn(5, hidden, generator=g).to(DEVICE, dtype)
    delta = torch.randn(5, hidden, generator=g).to(DEVICE, dtype) if with_delta else None
    norm = RMSNorm(hidden, 1e-5).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=g) + 0.5)
    h_ref = h.clone()
    if delta is not None:
        h_ref.add_(delta)
    x = h_ref.float()
    expected = (x * x.pow(2).mean(-1, keepdim=True).add_(1e-5).rsqrt_()).to(dtype).mul_(norm.weight)
    got = _ops().add_rms_norm(h, delta, norm.weight.detach(), 1e-5)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)  # the residual stream, updated in place
    torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
def test_rope_write_kv_equals_rotate_and_index_copy(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    t, d, blocks, page = 6, 32, 5, 4
    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE, dtype)
    rope = RotaryEmbedding(d, 64, 10000.0, None, torch.device(DEVICE), dtype)
    positions = torch.tensor([0, 3, 7, 20, 21, 63], device=DEVICE)
    cos, sin = rope.lookup(positions)
    slots = torch.tensor([19, 0, 5, 6, 12, 3], device=DEVICE)
    k_cache = torch.zeros(blocks, page, kv_heads, d, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref_cache, v_ref_cache = k_cache.clone(), v_cache.clone()

    qk = rotate(qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d), cos, sin)
    q_ref, k_ref = qk[:, :heads], qk[:, heads:]
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    k_ref_cache.view(-1, kv_heads, d).index_copy_(0, slots, k_ref)
    v_ref_cache.view(-1, kv_heads, d).index_copy_(0, slots, v)

    q, k = _ops().rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    # The interpreter gives the torch ops' very bits (same roundings, op for op); compiled for the H100,
    # 13-17% of half-precision elements came out one unit in the last place off.
    exact = dtype != torch.float32 and DEVICE == "cpu"
    tol = {"rtol": 0, "atol": 0} if exact else TOL[dtype]
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k, k_ref, **tol)
    torch.testing.assert_close(k_cache, k_ref_cache, **tol)
    torch.testing.assert_close(v_cache, v_ref_cache, rtol=0, atol=0)  # v is copied


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [48, 1100])  # 1100: two column blocks, the second partial
def test_silu_mul_equals_the_torch_ops(dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    gate_up = (3 * torch.randn(3, 2 * n, generator=g)).to(DEVICE, dtype)
    expected = F.silu(gate_up[:, :n]).mul_(gate_up[:, n:])
    torch.testing.assert_close(_ops().silu_mul(gate_up), expected, **TOL[dtype])


def test_empty_steps_launch_nothing() -> None:
    ops = _ops()
    h = torch.empty(0, 64, device=DEVICE, dtype=torch.float16)
    assert ops.add_rms_norm(h, None, torch.ones(64, device=DEVICE, dtype=torch.float16), 1e-5).shape == (
        0,
        64,
    )
    assert ops.silu_mul(torch.empty(0, 8, device=DEVICE, dtype=torch.float16)).shape == (0, 4)


def test_layer_ops_choose_by_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU every float dtype takes the C++ ops (where built); on CUDA fp32 keeps the torch ops and half
    precision takes the Triton ones, unless ``PARROT_LAYER_KERNELS=0``; a head dim that is no power of two
    keeps the torch RoPE there."""
    from kernels import cpu_kernels

    x32 = torch.zeros(2, 8)
    assert layer_ops.add_rms_norm_op(x32) is cpu_kernels.add_rms_norm_kernel()
    assert layer_ops.rope_write_kv_op(x32, 8) is cpu_kernels.rope_write_kv_kernel()
    assert layer_ops.silu_mul_op(x32) is cpu_kernels.silu_mul_kernel()
    assert layer_ops.add_rms_norm_op(torch.zeros(2, 8, dtype=torch.float64)) is None
    x16 = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert layer_ops.silu_mul_op(x16) is cpu_kernels.silu_mul_kernel()
    assert layer_ops.add_rms_norm_op(x16) is cpu_kernels.add_rms_norm_kernel()
    if DEVICE == "cuda":
        xc = x16.cuda()
        assert layer_ops.silu_mul_op(x32.cuda()) is None
        assert layer_ops.silu_mul_op(xc) is _ops().silu_mul
        assert layer_ops.rope_write_kv_op(xc, 96) is None
        monkeypatch.setenv(LAYER_KERNELS.name, "0")
        layer_ops.clear_cache()
        try:
            assert layer_ops.silu_mul_op(xc) is None
        finally:
            monkeypatch.undo()
            layer_ops.clear_cache()
