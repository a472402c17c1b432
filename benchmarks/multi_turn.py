"""Multi-turn chat over ``POST /v1/chat/completions``: does a conversation's KV survive its turn?

``N`` conversations run side by side, ``T`` turns each. Turn *t* sends the whole conversation so far — one
system prompt per app (the copilot preamble of `benchmarks.workloads.copilot`, then ``--system-tokens``
tokens of stdlib text from `benchmarks.workloads.chat.TextPool`), every earlier user message and the
answer exactly as streamed, then a new user message (20-60 tokens) — greedy, ``--max-tokens`` answer
tokens, streamed. The ``N`` turn-*t* requests go at once; the next turn starts when all are answered and
the engine is idle. Two systems (same weights and code, one server each), interleaved per repeat:

* **cached** — ``ManagerConfig(prefix_sharing=True)``: a request forks from the longest token prefix its
  engine holds, so turn *t* prefills only what turn *t - 1* did not compute (Parrot).
* **recompute** — ``prefix_sharing=False``: every request prefills its whole prompt.

Per turn: **TTFT** (client-side, to the first chunk with content; median over conversations and repeats),
**prefill** tokens per conversation (the engine's exact counter over the turn, divided by ``N``), **new**
tokens per conversation (``usage.prompt_tokens`` of turn *t* minus prompt + completion tokens of turn
*t - 1*: the engine's own counts). Each repeat is a new app (its system prompt tagged with the repeat's
seed), so no repeat forks from an earlier one's cache; ``answers_identical`` is the fraction of answers
equal between the systems. Headline over turns >= 2: ``prefill_ratio`` = cached prefill / new tokens
(goal <= 1.10), ``prefill_saving`` = recompute / cached prefill, ``ttft_speedup`` = recompute / cached
median TTFT. No network delay. With ``--engines`` > 1 each system has that many engines and the manager
places every request: a turn that lands away from its conversation's kept context prefills it again.

Last line: ``RESULT multi_turn prefill_ratio=... prefill_saving=... ttft_speedup=... turns=...
conversations=... answers_identical=... total_s=...``.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import engine_runs, record, systems
from benchmarks.harness.clients import stream_chat
from benchmarks.harness.line_panels import line_panels
from benchmarks.harness.output import fmt_num, log, markdown_table, quiet_transformers
from benchmarks.harness.stats import Spread, safe_ratio
from benchmarks.harness.systems import Served
from benchmarks.plotting import save
from benchmarks.workloads.chat import TextPool, conversations
from benchmarks.workloads.copilot import PREAMBLE

NAME = "multi_turn"
CACHED, RECOMPUTE = "cached", "recompute"
SYSTEMS = (CACHED, RECOMPUTE)
Turn = dict[str, Any]  # one turn of every conversation: its prefill and each conversation's answer


@dataclass(frozen=True)
class BenchConfig:
    conversations: int = 4
    turns: int = 5
    system_tokens: int = 256  # reference text after the 128-token preamble
    min_user_tokens: int = 20
    max_user_tokens: int = 60
    max_tokens: int = 32
    repeats: int = 5
    seed: int = 0
    engines: int = 1  # engines per system: a conversation's turns must find their kept context's engine


FULL = BenchConfig()
QUICK = BenchConfig(conversations=3, turns=4, repeats=2)
TINY = BenchConfig(2, 2, system_tokens=32, min_user_tokens=8, max_user_tokens=12, max_tokens=4, repeats=1)


async def chat(served: Served, system: str, queries: list[list[str]], max_tokens: int) -> list[Turn]:
    """Every conversation (one list of user messages each), turn by turn; per turn what it cost."""
    convs = [[{"role": "system", "content": system}] for _ in queries]
    turns, seen = [], [0] * len(queries)  # per conversation: its last prompt + answer, in tokens
    for t in range(len(queries[0])):
        for msgs, user in zip(convs, queries, strict=True):
            msgs.append({"role": "user", "content": user[t]})
        await engine_runs.idle(served)
        before = served.counters()["prefill_tokens_computed"]
        answers = await asyncio.gather(*(stream_chat(served.http, msgs, max_tokens) for msgs in convs))
        await engine_runs.idle(served)
        prefill = served.counters()["prefill_tokens_computed"] - before
        for c, (msgs, a) in enumerate(zip(convs, answers, strict=True)):
            msgs.append({"role": "assistant", "content": a["text"]})
            a["new_tokens"] = a["prompt_tokens"] - seen[c]
            seen[c] = a["prompt_tokens"] + a["completion_tokens"]
        turns.append({"prefill": prefill, "answers": answers})
    return turns


def workload(tokenizer: Any, pool: TextPool, cfg: BenchConfig, seed: int) -> tuple[str, list[list[str]]]:
    """One app: its system prompt (tagged with ``seed``) and each conversation's user messages."""
    reference = pool.text(random.Random(f"multi-turn-{seed}"), cfg.system_tokens)
    system = f"[chat app {seed}] {PREAMBLE}{reference}"
    lo, hi = cfg.min_user_tokens, cfg.max_user_tokens
    return system, conversations(tokenizer, cfg.conversations, cfg.turns, seed, lo, hi)


