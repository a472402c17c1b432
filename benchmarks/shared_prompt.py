"""Shared system prompt: a Bing-Copilot-like app, many users at once (the Parrot paper's Fig. 15/16).

The workload (`benchmarks.workloads.copilot`): one long system prompt (``--system-tokens``, 6000 as in the
paper, clipped to the model's window — the length used is printed and written to the JSON) and ``B``
distinct user queries (20-60 tokens, seeded), all sent at once; greedy, EOS ignored, ``--max-tokens``
answer tokens each. Three systems on the real engine (``--model``; SmolLM2 in float32 in the runner's runs):

* **parrot** — the app as a semantic function (system prompt, ``{{input:query}}``, ``{{output:answer}}``),
  one `parrot` session per user. The manager fills the constant prefix once and forks every request from
  it; decode reads the shared prefix once per group (`EngineConfig(shared_prefix_decode=...)`,
  ``--kernel-mode``: ``auto`` is the engine's own gate `kernels.should_share_prefix`).
* **parrot, no kernel** — the same with ``shared_prefix_decode="never"``: shared blocks, but each sequence
  reads the whole prefix itself (PagedAttention).
* **no sharing** — vLLM without prefix caching: ``B`` independent ``POST /v1/completions`` of the rendered
  prompts, each prefilling and storing the whole system prompt (served by the no-kernel engine: its
  requests share no blocks, so there is nothing to group).

Per batch size, an untimed warm-up checks the three give identical answers, then ``--repeats`` runs per
system, interleaved, each from an empty KV cache (Parrot prefills the system prompt inside every run):
**latency** (first request to the last answer in hand), **TPOT** from the engine's step trace (the
decode-weighted mean step time, `harness.engine_runs.tpot`; *pure-decode*: steps without prefill), **peak
KV blocks** (the engine's exact high-water mark; next to it the count the paged design predicts). Ratios:
``speedup`` (latency, no sharing / parrot), ``kernel_gain`` (TPOT, no kernel / parrot), ``kv_saving``
(peak blocks, no sharing / parrot). No network delay: single-shot requests pay it equally.

``--quick``: 1k-token prompt, batches 4/8/16, 16 answer tokens; ``--tiny``: a harness check in seconds.
Last line: ``RESULT shared_prompt speedup_b<max>=... kernel_gain_b<max>=... kv_saving_b<max>=... ...``.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from benchmarks.harness import app_jobs, engine_runs, measure, record, systems
from benchmarks.harness.engine_runs import model_facts
from benchmarks.harness.line_panels import line_panels
from benchmarks.harness.output import log, quiet_transformers
from benchmarks.harness.systems import Served
from benchmarks.plotting import save
from benchmarks.workloads import copilot
from benchmarks.workloads.copilot import CopilotWorkload, make_workload
from server.engine import EngineConfig

NAME = "shared_prompt"
PARROT, NO_KERNEL, BASELINE = "parrot", "parrot, no kernel", "no sharing"
SYSTEMS = (PARROT, NO_KERNEL, BASELINE)
# The ratios reported per batch size: (slower system, faster system, figure of `engine_runs.as_dict`).
RATIOS = {
    "speedup": (BASELINE, PARROT, "latency"),
    "speedup_no_kernel": (BASELINE, NO_KERNEL, "latency"),
    "kernel_latency": (NO_KERNEL, PARROT, "latency"),
    "kernel_gain": (NO_KERNEL, PARROT, "tpot"),
    "kernel_gain_pure": (NO_KERNEL, PARROT, "tpot_pure"),
    "tpot_vs_baseline": (BASELINE, PARROT, "tpot"),
    "kv_saving": (BASELINE, PARROT, "peak_blocks_max"),
}
# The Parrot paper (OSDI '24), Fig. 15/16, Bing-Copilot-like workload, A100, LLaMA-7B: not of this run.
PAPER_ANCHORS = {
    "fig15_latency_speedup_vs_vllm_no_sharing": "up to ~1.8-2.0x lower batch latency (paper)",
    "fig16_kernel_gain_per_output_token": "1.1-1.8x lower per-output-token latency from the kernel (paper)",
    "system_prompt_tokens": "~6k (paper)",
}

KernelMode = Literal["auto", "always"]


@dataclass(frozen=True)
class BenchConfig:
    batches: tuple[int, ...] = (8, 16, 32, 64)
    system_tokens: int = 6000  # asked for; clipped to the model's window (`fit_system_tokens`)
    min_query_tokens: int = 20
    max_query_tokens: int = 60
    max_tokens: int = 64  # answer tokens per request
    repeats: int = 3
    kernel_mode: KernelMode = "auto"
    seed: int = 0


FULL = BenchConfig()
# The batches the report reads (8, 16); batch 4, in neither the report nor the full size, cost ~35 s.
QUICK = BenchConfig(batches=(8, 16), system_tokens=1024, max_tokens=16, repeats=2)
TINY = BenchConfig(
    batches=(2, 4), system_tokens=256, min_query_tokens=8, max_query_tokens=16, max_tokens=6, repeats=1
)


# ----------------------------------------------------------------------------------------------- sizes
def fit_system_tokens(cfg: BenchConfig, max_model_len: int) -> int:
    """The system prompt length used: as asked, or less so that the longest prompt plus its answer fit."""
    return copilot.fit_system_tokens(cfg.system_tokens, max_model_len, cfg.max_query_tokens, cfg.max_tokens)


def compared(
    cfg: BenchConfig, longest_prompt: int, block_size: int = 16, device: str = "cpu"
) -> list[systems.System]:
    """Two engines, with and without the kernel, each with room for the baseline's biggest batch at its
    longest (nothing waits for memory) and a step trace; neither caches OpenAI-route prefixes."""
    most = max(cfg.batches)
    kv = engine_runs.kv_blocks([longest_prompt + cfg.max_tokens] * most, block_size) + 64  # + warm-up room
    # float32 on CPU: batch invariance (the other experiments' bf16 setting) never groups decodes, and
    # the kernel is what this experiment compares.
    dtype = "float32" if device == "cpu" else None
    engine = EngineConfig(
        num_kv_blocks=kv, max_num_seqs=max(64, most), device=device, dtype=dtype, trace_steps=100_000
    )
    kernel = replace(engine, shared_prefix_decode=cfg.kernel_mode)
    return [
        systems.parrot(PARROT, kernel, openai_prefix_cache=False),
        systems.baseline(NO_KERNEL, replace(engine, shared_prefix_decode="never")),
    ]


# ----------------------------------------------------------------------------------------------- clients
def batch_job(served: Served, workload: CopilotWorkload, batch: int, max_tokens: int) -> measure.Job:
    """The first ``batch`` users at once through the system's client (`app_jobs.copilot_batch`): ``B``
    completions (baseline) or one `parrot` session each (both Parrot systems)."""
    return app_jobs.copilot_batch(served, workload, batch, max_tokens, parrot=served.system.name != BASELINE)


# ----------------------------------------------------------------------------------------------- report
def summary(
    samples: dict[str, measure.Samples], ids: list[list[int]], prefix: int, expected: tuple[int, int]
) -> dict[str, Any]:
    """One batch size's payload row: each system's figures (`engine_runs.as_dict`, with the KV peak the
    paged design predicts: Parrot's exact, no sharing's a bound), and the `RATIOS`."""
    blocks = {PARROT: expected[0], NO_KERNEL: expected[0], BASELINE: expected[1]}
    per = {n: engine_runs.as_dict(s) | {"expected_blocks": blocks[n]} for n, s in samples.items()}
    return {
        "batch": len(ids),
        "prompt_tokens": [len(p) for p in ids],
        "shared_prefix_tokens": prefix,
        "systems": per,
        "ratios": {k: engine_runs.figure_ratio(per, *spec) for k, spec in RATIOS.items()},
    }


def metrics(rows: list[dict[str, Any]], system_tokens: int) -> dict[str, float | int]:
    """The headline ratios at the biggest batch, then each ratio at the other batch sizes, then raw
    figures at the biggest."""
    top = max(rows, key=lambda r: r["batch"])
    b, s = top["batch"], top["systems"]
    keys = ("speedup", "kernel_gain", "kv_saving")
    out: dict[str, float | int] = {f"{k}_b{b}": top["ratios"][k] for k in keys}
    out |= {f"{k}_b{r['batch']}": r["ratios"][k] for k in keys for r in rows if r is not top}
    out[f"parrot_s_b{b}"] = s[PARROT]["latency"]["median"]
    out[f"baseline_s_b{b}"] = s[BASELINE]["latency"]["median"]
    out[f"parrot_tpot_ms_b{b}"] = s[PARROT]["tpot"]["median"] * 1e3
    out[f"no_kernel_tpot_ms_b{b}"] = s[NO_KERNEL]["tpot"]["median"] * 1e3
    return out | {"system_tokens": system_tokens}


def plot(payload: dict[str, Any], path: Path) -> None:
    """Batch latency, per-output-token latency and peak KV blocks against batch size, per system (PNG)."""
    rows = payload["batches"]
    figures = {
        "batch latency (s)": lambda s: s["latency"]["median"],
        "per-output-token latency (ms)": lambda s: s["tpot"]["median"] * 1e3,
        "peak KV blocks": lambda s: s["peak_blocks_max"],
    }
    panels = {y: {n: [f(r["systems"][n]) for r in rows] for n in SYSTEMS} for y, f in figures.items()}
    fig, axes = line_panels([r["batch"] for r in rows], panels, "batch size (requests at once)", (15, 4.5))
    axes[0].legend()
    tokens = payload["system_prompt_tokens"]["used"]
    fig.suptitle(f"shared system prompt ({tokens} tokens), {payload['model']['name']}: Fig. 15/16 analogue")
    save(fig, path)


# ----------------------------------------------------------------------------------------------- main
def arguments(argv: list[str] | None) -> tuple[argparse.Namespace, BenchConfig]:
    """The command line and the configuration it asks for."""
    p = record.parser(
        __doc__,
        "1k-token system prompt, batches 8 and 16, 2 repeats (~1.5 min)",
        BenchConfig,
        repeats="timed repeats per batch size and system (median)",
        system_tokens="system prompt tokens asked for (default 6000)",
        max_tokens="answer tokens per request",
    )
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 8 16 32 64)")
    p.add_argument("--query-tokens", type=int, nargs=2, metavar=("MIN", "MAX"), help="query lengths")
    p.add_argument("--kernel-mode", choices=("auto", "always"), help="parrot's shared_prefix_decode")
    p.add_argument(
        "--device", default="cpu", help="the engines' device (default cpu; cuda: the Triton kernels)"
    )
    args = p.parse_args(argv)
    args.batches = tuple(sorted(set(args.batches))) if args.batches else None
    args.min_query_tokens, args.max_query_tokens = args.query_tokens or (None, None)
    return args, record.configured(args, FULL, QUICK, TINY)


def main(argv: list[str] | None = None) -> None:
    args, cfg = arguments(argv)
    rec = record.Recorder(NAME, args)
    quiet_transformers()  # the long-text warning of building the workload
    tokenizer, max_model_len = model_facts(args.model)
    used, most = fit_system_tokens(cfg, max_model_len), max(cfg.batches)
    workload = make_workload(tokenizer, used, most, cfg.seed, cfg.min_query_tokens, cfg.max_query_tokens)
    longest = workload.longest_prompt(tokenizer, most, cfg.max_tokens, max_model_len)
    setup = compared(cfg, longest, device=args.device)
    log(f"system prompt {used} tokens (asked {cfg.system_tokens}); starting two servers ({args.model}) ...")
    with systems.serve(args.model, setup, delay=None) as servers:
        # The baseline's client on the no-kernel server: its OpenAI route shares nothing.
        servers[BASELINE] = replace(servers[NO_KERNEL], system=systems.baseline(BASELINE, setup[1].engine))
        jobs = {f"b{b}": lambda s, b=b: batch_job(s, workload, b, cfg.max_tokens) for b in cfg.batches}
        measured = list(asyncio.run(engine_runs.sweep(servers, jobs, cfg.repeats)).values())
        block_size = servers[PARROT].engines[0].block_size
    rows = []
    for b, samples in zip(cfg.batches, measured, strict=True):
        ids, prefix = workload.tokens(tokenizer, b)
        expected = engine_runs.expected_peaks(ids, prefix, cfg.max_tokens, block_size)
        rows.append(summary(samples, ids, prefix, expected))

    print(rec.header(args.model))
    print(
        f"system prompt {used} tokens (asked {cfg.system_tokens}; shared prefix with BOS "
        f"{rows[-1]['shared_prefix_tokens']}), queries {cfg.min_query_tokens}-{cfg.max_query_tokens} tokens, "
        f"{cfg.max_tokens} answer tokens (greedy, EOS ignored), all at once, no network delay. Median of "
        f"{cfg.repeats} repeats, systems interleaved, each from an empty KV cache; answers checked "
        f"identical. Shared-prefix decode {cfg.kernel_mode!r} for parrot, 'never' for the others.\n"
    )
    speedups = [
        (str(b), s, {n: measure.ratio(s[n], s[PARROT]) for n in (NO_KERNEL, BASELINE)})
        for b, s in zip(cfg.batches, measured, strict=True)
    ]
    print(record.latency_table(speedups, "batch") + "\n")
    vs = {NO_KERNEL: "kernel_gain", BASELINE: "tpot_vs_baseline"}  # TPOT, this system / parrot
    tpot_ratios = [(str(r["batch"]), r["systems"], {n: r["ratios"][k] for n, k in vs.items()}) for r in rows]
    print(engine_runs.trace_table(tpot_ratios, "batch", PARROT) + "\n")
    print("paper (Fig. 15/16, A100, LLaMA-7B): " + "; ".join(PAPER_ANCHORS.values()))
    rec.finish(
        metrics(rows, used),
        config=cfg,
        model={"name": args.model, "max_model_len": max_model_len},
        systems={**{s.name: s.describe() for s in setup}, BASELINE: f"/v1/completions on {NO_KERNEL!r}"},
        system_prompt_tokens={"asked": cfg.system_tokens, "used": used},
        network_delay=None,
        outputs_identical=True,  # checked: a difference stops the run
        batches=rows,
        paper_anchors=PAPER_ANCHORS,
    )


if __name__ == "__main__":
    main()
