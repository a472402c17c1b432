"""`kernels.cpu_linear`: packed bf16 weights and the float32/bf16 GEMV against plain torch, which rows and
weights `linear` sends to each, and the engine's model using them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from benchmarks.harness.engine_models import engine_model
from kernels import cpu_kernels, cpu_linear
from kernels.settings import CPU_KERNELS
from server.engine import EngineConfig, LLMEngine, SamplingParams

BF16_NATIVE = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
needs_packing = pytest.mark.skipif(not BF16_NATIVE, reason="this CPU has no native bf16: nothing is packed")
BF16 = {"rtol": 2e-2, "atol": 2e-2}


F32_PACKED = cpu_kernels.packed_f32_ops() is not None


def test_only_native_bf16_and_avx2_float32_cpu_matrices_are_packed() -> None:
    # float32: for our AVX2 GEMM where it is built (CPUs without AVX-512), else nothing gains from packing
    f32 = cpu_linear.pack_weight(torch.randn(8, 4))
    assert (f32 is not None) == F32_PACKED
    assert f32 is None or (f32.dim() == 3 and cpu_linear.ours(f32))
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


def test_a_float32_engine_packs_only_for_the_avx2_gemm() -> None:
    with LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=16)) as engine:
        model = engine_model(engine)
        packed = model.packed_linears()
        if F32_PACKED:
            assert all(p is not None and p.dim() == 3 for p in packed)
        else:
            assert all(p is None for p in packed)


GEMV_DTYPES = [torch.float32, torch.bfloat16]


def _gemv_or_skip(dtype: torch.dtype) -> cpu_kernels.Gemv:
    gemv = cpu_kernels.gemv_kernel(dtype)
    if gemv is None:
        pytest.skip(f"no {dtype} GEMV built here (no AVX-512 / AVX512-BF16, or no compiler)")
    return gemv


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 32])
@pytest.mark.parametrize(("out", "inner"), [(96, 64), (13, 40), (200, 70), (8, 32), (3, 5)])
def test_the_gemv_equals_a_float32_product_rounded_once(
    dtype: torch.dtype, rows: int, out: int, inner: int
) -> None:
    """Row counts over and under a group of four, widths with a tail of columns (out % 8) and of lanes
    (inner % 16 or 32), with and without a bias: the float32 product (rounded once to bf16), up to the order
    of accumulation."""
    gemv = _gemv_or_skip(dtype)
    g = torch.Generator().manual_seed(rows * out + inner)
    x, w = torch.randn(rows, inner, generator=g).to(dtype), torch.randn(out, inner, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    for bias in (None, b):
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        got = gemv(x, w, bias)
        assert got.dtype == dtype and got.shape == (rows, out)
        torch.testing.assert_close(got.double(), want.to(dtype).double(), **tol)


def test_the_gemv_refuses_what_it_does_not_run() -> None:
    gemv = _gemv_or_skip(torch.float32)
    w = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="of one dtype"):
        gemv(torch.randn(1, 32, dtype=torch.float16), w.half(), None)
    with pytest.raises(RuntimeError, match="of one dtype"):
        gemv(torch.randn(1, 32, dtype=torch.bfloat16), w, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemv(torch.randn(1, 16), w[:, :16], None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        gemv(torch.randn(1, 31), w, None)
    with pytest.raises(RuntimeError, match="bias of 16"):
        gemv(torch.randn(1, 32), w, torch.randn(15))
    assert gemv(torch.randn(0, 32), w, None).shape == (0, 16)


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
def test_linear_takes_the_gemv_up_to_its_row_count_and_never_under_autograd(dtype: torch.dtype) -> None:
    _gemv_or_skip(dtype)
    limit = cpu_linear.GEMV_MAX_ROWS[dtype]
    w = torch.randn(24, 64).to(dtype)
    calls: list[int] = []
    real = cpu_kernels.gemv_kernel(dtype)

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        assert real is not None
        return real(x, weight, bias)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_linear, "gemv_kernel", lambda _: counted)
        for rows in (1, limit, limit + 1):
            cpu_linear.linear(torch.randn(rows, 64).to(dtype), w)
        cpu_linear.linear(torch.randn(1, 64).to(dtype), w.t().contiguous().t())  # a strided weight
        leaf = torch.randn(1, 64).to(dtype).requires_grad_()
        cpu_linear.linear(leaf, w).sum().backward()  # a gradient: torch's op
        assert leaf.grad is not None
    assert calls == [1, limit]


@pytest.mark.parametrize("dtype", GEMV_DTYPES)
def test_decode_at_batch_one_runs_its_linears_through_the_gemv(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A single-sequence decode step takes every projection and the LM head through the GEMV (four per layer
    and the head) — in bf16 through the packed GEMM where that is built, fill and decode alike; the tokens
    are those with both off."""
    real = _gemv_or_skip(dtype)
    packed_ops = cpu_kernels.packed_gemm_ops() if dtype == torch.bfloat16 else None
    calls: list[int] = []

    def counted(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, b)

    class CountedPacked:
        def __getattr__(self, name: str) -> Any:
            return getattr(packed_ops, name)

        def packed_linear(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
            calls.append(x.shape[0])
            return packed_ops.packed_linear(x, *rest)  # type: ignore[union-attr]

    def tokens(kernel: object, packed: object) -> tuple[list[int], int]:
        monkeypatch.setattr(cpu_linear, "gemv_kernel", lambda _: kernel)
        monkeypatch.setattr(cpu_linear, "packed_gemm_ops", lambda: packed)

        async def answer(engine: LLMEngine) -> list[int]:
            await engine.fill(1, list(range(5, 40)))
            return (await engine.generate(1, SamplingParams(max_tokens=6, ignore_eos=True))).token_ids

        config = EngineConfig(num_kv_blocks=64, dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
        with LLMEngine.from_pretrained("tiny", config) as engine:
            layers = len(engine_model(engine).model.layers)
            return asyncio.run(answer(engine)), layers

    with_kernels, layers = tokens(counted, CountedPacked() if packed_ops is not None else None)
    # the fill's last token is sampled from its logits (one row through the head; with the GEMV the fill's
    # 35 rows take oneDNN, with the packed GEMM they take it too), then each of the 5 decode steps runs 4
    # projections per layer and the head at one row
    fill = [35] * (4 * layers) if packed_ops is not None else []
    assert calls == fill + [1] + [1] * (5 * (4 * layers + 1))
    assert tokens(None, None)[0] == with_kernels


def _packed_ops() -> object:
    ops = cpu_kernels.packed_gemm_ops()
    if ops is None:
        pytest.skip("the packed bf16 GEMM is not built here (no compiler, or no AVX512-BF16)")
    return ops


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 1030])  # micro-kernel tails and a second row chunk
@pytest.mark.parametrize("out_features", [16, 40, 48, 100])  # whole panels, a short last panel, groups
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_packed_gemm_equals_a_float64_product(rows: int, out_features: int, with_bias: bool) -> None:
    ops: Any = _packed_ops()
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, 70, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 70, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    got = ops.packed_linear(x, ops.pack_bf16(w), out_features, b)
    expected = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    # float32 accumulation, one rounding to bf16 at the end: within bf16's half unit of the exact value
    torch.testing.assert_close(got.double(), expected, rtol=8e-3, atol=1e-2)


