"""`kernels.cpu_linear`: packed bf16 weights and the bf16 GEMV against plain torch, and the engine's model
using them."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from benchmarks.harness.engine_models import engine_model
from kernels import cpu_kernels, cpu_linear
from server.engine import EngineConfig, LLMEngine, SamplingParams

BF16_NATIVE = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
needs_packing = pytest.mark.skipif(not BF16_NATIVE, reason="this CPU has no native bf16: nothing is packed")
BF16 = {"rtol": 2e-2, "atol": 2e-2}


def test_only_native_bf16_cpu_matrices_are_packed() -> None:
    assert cpu_linear.pack_weight(torch.randn(8, 4)) is None  # fp32: packing gains nothing
    assert cpu_linear.pack_weight(torch.randn(8, 4, dtype=torch.float16)) is None
    assert cpu_linear.pack_weight(torch.randn(8, dtype=torch.bfloat16)) is None
    packed = cpu_linear.pack_weight(torch.randn(8, 4, dtype=torch.bfloat16))
    assert (packed is not None) == BF16_NATIVE


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_linear_equals_torch(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    w = torch.randn(96, 80, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 80, dtype=torch.bfloat16)
    packed = cpu_linear.pack_weight(w)
    got = cpu_linear.linear(x, w, b, packed)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), **BF16)
    # A strided input (a column slice) is made contiguous, not misread.
    wide = torch.randn(rows, 160, dtype=torch.bfloat16)
    torch.testing.assert_close(
        cpu_linear.linear(wide[:, :80], w, b, packed).float(), F.linear(wide[:, :80], w, b).float(), **BF16
    )


@needs_packing
def test_a_packed_weight_is_ignored_for_inputs_of_another_dtype() -> None:
    w = torch.randn(16, 8, dtype=torch.bfloat16)
    x = torch.randn(2, 8)
    got = cpu_linear.linear(x, w.float(), None, cpu_linear.pack_weight(w))
    torch.testing.assert_close(got, F.linear(x, w.float()))


@needs_packing
def test_a_bf16_engine_runs_every_linear_through_its_packed_weight() -> None:
    """Every projection and the (tied) LM head of a bf16 model get a packed copy, and the layer outputs
    equal those through the plain weights."""
    with LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=16, dtype="bfloat16")) as engine:
        model = engine_model(engine)
        layers = model.model.layers
        attn, mlp = layers[0].self_attn, layers[0].mlp
        for layer in layers:
            a, m = layer.self_attn, layer.mlp
            assert None not in (a.qkv_packed, a.o_packed, m.gate_up_packed, m.down_packed)
        assert model.lm_head_packed is not None
        torch.manual_seed(0)
        hidden = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
        packed_mlp, packed_logits = mlp(hidden), model.compute_logits(hidden)
        qkv_packed = cpu_linear.linear(hidden, attn.qkv_weight, attn.qkv_bias, attn.qkv_packed)
        mlp.gate_up_packed = mlp.down_packed = model.lm_head_packed = None
        torch.testing.assert_close(packed_mlp.float(), mlp(hidden).float(), **BF16)
        torch.testing.assert_close(packed_logits.float(), model.compute_logits(hidden).float(), **BF16)
        torch.testing.assert_close(qkv_packed.float(), F.linear(hidden, attn.qkv_weight).float(), **BF16)


def test_a_float32_engine_packs_nothing() -> None:
    with LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=16)) as engine:
        model = engine_model(engine)
        assert model.lm_head_packed is None
        assert all(layer.mlp.down_packed is None for layer in model.model.layers)


gemv = cpu_kernels.bf16_gemv_kernel()
needs_gemv = pytest.mark.skipif(
    gemv is None, reason="no AVX512-BF16 GEMV built here (no such CPU, or no compiler)"
)


@needs_gemv
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("out", "inner"), [(96, 64), (13, 40), (200, 70), (8, 32), (3, 5)])
def test_the_gemv_equals_a_float32_product_rounded_once(rows: int, out: int, inner: int) -> None:
    """Every row count the kernel takes, widths with a tail of columns (out % 8) and of lanes (inner % 32),
    with and without a bias: the float32 product rounded to bf16, within one bf16 step of accumulation
    order."""
    assert gemv is not None
    g = torch.Generator().manual_seed(rows * out + inner)
    x, w = torch.randn(rows, inner, generator=g), torch.randn(out, inner, generator=g)
    b = torch.randn(out, generator=g)
    x, w, b = x.bfloat16(), w.bfloat16(), b.bfloat16()
    for bias in (None, b):
        want = x.float() @ w.float().T + (0 if bias is None else bias.float())
        got = gemv(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@needs_gemv
def test_the_gemv_refuses_what_it_does_not_run() -> None:
    assert gemv is not None
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        gemv(torch.randn(5, 32, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemv(torch.randn(1, 32), w.float(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemv(torch.randn(1, 16, dtype=torch.bfloat16), w[:, :16], None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        gemv(torch.randn(1, 31, dtype=torch.bfloat16), w, None)


@needs_gemv
def test_decode_at_batch_one_runs_its_linears_through_the_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 engine's single-sequence decode step takes every projection and the LM head through the GEMV
    (four per layer and the head), a prefill none; the tokens are those with the GEMV off."""
    calls: list[int] = []

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        assert gemv is not None
        return gemv(x, w, b)

    def tokens(kernel: object) -> tuple[list[int], int]:
        monkeypatch.setattr(cpu_linear, "bf16_gemv_kernel", lambda: kernel)

        async def answer(engine: LLMEngine) -> list[int]:
            await engine.fill(1, list(range(5, 40)))
            return (await engine.generate(1, SamplingParams(max_tokens=6, ignore_eos=True))).token_ids

        with LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=64, dtype="bfloat16")) as engine:
            layers = len(engine_model(engine).model.layers)
            return asyncio.run(answer(engine)), layers

    with_gemv, layers = tokens(counted)
    # the fill's last token is sampled from its logits (one row through the head); each of the 5 decode
    # steps runs 4 projections per layer and the head at one row
    assert calls == [1] + [1] * (5 * (4 * layers + 1))
    assert tokens(None)[0] == with_gemv
