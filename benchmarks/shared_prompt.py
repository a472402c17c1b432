"""Shared system prompt: a Bing-Copilot-like app, many users at once (the Parrot paper's Fig. 15/16).

The workload (`benchmarks.workloads.copilot`): one long system prompt (``--system-tokens``, 6000 as in the
paper, clipped to the model's window — the length used is printed and written to the JSON) and ``B``
distinct user queries (20-60 tokens, seeded), all sent at once; greedy, EOS ignored, ``--max-tokens``
answer tokens each. Three systems on the real engine (the embedded tiny model by default, CPU):

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
import functools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import parrot as P

from benchmarks.common import Spread, fmt_num, log, markdown_table, safe_ratio
from benchmarks.harness import engine_runs, measure, record, systems
from benchmarks.harness.clients import complete, greedy
from benchmarks.harness.engine_runs import model_facts
from benchmarks.harness.systems import Served
from benchmarks.plotting import pyplot, save
from benchmarks.workloads.copilot import CopilotWorkload, make_workload
from server.engine import EngineConfig

NAME = "shared_prompt"
PARROT, NO_KERNEL, BASELINE = "parrot", "parrot, no kernel", "no sharing"
SYSTEMS = (PARROT, NO_KERNEL, BASELINE)
# The Parrot paper (OSDI '24), Fig. 15/16, Bing-Copilot-like workload, A100, LLaMA-7B: not of this run.
PAPER_ANCHORS = {
    "fig15_latency_speedup_vs_vllm_no_sharing": "up to ~1.8-2.0x lower batch latency (paper)",
    "fig16_kernel_gain_per_output_token": "1.1-1.8x lower per-output-token latency from the kernel (paper)",
    "system_prompt_tokens": "~6k (paper)",
}
_TEMPLATE_SLACK_TOKENS = 24  # the template's text around the query plus BOS, with room to spare

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
QUICK = BenchConfig(batches=(4, 8, 16), system_tokens=1024, max_tokens=16, repeats=4)
TINY = BenchConfig(
    batches=(2, 4), system_tokens=256, min_query_tokens=8, max_query_tokens=16, max_tokens=6, repeats=1
)


# ----------------------------------------------------------------------------------------------- sizes
def fit_system_tokens(cfg: BenchConfig, max_model_len: int) -> int:
    """The system prompt length used: as asked, or less so that the longest prompt plus its answer fit."""
    room = max_model_len - 1 - cfg.max_tokens - cfg.max_query_tokens - _TEMPLATE_SLACK_TOKENS
    if room < 64:
        raise SystemExit(f"the model's window ({max_model_len}) leaves no room for a system prompt")
    return min(cfg.system_tokens, room)


def blocks(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def shared_prefix(tokenizer: Any, workload: CopilotWorkload, prompt_ids: list[int]) -> int:
    """The constant prefix the manager shares, in tokens: the text before the query, cut back to a true
    prefix of the whole prompt's tokens (as `Manager._constant_prefix` does)."""
    prefix = tokenizer.encode(workload.prompts(1)[0][: -len(workload.queries[0])])
    while prefix and prompt_ids[: len(prefix)] != prefix:
        prefix.pop()
    return len(prefix)


