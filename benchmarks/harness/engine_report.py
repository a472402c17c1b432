"""The report of ``benchmarks/engine_throughput.py``: what one run measured (`Run`), its tables
(`print_report`) and the figures of its ``RESULT`` line (`metrics`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.harness.decode_ceiling import Ceiling
from benchmarks.harness.engine_batches import (
    KINDS,
    BatchResult,
    BatchSizes,
    throughput_table,
    workload_table,
)
from benchmarks.harness.kv_fork import KVResult, kv_table
from benchmarks.harness.output import fmt_num
from benchmarks.harness.prefill_ceiling import PrefillCeiling, describe
from benchmarks.harness.roofline import Roofline, roofline_metrics, roofline_table

__all__ = ["RATIO_KEY", "Run", "metrics", "print_report"]

# decode_ratio_b1 is ours/HF, decode_vs_vllm_b1 ours/vLLM, decode_vs_engine_b1 ours over the OpenAI route
# (`openai_route`) / ours over the engine API.
RATIO_KEY = {"hf": "ratio", "vllm": "vs_vllm"}


@dataclass
class Run:
    results: list[BatchResult]
    kv: KVResult
    ceiling: Ceiling
    prefill: PrefillCeiling  # at the largest batch
    roofline: Roofline


def print_report(cfg: BatchSizes, run: Run, dtypes: dict[str, str], vllm: dict[str, Any] | None) -> None:
    systems = f"ours {dtypes['ours']}, HF generate {dtypes['hf']}"
    if vllm is not None:
        mode = "eager" if vllm.get("enforce_eager") else "compiled"
        bind = vllm.get("env", {}).get("VLLM_CPU_OMP_THREADS_BIND")
        systems += (
            f", vLLM {vllm.get('vllm')} {dtypes['vllm']} ({mode}, max_num_batched_tokens "
            f"{vllm.get('max_num_batched_tokens')}, OMP threads bound to {bind})"
        )
    c, bw, kv = run.ceiling, run.ceiling.bandwidth, run.kv
    repeats = "/".join(str(r.repeats) for r in run.results)
    print(
        f"dtypes: {systems}.\n\nprompts {round(cfg.spread * cfg.prompt_len)}..{cfg.prompt_len} tokens, "
        f"{cfg.new_tokens} new tokens, greedy; median of {repeats} repeats after a warm-up, ± half the "
        "range. prefill = prompt tokens / T(1); decode = B(N-1) / (T(N) - T(1)); end-to-end = BN / T(N).\n"
    )
    print(throughput_table(run.results) + "\n\n" + workload_table(run.results, cfg.new_tokens) + "\n")
    print(
        f"Batch-1 decode ceiling: memory read bandwidth {c.read_bytes_per_s / 1e9:.1f} GB/s (matrix-vector "
        f"product / sum over {bw['tensor_bytes'] / (1 << 20):.0f} MiB, median of {bw['repeats']}, "
        f"{bw['threads']} threads) / {c.weight_bytes / 1e6:.0f} MB of weights read per step ({c.dtype}) = "
        f"{fmt_num(c.ceiling_tps, 1)} tok/s; ours at batch 1: {fmt_num(c.decode_b1_tps, 1)} tok/s = "
        f"{c.share:.0%} of it.\n\n{describe(run.prefill, run.results[-1])}\n\nKV memory: {kv.requests} "
        f"requests sharing a {kv.prefix_tokens}-token prefix, {kv.suffix_tokens}-token distinct suffix each, "
        f"{kv.new_tokens} new tokens, block size {kv.block_size}; blocks counted with every context alive.\n"
    )
    print(kv_table(kv) + "\n")
    print(roofline_table(run.roofline) + "\n")


def metrics(run: Run) -> dict[str, float | int]:
    """Ours/HF ratios per batch size, the KV block counts, the batch-1 decode ceiling, then ours/vLLM."""

    def ratios(other: str) -> dict[str, float]:
        rows = [r for r in run.results if other in r.systems]
        return {f"{k}_{RATIO_KEY[other]}_b{r.batch}": r.ratio(k, other).median for k in KINDS for r in rows}

    return {
        **ratios("hf"),
        "kv_fork_ratio": run.kv.ratio,
        "kv_blocks_fork": run.kv.fork.blocks_used,
        "kv_blocks_nofork": run.kv.no_fork.blocks_used,
        "mem_bw_gbs": run.ceiling.read_bytes_per_s / 1e9,
        "decode_b1_ceiling_tps": run.ceiling.ceiling_tps,
        "decode_b1_pct_ceiling": 100 * run.ceiling.share,
        "linear_tflops": run.prefill.linear_flops_per_s / 1e12,
        f"prefill_pct_ceiling_b{run.results[-1].batch}": 100 * run.prefill.share,
        **roofline_metrics(run.roofline),
        **ratios("vllm"),
        **_route_ratios(run),
    }


def _route_ratios(run: Run) -> dict[str, float]:
    """The OpenAI route's figures where it ran: ours over it against the engine API, and against vLLM's."""
    out: dict[str, float] = {}
    for r in run.results:
        for kind, attr in KINDS.items():
            if "ours_v1" not in r.systems:
                continue
            route = getattr(r.systems["ours_v1"], attr)
            out[f"{kind}_v1_vs_engine_b{r.batch}"] = route.over(getattr(r.systems["ours"], attr)).median
            if "vllm_v1" in r.systems:
                out[f"{kind}_v1_vs_vllm_v1_b{r.batch}"] = route.over(
                    getattr(r.systems["vllm_v1"], attr)
                ).median
    return out
