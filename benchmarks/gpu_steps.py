"""Where a GPU decode step's time goes, and when grouping shared prefixes pays once steps are graphed.

Two measurements on our engine alone, over a random-weight model of a real shape
(`benchmarks.harness.random_models`):

* **anatomy** (batch 1, and batch 64): the mean wall time of a pure decode step (the engine's step trace),
  the device time of the model's kernels in those steps (``torch.profiler``: CUPTI sees every kernel of a
  CUDA graph replay, whichever thread launched it), so the step's host share is the difference, and the
  engine thread's Python functions by own time (``cProfile`` on that thread) — what the batch-1 floor gap
  is made of.
* **grouping**: ``n`` requests fork one ``P``-token prefix (each with its own suffix) and decode; the mean
  decode step with ``shared_prefix_decode`` = ``never`` (plain paged decode), ``always`` (grouped: the
  Triton shared-prefix kernel) and ``auto`` (the engine's gate, `kernels.should_share_prefix`) — the gate's
  end-to-end crossover. Grouped steps replay graphs of their own (`server.engine.cuda_graphs`); before
  those existed they ran eagerly.

    python -m benchmarks.gpu_steps [--tiny] [--shape llama-2-7b] [--json PATH]

Last line: ``RESULT gpu_steps b1_step_ms=... b1_device_ms=... grouped_vs_graphed_b<n>_p<P>=...``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import random_models
from benchmarks.harness.engine_models import engine_model
from benchmarks.harness.fill_ab import fresh_fill_ab
from benchmarks.harness.flags import bench_dtype
from benchmarks.harness.generators import OurEngine
from benchmarks.harness.kv_fork import blocks
from benchmarks.harness.output import log, result_line, write_json
from benchmarks.harness.prefill_ab import paged_prefill_ab
from benchmarks.harness.step_anatomy import anatomy, grouping
from benchmarks.harness.step_tables import anatomy_table, grouping_table
from kernels import cpu_kernels, layer_ops
from kernels.settings import CPU_KERNELS, LAYER_KERNELS
from server.engine import EngineConfig, LLMEngine
from server.engine.config import ModelConfig

NAME = "gpu_steps"


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
    grouped = (
        blocks(max(cfg.group_prefixes), EngineConfig.block_size) + max(cfg.group_batches, default=0) * per_seq
    )
    anatomy = max(cfg.anatomy_batches) * (
        blocks(cfg.anatomy_prompt + cfg.anatomy_new, EngineConfig.block_size) + 1
    )
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


def fresh_fills(
    cfg: StepsConfig, dtype: torch.dtype, device: torch.device, tiny: bool
) -> list[dict[str, Any]]:
    """`fill_ab.fresh_fill_ab` on SmolLM2's shape (where the fifth run's fill was host-bound) and this run's:
    steps of 64 and 256 prompts of 128-256 tokens, as `benchmarks.gpu_engine` fills them."""
    shapes = dict.fromkeys(("smollm2-135m", cfg.shape))
    batches, lengths = ((4,), (8, 16)) if tiny else ((64, 256), (128, 256))
    rows = []
    for shape in shapes:
        model = ModelConfig.from_hf_dict(random_models.hf_config(shape))
        rows += [{"shape": shape} | r for r in fresh_fill_ab(model, dtype, device, batches, lengths)]
    return rows


def _report(steps: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    for s in steps:
        print(f"\n## batch {s['batch']} ({s['ops']}): engine thread, Python by own time\n{s['python']}")
        print(f"## batch {s['batch']} ({s['ops']}): the fill, engine thread's Python\n{s['fill_python']}")
        if "kernels" in s:
            print(f"## batch {s['batch']} ({s['ops']}): kernels\n{s['kernels']}")
    print(anatomy_table(steps))
    print(grouping_table(groups))


def _metrics(steps: list[dict[str, Any]], groups: list[dict[str, Any]]) -> dict[str, float]:
    found: dict[str, float] = {}
    for s in steps:
        tag = "" if s["ops"] == "fused" else "_torch_ops"
        found[f"b{s['batch']}_step_ms{tag}"] = s["step_ms"]
        found[f"b{s['batch']}_fill_ms{tag}"] = s["fill_ms"]
        if "device_ms" in s:
            found[f"b{s['batch']}_device_ms{tag}"] = s["device_ms"]
    for g in groups:
        found[f"grouped_vs_graphed_b{g['batch']}_p{g['prefix']}"] = g["grouped_vs_graphed"]
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a small shape and sizes: a harness check")
    p.add_argument("--shape", choices=list(random_models.SHAPES))
    p.add_argument("--json", type=Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--group-batches", type=int, nargs="*", help="batches of the grouping sweep (none: skip)")
    p.add_argument("--group-prefixes", type=int, nargs="+")
    p.add_argument(
        "--compare-layer-ops",
        action="store_true",
        help="also the anatomy of an engine over the same weights with torch's layer ops (no fused kernels)",
    )
    p.add_argument(
        "--compare-paged-prefill",
        action="store_true",
        help="also one layer's attention of a fill chunk after cached tokens: gathered + SDPA vs in place",
    )
    p.add_argument(
        "--compare-fresh-fill",
        action="store_true",
        help="also one layer's attention of a step of fresh fills (SmolLM2's shape and this one): length "
        "groups vs one varlen FlashAttention call",
    )
    args = p.parse_args(argv)
    cfg = TINY if args.tiny else QUICK
    overrides = {"group_batches": args.group_batches, "group_prefixes": args.group_prefixes}
    cfg = replace(
        cfg, shape=args.shape or cfg.shape, **{k: tuple(v) for k, v in overrides.items() if v is not None}
    )
    device = torch.device(args.device)
    dtype = bench_dtype(device, None)
    config = engine_config(cfg, str(device), dtype)
    log(f"{cfg.shape}: building random parameters on {device} ({dtype}) ...")
    pair = random_models.load_pair(cfg.shape, config)
    ours = OurEngine(pair.engine)
    vocab = pair.engine.vocab_size
    cuda = device.type == "cuda"
    try:
        steps = [anatomy(ours, cfg, b, vocab, cuda) | {"ops": "fused"} for b in cfg.anatomy_batches]
        groups = [grouping(ours, cfg, b, pl, vocab) for pl in cfg.group_prefixes for b in cfg.group_batches]
    finally:
        ours.close()
        pair.engine.shutdown()
    if args.compare_layer_ops:  # a second engine over the same weights, its graphs captured without them
        os.environ[LAYER_KERNELS.name] = "0"
        os.environ[CPU_KERNELS.name] = "0"
        layer_ops.clear_cache()
        cpu_kernels.clear_cache()
        e = pair.engine
        plain = OurEngine(LLMEngine(engine_model(e), e.tokenizer, e.model_config, config, cfg.shape))
        try:
            steps += [anatomy(plain, cfg, b, vocab, cuda) | {"ops": "torch"} for b in cfg.anatomy_batches]
        finally:
            plain.close()
            plain.engine.shutdown()
    prefill: list[dict[str, Any]] = []
    if args.compare_paged_prefill:  # one layer's attention, both ways called directly (no switch involved)
        sizes = ((64,), (32,)) if args.tiny else ((2048, 4096), (512, 2048))
        prefill = paged_prefill_ab(pair.engine.model_config, getattr(torch, dtype), device, *sizes)
        for row in prefill:
            print("paged prefill: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()))
    fills: list[dict[str, Any]] = []
    if args.compare_fresh_fill:
        fills = fresh_fills(cfg, getattr(torch, dtype), device, args.tiny)
        for row in fills:
            print("fresh fill: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in row.items()))  # fmt: skip
    _report(steps, groups)
    found = _metrics(steps, groups)
    found |= {f"prefill_gathered_over_in_place_c{r['cached']}_n{r['chunk']}": r["gathered_over_in_place"]
              for r in prefill}  # fmt: skip
    found |= {f"fill_groups_over_varlen_{r['shape']}_b{r['batch']}": r["groups_over_varlen"]
              for r in fills if "groups_over_varlen" in r}  # fmt: skip
    if args.json:
        payload = {"benchmark": NAME, "shape": cfg.shape, "device": str(device), "dtype": dtype}
        write_json(
            args.json,
            payload
            | {"anatomy": steps, "grouping": groups, "paged_prefill": prefill, "fresh_fill": fills}
            | {"metrics": found},
        )
    print(result_line(NAME, found))


if __name__ == "__main__":
    main()
