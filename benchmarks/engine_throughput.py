"""Engine throughput: our paged-KV engine vs Hugging Face ``generate`` on the same model, in one run.

Measured at batch 1, 16 and 64 with the same prompts (stdlib docstrings, lengths spread over
``[spread * L, L]``), greedy, the same number of new tokens, fp32 on CPU:

* **prefill tok/s** = prompt tokens / ``T(1)``, where ``T(1)`` is the wall time from submitting the batch to
  having the first generated token of every request (ours: ``fill`` + ``generate(max_tokens=1)`` per request,
  all at once; HF: ``generate(max_new_tokens=1)`` over the left-padded batch). Prompt tokens are the real,
  unpadded ones for both systems, so the padding HF computes counts against it.
* **decode tok/s** = ``B * (N - 1) / (T(N) - T(1))``: the generated tokens after the first, over the time the
  run with ``N`` new tokens takes beyond the prefill-only run. Same definition for both systems; with
  continuous batching, prefill and decode of different requests overlap, and this charges decode with
  exactly the extra time that producing the other ``N - 1`` tokens costs.
* **end-to-end tok/s** = ``B * N / T(N)`` (generated tokens over the whole run).

``T(1)`` and ``T(N)`` are medians over at least ``--repeats`` runs (small batches get more, up to 3x,
within a time budget), ours and HF interleaved (alternating which goes first), each system's pair of timed
runs preceded by an untimed prefill-only run (see `measure_batch`), after one full warm-up run of each;
the spread (``±``) is half the range of the per-repeat figures. HF is what a Hugging Face user runs:
``LlamaForCausalLM.from_pretrained(folder)``, left padding with an attention mask,
``generate(do_sample=False, min_new_tokens=N, max_new_tokens=N)`` (its default cache and attention).

KV memory: 32 requests sharing a 2048-token prefix plus a distinct 16-token suffix each, generating a few
tokens, counted exactly (``engine.stats().blocks_used`` with every context still alive) with fork (the prefix
filled once, 32 children forked from it) and without (32 independent fills of prefix + suffix).

    python -m benchmarks.engine_throughput [--quick] [--json PATH] [--model PATH] [--repeats N]
    (or python benchmarks/engine_throughput.py ...)

The last line is ``RESULT engine_throughput decode_ratio_b1=... prefill_ratio_b64=... kv_fork_ratio=...``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

if not __package__:
    # Run as a file, this script's directory would come first on sys.path (where `benchmarks/kernels.py`
    # shadows the `kernels` package); put the repository root there instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.common import (
    Spread,
    add_engine_flags,
    add_size_flags,
    fmt_num,
    load_average,
    log,
    machine_info,
    markdown_table,
    result_line,
    safe_ratio,
    set_threads,
    sized,
    stdlib_text,
    write_json,
)
from server.engine import EngineConfig, LLMEngine, SamplingParams

NAME = "engine_throughput"


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures."""

    batches: tuple[int, ...] = (1, 16, 64)
    prompt_len: int = 512  # the longest prompt; the others are spread down to `spread * prompt_len`
    spread: float = 0.5
    max_new_tokens: int = 128
    repeats: int = 5  # at least; small batches get more (see `measure_batch`)
    min_time_s: float = 20.0  # timed seconds per batch size before the repeats may stop
    kv_requests: int = 32
    kv_prefix: int = 2048
    kv_suffix: int = 16
    kv_new_tokens: int = 8
    max_num_batched_tokens: int = 2048  # the engine's default token budget per step
    seed: int = 0


FULL = BenchConfig()
QUICK = BenchConfig(prompt_len=64, max_new_tokens=16, repeats=3, min_time_s=1.5)
TINY = BenchConfig(
    batches=(1, 4), prompt_len=16, max_new_tokens=4, repeats=1, min_time_s=0.0, kv_requests=4, kv_prefix=64
)


