"""Compile the Triton kernels for an NVIDIA target without a GPU (``python -m tests.kernels.compile_check``).

The interpreter runs kernels as numpy and accepts code the real compiler rejects (non-constexpr globals,
type mismatches, unsupported ops), so CPU-only runs also push every kernel through triton's CUDA frontend
and ptxas. Must run without ``TRITON_INTERPRET`` (the test spawns it in a clean process).
"""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import triton_kernels as tk, triton_layer_ops as lo, triton_prefill as tp


def _compile(fn: triton.JITFunction, pointers: dict[str, str], constexprs: dict, arch: int) -> None:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        else:
            signature[name] = "fp32" if name in ("qk_scale", "eps") else "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


ROPE_POINTERS = ("qkv_ptr", "cos_ptr", "sin_ptr", "k_cache_ptr", "v_cache_ptr", "q_ptr", "k_ptr")


def main(arch: int = 90) -> None:
    for dt, dim, final in (("fp16", 128, False), ("bf16", 64, True), ("fp32", 64, True)):
        prec = "ieee" if dt == "fp32" else "tf32"
        kv = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}"}
        parts = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
        _compile(
            tk._paged_kernel,
            {**kv, **parts, "tables_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": f"*{dt}"},
            {"GROUP": 4, "PAGE": 16, "HEAD_DIM": dim, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_D": dim,
             "WRITE_FINAL": final, "DOT_PREC": prec},
            arch,
        )  # fmt: skip
        ints = ("prefix_tables_ptr", "prefix_lens_ptr", "members_ptr", "member_start_ptr", "member_count_ptr")
        _compile(
            tk._prefix_kernel,
            {**kv, **parts, **dict.fromkeys((*ints, "tile_group_ptr", "tile_row_ptr"), "*i32")},
            {"GROUP": 4, "PAGE": 16, "HEAD_DIM": dim, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": dim,
             "DOT_PREC": prec},
            arch,
        )  # fmt: skip
        _compile(
            tp._prefill_kernel,
            {**kv, "table_ptr": "*i64", "out_ptr": f"*{dt}"},
            {"GROUP": 4, "TOKENS": 16, "PAGE": 16, "HEAD_DIM": dim, "BLOCK_M": 64, "BLOCK_N": 64,
             "BLOCK_D": dim, "DOT_PREC": prec},
            arch,
        )  # fmt: skip
    _compile(
        tk._reduce_kernel,
        {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "group_of_ptr": "*i32", "out_ptr": "*bf16"},
        {"HEAD_DIM": 128, "BLOCK_S": 8, "BLOCK_D": 128, "HAS_GROUPS": True},
        arch,
    )
    _compile(
        tk._merge_kernel,
        {"out_a_ptr": "*fp16", "lse_a_ptr": "*fp32", "out_b_ptr": "*fp16", "lse_b_ptr": "*fp32",
         "out_ptr": "*fp16", "lse_ptr": "*fp32"},
        {"HEAD_DIM": 64, "BLOCK_R": 16, "BLOCK_D": 64},
        arch,
    )  # fmt: skip
    for dt in ("bf16", "fp16"):
        _compile(
            lo._add_rms_norm_kernel,
            dict.fromkeys(("h_ptr", "delta_ptr", "w_ptr", "out_ptr"), f"*{dt}"),
            {"HAS_DELTA": True, "BLOCK": 4096},
            arch,
        )
        _compile(
            lo._rope_write_kv_kernel,
            {**dict.fromkeys(ROPE_POINTERS, f"*{dt}"), "slots_ptr": "*i64"},
            {"HEADS": 32, "KV_HEADS": 8, "HEAD_DIM": 128},
            arch,
        )  # fmt: skip
        _compile(lo._silu_mul_kernel, {"gate_up_ptr": f"*{dt}", "out_ptr": f"*{dt}"}, {"BLOCK": 1024}, arch)
    print("compiled")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
