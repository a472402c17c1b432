"""Engine throughput on a GPU: our engine vs Hugging Face ``generate`` on random-weight LLaMA models.

Models are built from the configs of real ones (`benchmarks.harness.random_models`: SmolLM2-135M,
Llama-3.2-1B, Llama-2-7B shapes), once per shape, and our engine runs over HF's very tensors. Per batch size
the same measurement as `benchmarks.engine_throughput` (``T(1)`` and ``T(N)`` of each system, interleaved;
prefill, decode and end-to-end tok/s; the share of requests whose greedy tokens equal ours), and whether
ours are HF's own choices near-ties aside (`forced_agreement`: HF teacher-forced over our tokens). A batch
size whose KV (ours and HF's) and weights would not fit the GPU is skipped and said so.

Batch-1 floor: the bytes one decode step must read (weights + the KV of the context) over the GPU's copy
bandwidth measured in the same run; ours at batch 1 is reported as ``floor_ratio`` (time per token over
the floor time; the issue's goal is <= 1.5). ``--profile-shape``: also traces our engine over a sweep of
batch shapes (`server.sim.calibrate`) and fits the simulator's latency model to it (`server.sim.latency`),
written as ``<json stem>.profile.json``.

    python -m benchmarks.gpu_engine [--quick | --tiny] [--json PATH] [--shapes S ...] [--batches B ...]
        [--device cuda] [--dtype bfloat16] [--profile-shape llama-2-7b]

Last line: ``RESULT gpu_engine decode_ratio_vs_hf_b64=... decode_ratio_vs_hf_b64_<shape>=...
floor_ratio_b1_<shape>=...``.
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.harness import random_models
from benchmarks.harness.engine_batches import Sizes, make_prompts, measure_batch, workload
from benchmarks.harness.engine_models import engine_model
from benchmarks.harness.flags import bench_dtype
from benchmarks.harness.forced_agreement import agreement
from benchmarks.harness.generators import Generator, OurEngine
from benchmarks.harness.gpu_results import (
    EAGER,
    PROFILE_BATCHES,
    PROFILE_LONG_BATCHES,
    PROFILE_LONG_PROMPTS,
    PROFILE_NEW,
    PROFILE_PROMPTS,
    ShapeResult,
    copy_bandwidth,
    fit_profile,
    metrics,
    row_of,
    table,
)
from benchmarks.harness.hf_generate import HFGenerate
from benchmarks.harness.kv_fork import blocks
from benchmarks.harness.output import log, result_line, write_json
from server.engine import EngineConfig, LLMEngine

NAME = "gpu_engine"


@dataclass(frozen=True)
class GpuConfig:
    shapes: tuple[str, ...] = tuple(random_models.SHAPES)
    batches: tuple[int, ...] = (1, 16, 64, 256)
    prompt_len: int = 256
    spread: float = 0.5
    new_tokens: int = 32
    repeats: int = 2
    max_num_batched_tokens: int = 8192
    memory_fraction: float = 0.85  # of the GPU's memory all systems' weights and KV may take
    profile_shape: str | None = None
    # Also run our engine with every step eager (no CUDA graphs) over the same weights: the graphs' gain.
    compare_eager: bool = True


QUICK = GpuConfig()
TINY = GpuConfig(shapes=("smollm2-135m",), batches=(1, 4), prompt_len=16, new_tokens=4, repeats=1)


def _fits(cfg: GpuConfig, batch: int, kv_per_token: int, weight_bytes: int, device: torch.device) -> str:
    """Why ``batch`` does not fit (empty: it fits): each system's KV at the longest, weights twice (ours
    fuses its own copy of the projections)."""
    if device.type != "cuda":
        return ""
    total = torch.cuda.get_device_properties(device).total_memory
    caches = 3 if cfg.compare_eager else 2
    need = caches * batch * (cfg.prompt_len + cfg.new_tokens + 16) * kv_per_token + 2 * weight_bytes
    if need > cfg.memory_fraction * total:
        return f"needs ~{need / 2**30:.0f} GiB ({caches} KV caches + weights) of {total / 2**30:.0f} GiB"
    return ""


def engine_config(cfg: GpuConfig, batches: list[int], device: str, dtype: str) -> EngineConfig:
    """KV blocks for the largest batch that fits, every context at its longest; nothing preempted."""
    most = max(batches, default=1)
    per_seq = blocks(cfg.prompt_len + cfg.new_tokens, EngineConfig.block_size) + 1
    return EngineConfig(
        num_kv_blocks=most * per_seq + 64,
        max_num_seqs=max(most, 16),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.prompt_len + cfg.new_tokens + 64,
        device=device,
        dtype=dtype,
    )


def run_shape(cfg: GpuConfig, shape: str, device: torch.device, dtype: str, bandwidth: float) -> ShapeResult:
    torch_dtype = getattr(torch, dtype)
    kv_per_token = random_models.kv_bytes_per_token(shape, torch_dtype)
    params = random_models.parameter_count(shape)
    weight_bytes = params * torch_dtype.itemsize
    out = ShapeResult(shape, params, weight_bytes, kv_per_token)
    batches = []
    for b in cfg.batches:
        why = _fits(cfg, b, kv_per_token, weight_bytes, device)
        if why:
            out.skipped[b] = why
        else:
            batches.append(b)
    config = engine_config(cfg, batches, str(device), dtype)
    eager_config = replace(config, cuda_graphs=False)
    if cfg.profile_shape == shape:  # room for the calibration sweep's largest shape too
        longest = max(PROFILE_LONG_PROMPTS) + PROFILE_NEW
        sweep = max(
            max(batches) * (blocks(max(prompts) + PROFILE_NEW, config.block_size) + 1)
            for batches, prompts in (
                (PROFILE_BATCHES, PROFILE_PROMPTS),
                (PROFILE_LONG_BATCHES, PROFILE_LONG_PROMPTS),
            )
        )
        sweep += 64
        kv_blocks = max(config.num_kv_blocks or 0, sweep)
        config = replace(config, trace_steps=100_000, max_model_len=2 * longest, num_kv_blocks=kv_blocks)
    log(f"{shape}: building {params / 1e9:.2f}B random parameters on {device} ({dtype}) ...")
    pair = random_models.load_pair(shape, config)
    eager: LLMEngine | None = None
    runners: list[OurEngine] = []  # their event loops, closed at the end
    try:
        ours = OurEngine(pair.engine)
        runners.append(ours)
        hf = HFGenerate(pair.hf, pad_token_id=0)
        systems: list[Generator] = [hf]
        if cfg.compare_eager and device.type == "cuda":
            model = engine_model(pair.engine)
            eager = LLMEngine(model, pair.engine.tokenizer, pair.engine.model_config, eager_config, shape)
            eager_runner = OurEngine(eager)
            eager_runner.name = EAGER
            runners.append(eager_runner)
            systems.insert(0, eager_runner)
        bench = Sizes(cfg.prompt_len, cfg.spread, cfg.new_tokens, cfg.repeats, min_time_s=0.0)
        tokens = workload(pair.engine.tokenizer, 4 * cfg.prompt_len)
        for b in batches:
            prompts = make_prompts(tokens, b, bench)
            log(f"{shape} batch {b}: {sum(map(len, prompts))} prompt tokens, {cfg.new_tokens} new each")
            result = measure_batch(ours, systems, prompts, bench)
            forced = agreement(pair.hf, prompts, result.outputs["ours"], result.outputs["hf"])
            out.rows.append(row_of(result) | forced)
        b1 = next((r for r in out.rows if r["batch"] == 1), None)
        if b1 is not None:
            context = b1["prompt_tokens"] + cfg.new_tokens / 2  # the mean context of the decode steps
            floor_s = (weight_bytes + context * kv_per_token) / bandwidth
            tps = b1["ours"]["decode_tps"]
            out.floor = {"floor_tps": 1 / floor_s, "decode_tps": tps, "floor_ratio": 1 / (floor_s * tps)}
        if cfg.profile_shape == shape:
            try:
                out.profile = fit_profile(pair.engine, shape)
            except Exception as e:  # the rows above stand without the profile
                log(f"{shape}: the calibration sweep failed: {e!r}")
                out.error = f"profile: {e!r}"
    finally:
        for runner in runners:
            runner.close()
        pair.engine.shutdown()
        if eager is not None:
            eager.shutdown()
        del pair
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the default sizes (kept for the runner's flags)")
    p.add_argument("--tiny", action="store_true", help="one small shape, batches 1/4: a harness check")
    p.add_argument("--json", type=Path, help="write the payload here")
    p.add_argument("--shapes", nargs="+", choices=list(random_models.SHAPES))
    p.add_argument("--batches", type=int, nargs="+")
    p.add_argument("--repeats", type=int)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--profile-shape", choices=list(random_models.SHAPES))
    args = p.parse_args(argv)
    cfg = TINY if args.tiny else QUICK
    overrides = {
        "shapes": args.shapes,
        "batches": args.batches,
        "repeats": args.repeats,
        "profile_shape": args.profile_shape,
    }
    cfg = replace(cfg, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items() if v})
    device = torch.device(args.device)
    dtype = bench_dtype(device, args.dtype)
    bandwidth = copy_bandwidth(device, 1024 if device.type == "cuda" else 64)
    log(f"copy bandwidth on {device}: {bandwidth / 1e9:.0f} GB/s (read + write)")
    results = []
    for shape in cfg.shapes:
        try:
            results.append(run_shape(cfg, shape, device, dtype, bandwidth))
        except Exception as e:  # one shape's failure is recorded; the others still run
            import traceback

            log(f"{shape} failed: {e!r}")
            failed = ShapeResult(shape, 0, 0, 0, error=traceback.format_exc())
            results.append(failed)
    print(table(results))
    found = metrics(results)
    if args.json:
        profile = next((s.profile for s in results if s.profile is not None), None)
        write_json(
            args.json,
            {
                "benchmark": NAME,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": dtype,
                "config": asdict(cfg),
                "copy_bandwidth_bytes_per_s": bandwidth,
                "shapes": [asdict(s) | {"profile": None} for s in results],  # the profile: its own file
                "metrics": found,
            },
        )
        if profile is not None:
            write_json(args.json.with_suffix(".profile.json"), profile)
    print(result_line(NAME, found))


if __name__ == "__main__":
    main()