async def repeats(servers: dict[str, Served], cfg: BenchConfig) -> list[dict[str, list[Turn]]]:
    """An untimed warm-up (one conversation, two turns, its own app), then each repeat's app on both
    systems, alternating which goes first."""
    tokenizer = servers[CACHED].tokenizer
    pool, runs = TextPool(tokenizer), []
    async with systems.connected(servers, timeout=600):
        system, queries = workload(tokenizer, pool, cfg, cfg.seed + 10_000)
        for s in servers.values():
            await chat(s, system, [queries[0][:2]], cfg.max_tokens)
        for rep in range(cfg.repeats):
            system, queries = workload(tokenizer, pool, cfg, cfg.seed + rep)
            order = SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]
            run = {s: await chat(servers[s], system, queries, cfg.max_tokens) for s in order}
            runs.append({s: run[s] for s in SYSTEMS})
            prefills = " | ".join(f"{s} {[t['prefill'] for t in run[s]]}" for s in SYSTEMS)
            log(f"repeat {rep + 1}: prefill per turn {prefills}")
    return runs


def summarise(runs: list[dict[str, list[Turn]]], cfg: BenchConfig) -> dict[str, Any]:
    """Per-turn figures over conversations and repeats, and the headline ratios over turns >= 2."""
    same: list[bool] = []
    for r in runs:
        for x, y in zip(r[CACHED], r[RECOMPUTE], strict=True):
            same += [a["text"] == b["text"] for a, b in zip(x["answers"], y["answers"], strict=True)]
    per_turn, later = [], {s: {"prefill": 0, "new": 0, "ttft": []} for s in SYSTEMS}
    for t in range(cfg.turns):
        row: dict[str, Any] = {"turn": t + 1}
        for s in SYSTEMS:
            prefill = sum(r[s][t]["prefill"] for r in runs)
            answers = [a for r in runs for a in r[s][t]["answers"]]
            new, ttft, n = sum(a["new_tokens"] for a in answers), [a["ttft_s"] for a in answers], len(answers)
            row[s] = {
                "prompt_per_conv": sum(a["prompt_tokens"] for a in answers) / n,
                "new_per_conv": new / n,
                "prefill_per_conv": prefill / n,
                "prefill_ratio": safe_ratio(prefill, new),
                "ttft_ms": Spread.of(ttft).median * 1e3,
            }
            if t:
                for key, value in (("prefill", prefill), ("new", new), ("ttft", ttft)):
                    later[s][key] += value
        per_turn.append(row)
    c, r = later[CACHED], later[RECOMPUTE]
    return {
        "per_turn": per_turn,
        "answers_identical": sum(same) / len(same),
        "prefill_ratio": safe_ratio(c["prefill"], c["new"]),
        "prefill_saving": safe_ratio(r["prefill"], c["prefill"]),
        "ttft_speedup": safe_ratio(Spread.of(r["ttft"]).median, Spread.of(c["ttft"]).median),
    }


