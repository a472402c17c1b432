"""The prefill ceiling: the model's own linears at many rows, as the engine runs them, over their FLOPs.

A prefill of many tokens is bound by its GEMMs: two FLOPs per weight per token through every layer's
projections. Timing those projections at ``rows`` rows through `kernels.cpu_linear.linear` (the packed
weights the engine uses) gives the rate this machine runs them at, and so the most prompt tokens per second
any prefill here can reach with them (attention, norms and the LM head not even counted). A measured
prefill rate is reported as a share of that bound, and another system's rate as the multiple of it the
bound would allow.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from benchmarks.harness.batch_timing import Rates
from benchmarks.harness.engine_batches import LABELS, BatchResult
from benchmarks.harness.output import fmt_num
from benchmarks.harness.stats import safe_ratio
from kernels.cpu_linear import linear

__all__ = ["PrefillCeiling", "describe", "layer_linears", "prefill_ceiling"]


def layer_linears(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Every decoder layer's projections as the engine runs them: (weight [out, in], packed copy or None)
    for the fused q/k/v, the output, the fused gate/up and the down projection."""
    model.prepare_weights()  # the fused and packed weights, as the first forward makes them
    pairs = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        pairs += [
            (attn.qkv_weight, attn.qkv_packed),
            (attn.o_proj.weight, attn.o_packed),
            (mlp.gate_up_weight, mlp.gate_up_packed),
            (mlp.down_proj.weight, mlp.down_packed),
        ]
    return pairs


@dataclass
class PrefillCeiling:
    """The prompt tokens per second the model's linears allow here, and a measured prefill rate against it."""

    rows: int  # rows per GEMM when timed
    flops_per_token: float  # 2 x the layers' linear weights
    linear_flops_per_s: float  # median over the repeats
    ceiling_tps: float  # linear_flops_per_s / flops_per_token
    prefill_tps: float  # the measured prefill rate it is compared with (NaN: none)
    share: float  # prefill_tps / ceiling_tps


@torch.inference_mode()
def prefill_ceiling(
    model: torch.nn.Module, ours: Rates, rows: int = 2048, repeats: int = 3
) -> PrefillCeiling:
    """Time one pass of ``rows`` rows through every layer's projections (``repeats`` times after a warm-up;
    the median) and set the prefill rate of ``ours`` against the rate that allows."""
    prefill_tps = ours.prefill_tps.value
    pairs = layer_linears(model)
    dtype = pairs[0][0].dtype
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=dtype) for w, _ in pairs}
    flops_per_token = 2.0 * sum(w.numel() for w, _ in pairs)

    def one_pass() -> float:
        start = time.perf_counter()
        for w, packed in pairs:
            linear(inputs[w.shape[1]], w, None, packed)
        return time.perf_counter() - start

    one_pass()
    seconds = statistics.median(one_pass() for _ in range(repeats))
    rate = rows * flops_per_token / seconds
    ceiling = rate / flops_per_token
    return PrefillCeiling(rows, flops_per_token, rate, ceiling, prefill_tps, safe_ratio(prefill_tps, ceiling))


def describe(c: PrefillCeiling, batch: BatchResult) -> str:
    """One report line: the rate, the ceiling, ours at ``batch`` (the row ``c`` was measured against) and
    the most each other system's prefill there could be bettered by with these GEMMs."""
    rates = {LABELS[n]: r.prefill_tps.value for n, r in batch.systems.items() if n != "ours"}
    others = "; ".join(
        f"{n} {fmt_num(t)} tok/s: at most {safe_ratio(c.ceiling_tps, t):.2f}x it" for n, t in rates.items()
    )
    return (
        f"Prefill ceiling: the model's linears run at {c.linear_flops_per_s / 1e12:.2f} TFLOP/s here at "
        f"{c.rows} rows (its own GEMMs, this run) = {fmt_num(c.ceiling_tps)} prompt tok/s (attention and the "
        f"rest not counted); ours at batch {batch.batch}: {fmt_num(c.prefill_tps)} tok/s = {c.share:.0%} of "
        f"it; {others}."
    )
