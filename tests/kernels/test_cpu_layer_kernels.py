"""The fused CPU kernels of a layer's elementwise parts equal the torch ops they replace, bit for bit.

RoPE + KV write against `server.engine.rope.rotate` and two `index_copy_`; SwiGLU's activation against
``F.silu(gate) * up`` — in bf16 and fp16, on the vectorised path (head dim 64, width a multiple of 16) and the
plain loops; fp32 to a few ulps (the compiler may contract a product and a sum into one FMA, and the exp
may be another's; SwiGLU's is bit for bit on AVX2, where both take SLEEF's); bad slots are refused before
anything is written; and the model takes the kernels for bf16 and gives the same tokens as with them off.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from server.engine.rope import RotaryEmbedding, rotate

rope_write_kv = cpu_kernels.rope_write_kv_kernel()
silu_mul = cpu_kernels.silu_mul_kernel()
pytestmark = pytest.mark.skipif(
    rope_write_kv is None, reason="the CPU kernels could not be built here (see the log)"
)

HEADS, KV_HEADS, BLOCKS, BLOCK_SIZE = 9, 3, 20, 16


def _case(dtype: torch.dtype, head_dim: int, tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(head_dim, 1024, 10000.0, None, torch.device("cpu"), dtype)
    cos, sin = rope.lookup(torch.randint(0, 1024, (tokens,), generator=g))
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * head_dim, generator=g).to(dtype)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=g)[:tokens]
    return qkv, cos, sin, slots


def _caches(dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, head_dim)
    return torch.full(shape, 7.0, dtype=dtype), torch.full(shape, -7.0, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 40])  # vector lanes (halves of 32); plain loops (halves of 20)
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_rope_write_kv_equals_rotate_and_index_copy(dtype: torch.dtype, head_dim: int, tokens: int) -> None:
    qkv, cos, sin, slots = _case(dtype, head_dim, tokens, seed=tokens)
    k_cache, v_cache = _caches(dtype, head_dim)
    assert rope_write_kv is not None
    q, k = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, HEADS, KV_HEADS)

    qk = rotate(qkv[:, : (HEADS + KV_HEADS) * head_dim].view(tokens, HEADS + KV_HEADS, head_dim), cos, sin)
    v = qkv[:, (HEADS + KV_HEADS) * head_dim :].view(tokens, KV_HEADS, head_dim)
    want_k, want_v = _caches(dtype, head_dim)
    want_k.view(-1, KV_HEADS, head_dim).index_copy_(0, slots, qk[:, HEADS:])
    want_v.view(-1, KV_HEADS, head_dim).index_copy_(0, slots, v)
    assert q.shape == (tokens, HEADS, head_dim) and q.is_contiguous()
    assert torch.equal(q, qk[:, :HEADS]) and torch.equal(k, qk[:, HEADS:])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_rope_write_kv_refuses_a_slot_outside_the_cache_before_writing() -> None:
    qkv, cos, sin, slots = _case(torch.bfloat16, 64, 4, seed=0)
    k_cache, v_cache = _caches(torch.bfloat16, 64)
    slots[-1] = BLOCKS * BLOCK_SIZE
    assert rope_write_kv is not None
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, HEADS, KV_HEADS)
    untouched_k, untouched_v = _caches(torch.bfloat16, 64)
    assert torch.equal(k_cache, untouched_k) and torch.equal(v_cache, untouched_v)


def test_fp32_equals_the_torch_ops_to_a_few_ulps() -> None:
    tokens, head_dim = 7, 64
    qkv, cos, sin, slots = _case(torch.float32, head_dim, tokens, seed=1)
    k_cache, v_cache = _caches(torch.float32, head_dim)
    assert rope_write_kv is not None and silu_mul is not None
    q, k = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, HEADS, KV_HEADS)
    qk = rotate(qkv[:, : (HEADS + KV_HEADS) * head_dim].view(tokens, HEADS + KV_HEADS, head_dim), cos, sin)
    tol = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(q, qk[:, :HEADS], **tol)
    torch.testing.assert_close(k, qk[:, HEADS:], **tol)
    torch.testing.assert_close(k_cache.view(-1, KV_HEADS, head_dim)[slots], qk[:, HEADS:], **tol)
    v = qkv[:, (HEADS + KV_HEADS) * head_dim :].view(tokens, KV_HEADS, head_dim)
    assert torch.equal(v_cache.view(-1, KV_HEADS, head_dim)[slots], v)  # v is copied
    gate_up = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)) * 4
    want = F.silu(gate_up[:, :40]).mul_(gate_up[:, 40:])
    torch.testing.assert_close(silu_mul(gate_up), want, **tol)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        silu_mul(gate_up.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [1536, 40])  # vector lanes; plain loops
@pytest.mark.parametrize("tokens", [1, 64])
def test_silu_mul_equals_the_torch_ops(dtype: torch.dtype, width: int, tokens: int) -> None:
    gate_up = (torch.randn(tokens, 2 * width, generator=torch.Generator().manual_seed(width)) * 4).to(dtype)
    assert silu_mul is not None
    got = silu_mul(gate_up)
    want = F.silu(gate_up[:, :width]).mul_(gate_up[:, width:])
    assert got.shape == (tokens, width) and torch.equal(got, want)


@pytest.mark.parametrize("width", [1536, 44])  # eight float32 lanes (AVX2's SLEEF exp); the plain loop
@pytest.mark.parametrize("tokens", [1, 64])
def test_fp32_silu_mul_equals_the_torch_ops_to_a_few_ulps(width: int, tokens: int) -> None:
    gate_up = torch.randn(tokens, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    assert silu_mul is not None
    want = F.silu(gate_up[:, :width]).mul_(gate_up[:, width:])
    torch.testing.assert_close(silu_mul(gate_up), want, rtol=1e-6, atol=1e-6)


def test_the_model_takes_the_kernels_for_bf16_with_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from server.engine import EngineConfig, LLMEngine, SamplingParams, model as model_module

    calls = {"rope": 0, "silu": 0}

    def counted(name: str, kernel: object) -> object:
        def run(*args: object) -> object:
            calls[name] += 1
            return kernel(*args)  # type: ignore[operator]

        return run

    monkeypatch.setattr(model_module, "rope_write_kv_op", lambda qkv, d: counted("rope", rope_write_kv))
    monkeypatch.setattr(model_module, "silu_mul_op", lambda gate_up: counted("silu", silu_mul))
    prompt = list(range(5, 40))
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)

    def tokens() -> list[int]:
        async def answer(engine: LLMEngine) -> list[int]:
            await engine.fill(1, prompt)
            return (await engine.generate(1, sampling)).token_ids

        with LLMEngine.from_pretrained("tiny", EngineConfig(dtype="bfloat16", num_kv_blocks=64)) as engine:
            return asyncio.run(answer(engine))

    fused = tokens()
    layers = calls["rope"]
    assert layers > 0 and calls["silu"] == layers  # one call each per layer and step
    monkeypatch.setattr(model_module, "rope_write_kv_op", lambda qkv, d: None)
    monkeypatch.setattr(model_module, "silu_mul_op", lambda gate_up: None)
    assert tokens() == fused
