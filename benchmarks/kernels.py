"""Shared-prefix decode attention vs plain paged decode over the same KV cache.

Each case is one decode step of ``batch`` sequences that share a ``prefix``-token prompt and have a private
``suffix`` each, GQA 32/8 heads, head dim 128, page 16, physical blocks shuffled. Plain paged decode reads
the prefix once per sequence; shared-prefix decode reads it once per batch, so the memory-traffic ceiling
of the speedup is ``B(P+S) / (P+B*S)``. Both run on the same caches, in the same process, and their outputs
are checked against each other.

On CPU this times the torch path in float32 (wall time); on CUDA the Triton kernels in bfloat16 (``--dtype``:
float16), as device time with the L2 cache flushed before each call (CUDA events), with the wall time of an
eager call (host launch overhead included) beside it.

    python -m benchmarks.kernels [--quick] [--json PATH] [--repeats N] [--device cpu|cuda]
        [--dtype bfloat16|float16|float32]
    (or python benchmarks/kernels.py ...)

The last line is ``RESULT kernels speedup_b<B>_p<P>=... ceiling_b<B>_p<P>=... ...``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

if not __package__:
    # Run as a file, this script's own directory would come first on sys.path and `import kernels` (in
    # `benchmarks.harness.kernel_cases`) would import this file; import the repository's package instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.harness.flags import add_size_flags, bench_dtype
from benchmarks.harness.kernel_cases import BLOCK, HEAD_DIM, HEADS, KV_HEADS, Row, run_case
from benchmarks.harness.machine import machine_info
from benchmarks.harness.output import result_line, write_json
from benchmarks.plotting import pyplot, save
from server.common.malloc_tuning import tune_glibc_malloc

SUFFIX = 256


def _key(row: Row) -> str:
    return f"b{row.batch}_p{row.prefix}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "prefix 1k/4k only, fewer repeats (~1 min on CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    dtype = getattr(torch, bench_dtype(device, args.dtype))
    # The engine process runs with this allocator setting; time the kernels as the engine runs them.
    tune_glibc_malloc()
    batches = [2, 8] if args.tiny else [8, 32, 64]
    prefixes = [256] if args.tiny else [1024, 4096] if args.quick else [1024, 4096, 6144]
    suffix = 16 if args.tiny else SUFFIX
    repeats = args.repeats or (1 if args.tiny else 5 if args.quick else 15)
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    where = (
        f"triton {short}" if device.type == "cuda" else f"torch {short}, {torch.get_num_threads()} threads"
    )
    print(f"shared-prefix vs paged decode on {device} ({where}); heads {HEADS}/{KV_HEADS}, dim {HEAD_DIM}")
    print(
        f"{'batch':>5} {'prefix':>6} {'suffix':>6} {'plain ms':>9} {'shared ms':>9} {'speedup':>8} "
        f"{'ceiling':>8} {'of ceil':>7} {'max diff':>9} {'wall ms plain/shared':>21}"
    )
    rows = []
    for prefix in prefixes:
        for batch in batches:
            row = run_case(batch, prefix, suffix, repeats, device, dtype)
            rows.append(row)
            print(
                f"{row.batch:>5} {row.prefix:>6} {row.suffix:>6} {row.plain_ms:>9.2f} {row.shared_ms:>9.2f} "
                f"{row.speedup:>7.2f}x {row.ceiling:>7.2f}x {row.frac_of_ceiling:>7.0%} "
                f"{row.max_abs_diff:>9.2e} {row.plain_wall_ms:>10.3f}/{row.shared_wall_ms:<10.3f}"
                + (
                    ""
                    if math.isnan(row.plain_private_ms)
                    else f" own prefix copies {row.plain_private_ms:.3f} ms: {row.speedup_vs_private:.2f}x"
                ),
                flush=True,
            )

    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "kernels",
                "device": str(device),
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                "dtype": str(dtype).removeprefix("torch."),
                "backend": where,
                "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block": BLOCK},
                "repeats": repeats,
                "machine": machine_info(),
                "rows": [asdict(r) for r in rows],
            },
        )
    metrics = {f"speedup_{_key(r)}": r.speedup for r in rows} | {
        f"ceiling_{_key(r)}": r.ceiling for r in rows
    }
    metrics |= {
        f"speedup_vs_private_{_key(r)}": r.speedup_vs_private
        for r in rows
        if not math.isnan(r.plain_private_ms)
    }
    print(result_line("kernels", metrics))


def plot(payload: dict[str, Any], path: Path) -> None:
    """Shared-prefix vs paged decode from a results payload: speedup against batch size per prefix length,
    each with its memory-traffic ceiling (dashed)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for prefix in sorted({r["prefix"] for r in payload["rows"]}):
        rows = sorted((r for r in payload["rows"] if r["prefix"] == prefix), key=lambda r: r["batch"])
        line = ax.plot(
            [r["batch"] for r in rows], [r["speedup"] for r in rows], "o-", label=f"prefix {prefix}"
        )
        ax.plot(
            [r["batch"] for r in rows], [r["ceiling"] for r in rows], "--", color=line[0].get_color(), lw=1
        )
    ax.set_xlabel("batch (sequences sharing the prefix)")
    ax.set_ylabel("speedup over paged decode (x)")
    ax.set_title(f"{payload['backend']} (dashed: ceiling B(P+S)/(P+BS))", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