def expected_blocks(ids: list[list[int]], prefix: int, new_tokens: int, block_size: int) -> dict[str, int]:
    """KV blocks with every context alive at its end (a context has KV for its prompt and all but its last
    token). Parrot: the prefix once, plus per fork its context beyond the prefix's full blocks (exact).
    No sharing: every whole context (a bound: early requests may finish before late ones start)."""
    cached = [len(p) + new_tokens - 1 for p in ids]
    shared = blocks(prefix, block_size) + sum(blocks(c, block_size) - prefix // block_size for c in cached)
    return {PARROT: shared, NO_KERNEL: shared, BASELINE: sum(blocks(c, block_size) for c in cached)}


def compared(
    cfg: BenchConfig, longest_prompt: int, block_size: int = 16, device: str = "cpu"
) -> list[systems.System]:
    """Two engines, with and without the kernel, each with room for the baseline's biggest batch at its
    longest (nothing waits for memory) and a step trace; neither caches OpenAI-route prefixes."""
    most = max(cfg.batches)
    kv = most * blocks(longest_prompt + cfg.max_tokens, block_size) + 64  # + the warm-up's spare
    engine = EngineConfig(num_kv_blocks=kv, max_num_seqs=max(64, most), device=device, trace_steps=100_000)
    kernel = replace(engine, shared_prefix_decode=cfg.kernel_mode)
    return [
        systems.parrot(PARROT, kernel, openai_prefix_cache=False),
        systems.baseline(NO_KERNEL, replace(engine, shared_prefix_decode="never")),
    ]


# ----------------------------------------------------------------------------------------------- clients
def batch_job(served: Served, workload: CopilotWorkload, batch: int, max_tokens: int) -> measure.Job:
    """The first ``batch`` users at once through the system's client: ``B`` completions (baseline) or one
    `parrot` session each, timed to the last answer in hand (the sessions' ``DELETE`` is not)."""
    if served.system.name == BASELINE:
        prompts = workload.prompts(batch)
        model = served.model_name
        return lambda _: asyncio.gather(*(complete(served.http, p, max_tokens, model=model) for p in prompts))
    sampling = P.SamplingConfig(**greedy(max_tokens))
    fn = P.SemanticFunction.from_template(workload.template, name="copilot", sampling=sampling)

    async def users(done: Any) -> list[str]:
        left = batch

        async def user(query: str) -> str:
            nonlocal left
            async with P.Session(str(served.http.base_url), client=served.http, timeout=600):
                answer = fn(query=query)
                assert isinstance(answer, P.Variable)
                value = str(await answer.aget())
                left -= 1
                if not left:
                    done()
            return value

        return list(await asyncio.gather(*(user(q) for q in workload.queries[:batch])))

    return users


# ----------------------------------------------------------------------------------------------- runs
def summary(
    samples: dict[str, measure.Samples], ids: list[list[int]], prefix: int, expected: dict[str, int]
) -> dict[str, Any]:
    """One batch size's payload row: each system's figures (`engine_runs.as_dict`, with the blocks the
    paged design predicts), and the ratios to Parrot."""
    per = {n: engine_runs.as_dict(s) | {"expected_blocks": expected[n]} for n, s in samples.items()}

    def vs(slow: str, fast: str, key: str) -> float:
        x, y = per[slow][key], per[fast][key]
        return safe_ratio(x["median"], y["median"]) if isinstance(x, dict) else safe_ratio(x, y)

    ratios = {
        "speedup": vs(BASELINE, PARROT, "latency"),
        "speedup_no_kernel": vs(BASELINE, NO_KERNEL, "latency"),
        "kernel_latency": vs(NO_KERNEL, PARROT, "latency"),
        "kernel_gain": vs(NO_KERNEL, PARROT, "tpot"),
        "kernel_gain_pure": vs(NO_KERNEL, PARROT, "tpot_pure"),
        "tpot_vs_baseline": vs(BASELINE, PARROT, "tpot"),
        "kv_saving": vs(BASELINE, PARROT, "peak_blocks_max"),
    }
    tokens = [len(p) for p in ids]  # BOS included: what the baseline prefills per request
    return {
        "batch": len(ids),
        "prompt_tokens": tokens,
        "shared_prefix_tokens": prefix,
        "systems": per,
        "ratios": ratios,
    }


async def measure_batches(
    servers: dict[str, Served], workload: CopilotWorkload, tokenizer: Any, cfg: BenchConfig
) -> list[tuple[dict[str, Any], dict[str, measure.Samples]]]:
    """Per batch size: the payload row and the samples (answers checked identical first)."""
    out = []
    async with systems.connected(servers, timeout=600):
        for b in cfg.batches:
            log(f"batch {b}: verifying answers and warming up ...")
            job = functools.partial(batch_job, workload=workload, batch=b, max_tokens=cfg.max_tokens)
            samples = await engine_runs.compare(servers, job, cfg.repeats, f"b{b} ")
            ids = [tokenizer.encode(p) for p in workload.prompts(b)]
            prefix = shared_prefix(tokenizer, workload, ids[0])
            expected = expected_blocks(ids, prefix, cfg.max_tokens, servers[PARROT].engines[0].block_size)
            out.append((summary(samples, ids, prefix, expected), samples))
    return out


# ----------------------------------------------------------------------------------------------- report
def engine_table(rows: list[dict[str, Any]]) -> str:
    """TPOT and KV blocks per batch size and system (the latencies are in `record.latency_table`)."""
    cells = []
    for row in rows:
        vs = {NO_KERNEL: row["ratios"]["kernel_gain"], BASELINE: row["ratios"]["tpot_vs_baseline"]}
        for name, f in row["systems"].items():
            tp = Spread(*(f["tpot"][k] for k in ("median", "min", "max", "n")))
            cells.append(
                [
                    str(row["batch"]),
                    name,
                    f"{tp.median * 1e3:.2f} ±{tp.rel_half_range:.0%}",
                    f"{f['tpot_pure']['median'] * 1e3:.2f}",
                    f"{fmt_num(f['peak_blocks_max'])} ({fmt_num(f['expected_blocks'])})",
                    f"{f['grouped_decode_steps'][-1]}/{f['decode_steps'][-1]}",
                    f"{vs[name]:.2f}x" if name in vs else "",
                ]
            )
    heads = ["batch", "system", "TPOT ms", "pure-decode TPOT ms", "peak KV blocks (expected)"]
    heads += ["grouped / decode steps (last)", "TPOT this / parrot"]
    return markdown_table(heads, cells, [True, False, *([True] * 5)])


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
    plt = pyplot()
    rows = payload["batches"]
    xs = [r["batch"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("batch latency (s)", lambda s: s["latency"]["median"]),
        ("per-output-token latency (ms)", lambda s: s["tpot"]["median"] * 1e3),
        ("peak KV blocks", lambda s: s["peak_blocks_max"]),
    )
    for ax, (label, value) in zip(axes, panels, strict=True):
        # Dashed/dotted lines: parrot and no-kernel hold the same KV blocks, one line would hide the other.
        for name, marker, style in zip(SYSTEMS, ("o", "s", "^"), ("-", "--", ":"), strict=True):
            ax.plot(xs, [value(r["systems"][name]) for r in rows], marker=marker, linestyle=style, label=name)
        ax.set(xlabel="batch size (requests at once)", ylabel=label, xticks=xs)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    tokens = payload["system_prompt_tokens"]["used"]
    fig.suptitle(f"shared system prompt ({tokens} tokens), {payload['model']['name']}: Fig. 15/16 analogue")
    save(fig, path)


# ----------------------------------------------------------------------------------------------- main
def arguments(argv: list[str] | None) -> tuple[argparse.Namespace, BenchConfig]:
    """The command line and the configuration it asks for."""
    p = record.parser(
        __doc__,
        "1k-token system prompt, batches 4 8 16, 4 repeats (~1 min)",
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
    import transformers

    transformers.utils.logging.set_verbosity_error()  # the long-text warning of building the workload
    tokenizer, max_model_len = model_facts(args.model)
    used, most = fit_system_tokens(cfg, max_model_len), max(cfg.batches)
    workload = make_workload(tokenizer, used, most, cfg.seed, cfg.min_query_tokens, cfg.max_query_tokens)
    longest = max(len(tokenizer.encode(p)) for p in workload.prompts(most))
    if longest + cfg.max_tokens >= max_model_len:
        raise SystemExit(f"a prompt of {longest} tokens plus the answer exceeds the window ({max_model_len})")
    setup = compared(cfg, longest, device=args.device)
    log(f"system prompt {used} tokens (asked {cfg.system_tokens}); starting two servers ({args.model}) ...")
    with systems.serve(args.model, setup, delay=None) as servers:
        # The baseline's client on the no-kernel server: its OpenAI route shares nothing.
        servers[BASELINE] = replace(servers[NO_KERNEL], system=systems.baseline(BASELINE, setup[1].engine))
        measured = asyncio.run(measure_batches(servers, workload, tokenizer, cfg))
    rows = [row for row, _ in measured]

    print(rec.header(args.model))
    print(
        f"system prompt {used} tokens (asked {cfg.system_tokens}; shared prefix with BOS "
        f"{rows[-1]['shared_prefix_tokens']}), queries {cfg.min_query_tokens}-{cfg.max_query_tokens} tokens, "
        f"{cfg.max_tokens} answer tokens (greedy, EOS ignored), all at once, no network delay. Median of "
        f"{cfg.repeats} repeats, systems interleaved, each from an empty KV cache; answers checked "
        f"identical. Shared-prefix decode {cfg.kernel_mode!r} for parrot, 'never' for the others.\n"
    )
    speedups = [
        (str(row["batch"]), s, {n: measure.ratio(s[n], s[PARROT]) for n in (NO_KERNEL, BASELINE)})
        for row, s in measured
    ]
    print(record.latency_table(speedups, "batch") + "\n")
    print(engine_table(rows) + "\n")
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
