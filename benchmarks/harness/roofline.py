"""What the engine achieved at each batch size in FLOP/s and bytes/s, beside what this machine reaches.

A CPU engine is bound by its GEMMs' arithmetic at large batches and by the weight stream at small ones, and
CPUs differ in both by several times (AMX tiles, AVX512-BF16 dot products, AVX2 FMA; memory channels), so
a throughput figure means little without them. Per batch size:

* **decode FLOP/s** = decode tok/s x (2 x the decoder's linear weights + 2 x the LM head's): each decoded
  token goes through every linear and the head once (attention's FLOPs, small at these contexts, are not
  counted, so this is a lower bound);
* **decode bytes/s** = decode steps/s (decode tok/s / batch) x the weight bytes one step reads: the weights
  stream once per step whatever the batch (KV reads not counted);
* **prefill FLOP/s** = prefill tok/s x 2 x the decoder's linear weights (the head runs on one row per
  prompt).

Beside them: the **library peak**, a 2,048-cube (``peak_size``) ``torch.mm`` in the engine's dtype (MKL
or oneDNN, which use AMX where the CPU has it: the most this torch gets from the machine), our own linears
at 2,048 rows (the prefill ceiling's rate) and the memory read bandwidth, all measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.harness.decode_ceiling import Ceiling
from benchmarks.harness.engine_batches import BatchResult
from benchmarks.harness.output import log, markdown_table
from benchmarks.harness.prefill_ceiling import PrefillCeiling, layer_linears
from benchmarks.harness.stats import safe_ratio
from server.engine.compute_thread import on_own_thread

__all__ = [
    "Roofline",
    "RooflineRow",
    "library_peak_flops",
    "measure_roofline",
    "roofline",
    "roofline_metrics",
    "roofline_table",
]


@dataclass(frozen=True)
class RooflineRow:
    batch: int
    decode_flops_per_s: float
    decode_bytes_per_s: float
    prefill_flops_per_s: float


@dataclass(frozen=True)
class Roofline:
    dtype: str
    library_peak_flops_per_s: float  # `library_peak_flops`
    peak_size: int  # of the torch.mm cube it was measured on
    linear_flops_per_s: float  # our linears at 2,048 rows (`prefill_ceiling`)
    read_bytes_per_s: float  # memory read bandwidth (`machine.memory_bandwidth`)
    decode_flops_per_token: float  # 2 x (decoder linears + LM head)
    prefill_flops_per_token: float  # 2 x decoder linears
    weight_bytes_per_step: int  # what a decode step reads (`decode_ceiling.decode_weight_bytes`)
    rows: list[RooflineRow]


@torch.inference_mode()
def library_peak_flops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a ``size``-cube ``torch.mm`` in ``dtype`` (median of ``repeats`` after a warm-up)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)

    def once() -> float:
        start = time.perf_counter()
        torch.mm(a, b)
        return time.perf_counter() - start

    return 2.0 * size**3 / statistics.median(once() for _ in range(repeats))


def roofline(
    results: list[BatchResult],
    *,
    dtype: torch.dtype,
    linear_weights: int,
    head_weights: int,
    weight_bytes_per_step: int,
    linear_flops_per_s: float,
    read_bytes_per_s: float,
    library_peak: float,
    peak_size: int,
) -> Roofline:
    """Ours at every batch size of ``results`` against the machine's rates (``linear_weights``: the
    decoder's linear parameters; ``head_weights``: the LM head's)."""
    decode_fpt, prefill_fpt = 2.0 * (linear_weights + head_weights), 2.0 * linear_weights
    rows = []
    for r in results:
        ours = r.systems["ours"]
        decode, prefill = ours.decode_tps.value, ours.prefill_tps.value
        rows.append(
            RooflineRow(
                r.batch,
                decode * decode_fpt,
                safe_ratio(decode, r.batch) * weight_bytes_per_step,
                prefill * prefill_fpt,
            )
        )
    return Roofline(
        str(dtype).removeprefix("torch."),
        library_peak,
        peak_size,
        linear_flops_per_s,
        read_bytes_per_s,
        decode_fpt,
        prefill_fpt,
        weight_bytes_per_step,
        rows,
    )


def measure_roofline(
    results: list[BatchResult],
    model: torch.nn.Module,
    dtype: torch.dtype,
    ceiling: Ceiling,
    prefill: PrefillCeiling,
    peak_size: int = 2048,
) -> Roofline:
    """`roofline` of ``model`` (the engine's, in ``dtype``) with the library peak measured now on a
    ``peak_size`` cube (on a thread of its own, as the engine computes) and the rates the ceilings
    measured."""
    log(f"library GEMM peak ({str(dtype).removeprefix('torch.')}, {peak_size}-cube) ...")
    peak = on_own_thread(lambda: library_peak_flops(dtype, peak_size), "peak")
    return roofline(
        results,
        dtype=dtype,
        linear_weights=sum(w.numel() for w, _ in layer_linears(model)),
        head_weights=model.lm_head.weight.numel(),
        weight_bytes_per_step=ceiling.weight_bytes,
        linear_flops_per_s=prefill.linear_flops_per_s,
        read_bytes_per_s=ceiling.read_bytes_per_s,
        library_peak=peak,
        peak_size=peak_size,
    )


def roofline_metrics(r: Roofline) -> dict[str, float]:
    """The figures for the RESULT line: the peak, then GFLOP/s and GB/s per batch size."""
    return {
        "peak_gflops": r.library_peak_flops_per_s / 1e9,
        **{f"decode_gflops_b{x.batch}": x.decode_flops_per_s / 1e9 for x in r.rows},
        **{f"decode_gbs_b{x.batch}": x.decode_bytes_per_s / 1e9 for x in r.rows},
        **{f"prefill_gflops_b{x.batch}": x.prefill_flops_per_s / 1e9 for x in r.rows},
    }


def roofline_table(r: Roofline) -> str:
    """One row per batch size: our FLOP/s and bytes/s, each as a share of the machine's rate."""
    rows = [
        [
            str(row.batch),
            f"{row.decode_flops_per_s / 1e9:.1f}",
            f"{safe_ratio(row.decode_flops_per_s, r.library_peak_flops_per_s):.0%}",
            f"{row.decode_bytes_per_s / 1e9:.1f}",
            f"{safe_ratio(row.decode_bytes_per_s, r.read_bytes_per_s):.0%}",
            f"{row.prefill_flops_per_s / 1e9:.1f}",
            f"{safe_ratio(row.prefill_flops_per_s, r.library_peak_flops_per_s):.0%}",
        ]
        for row in r.rows
    ]
    headers = [
        "batch",
        "decode GFLOP/s",
        "of peak",
        "decode GB/s",
        "of bandwidth",
        "prefill GFLOP/s",
        "of peak",
    ]
    peak, ours, read = r.library_peak_flops_per_s / 1e9, r.linear_flops_per_s / 1e9, r.read_bytes_per_s / 1e9
    return (
        f"Machine: {r.dtype} library peak {peak:.0f} GFLOP/s ({r.peak_size:,}-cube torch.mm), our linears "
        f"{ours:.0f} GFLOP/s at 2,048 rows, memory read {read:.1f} GB/s; per token "
        f"{r.decode_flops_per_token / 1e6:.0f} MFLOP decoded ({r.prefill_flops_per_token / 1e6:.0f} "
        f"prefilled), {r.weight_bytes_per_step / 1e6:.0f} MB of weights read per decode step.\n\n"
        + markdown_table(headers, rows, [True] * len(headers))
    )
