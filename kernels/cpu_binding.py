"""Our CPU kernels' C ABI (``kernels/csrc``) bound to tensors: `CpuOps` checks each call's shapes and
dtypes, allocates its outputs and passes raw pointers through ``ctypes``.

The kernels take no torch type, so compiling them parses no torch header (each file ~2 s, not ~25); what the
binding checks here, torch's op registration used to check in C++, with the same messages. Checks that read
the data (a block table's entries, a token's cache slot) stay in C++, before anything is read or written
through them; their errors come back through ``parrot_last_error``. Errors are `CpuKernelError`, a
``RuntimeError`` as the torch ops' were.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ABI_VERSION", "CpuKernelError", "CpuOps", "bind"]

ABI_VERSION = 1  # `parrot_abi_version` of the sources this binding was written for

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
# Each entry point's argument types (all return int: 0, or nonzero with `parrot_last_error` set).
_SIGNATURES: dict[str, list[Any]] = {
    "parrot_add_rms_norm": [_I32, _P, _P, _P, _P, _I64, _I64, _F32, _I32],
    "parrot_silu_mul": [_I32, _P, _P, _I64, _I64, _I32],
    "parrot_rope_write_kv": [_I32, _P, _P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I32],
    "parrot_paged_decode_partial": [_I32, _P, _P, _P, _P, _P, _P, _P, *[_I64] * 7, _F32, _I32],
    "parrot_paged_decode_vector_bits": [],
    "parrot_gemv_supports": [_I32],
    "parrot_gemv": [_I32, _P, _P, _P, _P, _I64, _I64, _I64, _I32],
    "parrot_packed_gemm_supported": [],
    "parrot_pack_bf16": [_P, _P, _I64, _I64, _I32],
    "parrot_packed_linear": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I32],
    "parrot_packed_gemm_f32_supported": [],
    "parrot_pack_f32": [_P, _P, _I64, _I64, _I32],
    "parrot_packed_linear_f32": [_P, _P, _P, _P, _I64, _I64, _I64, _I64, _I32],
}


class CpuKernelError(RuntimeError):
    """A CPU kernel refused its inputs; the message says which and why."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise CpuKernelError(message)


def _code(op: str, dtype: torch.dtype) -> int:
    code = _DTYPE_CODE.get(dtype)
    if code is None:
        raise CpuKernelError(f"{op}: float32, bfloat16 or float16, not {dtype}")
    return code


def _float_bias(op: str, bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    _check(bias.numel() == n, f"{op}: bias of {n} values")
    return bias.to(torch.float32).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class CpuOps:
    """The kernels of one loaded binary, as tensor functions (each documented where it is picked:
    `kernels.cpu_kernels`). Attributes, not methods: a caller may keep one and compare it by identity."""

    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_write_kv: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    paged_decode_partial: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    paged_decode_vector_bits: Callable[[], int]
    gemv_supports: Callable[[torch.dtype], bool]
    gemv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    packed_gemm_supported: Callable[[], bool]
    pack_bf16: Callable[[torch.Tensor], torch.Tensor]
    packed_linear: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]
    packed_gemm_f32_supported: Callable[[], bool]
    pack_f32: Callable[[torch.Tensor], torch.Tensor]
    packed_linear_f32: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


