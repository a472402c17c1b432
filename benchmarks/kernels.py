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
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

if not __package__:
    # Run as a file, this script's own directory would come first on sys.path and `import kernels` would
    # import this file; import the repository's package instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import kernels
from benchmarks.common import add_size_flags, bench_dtype, machine_info, result_line, write_json
from benchmarks.harness.kernel_timing import interleaved
from benchmarks.plotting import pyplot, save
from server.malloc_tuning import tune_glibc_malloc

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SUFFIX = 256


@dataclass
class Row:
    batch: int
    prefix: int
    suffix: int
    plain_ms: float
    shared_ms: float
    speedup: float
    ceiling: float
    frac_of_ceiling: float
    max_abs_diff: float
    # CUDA: the times above are device times with the L2 cache flushed before each call (what the kernels
    # do); these are wall times of a call as an eager caller sees them, host launch overhead included.
    plain_wall_ms: float = math.nan
    shared_wall_ms: float = math.nan


def ceiling(batch: int, prefix: int, suffix: int) -> float:
    """KV tokens read by plain paged decode over those read by shared-prefix decode."""
    return batch * (prefix + suffix) / (prefix + batch * suffix)


def run_case(
    batch: int, prefix: int, suffix: int, repeats: int, device: torch.device, dtype: torch.dtype
) -> Row:
    gen = torch.Generator().manual_seed(batch * 100_003 + prefix)
    n_prefix = -(-prefix // BLOCK)
    n_suffix = -(-suffix // BLOCK)
    num_blocks = n_prefix + batch * n_suffix
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    # Shuffled physical blocks, as a long-running paged cache has them.
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    prefix_table = perm[:n_prefix]
    suffix_tables = perm[n_prefix:].view(batch, n_suffix)

    def i32(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=torch.int32).contiguous()

    plain_tables = i32(torch.cat([prefix_table.expand(batch, n_prefix), suffix_tables], dim=1))
    plain_lens = i32(torch.full((batch,), prefix + suffix))
    prefix_tables = i32(prefix_table[None])
    prefix_lens = i32(torch.tensor([prefix]))
    group_of = i32(torch.zeros(batch))
    suffix_tables_d = i32(suffix_tables)
    suffix_lens = i32(torch.full((batch,), suffix))
    backend: kernels.Backend = "auto" if device.type == "cuda" else "torch"
    scale = HEAD_DIM**-0.5

    def plain() -> torch.Tensor:
        return kernels.paged_decode_attention(
            q, k_cache, v_cache, plain_tables, plain_lens, scale, backend=backend
        )

    def shared() -> torch.Tensor:
        return kernels.shared_prefix_decode_attention(
            q,
            k_cache,
            v_cache,
            prefix_tables,
            prefix_lens,
            group_of,
            suffix_tables_d,
            suffix_lens,
            scale,
            backend=backend,
        )

    # The first calls also warm up (compilation, workspaces, caches).
    diff = (plain().float() - shared().float()).abs().max().item()
    # The two interleaved (`kernel_timing.interleaved`), and the speedup taken as the median of the
    # back-to-back pairs' ratios: on a shared machine whose speed shifts between runs, a pair sees one
    # state, while a ratio of two medians can mix states.
    t = interleaved([plain, shared], repeats, device)
    (plain_ms, shared_ms), (plain_wall, shared_wall) = t.ms, t.wall_ms
    speedup = statistics.median(p / s for p, s in zip(plain_ms, shared_ms, strict=True))
    ceil = ceiling(batch, prefix, suffix)
    return Row(
        batch,
        prefix,
        suffix,
        statistics.median(plain_ms),
        statistics.median(shared_ms),
        speedup,
        ceil,
        speedup / ceil,
        diff,
        statistics.median(plain_wall),
        statistics.median(shared_wall),
    )


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
                f"{row.max_abs_diff:>9.2e} {row.plain_wall_ms:>10.3f}/{row.shared_wall_ms:<10.3f}",
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
