"""Where a GPU decode step's time goes, and when grouping shared prefixes pays once steps are graphed.

Two measurements on our engine alone, over a random-weight model of a real shape
(`benchmarks.harness.random_models`):

* **anatomy** (batch 1, and batch 64): the mean wall time of a pure decode step (the engine's step trace),
  the device time of the model's kernels in those steps (``torch.profiler``: CUPTI sees every kernel of a
  CUDA graph replay, whichever thread launched it), so the step's host share is the difference, and the
  engine thread's Python functions by own time (``cProfile`` on that thread) — what the batch-1 floor gap
  is made of.
* **grouping**: ``n`` requests fork one ``P``-token prefix (each with its own suffix) and decode; the mean
  decode step with ``shared_prefix_decode`` = ``never`` (every step replays a CUDA graph), ``always``
  (grouped, eager: the Triton shared-prefix kernel) and ``auto`` (the engine's gate,
  `kernels.should_share_prefix` with ``graphed=True``) — the gate's end-to-end crossover.

    python -m benchmarks.gpu_steps [--tiny] [--shape llama-2-7b] [--json PATH]

Last line: ``RESULT gpu_steps b1_step_ms=... b1_device_ms=... grouped_vs_graphed_b<n>_p<P>=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import random_models
from benchmarks.harness.flags import bench_dtype
from benchmarks.harness.generators import OurEngine
from benchmarks.harness.kv_fork import blocks
from benchmarks.harness.output import log, markdown_table, result_line, write_json
from server.engine import EngineConfig, SamplingParams

NAME = "gpu_steps"
MODES = ("never", "always", "auto")


@dataclass(frozen=True)
class StepsConfig:
    shape: str = "llama-2-7b"
    anatomy_batches: tuple[int, ...] = (1, 64)
    anatomy_prompt: int = 256
    anatomy_new: int = 64
    group_batches: tuple[int, ...] = (8, 16, 32, 64)
    group_prefixes: tuple[int, ...] = (1024, 3840)  # the 7B's window is 4,096
    suffix: int = 128
    group_new: int = 24
    repeats: int = 2


QUICK = StepsConfig()
TINY = StepsConfig(
    shape="smollm2-135m",
    anatomy_batches=(1, 4),
    anatomy_prompt=16,
    anatomy_new=4,
    group_batches=(4,),
    group_prefixes=(64,),
    suffix=16,
    group_new=4,
    repeats=1,
)


def engine_config(cfg: StepsConfig, device: str, dtype: str) -> EngineConfig:
    longest = max(cfg.group_prefixes) + cfg.suffix + cfg.group_new
    per_seq = blocks(cfg.suffix + cfg.group_new, EngineConfig.block_size) + 2
    grouped = blocks(max(cfg.group_prefixes), EngineConfig.block_size) + max(cfg.group_batches) * per_seq
    anatomy = max(cfg.anatomy_batches) * (blocks(cfg.anatomy_prompt + cfg.anatomy_new, 16) + 1)
    batch = max(*cfg.group_batches, *cfg.anatomy_batches)
    return EngineConfig(
        num_kv_blocks=max(grouped, anatomy) + 64,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        max_model_len=max(longest, cfg.anatomy_prompt + cfg.anatomy_new) + 64,
        device=device,
        dtype=dtype,
        trace_steps=100_000,
    )


def _decode_step_s(ours: OurEngine, since: int) -> float:
    """Mean wall time of the pure decode steps traced since index ``since`` (a generate's first step
    samples a fill's stored hidden state and runs no model: left out)."""
    trace = ours.engine.step_trace
    assert trace is not None
    steps = list(trace)[since:]
    times = [r.seconds for r in steps if r.features.prefill_tokens == 0 and r.features.decode_seqs > 0]
    return statistics.mean(times) if times else float("nan")


async def _fill(ours: OurEngine, prompts: list[list[int]]) -> list[int]:
    ids = ours.context_ids(len(prompts))
    await asyncio.gather(*(ours.engine.fill(c, p) for c, p in zip(ids, prompts, strict=True)))
    return ids


async def _decode(ours: OurEngine, ids: list[int], new: int) -> None:
    sampling = SamplingParams(max_tokens=new, ignore_eos=True)
    await asyncio.gather(*(ours.engine.generate(c, sampling) for c in ids))
    await asyncio.gather(*(ours.engine.free_context(c) for c in ids))


def anatomy(ours: OurEngine, cfg: StepsConfig, batch: int, vocab: int, cuda: bool) -> dict[str, Any]:
    """A batch's decode steps: wall time, device time, and the engine thread's Python by own time."""
    prompts = [[(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(cfg.anatomy_prompt)] for i in range(batch)]
    new = cfg.anatomy_new
    ours.call(_decode(ours, ours.call(_fill(ours, prompts)), new))  # warm-up
    trace = ours.engine.step_trace
    assert trace is not None
    ids = ours.call(_fill(ours, prompts))
    since = len(trace)
    ours.call(_decode(ours, ids, new))
    out: dict[str, Any] = {"batch": batch, "step_ms": 1000 * _decode_step_s(ours, since)}
    if cuda:
        ids = ours.call(_fill(ours, prompts))
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            ours.call(_decode(ours, ids, new))
        # Every kernel of the generate, over the steps that ran the model (all but the first).
        total_us = sum(e.self_device_time_total for e in prof.key_averages())
        out["device_ms"] = total_us / 1000 / max(1, new - 1)
        out["kernels"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
    ids = ours.call(_fill(ours, prompts))
    profiler = cProfile.Profile()
    # The engine runs its steps on its own thread; cProfile sees only the thread that enabled it.
    ours.call(ours.engine._run_on_thread(profiler.enable))
    ours.call(_decode(ours, ids, new))
    ours.call(ours.engine._run_on_thread(profiler.disable))
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    out["python"] = text.getvalue()
    log(f"batch {batch}: step {out['step_ms']:.2f} ms, device {out.get('device_ms', float('nan')):.2f} ms")
    return out


def grouping(ours: OurEngine, cfg: StepsConfig, batch: int, prefix_len: int, vocab: int) -> dict[str, Any]:
    """Mean decode step of ``batch`` forks of one prefix, per ``shared_prefix_decode`` mode (interleaved)."""
    runner = ours.engine._runner  # the mode is read per step: switched between runs, same weights and KV
    shipped = runner.shared_prefix_decode
    prefix = [(5 * j + 11) % (vocab - 3) + 3 for j in range(prefix_len)]
    suffixes = [[(3 * i + 7 * j) % (vocab - 3) + 3 for j in range(cfg.suffix)] for i in range(batch)]
    sampling = SamplingParams(max_tokens=cfg.group_new, ignore_eos=True)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    grouped: dict[str, int] = {}

    async def once() -> None:
        root, *ids = ours.context_ids(batch + 1)
        await ours.engine.fill(root, prefix)
        await asyncio.gather(*(ours.engine.fill(c, s, root) for c, s in zip(ids, suffixes, strict=True)))
        await asyncio.gather(*(ours.engine.generate(c, sampling) for c in ids))
        await asyncio.gather(*(ours.engine.free_context(c) for c in [root, *ids]))

    try:
        for repeat in range(cfg.repeats + 1):  # the first round warms up (Triton compiles)
            for mode in MODES:
                runner.shared_prefix_decode = mode
                trace = ours.engine.step_trace
                assert trace is not None
                since, before = len(trace), runner.grouped_decode_steps
                ours.call(once())
                if repeat:
                    times[mode].append(_decode_step_s(ours, since))
                grouped[mode] = runner.grouped_decode_steps - before
    finally:
        runner.shared_prefix_decode = shipped
    ms = {m: 1000 * statistics.median(t) for m, t in times.items()}
    row = {"batch": batch, "prefix": prefix_len, "step_ms": ms, "grouped_steps": grouped}
    row["grouped_vs_graphed"] = ms["never"] / ms["always"]
    log(f"b{batch} p{prefix_len}: " + ", ".join(f"{m} {v:.2f} ms" for m, v in ms.items()))
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a small shape and sizes: a harness check")
    p.add_argument("--shape", choices=list(random_models.SHAPES))
    p.add_argument("--json", type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    cfg = TINY if args.tiny else QUICK
    cfg = replace(cfg, shape=args.shape or cfg.shape)
    device = torch.device(args.device)
    dtype = bench_dtype(device, None)
    config = engine_config(cfg, str(device), dtype)
    log(f"{cfg.shape}: building random parameters on {device} ({dtype}) ...")
    pair = random_models.load_pair(cfg.shape, config)
    ours = OurEngine(pair.engine)
    vocab = pair.engine.vocab_size
    cuda = device.type == "cuda"
    try:
        steps = [anatomy(ours, cfg, b, vocab, cuda) for b in cfg.anatomy_batches]
        groups = [grouping(ours, cfg, b, pl, vocab) for pl in cfg.group_prefixes for b in cfg.group_batches]
    finally:
        ours.close()
        pair.engine.shutdown()
    for s in steps:
        print(f"\n## batch {s['batch']}: engine thread, Python by own time\n{s['python']}")
        if "kernels" in s:
            print(f"## batch {s['batch']}: kernels\n{s['kernels']}")
    print(
        markdown_table(
            ["batch", "prefix", *(f"{m} ms" for m in MODES), "never/always", "auto grouped steps"],
            [
                [
                    str(g["batch"]),
                    str(g["prefix"]),
                    *(f"{g['step_ms'][m]:.2f}" for m in MODES),
                    f"{g['grouped_vs_graphed']:.2f}x",
                    str(g["grouped_steps"]["auto"]),
                ]
                for g in groups
            ],
            [True] * 7,
        )
    )
    found: dict[str, float] = {}
    for s in steps:
        found[f"b{s['batch']}_step_ms"] = s["step_ms"]
        if "device_ms" in s:
            found[f"b{s['batch']}_device_ms"] = s["device_ms"]
    for g in groups:
        found[f"grouped_vs_graphed_b{g['batch']}_p{g['prefix']}"] = g["grouped_vs_graphed"]
    if args.json:
        payload = {"benchmark": NAME, "shape": cfg.shape, "device": str(device), "dtype": dtype}
        write_json(args.json, payload | {"anatomy": steps, "grouping": groups, "metrics": found})
    print(result_line(NAME, found))


if __name__ == "__main__":
    main()
