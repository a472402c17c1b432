"""The engine's linears on CPU: oneDNN where it beats ``F.linear``, with bf16 weights prepacked once.

On CPU, ``torch.mm``/``F.linear`` go to MKL, which on AMD parts runs only its AVX2 kernels: on an AVX-512
EPYC ~170 GFLOP/s on 2 cores, where oneDNN's linear uses AVX-512 and runs the model's shapes (and the
attention GEMMs of ``torch_path``) at 330-420; on an AVX2 EPYC oneDNN is still the faster of the two
(1.05-1.2x at 1-64 rows, 1.5-2.2x for a 49k-row LM head). oneDNN reads a float32 weight either row-major
or as the transpose of a row-major matrix; any other stride (a head sliced out of a [tokens, heads, dim]
tensor) takes a path a thousand times slower, so callers pass contiguous matrices.

bf16 is different: given a plain bf16 weight, oneDNN reorders it into its blocked layout on every call, and
``F.linear`` is no faster. Reordered once (``pack_weight``), the same GEMM runs 1.7-2.3x faster on the
decoder's shapes at 1-16 rows and 2.9x on SmolLM2's tied LM head at one row (measured on a bf16-native EPYC,
2 cores), with bit-identical results. For float32 a packed weight gains nothing measurable, so only bf16 is
packed. A packed weight is a copy: the plain parameters stay (state dicts, the embedding a tied LM head
shares, other devices), which costs the linears' bytes once more.

Where our C++ kernels are built, bf16 weights are packed for our own GEMM instead (`pack_weight`,
``kernels/csrc/packed_gemm_cpu.cpp``: panels of 16 output features laid out for AVX512-BF16's dot product,
an 8-row x 3-panel register-blocked micro-kernel), which `linear` takes at every row count. Over SmolLM2's
30 layers of linears (weights streamed from DRAM, 2 cores, against oneDNN's packed weight): 1.17x at 1 row,
1.33x at 2, 1.13-1.29x at 3-8, 1.2x at 16, 1.1x at 32, 1.15x at 64 (also 1.13x and 1.2x faster than our GEMV
at 1-2 rows), 1.4-1.5x at 256-2,048 rows on the main thread. In the engine (SmolLM2 bf16, interleaved A/B
runs): decode steps 1.13x faster at batch 16 and 1.1x at 64, equal at batch 1, fills of 2,200 tokens equal
(with passes of 192 rows over the weights they were 2-4% slower: at thousands of rows the weights were read
from DRAM once per pass, so a pass now takes 1,024 rows). Its results are not oneDNN's bit for bit (another
summation order), which can turn a bf16 near-tie the other way.

At few rows (decode steps) a linear is a read of its weight, and oneDNN reads it slowly here: our kernel
(`kernels.cpu_kernels.gemv_kernel`: FMA for float32, AVX512-BF16 dot products for bf16, over the plain
weight) takes those rows where it is built. Measured on SmolLM2's 30 layers of linears (2 cores, bf16-native
EPYC, median of 8 sweeps): float32 1.9x oneDNN at 1 row, 2.1x at 2, 1.9x at 4, 1.45x at 8; bf16 (against
the packed weight) 1.4x at 1 row, 1.2x at 2, 1.08x at 3, 0.97x at 4. In the engine (SmolLM2 decode steps,
everything else included) float32 gained 1.27x at batch 1, 1.21x at 4, 1.25x at 8, nothing at 16 and lost
at 32 (0.79x; the sweeps alone still showed 1.1x there): float32 stops at 8 rows.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

from kernels.cpu_kernels import gemv_kernel, packed_f32_ops, packed_gemm_ops
from kernels.settings import BF16_GEMM

__all__ = [
    "GEMV_MAX_ROWS",
    "Bf16Gemm",
    "bf16_gemm",
    "choose_bf16_gemm",
    "linear",
    "onednn_linear",
    "ours",
    "pack_weight",
    "use_onednn",
]

# Rows the packed layout is chosen for: decode steps (1-64 rows) dominate; prefill's hundreds of rows run
# as fast with it as with any other hint (measured 1.0-1.1x of F.linear either way).
_PACK_ROWS_HINT = 1
# On an AMX CPU, the rows oneDNN's layout is chosen for: a batch of decode steps, as vLLM's CPU linears
# (``create_onednn_mm(weight, 32)``), so the primitive picked for it is an AMX one.
_AMX_PACK_ROWS_HINT = 32
Bf16Gemm = Literal["ours", "onednn"]
# Most rows a linear takes through `gemv_kernel` rather than oneDNN, per dtype (measured above); a bf16
# weight packed for our GEMM goes there instead, at every row count.
GEMV_MAX_ROWS: dict[torch.dtype, int] = {torch.float32: 8, torch.bfloat16: 2}


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` through oneDNN; ``w`` plain (row-major or a transposed row-major) or packed."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


@functools.cache
def _onednn_usable() -> bool:
    """Whether oneDNN's fp32 linear is usable and exact here, for both operand layouts the GEMM helpers pass
    (it is torch-internal: check, not assume)."""
    try:
        x, w, b = torch.randn(5, 32), torch.randn(40, 32), torch.randn(40)
        nt = torch.allclose(onednn_linear(x, w, b), x @ w.t() + b, rtol=1e-5, atol=1e-5)
        v = torch.randn(32, 40)
        nn = torch.allclose(onednn_linear(x, v.t()), x @ v, rtol=1e-5, atol=1e-5)
        return nt and nn
    except Exception:  # missing op, torch built without oneDNN, ...
        return False


@functools.cache
def _packing_usable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and multiplies ``dtype`` weights here, natively and matching ``F.linear``."""
    if dtype != torch.bfloat16:
        return False
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False  # emulated bf16: slower than F.linear, nothing to gain
        x, w = torch.randn(3, 64, dtype=dtype), torch.randn(48, 64, dtype=dtype)
        b = torch.randn(48, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT)
        got = onednn_linear(x, packed, b).float()
        return torch.allclose(got, F.linear(x, w, b).float(), rtol=2e-2, atol=2e-2)
    except Exception:
        return False