# ----------------------------------------------------------------------------------------------- systems
class System(Protocol):
    """A way to run a batch of greedy generations; both systems are driven through this."""

    name: str

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
        """Generate ``max_new_tokens`` greedily for every prompt at once; return (seconds, token ids)."""
        ...


class OurEngine:
    """Our engine, driven as the manager drives it: per request a fill then a generate, all concurrent."""

    name = "ours"

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # One event loop for the whole run: results come back into it from the engine thread.
        self._loop = asyncio.new_event_loop()
        self._ids = itertools.count(1)

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
        return self.call(self._run(prompts, max_new_tokens))

    async def _run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
        sampling = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
        ids = self.context_ids(len(prompts))

        async def one(cid: int, prompt: list[int]) -> list[int]:
            await self.engine.fill(cid, prompt)
            return (await self.engine.generate(cid, sampling)).token_ids

        start = time.perf_counter()
        outputs = await asyncio.gather(*(one(c, p) for c, p in zip(ids, prompts, strict=True)))
        elapsed = time.perf_counter() - start
        # Freed outside the timed region: a server frees contexts after answering.
        await asyncio.gather(*(self.engine.free_context(c) for c in ids))
        return elapsed, list(outputs)

    def context_ids(self, n: int) -> list[int]:
        """``n`` context ids never used before in this run (the engine rejects a live id)."""
        return [next(self._ids) for _ in range(n)]

    def call(self, coro: Any) -> Any:
        """Run a coroutine that talks to the engine on this runner's event loop."""
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        self._loop.close()