def bind(lib: ctypes.CDLL) -> CpuOps:
    """`CpuOps` over a loaded kernels binary; `CpuKernelError` if it is not of this binding's ABI.

    The functions run at every layer of every step: their checks read only a tensor's attributes, and a
    message is formatted only when a check fails."""
    version = getattr(lib, "parrot_abi_version", None)
    found = None if version is None else version()
    _check(found == ABI_VERSION, f"CPU kernels: the binary's ABI is {found}, this binding's {ABI_VERSION}")
    for name, argtypes in _SIGNATURES.items():
        entry = getattr(lib, name)
        entry.argtypes, entry.restype = argtypes, ctypes.c_int
    last_error = lib.parrot_last_error
    last_error.argtypes, last_error.restype = [], ctypes.c_char_p
    threads = torch.get_num_threads

    def failed() -> CpuKernelError:
        return CpuKernelError(last_error().decode())

    norm_entry = lib.parrot_add_rms_norm

    def add_rms_norm(
        h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        if not (h.dim() == 2 and h.is_contiguous()):
            raise CpuKernelError("h must be a contiguous [rows, hidden] tensor")
        rows, hidden = h.shape
        if not (weight.dim() == 1 and weight.shape[0] == hidden and weight.dtype == h.dtype):
            raise CpuKernelError("weight must be [hidden] of h's dtype")
        if delta is not None:
            if not (delta.shape == h.shape and delta.dtype == h.dtype):
                raise CpuKernelError("delta must be like h")
            delta = delta.contiguous()
        code, out = _code("add_rms_norm", h.dtype), torch.empty_like(h)
        w = weight.contiguous()
        if norm_entry(
            code, h.data_ptr(), _ptr(delta), w.data_ptr(), out.data_ptr(), rows, hidden, eps, threads()
        ):
            raise failed()
        return out

    silu_entry = lib.parrot_silu_mul

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if not (gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0):
            raise CpuKernelError("gate_up must be [T, 2n]")
        x = gate_up.contiguous()
        tokens, n = x.shape[0], x.shape[1] // 2
        code, out = _code("silu_mul", x.dtype), x.new_empty(tokens, n)
        if silu_entry(code, x.data_ptr(), out.data_ptr(), tokens, n, threads()):
            raise failed()
        return out

    rope_entry = lib.parrot_rope_write_kv

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
        shape = k_cache.shape
        if not (
            len(shape) == 4 and v_cache.shape == shape and k_cache.is_contiguous() and v_cache.is_contiguous()
        ):
            raise CpuKernelError(
                "k_cache and v_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]"
            )
        d, tokens = shape[3], qkv.shape[0]
        if not (shape[2] == kv_heads and d % 2 == 0):
            raise CpuKernelError("the cache's head shape disagrees with kv_heads")
        if not (qkv.dim() == 2 and qkv.shape[1] == (heads + 2 * kv_heads) * d):
            raise CpuKernelError("qkv must be [T, (H + 2 KVH) D]")
        if not (cos.numel() == tokens * d and sin.shape == cos.shape):
            raise CpuKernelError("cos and sin must hold [T, D] values")
        if not (slot_mapping.dtype == torch.int64 and slot_mapping.numel() == tokens):
            raise CpuKernelError("one int64 slot per token")
        dtype = qkv.dtype
        if not (
            cos.dtype == dtype and sin.dtype == dtype and k_cache.dtype == dtype and v_cache.dtype == dtype
        ):
            raise CpuKernelError("qkv, cos, sin and the caches must share one dtype")
        code = _code("rope_write_kv", dtype)
        x, c, s, slots = qkv.contiguous(), cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
        q, k = qkv.new_empty(tokens, heads, d), qkv.new_empty(tokens, kv_heads, d)
        if rope_entry(
            code,
            x.data_ptr(),
            c.data_ptr(),
            s.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slots.data_ptr(),
            shape[0] * shape[1],
            q.data_ptr(),
            k.data_ptr(),
            tokens,
            heads,
            kv_heads,
            d,
            threads(),
        ):
            raise failed()
        return q, k

    attention_entry = lib.parrot_paged_decode_partial

    def paged_decode_partial(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.dim() != 3:
            raise CpuKernelError("q must be [batch, heads, head_dim]")
        shape = k_cache.shape
        if not (len(shape) == 4 and v_cache.shape == shape):
            raise CpuKernelError("k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim]")
        if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu):
            raise CpuKernelError("CPU tensors")
        if not (q.dtype == k_cache.dtype == v_cache.dtype):
            raise CpuKernelError("q, k_cache and v_cache must share one dtype")
        if not (block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32):
            raise CpuKernelError("block_tables and context_lens must be int32")
        batch, q_heads, head_dim = q.shape
        num_blocks, block_size, kv_heads = shape[0], shape[1], shape[2]
        if not (shape[3] == head_dim and q_heads % kv_heads == 0):
            raise CpuKernelError("head shapes disagree")
        if not (
            block_tables.dim() == 2 and block_tables.shape[0] == batch and context_lens.shape[0] == batch
        ):
            raise CpuKernelError("one block table and one length per sequence")
        code = _code("paged_decode_partial", q.dtype)
        qc, kc, vc = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
        tables, lens = block_tables.contiguous(), context_lens.contiguous()
        out = torch.empty(batch, q_heads, head_dim, dtype=torch.float32)
        lse = torch.empty(batch, q_heads, dtype=torch.float32)
        if attention_entry(
            code,
            qc.data_ptr(),
            kc.data_ptr(),
            vc.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            lse.data_ptr(),
            batch,
            q_heads,
            head_dim,
            num_blocks,
            block_size,
            kv_heads,
            tables.shape[1],
            scale,
            threads(),
        ):
            raise failed()
        return out, lse

    gemv_dtypes = {dtype for dtype, code in _DTYPE_CODE.items() if lib.parrot_gemv_supports(code)}
    gemv_entry = lib.parrot_gemv

    def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not (x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1]):
            raise CpuKernelError("gemv: x [M, K] and w [N, K]")
        if not (x.dtype == w.dtype and x.dtype in gemv_dtypes):
            raise CpuKernelError(
                "gemv: x and w of one dtype this build runs (float32; bfloat16 with AVX512-BF16), not "
                f"{x.dtype} and {w.dtype}"
            )
        if not w.is_contiguous():
            raise CpuKernelError("gemv: a contiguous weight")
        xc = x.contiguous()
        (m, k), n = xc.shape, w.shape[0]
        b = _float_bias("gemv", bias, n)
        y = xc.new_empty(m, n)
        if (
            m
            and n
            and gemv_entry(
                _DTYPE_CODE[x.dtype], xc.data_ptr(), w.data_ptr(), _ptr(b), y.data_ptr(), m, k, n, threads()
            )
        ):
            raise failed()
        return y

    def packing(name: str, dtype: torch.dtype, panel: int) -> Callable[[torch.Tensor], torch.Tensor]:
        entry, pairs = getattr(lib, f"parrot_{name}"), 2 if dtype == torch.bfloat16 else 1
        kind = "bfloat16" if dtype == torch.bfloat16 else "float32"

        def pack(w: torch.Tensor) -> torch.Tensor:
            if not (w.dim() == 2 and w.dtype == dtype and w.shape[1] % pairs == 0):
                even = " with K even" if pairs == 2 else ""
                raise CpuKernelError(f"{name}: a {kind} weight [N, K]{even}, not {w.dtype} {list(w.shape)}")
            wc = w.contiguous()
            n, k = wc.shape
            lanes = (k // 2, panel, 2) if pairs == 2 else (k, panel)
            out = wc.new_empty((n + panel - 1) // panel, *lanes)
            if entry(wc.data_ptr(), out.data_ptr(), n, k, threads()):
                raise failed()
            return out

        return pack

    def packed(name: str, pack: str, dtype: torch.dtype, panel: int) -> Callable[..., torch.Tensor]:
        entry, pairs = getattr(lib, f"parrot_{name}"), 2 if dtype == torch.bfloat16 else 1
        dims = 4 if pairs == 2 else 3

        def linear(
            x: torch.Tensor, w: torch.Tensor, out_features: int, bias: torch.Tensor | None
        ) -> torch.Tensor:
            if not (x.dim() == 2 and x.dtype == dtype and w.dtype == dtype):
                kind = "bfloat16" if dtype == torch.bfloat16 else "float32"
                raise CpuKernelError(f"{name}: {kind} x [M, K] and a weight from {pack}")
            shape = w.shape
            if not (
                len(shape) == dims
                and shape[2] == panel
                and shape[-1] == (2 if dims == 4 else panel)
                and w.is_contiguous()
            ):
                raise CpuKernelError(f"{name}: a weight from {pack}, not {list(shape)}")
            (m, k), n, panels = x.shape, out_features, shape[0]
            if not (shape[1] * pairs == k and (n + panel - 1) // panel == panels and n > 0):
                raise CpuKernelError(
                    f"{name}: x has {k} features and the packed weight {shape[1] * pairs} for "
                    f"{panels * panel} outputs at most; asked for {n}"
                )
            xc = x.contiguous()
            b = None if bias is None else _float_bias(name, bias, n)
            y = xc.new_empty(m, n)
            if m and entry(xc.data_ptr(), w.data_ptr(), _ptr(b), y.data_ptr(), m, k, n, panels, threads()):
                raise failed()
            return y

        return linear

    return CpuOps(
        add_rms_norm=add_rms_norm,
        silu_mul=silu_mul,
        rope_write_kv=rope_write_kv,
        paged_decode_partial=paged_decode_partial,
        paged_decode_vector_bits=lambda: int(lib.parrot_paged_decode_vector_bits()),
        gemv_supports=lambda dtype: dtype in gemv_dtypes,
        gemv=gemv,
        packed_gemm_supported=lambda: bool(lib.parrot_packed_gemm_supported()),
        pack_bf16=packing("pack_bf16", torch.bfloat16, 16),
        packed_linear=packed("packed_linear", "pack_bf16", torch.bfloat16, 16),
        packed_gemm_f32_supported=lambda: bool(lib.parrot_packed_gemm_f32_supported()),
        pack_f32=packing("pack_f32", torch.float32, 8),
        packed_linear_f32=packed("packed_linear_f32", "pack_f32", torch.float32, 8),
    )