def choose_bf16_gemm(*, amx: bool, ours_built: bool, invariant: bool, override: str = "auto") -> Bf16Gemm:
    """Which GEMM runs bf16 linears (over weights packed for it): our AVX512-BF16 one where it is built,
    except on a CPU with AMX tiles, whose bf16 matrix units only oneDNN drives (vLLM's CPU linears go there
    too): there a vector dot product computes several times slower than the tiles (an AMX Xeon, 2 cores:
    ours at batch 16-64 ran at the ~100 GFLOP/s of its dot products, vLLM's oneDNN at ~350). ``invariant``
    (`EngineConfig.batch_invariant`) needs ours wherever it is built: it sums each output row in one order
    at every row count. ``override`` ("ours" / "onednn", from `kernels.settings.BF16_GEMM`) wins where it
    can run."""
    if override not in ("auto", "ours", "onednn"):
        raise ValueError(f"${BF16_GEMM.name}={override!r}: use auto, ours or onednn")
    if not ours_built or override == "onednn":
        return "onednn"
    if invariant or override == "ours":
        return "ours"
    return "onednn" if amx else "ours"


@functools.cache
def _amx() -> bool:
    """Whether this CPU has AMX tiles (torch's own cpuid probe)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def bf16_gemm(invariant: bool = False) -> Bf16Gemm:
    """`choose_bf16_gemm` for this CPU, this build and ``$PARROT_BF16_GEMM``."""
    return choose_bf16_gemm(
        amx=_amx(),
        ours_built=packed_gemm_ops() is not None,
        invariant=invariant,
        override=BF16_GEMM.get(),
    )


def use_onednn(x: torch.Tensor) -> bool:
    """Whether a float32 GEMM on ``x`` goes through oneDNN (CPU, and the op usable)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _onednn_usable()


def pack_weight(weight: torch.Tensor, invariant: bool = False) -> torch.Tensor | None:
    """``weight`` ([out, in]) packed for `linear`'s ``packed``, where that pays: float32 for our AVX2 GEMM
    (`kernels.cpu_kernels.packed_f32_ops`, a 3-D tensor) where it is built; bf16 on a CPU with native bf16
    for the GEMM `bf16_gemm` picks (``invariant``: `EngineConfig.batch_invariant`): ours
    (`kernels.cpu_kernels.packed_gemm_ops`, a 4-D tensor) where ``in`` is even, else oneDNN's blocked
    layout; None elsewhere. Pack only final weights: the copy does not follow later writes to ``weight``."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    f32_ops = packed_f32_ops() if weight.dtype == torch.float32 else None
    if f32_ops is None and not _packing_usable(weight.dtype):
        return None
    with torch.inference_mode(False), torch.no_grad():
        plain = weight.detach().contiguous()
        if f32_ops is not None:
            return f32_ops.pack_f32(plain)
        ops = packed_gemm_ops()
        if ops is not None and plain.shape[1] % 2 == 0 and bf16_gemm(invariant) == "ours":
            return ops.pack_bf16(plain)
        hint = _AMX_PACK_ROWS_HINT if _amx() else _PACK_ROWS_HINT
        return torch.ops.mkldnn._reorder_linear_weight(plain, hint)


def ours(packed: torch.Tensor | None) -> bool:
    """Whether ``packed`` (from `pack_weight`) is laid out for one of our GEMMs, not oneDNN's."""
    return packed is not None and packed.dim() in (3, 4)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: on CPU through our kernel at up to `GEMV_MAX_ROWS` rows of ``x`` where
    it is built for their dtype, else through ``packed`` (from `pack_weight(weight)`) where given and ``x``
    is of its dtype, through oneDNN for contiguous float32 operands, else (and wherever a gradient is
    recorded) through torch."""
    if x.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)  # our kernel and oneDNN's op have no backward
    if packed is not None and ours(packed) and x.dtype == packed.dtype:
        # (the kernels may have been turned off since the weight was packed: then the plain weight runs)
        f32 = packed.dim() == 3
        ops = packed_f32_ops() if f32 else packed_gemm_ops()
        if ops is not None:
            flat = x.reshape(-1, x.shape[-1])
            gemm = ops.packed_linear_f32 if f32 else ops.packed_linear
            return gemm(flat, packed, weight.shape[0], bias).view(*x.shape[:-1], -1)
    if x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS.get(x.dtype, 0):
        plain = x.dtype == weight.dtype and weight.is_contiguous()
        gemv = gemv_kernel(x.dtype) if plain else None
        if gemv is not None:
            return gemv(x, weight, bias)
    if packed is not None and not ours(packed) and x.dtype == packed.dtype:
        return onednn_linear(x.contiguous(), packed, bias)
    if use_onednn(x) and x.is_contiguous() and weight.is_contiguous():
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)