class HFGenerate:
    """``transformers`` ``generate`` over a left-padded batch with an attention mask."""

    name = "hf"

    def __init__(self, model: Any, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id

    def run(self, prompts: Sequence[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
        input_ids, mask = left_pad(prompts, self.pad_token_id)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,  # as our ignore_eos: every request makes N tokens
                do_sample=False,
                pad_token_id=self.pad_token_id,
            )
        elapsed = time.perf_counter() - start
        return elapsed, out[:, input_ids.shape[1] :].tolist()


def left_pad(prompts: Sequence[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a left-padded batch (how decoder-only models are batched in HF)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


# ----------------------------------------------------------------------------------------------- workload
def make_prompts(tokens: list[int], batch: int, max_len: int, spread: float, seed: int) -> list[list[int]]:
    """``batch`` prompts cut from the token stream at distinct offsets, lengths uniform in the spread."""
    rng = random.Random(f"{seed}-{batch}-{max_len}")  # a string seed: the same prompts on every run
    lo = max(1, round(spread * max_len))
    prompts = []
    for _ in range(batch):
        n = rng.randint(lo, max_len)
        start = rng.randrange(0, len(tokens) - n)
        prompts.append(tokens[start : start + n])
    return prompts


def tokenize_text(tokenizer: Any, min_tokens: int) -> list[int]:
    """The stdlib workload text as token ids (no special tokens), at least ``min_tokens`` of them."""
    chars = 4 * min_tokens
    while True:
        ids = tokenizer(stdlib_text(chars), add_special_tokens=False).input_ids
        if len(ids) >= min_tokens:
            return list(ids)
        chars *= 2


# ----------------------------------------------------------------------------------------------- throughput
@dataclass(frozen=True)
class Rate:
    """A rate computed from the median times, with the range of the per-repeat rates around it."""

    value: float
    lo: float
    hi: float

    @classmethod
    def around(cls, value: float, per_repeat: list[float]) -> Rate:
        spread = Spread.of(per_repeat)
        return cls(value, spread.lo, spread.hi)

    @property
    def rel_half_range(self) -> float:
        """Half the per-repeat range relative to the value (``±`` in the table)."""
        return safe_ratio(self.hi - self.lo, 2 * abs(self.value))


@dataclass
class SystemResult:
    """One system at one batch size: raw times per repeat and the rates derived from them."""

    t_first: list[float]  # T(1) per repeat, seconds
    t_full: list[float]  # T(N) per repeat, seconds
    prefill_tps: Rate
    decode_tps: Rate
    e2e_tps: Rate


def summarize(
    t_first: list[float], t_full: list[float], prompt_tokens: int, batch: int, new_tokens: int
) -> SystemResult:
    """Rates from the medians of the times (robust to one slow repeat); the range from each repeat alone."""
    t1, tn = Spread.of(t_first).median, Spread.of(t_full).median
    decode_tokens = batch * (new_tokens - 1)
    per_rep_decode = [
        safe_ratio(decode_tokens, b - a) if b > a else math.nan for a, b in zip(t_first, t_full, strict=True)
    ]
    return SystemResult(
        t_first=t_first,
        t_full=t_full,
        prefill_tps=Rate.around(prompt_tokens / t1, [prompt_tokens / t for t in t_first]),
        decode_tps=Rate.around(safe_ratio(decode_tokens, tn - t1), per_rep_decode),
        e2e_tps=Rate.around(batch * new_tokens / tn, [batch * new_tokens / t for t in t_full]),
    )


@dataclass
class BatchResult:
    """Both systems at one batch size, plus checks that the comparison is sound."""

    batch: int
    prompt_tokens: int  # real prompt tokens (what both systems are credited with)
    padded_tokens: int  # what HF's left-padded batch computes
    new_tokens: int
    ours: SystemResult
    hf: SystemResult
    greedy_agreement: float  # share of requests whose tokens are identical in both systems
    engine_prefill_tokens_per_run: float  # sanity: ours computes each prompt token once (no recompute)
    engine_preemptions: int
    repeats: int


def measure_batch(
    ours: OurEngine, hf: HFGenerate, prompts: list[list[int]], new_tokens: int, cfg: BenchConfig
) -> BatchResult:
    """Warm up, then time ``T(1)`` and ``T(N)`` for both systems, interleaved, repeat after repeat.

    At least ``cfg.repeats`` repeats, more (up to 3x) while less than ``cfg.min_time_s`` was spent: small
    batches are cheap and the noisiest relative to their length, so they get more samples.
    """
    batch = len(prompts)
    times: dict[str, tuple[list[float], list[float]]] = {ours.name: ([], []), hf.name: ([], [])}
    outputs: dict[str, list[list[int]]] = {}
    for system in (ours, hf):  # warm-up: one-time allocations, workspaces, lazy imports
        system.run(prompts, new_tokens)
    before = ours.engine.stats()
    started, rep = time.perf_counter(), 0
    while rep < cfg.repeats or (rep < 3 * cfg.repeats and time.perf_counter() - started < cfg.min_time_s):
        # Alternate which system goes first, so a slow drift of the machine hits both alike.
        order: tuple[System, System] = (ours, hf) if rep % 2 == 0 else (hf, ours)
        for system in order:
            # Untimed: the first HF run after our engine ran pays ~1.5-2 s extra at batch 64 (it goes away
            # with MALLOC_MMAP_THRESHOLD_ pinned, so it looks like glibc returning memory that the big padded
            # tensors then fault in again) — a cost an HF user running HF alone never sees, which would
            # otherwise land entirely in T(1) and inflate HF's decode rate.
            system.run(prompts, 1)
            t1, _ = system.run(prompts, 1)
            tn, out = system.run(prompts, new_tokens)
            times[system.name][0].append(t1)
            times[system.name][1].append(tn)
            outputs[system.name] = out
        rep += 1
        log(
            f"  b{batch} repeat {rep}: "
            + " | ".join(f"{name} T(1)={t[0][-1]:.3f}s T(N)={t[1][-1]:.3f}s" for name, t in times.items())
        )
    after = ours.engine.stats()
    prompt_tokens = sum(len(p) for p in prompts)
    summary = {name: summarize(*t, prompt_tokens, batch, new_tokens) for name, t in times.items()}
    agree = sum(a == b for a, b in zip(outputs["ours"], outputs["hf"], strict=True)) / batch
    return BatchResult(
        batch=batch,
        prompt_tokens=prompt_tokens,
        padded_tokens=batch * max(len(p) for p in prompts),
        new_tokens=new_tokens,
        ours=summary[ours.name],
        hf=summary[hf.name],
        greedy_agreement=agree,
        engine_prefill_tokens_per_run=(after.prefill_tokens_computed - before.prefill_tokens_computed)
        / (3 * rep),
        engine_preemptions=after.preemptions - before.preemptions,
        repeats=rep,
    )


# ----------------------------------------------------------------------------------------------- KV memory
@dataclass
class KVMode:
    """One way of serving the shared-prefix requests: blocks in use (measured and predicted), work done."""

    blocks_used: int
    blocks_expected: int
    prefill_tokens_computed: int
    seconds: float
    blocks_after_free: int
    grouped_decode_steps: int  # decode steps that read the shared prefix once for the whole group


@dataclass
class KVResult:
    """The shared-prefix requests served with and without fork."""

    requests: int
    prefix_tokens: int
    suffix_tokens: int
    new_tokens: int
    block_size: int
    fork: KVMode
    no_fork: KVMode

    @property
    def ratio(self) -> float:
        return safe_ratio(self.no_fork.blocks_used, self.fork.blocks_used)


def blocks(n_tokens: int, block_size: int) -> int:
    """Blocks that hold ``n_tokens`` tokens."""
    return -(-n_tokens // block_size)


async def measure_kv(
    engine: LLMEngine, ids: list[int], prefix: list[int], suffixes: list[list[int]], new_tokens: int
) -> KVResult:
    """Blocks in use for the shared-prefix requests with and without fork, every context still alive."""
    bs = engine.block_size
    sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    n, p, s = len(suffixes), len(prefix), len(suffixes[0])
    # After a generate of G tokens a context holds P+S+G tokens; the last sampled one is never computed,
    # so P+S+G-1 tokens have KV. A fork shares the parent's full blocks and copies a partial last one.
    cached = p + s + new_tokens - 1
    expected_no_fork = n * blocks(cached, bs)
    expected_fork = blocks(p, bs) + n * (blocks(cached, bs) - p // bs)

    # ids: n for the independent contexts, then the prefix context and its n children.
    alone, root, children = ids[:n], ids[n], ids[n + 1 : 2 * n + 1]

    async def no_fork() -> list[int]:
        async def one(cid: int, suffix: list[int]) -> None:
            await engine.fill(cid, prefix + suffix)
            await engine.generate(cid, sampling)

        await asyncio.gather(*(one(c, x) for c, x in zip(alone, suffixes, strict=True)))
        return alone

    async def fork() -> list[int]:
        await engine.fill(root, prefix)

        async def one(cid: int, suffix: list[int]) -> None:
            await engine.fill(cid, suffix, parent_context_id=root)
            await engine.generate(cid, sampling)

        await asyncio.gather(*(one(c, x) for c, x in zip(children, suffixes, strict=True)))
        return [root, *children]

    async def run(mode: Any, expected: int) -> KVMode:
        before = engine.stats()
        assert before.blocks_used == 0, f"{before.blocks_used} blocks in use before the KV measurement"
        start = time.perf_counter()
        ids = await mode()
        seconds = time.perf_counter() - start
        stats = engine.stats()
        for cid in ids:
            await engine.free_context(cid)
        return KVMode(
            blocks_used=stats.blocks_used,
            blocks_expected=expected,
            prefill_tokens_computed=stats.prefill_tokens_computed - before.prefill_tokens_computed,
            seconds=seconds,
            blocks_after_free=engine.stats().blocks_used,
            grouped_decode_steps=stats.grouped_decode_steps - before.grouped_decode_steps,
        )

    return KVResult(
        requests=n,
        prefix_tokens=p,
        suffix_tokens=s,
        new_tokens=new_tokens,
        block_size=bs,
        no_fork=await run(no_fork, expected_no_fork),
        fork=await run(fork, expected_fork),
    )


# ----------------------------------------------------------------------------------------------- loading
def load_models(model: str, engine_config: EngineConfig, workdir: Path) -> tuple[LLMEngine, Any]:
    """Our engine and HF's ``LlamaForCausalLM`` on the same weights, fp32 on CPU."""
    from transformers import LlamaForCausalLM

    if model == "tiny":
        from server.engine.tiny.model import save_tiny

        # The same deterministic weights (EngineConfig.seed is save_tiny's seed), written as an HF folder.
        folder = save_tiny(workdir / "tiny", seed=engine_config.seed)
    else:
        folder = Path(model)
    engine = LLMEngine.from_pretrained(model, config=engine_config)
    hf = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return engine, hf


def pad_token_id(tokenizer: Any, hf_model: Any) -> int:
    """A token to pad with (masked out, so any id works; prefer the model's own pad token)."""
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(hf_model.config, "pad_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        if isinstance(candidate, int):
            return candidate
    return 0


# ----------------------------------------------------------------------------------------------- report
def throughput_table(results: list[BatchResult]) -> str:
    """Prefill, decode and end-to-end rates of both systems per batch size, with their ratio."""
    rows = []
    for r in results:
        for label, attr in (("prefill", "prefill_tps"), ("decode", "decode_tps"), ("end-to-end", "e2e_tps")):
            ours: Rate = getattr(r.ours, attr)
            hf: Rate = getattr(r.hf, attr)
            rows.append(
                [
                    str(r.batch),
                    f"{label} tok/s",
                    f"{fmt_num(ours.value)} ±{ours.rel_half_range:.0%}",
                    f"{fmt_num(hf.value)} ±{hf.rel_half_range:.0%}",
                    f"{safe_ratio(ours.value, hf.value):.2f}x",
                ]
            )
    return markdown_table(
        ["batch", "metric", "ours", "HF generate", "ours/HF"], rows, [True, False, True, True, True]
    )


def workload_table(results: list[BatchResult]) -> str:
    """What was run: tokens in and out, the median raw times, and whether both produced the same tokens."""
    rows = [
        [
            str(r.batch),
            fmt_num(r.prompt_tokens),
            fmt_num(r.padded_tokens),
            str(r.new_tokens),
            f"{Spread.of(r.ours.t_first).median:.3f} / {Spread.of(r.ours.t_full).median:.3f}",
            f"{Spread.of(r.hf.t_first).median:.3f} / {Spread.of(r.hf.t_full).median:.3f}",
            f"{r.greedy_agreement:.0%}",
        ]
        for r in results
    ]
    return markdown_table(
        [
            "batch",
            "prompt tok",
            "HF padded",
            "new tok",
            "ours T(1) / T(N) s",
            "HF T(1) / T(N) s",
            "same tokens",
        ],
        rows,
        [True] * 7,
    )


def kv_table(kv: KVResult) -> str:
    """Exact block counts with and without fork, against the counts the paged design predicts."""
    rows = [
        [
            mode,
            fmt_num(m.blocks_used),
            fmt_num(m.blocks_expected),
            fmt_num(m.prefill_tokens_computed),
            f"{m.seconds:.2f}",
            str(m.grouped_decode_steps),
        ]
        for mode, m in (("without fork", kv.no_fork), ("with fork", kv.fork))
    ]
    rows.append(
        [
            "without / with",
            f"{kv.ratio:.2f}x",
            f"{safe_ratio(kv.no_fork.blocks_expected, kv.fork.blocks_expected):.2f}x",
            f"{safe_ratio(kv.no_fork.prefill_tokens_computed, kv.fork.prefill_tokens_computed):.2f}x",
            f"{safe_ratio(kv.no_fork.seconds, kv.fork.seconds):.2f}x",
            "",
        ]
    )
    return markdown_table(
        [
            "KV cache",
            "blocks used",
            "expected",
            "prefill tokens computed",
            "time s",
            "shared-prefix decode steps",
        ],
        rows,
        [False, True, True, True, True, True],
    )


def result_metrics(results: list[BatchResult], kv: KVResult, total_s: float) -> dict[str, float | int]:
    """The figures of the RESULT line: ours/HF ratios per batch size, then the KV block counts."""
    metrics: dict[str, float | int] = {}
    for kind in ("decode", "prefill", "e2e"):
        for r in results:
            ours: Rate = getattr(r.ours, f"{kind}_tps")
            hf: Rate = getattr(r.hf, f"{kind}_tps")
            metrics[f"{kind}_ratio_b{r.batch}"] = safe_ratio(ours.value, hf.value)
    metrics["kv_fork_ratio"] = kv.ratio
    metrics["kv_blocks_fork"] = kv.fork.blocks_used
    metrics["kv_blocks_nofork"] = kv.no_fork.blocks_used
    metrics["total_s"] = total_s
    return metrics


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_flags(parser, "short prompts and outputs, 3 repeats (~1 min)")
    add_engine_flags(parser)
    parser.add_argument("--repeats", type=int, help="least timed repeats per batch size (median)")
    parser.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 16 64)")
    parser.add_argument("--prompt-len", type=int, help="longest prompt in tokens")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per request")
    parser.add_argument("--spread", type=float, help="shortest prompt / longest prompt (1: all equal)")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace) -> BenchConfig:
    return sized(
        args,
        FULL,
        QUICK,
        TINY,
        repeats=args.repeats,
        batches=tuple(args.batches) if args.batches else None,
        prompt_len=args.prompt_len,
        max_new_tokens=args.new_tokens,
        spread=args.spread,
    )


def engine_config_for(cfg: BenchConfig) -> EngineConfig:
    """Engine knobs: the defaults, with enough KV blocks and sequence slots that nothing is preempted."""
    block = EngineConfig().block_size
    max_batch = max(cfg.batches)
    # Every context of the biggest batch alive at its longest (contexts are freed between runs).
    throughput = max_batch * (blocks(cfg.prompt_len + cfg.max_new_tokens, block) + 1)
    memory = cfg.kv_requests * blocks(cfg.kv_prefix + cfg.kv_suffix + cfg.kv_new_tokens, block) + 64
    return EngineConfig(
        num_kv_blocks=max(throughput, memory),
        max_num_seqs=max(max_batch, cfg.kv_requests),
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        device="cpu",
    )


def print_report(
    cfg: BenchConfig,
    model: str,
    params: int,
    machine: dict[str, Any],
    results: list[BatchResult],
    kv: KVResult,
) -> None:
    """The markdown tables on stdout."""
    print(
        f"## engine_throughput — {model} ({params / 1e6:.1f}M params, fp32), "
        f"{machine['cpu_model']}, {machine['usable_cores']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} threads), load average {machine['load_average_1m']} at start\n"
    )
    print(
        f"prompts {round(cfg.spread * cfg.prompt_len)}..{cfg.prompt_len} tokens, {cfg.max_new_tokens} new "
        f"tokens, greedy; median of {'/'.join(str(r.repeats) for r in results)} repeats after a warm-up, "
        "± half the range. "
        "prefill = prompt tokens / T(1); decode = B(N-1) / (T(N) - T(1)); end-to-end = BN / T(N).\n"
    )
    print(throughput_table(results) + "\n")
    print(workload_table(results) + "\n")
    print(
        f"KV memory: {kv.requests} requests sharing a {kv.prefix_tokens}-token prefix, "
        f"{kv.suffix_tokens}-token distinct suffix each, {kv.new_tokens} new tokens, "
        f"block size {kv.block_size}; blocks counted with every context alive.\n"
    )
    print(kv_table(kv) + "\n")


def json_payload(
    cfg: BenchConfig,
    model: str,
    hf_model: Any,
    engine_config: EngineConfig,
    model_config: Any,
    machine: dict[str, Any],
    results: list[BatchResult],
    kv: KVResult,
    total_s: float,
) -> dict[str, Any]:
    """Every figure, the raw times, and what is needed to reproduce or judge them."""
    return {
        "benchmark": NAME,
        "config": asdict(cfg),
        "model": {
            "name": model,
            "config": asdict(model_config),
            "parameters": sum(p.numel() for p in hf_model.parameters()),
            "dtype": "float32",
            "hf_attn_implementation": getattr(hf_model.config, "_attn_implementation", None),
        },
        "engine_config": asdict(engine_config),
        "machine": machine,
        "load_average_1m_at_end": load_average(),
        "definitions": {
            "prefill_tps": "prompt tokens (unpadded) / T(1)",
            "decode_tps": "B*(N-1) / (T(N) - T(1))",
            "e2e_tps": "B*N / T(N)",
            "T(1), T(N)": "median wall time of a batch with 1 / N new tokens (ours: fill + generate each)",
            "value": "the rate computed from the median T(1) and T(N)",
            "lo, hi": "min/max of the rates computed from each repeat's own T(1) and T(N)",
        },
        "throughput": [asdict(r) for r in results],
        "kv_memory": {**asdict(kv), "ratio": kv.ratio},
        "total_s": total_s,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = build_config(args)
    set_threads(args)
    import transformers

    # Quiet: the weight-loading progress bar and the over-long-sequence warning of the workload tokenizer.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    started = time.perf_counter()
    machine = machine_info()
    engine_config = engine_config_for(cfg)
    with tempfile.TemporaryDirectory(prefix="engine-throughput-") as tmp:
        log(f"loading {args.model} into our engine and into transformers ...")
        engine, hf_model = load_models(args.model, engine_config, Path(tmp))
        with engine:
            results, kv = run_all(cfg, engine, hf_model)
    total_s = time.perf_counter() - started

    params = sum(p.numel() for p in hf_model.parameters())
    print_report(cfg, args.model, params, machine, results, kv)
    print(f"total {total_s:.0f}s")
    if args.json:
        payload = json_payload(
            cfg, args.model, hf_model, engine_config, engine.model_config, machine, results, kv, total_s
        )
        write_json(args.json, payload)
    print(result_line(NAME, result_metrics(results, kv, total_s)))


def run_all(cfg: BenchConfig, engine: LLMEngine, hf_model: Any) -> tuple[list[BatchResult], KVResult]:
    """The throughput rows for every batch size, then the KV memory comparison."""
    tokenizer = engine.tokenizer
    limit = engine.max_model_len
    if cfg.prompt_len + cfg.max_new_tokens > limit:
        raise SystemExit(f"prompt_len + new tokens exceed the model's context window ({limit})")
    need = max(cfg.kv_prefix + cfg.kv_requests * cfg.kv_suffix, cfg.prompt_len) * 4
    tokens = tokenize_text(tokenizer, need)
    ours = OurEngine(engine)
    hf = HFGenerate(hf_model, pad_token_id(tokenizer, hf_model))
    try:
        results = []
        for batch in cfg.batches:
            prompts = make_prompts(tokens, batch, cfg.prompt_len, cfg.spread, cfg.seed)
            log(f"batch {batch}: {sum(map(len, prompts))} prompt tokens, {cfg.max_new_tokens} new each")
            results.append(measure_batch(ours, hf, prompts, cfg.max_new_tokens, cfg))
        prefix_len = min(cfg.kv_prefix, limit - cfg.kv_suffix - cfg.kv_new_tokens - 1)
        prefix = tokens[:prefix_len]
        # Distinct suffixes from elsewhere in the text, so no two requests share more than the prefix.
        suffixes = [
            tokens[prefix_len + i * cfg.kv_suffix : prefix_len + (i + 1) * cfg.kv_suffix]
            for i in range(cfg.kv_requests)
        ]
        log(f"KV memory: {cfg.kv_requests} requests sharing a {prefix_len}-token prefix")
        ids = ours.context_ids(2 * cfg.kv_requests + 1)
        kv = ours.call(measure_kv(engine, ids, prefix, suffixes, cfg.kv_new_tokens))
    finally:
        ours.close()
    return results, kv


if __name__ == "__main__":
    main()
