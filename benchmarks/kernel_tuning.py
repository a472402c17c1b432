"""Tune the Triton decode kernels on a GPU: tile and split-KV settings, and the shared-prefix gate.

Two sweeps over `benchmarks.harness.kernel_cases.run_case` (one decode step, GQA 32/8, head dim 128, page
16, shuffled blocks; plain paged decode vs shared-prefix decode on the same caches):

* **settings**: each module setting of `kernels.triton_kernels` (``BLOCK_N``, ``PREFIX_BLOCK_M``,
  ``PROGRAMS_PER_SM``, ``MIN_SPLIT_TOKENS``) varied one at a time around the shipped values, at the
  headline shapes (batch 32 and 64 with a 4k prefix, batch 8 with 1k);
* **gate**: shared over plain at small batches and prefixes, where `kernels.gate.should_share_prefix`
  decides (on CUDA: 128 MiB of KV reads saved per layer, the crossover this sweep measured on an H100).

    python -m benchmarks.kernel_tuning [--tiny] [--json PATH] [--dtype bfloat16]

Last line: ``RESULT kernel_tuning best_<setting>=... gate_min_members_p<P>=...``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.flags import bench_dtype
from benchmarks.harness.kernel_cases import run_case
from benchmarks.harness.output import log, result_line, write_json

SETTINGS: dict[str, tuple[int, ...]] = {
    "BLOCK_N": (32, 64, 128),
    "PREFIX_BLOCK_M": (32, 64, 128),
    "PROGRAMS_PER_SM": (2, 4, 8),
    "MIN_SPLIT_TOKENS": (128, 256, 512),
}
SHAPES = ((32, 4096), (64, 4096), (8, 1024))  # (batch, prefix)
GATE_BATCHES = (4, 8, 16, 32, 64)
GATE_PREFIXES = (256, 1024, 2048, 4096)


def sweep_settings(
    device: torch.device, dtype: torch.dtype, shapes: tuple[tuple[int, int], ...], suffix: int, repeats: int
) -> list[dict[str, Any]]:
    from kernels import triton_kernels as tk

    rows = []
    for name, values in SETTINGS.items():
        shipped = getattr(tk, name)
        try:
            for value in values:
                setattr(tk, name, value)
                for batch, prefix in shapes:
                    r = run_case(batch, prefix, suffix, repeats, device, dtype)
                    rows.append({"setting": name, "value": value, "shipped": value == shipped, **asdict(r)})
                    log(
                        f"{name}={value} b{batch} p{prefix}: plain {r.plain_ms:.3f} ms, "
                        f"shared {r.shared_ms:.3f} ms, {r.speedup:.2f}x"
                    )
        finally:
            setattr(tk, name, shipped)
    return rows


def sweep_gate(
    device: torch.device,
    dtype: torch.dtype,
    batches: tuple[int, ...],
    prefixes: tuple[int, ...],
    suffix: int,
    repeats: int,
) -> list[dict[str, Any]]:
    rows = []
    for prefix in prefixes:
        for batch in batches:
            r = run_case(batch, prefix, suffix, repeats, device, dtype)
            rows.append(asdict(r))
            log(f"gate b{batch} p{prefix}: {r.speedup:.2f}x")
    return rows


def best_values(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Per setting, the value with the lowest summed shared-prefix time over the shapes (plain decode's
    time summed as well: a setting must not buy one by the other)."""
    best: dict[str, int] = {}
    for name in SETTINGS:
        totals: dict[int, float] = {}
        for r in rows:
            if r["setting"] == name:
                totals[r["value"]] = totals.get(r["value"], 0.0) + r["shared_ms"] + r["plain_ms"]
        if totals:
            best[name] = min(totals, key=totals.__getitem__)
    return best


def gate_crossover(rows: list[dict[str, Any]]) -> dict[int, int | None]:
    """Per prefix, the smallest batch from which shared-prefix decode is never slower than plain."""
    out: dict[int, int | None] = {}
    for prefix in sorted({r["prefix"] for r in rows}):
        ordered = sorted((r for r in rows if r["prefix"] == prefix), key=lambda r: r["batch"])
        out[prefix] = next(
            (r["batch"] for i, r in enumerate(ordered) if all(x["speedup"] >= 1.0 for x in ordered[i:])), None
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small shapes, one repeat: a harness check")
    p.add_argument("--json", type=Path)
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, bench_dtype(device, args.dtype))
    if args.tiny:
        shapes, batches, prefixes, suffix, repeats = ((4, 64),), (2, 4), (32, 64), 16, 1
    else:
        shapes, batches, prefixes, suffix, repeats = SHAPES, GATE_BATCHES, GATE_PREFIXES, 256, 7
    settings = sweep_settings(device, dtype, shapes, suffix, repeats)
    gate = sweep_gate(device, dtype, batches, prefixes, suffix, repeats)
    best, crossover = best_values(settings), gate_crossover(gate)
    print(f"best settings: {best}; shared-prefix decode pays from batch {crossover} (by prefix)")
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "kernel_tuning",
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": str(dtype).removeprefix("torch."),
                "settings": settings,
                "gate": gate,
                "best": best,
                "gate_crossover": {str(k): v for k, v in crossover.items()},
            },
        )
    metrics: dict[str, float] = {f"best_{k.lower()}": v for k, v in best.items()}
    metrics |= {
        f"gate_min_members_p{k}": (v if v is not None else float("nan")) for k, v in crossover.items()
    }
    print(result_line("kernel_tuning", metrics))


if __name__ == "__main__":
    main()