def table(summary: dict[str, Any]) -> str:
    """Tokens per conversation and median TTFT per turn, both systems."""
    rows = []
    for row in summary["per_turn"]:
        c, r = row[CACHED], row[RECOMPUTE]
        saving, speedup = (safe_ratio(r[k], c[k]) for k in ("prefill_per_conv", "ttft_ms"))
        cells = [row["turn"], c["prompt_per_conv"], c["new_per_conv"], c["prefill_per_conv"]]
        cells = [fmt_num(x) for x in [*cells, r["prefill_per_conv"]]]
        cells += [fmt_num(c["prefill_ratio"], 2), fmt_num(saving, 2)]
        rows.append([*cells, fmt_num(c["ttft_ms"], 1), fmt_num(r["ttft_ms"], 1), fmt_num(speedup, 2)])
    heads = ["turn", "prompt", "new", "prefill cached", "prefill recompute", "cached / new"]
    heads += ["recompute / cached", "TTFT cached ms", "TTFT recompute ms", "TTFT recompute / cached"]
    return markdown_table(heads, rows, [True] * len(heads))


def plot(payload: dict[str, Any], path: Path) -> None:
    """Prefill tokens (cached, recompute, new) and median TTFT per turn."""
    rows = payload["summary"]["per_turn"]
    xs = [r["turn"] for r in rows]
    panels = {
        "tokens per conversation": {
            f"prefill, {s}": [r[s]["prefill_per_conv"] for r in rows] for s in SYSTEMS
        },
        "median TTFT (ms)": {s: [r[s]["ttft_ms"] for r in rows] for s in SYSTEMS},
    }
    fig, (left, right) = line_panels(xs, panels, "turn", (10, 4))
    left.plot(xs, [r[CACHED]["new_per_conv"] for r in rows], "k:", marker="^", label="new tokens")
    for ax in (left, right):
        ax.legend()
    fig.suptitle(f"multi-turn chat over /v1/chat/completions, {payload['model']}")
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    size = "(default: the size's)"
    args = record.parser(
        __doc__,
        "3 conversations x 4 turns, 2 repeats",
        BenchConfig,
        conversations=f"conversations at once {size}",
        turns=f"turns per conversation, at least 2 {size}",
        repeats=f"repeats, each a new app {size}",
        system_tokens=f"system prompt tokens after the preamble {size}",
        max_tokens=f"answer tokens per turn {size}",
        engines=f"engines per system (the manager places each turn) {size}",
    ).parse_args(argv)
    cfg = record.configured(args, FULL, QUICK, TINY)
    if cfg.turns < 2:
        raise SystemExit("--turns must be at least 2 (the headline is over turns >= 2)")
    rec = record.Recorder(NAME, args)
    quiet_transformers()  # the long-text warning of building the workload
    setup = [systems.parrot(s, engines=cfg.engines, prefix_sharing=s == CACHED) for s in SYSTEMS]
    with systems.serve(args.model, setup, delay=None) as servers:
        window = servers[CACHED].engines[0].max_model_len
        longest = cfg.system_tokens + 160 + cfg.turns * (cfg.max_user_tokens + cfg.max_tokens + 24)
        if longest >= window:
            raise SystemExit(f"~{longest} tokens of conversation exceed the window ({window})")
        runs = asyncio.run(repeats(servers, cfg))
    summary = summarise(runs, cfg)
    print(rec.header(args.model))
    print(
        f"{cfg.conversations} conversations at once x {cfg.turns} turns, system prompt ~{cfg.system_tokens} "
        f"tokens, user messages {cfg.min_user_tokens}-{cfg.max_user_tokens} tokens, {cfg.max_tokens} answer "
        f"tokens (greedy, streamed); {cfg.repeats} repeats, systems interleaved. Tokens per conversation "
        "and turn (mean); TTFT median.\n"
    )
    print(table(summary) + "\n")
    print(f"answers identical between the systems: {summary['answers_identical']:.0%}")
    metrics = {k: summary[k] for k in ("prefill_ratio", "prefill_saving", "ttft_speedup")}
    metrics |= {"turns": cfg.turns, "conversations": cfg.conversations}
    metrics["answers_identical"] = summary["answers_identical"]
    rec.finish(
        metrics,
        config=cfg,
        model=args.model,
        systems={s.name: s.describe() for s in setup},
        summary=summary,
        runs=runs,
    )


if __name__ == "__main__":
    main()