def test_the_packed_gemm_refuses_what_it_cannot_run() -> None:
    ops: Any = _packed_ops()
    w = torch.randn(32, 8, dtype=torch.bfloat16)
    packed = ops.pack_bf16(w)
    with pytest.raises(RuntimeError, match="K even"):
        ops.pack_bf16(torch.randn(32, 7, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 weight"):
        ops.pack_bf16(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        ops.packed_linear(torch.randn(2, 8), packed, 32, None)
    with pytest.raises(RuntimeError, match="x has 10 features"):
        ops.packed_linear(torch.randn(2, 10, dtype=torch.bfloat16), packed, 32, None)
    with pytest.raises(RuntimeError, match="asked for 40"):
        ops.packed_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias of 32"):
        ops.packed_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, 32, torch.zeros(3))
    assert ops.packed_linear(torch.empty(0, 8, dtype=torch.bfloat16), packed, 32, None).shape == (0, 32)


@needs_packing
def test_pack_weight_prefers_our_layout_and_linear_routes_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel built (and no AMX), a bf16 weight of even width is packed for it (4-D) and `linear`
    runs it at any row count, 3-D inputs included; an odd width, or the kernels off, keeps oneDNN's packed
    weight."""
    ops: Any = _packed_ops()
    monkeypatch.setattr(cpu_linear, "_amx", lambda: False)  # on an AMX CPU oneDNN's layout is preferred
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    packed = cpu_linear.pack_weight(w)
    assert packed is not None and packed.dim() == 4
    rows: list[int] = []

    class Spy:
        def packed_linear(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
            rows.append(x.shape[0])
            return ops.packed_linear(x, *rest)

    with monkeypatch.context() as spying:
        spying.setattr(cpu_linear, "packed_gemm_ops", lambda: Spy())
        x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
        got = cpu_linear.linear(x, w, None, packed)
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), **BF16)
    assert rows == [10] and got.shape == (2, 5, 48)
    odd = cpu_linear.pack_weight(torch.randn(48, 63, dtype=torch.bfloat16))
    assert odd is not None and odd.dim() != 4  # oneDNN's blocked weight
    monkeypatch.setenv(CPU_KERNELS.name, "0")
    cpu_kernels.clear_cache()
    try:
        off = cpu_linear.pack_weight(w)
        assert off is not None and off.dim() != 4
        y = torch.randn(3, 64, dtype=torch.bfloat16)
        torch.testing.assert_close(cpu_linear.linear(y, w, None, off).float(), F.linear(y, w).float(), **BF16)
    finally:
        monkeypatch.delenv(CPU_KERNELS.name)
        cpu_kernels.clear_cache()


def _f32_ops() -> Any:
    ops = cpu_kernels.packed_f32_ops()
    if ops is None:
        pytest.skip("the packed float32 GEMM is built only for AVX2 CPUs without AVX-512")
    return ops


# micro-kernel tails with and without the next group's prefetch (rows past the first 6), a second row chunk
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 300])
@pytest.mark.parametrize("out_features", [8, 20, 24, 100])  # whole panels, a short last panel, groups
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_packed_f32_gemm_equals_a_float64_product(rows: int, out_features: int, with_bias: bool) -> None:
    ops = _f32_ops()
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, 70, generator=gen)
    x = torch.randn(rows, 70, generator=gen)
    b = torch.randn(out_features, generator=gen) if with_bias else None
    got = ops.packed_linear_f32(x, ops.pack_f32(w), out_features, b)
    expected = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # every output row is summed in one order whatever the row count: row 0 alone is row 0 in the batch
    alone = ops.packed_linear_f32(x[:1], ops.pack_f32(w), out_features, b)
    assert torch.equal(alone[0], got[0])


def test_the_packed_f32_gemm_refuses_what_it_cannot_run() -> None:
    ops = _f32_ops()
    packed = ops.pack_f32(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="float32 weight"):
        ops.pack_f32(torch.randn(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="float32 x"):
        ops.packed_linear_f32(torch.randn(2, 8, dtype=torch.bfloat16), packed, 32, None)
    with pytest.raises(RuntimeError, match="x has 10 features"):
        ops.packed_linear_f32(torch.randn(2, 10), packed, 32, None)
    with pytest.raises(RuntimeError, match="asked for 40"):
        ops.packed_linear_f32(torch.randn(2, 8), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias of 32"):
        ops.packed_linear_f32(torch.randn(2, 8), packed, 32, torch.zeros(3))
    assert ops.packed_linear_f32(torch.empty(0, 8), packed, 32, None).shape == (0, 32)


def test_linear_runs_a_float32_weight_packed_for_our_gemm() -> None:
    ops = _f32_ops()
    w, b = torch.randn(40, 24), torch.randn(40)
    packed = cpu_linear.pack_weight(w)
    assert packed is not None and packed.dim() == 3
    x = torch.randn(2, 5, 24)
    got = cpu_linear.linear(x, w, b, packed)
    assert got.shape == (2, 5, 40)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(got.view(10, 40), ops.packed_linear_f32(x.view(10, 24), packed, 40, b))


@pytest.mark.parametrize(
    ("amx", "ours_built", "invariant", "override", "expected"),
    [
        (False, True, False, "auto", "ours"),  # AVX512-BF16 without tiles: our GEMM
        (True, True, False, "auto", "onednn"),  # AMX: only oneDNN drives the tiles
        (True, True, True, "auto", "ours"),  # batch invariance needs one summation order
        (True, True, False, "ours", "ours"),
        (False, True, False, "onednn", "onednn"),
        (False, False, False, "auto", "onednn"),  # ours not built: nothing else to run
        (True, False, True, "ours", "onednn"),
    ],
)
def test_the_bf16_gemm_is_chosen_by_the_cpu(
    amx: bool, ours_built: bool, invariant: bool, override: str, expected: str
) -> None:
    got = cpu_linear.choose_bf16_gemm(amx=amx, ours_built=ours_built, invariant=invariant, override=override)
    assert got == expected


def test_an_unknown_bf16_gemm_override_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="PARROT_BF16_GEMM='fast': use auto, ours or onednn"):
        cpu_linear.choose_bf16_gemm(amx=False, ours_built=True, invariant=False, override="fast")


@needs_packing
def test_on_an_amx_cpu_bf16_weights_are_packed_for_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX tiles (mocked), a bf16 weight goes to oneDNN's layout, unless batch invariance asks for
    ours; the product is the same either way."""
    _packed_ops()
    monkeypatch.setattr(cpu_linear, "_amx", lambda: True)
    w, x = torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(5, 64, dtype=torch.bfloat16)
    fast, invariant = cpu_linear.pack_weight(w), cpu_linear.pack_weight(w, invariant=True)
    assert fast is not None and not cpu_linear.ours(fast)
    assert invariant is not None and invariant.dim() == 4
    for packed in (fast, invariant):
        torch.testing.assert_close(
            cpu_linear.linear(x, w, None, packed).float(), F.linear(x, w).float(), **BF16
        )


def test_a_weight_packed_for_kernels_turned_off_since_runs_its_plain_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine's weights are packed once; a model whose kernels are turned off later (a second engine
    over the same weights, for an A/B) computes with the plain weight instead of failing."""
    _f32_ops()
    w, x = torch.randn(40, 24), torch.randn(3, 24)
    packed = cpu_linear.pack_weight(w)
    monkeypatch.setattr(cpu_linear, "packed_f32_ops", lambda: None)
    torch.testing.assert_close(cpu_linear.linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
