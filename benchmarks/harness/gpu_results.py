"""What `benchmarks.gpu_engine` measures per model shape and how it reports it: the result record, the GPU's
copy bandwidth (the batch-1 floor's denominator), a batch's row, the simulator profile fitted on the run,
the ``RESULT`` metrics and the printed table."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks.harness import engine_batches as et
from benchmarks.harness.output import log
from benchmarks.harness.step_tables import forced_cell

EAGER = "ours_eager"  # our engine with CUDA graphs off, as a system of the comparison
# The calibration sweep of --profile-shape (`server.sim.calibrate`).
PROFILE_BATCHES, PROFILE_PROMPTS, PROFILE_NEW = (1, 8, 32, 64), (128, 512), 12
# ... and long prompts at small batches (the prefill-attention term; within a 4k window).
PROFILE_LONG_BATCHES, PROFILE_LONG_PROMPTS = (1, 4), (2048, 4000)


@dataclass
class ShapeResult:
    """One model shape's rows (a batch size each), the batch sizes skipped and why, the batch-1 floor, the
    simulator profile fitted there (with ``--profile-shape``) and the error that stopped it, if any."""

    shape: str
    parameters: int
    weight_bytes: int
    kv_bytes_per_token: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)  # batch -> why
    floor: dict[str, float] = field(default_factory=dict)
    profile: dict[str, Any] | None = None  # the fitted model and its traced steps (its own file)
    error: str | None = None


def copy_bandwidth(device: torch.device, mib: int = 1024, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy moves, read and write counted (median of ``repeats``)."""
    src = torch.ones(mib << 18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    rates = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        rates.append(2 * src.numel() * 4 / (time.perf_counter() - start))
    return statistics.median(rates[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def row_of(r: et.BatchResult) -> dict[str, Any]:
    """A batch's figures: each system's rates (tok/s) and times, ours over HF and over eager, same tokens."""
    systems = {
        name: {attr: getattr(rates, attr).value for attr in et.KINDS.values()}
        | {"t_first": rates.t_first, "t_full": rates.t_full}
        for name, rates in r.systems.items()
    }
    return {
        "batch": r.batch,
        "prompt_tokens": r.prompt_tokens,
        "repeats": r.repeats,
        **systems,
        **{f"{kind}_ratio_vs_hf": r.ratio(kind, "hf").median for kind in et.KINDS},
        "same_tokens_hf": r.same_tokens["hf"],
        **(
            {
                "decode_graphs_vs_eager": r.ratio("decode", EAGER).median,
                "same_tokens_eager": r.same_tokens[EAGER],
            }
            if EAGER in r.systems
            else {}
        ),
        "engine_preemptions": r.engine_preemptions,
    }


def fit_profile(engine: Any, shape: str) -> dict[str, Any]:
    """Trace our engine over a sweep of batch shapes and fit the simulator's latency model to it."""
    from server.sim.calibrate import calibrate
    from server.sim.latency import fit_latency_model

    log(f"{shape}: calibration sweep for the simulator's latency model ...")
    loop = asyncio.new_event_loop()
    try:
        trace = [
            step
            for batches, prompts in (
                (PROFILE_BATCHES, PROFILE_PROMPTS),
                (PROFILE_LONG_BATCHES, PROFILE_LONG_PROMPTS),
            )
            for step in loop.run_until_complete(
                calibrate(engine, batch_sizes=batches, prompt_lens=prompts, new_tokens=PROFILE_NEW)
            )
        ]
    finally:
        loop.close()
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    model = fit_latency_model(
        trace,
        f"{shape} on {name}",
        kv_tokens=engine.stats().blocks_total * engine.block_size,
        max_model_len=engine.max_model_len,
        shared_prefix_decode=False,
        source=f"measured: our engine, random-weight {shape} shape, {name}, {len(trace)} traced steps",
    )
    steps = [{"features": asdict(s.features), "seconds": s.seconds} for s in trace]
    return {"model": asdict(model), "steps": steps}


def metrics(results: list[ShapeResult]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in results:
        for r in s.rows:
            out[f"decode_ratio_vs_hf_b{r['batch']}_{s.shape}"] = r["decode_ratio_vs_hf"]
            if "decode_graphs_vs_eager" in r:
                out[f"graphs_vs_eager_b{r['batch']}_{s.shape}"] = r["decode_graphs_vs_eager"]
            if "forced_token_agree" in r:
                out[f"forced_token_agree_b{r['batch']}_{s.shape}"] = r["forced_token_agree"]
        if "floor_ratio" in s.floor:
            out[f"floor_ratio_b1_{s.shape}"] = s.floor["floor_ratio"]
    # The headline: the largest model that ran batch 64.
    for s in reversed(results):
        row = next((r for r in s.rows if r["batch"] == 64), None)
        if row is not None:
            out["decode_ratio_vs_hf_b64"] = row["decode_ratio_vs_hf"]
            break
    return out


def table(results: list[ShapeResult]) -> str:
    lines = [
        f"{'shape':<14} {'batch':>5} {'ours dec tok/s':>14} {'HF dec tok/s':>12} {'ours/HF':>8} "
        f"{'prefill ours/HF':>15} {'same tok':>8} {'forced tok (HF self)':>20}"
    ]
    for s in results:
        if s.error:
            lines.append(f"{s.shape:<14} error: {s.error.splitlines()[-1][:90]}")
        for r in s.rows:
            ours, hf = r["ours"]["decode_tps"], r["hf"]["decode_tps"]
            lines.append(
                f"{s.shape:<14} {r['batch']:>5} {ours:>14.0f} {hf:>12.0f} {r['decode_ratio_vs_hf']:>7.2f}x "
                f"{r['prefill_ratio_vs_hf']:>14.2f}x {r['same_tokens_hf']:>8.0%} {forced_cell(r):>20}"
            )
        for b, why in s.skipped.items():
            lines.append(f"{s.shape:<14} {b:>5} skipped: {why}")
        if s.floor:
            lines.append(
                f"{s.shape:<14} batch 1: {s.floor['decode_tps']:.0f} tok/s, floor {s.floor['floor_tps']:.0f} "
                f"tok/s (bytes / copy bandwidth): {s.floor['floor_ratio']:.2f}x the floor time"
            )
    return "\n".join(lines)
