"""Multi-turn chat on real engines under the three disaggregation policies (`server.cluster.disagg_chat`).

Two in-process engines on the same weights: ``colocated`` uses both as full engines (a conversation stays
on one); ``splitwise`` and ``mutel`` use one as the prefill instance and one as the decode instance;
``mutel recompute`` is Mutel recomputing each answer's KV on the prefill engine at the next turn instead of
moving it back (the paper's balancer picks by bytes vs compute: both are measured here).
``conversations`` run side by side, ``turns`` each: a system prompt of reference text, then user messages
of ``user_tokens`` tokens, greedy answers of up to ``max_tokens``. Per policy and turn: TTFT (median over
conversations), KV bytes moved between engines and attention-exchange bytes per turn, prefill tokens; and
whether every policy gave the same answers. On CPU these are small-scale mechanics, not GPU timings.
`table` prints those figures, `metrics` is their part of the ``RESULT`` line.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks.harness.output import log, markdown_table
from benchmarks.workloads.chat import TextPool, conversations
from server.cluster.disagg_chat import POLICIES, DisaggregatedChat, TurnResult
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.model_runner import KVCache

RECOMPUTE = "mutel recompute"
RUNS = (*POLICIES, RECOMPUTE)  # Mutel both ways: the answer's KV moved back once, or recomputed there


@dataclass(frozen=True)
class RealConfig:
    conversations: int = 4
    turns: int = 4
    system_tokens: int = 192
    user_tokens: tuple[int, int] = (20, 50)
    max_tokens: int = 32
    seed: int = 0


def chatml_turn(tokenizer: Any, message: str, system: str | None, after_answer: list[int]) -> list[int]:
    """The tokens a turn adds in ChatML (SmolLM2's format): the close of the last answer unless it ended on
    the end-of-turn token, the user message, and the assistant header."""
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    head = "" if system is None else f"<|im_start|>system\n{system}<|im_end|>\n"
    close = "" if not after_answer else ("\n" if after_answer[-1] == end_id else "<|im_end|>\n")
    text = f"{close}{head}<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer.encode(text, add_special_tokens=False))


async def _policy(
    policy: str,
    engines: list[LLMEngine],
    tokenizer: Any,
    system: str,
    queries: list[list[str]],
    cfg: RealConfig,
) -> list[dict[str, Any]]:
    """Every conversation's turn t at once, turn after turn; per turn the conversations' results and the
    engines' counters over the round, per conversation."""
    if policy == "colocated":
        chat = DisaggregatedChat("colocated", engines)
    else:  # mutel, splitwise, or mutel recomputing its answers' KV instead of moving it back
        name = policy.split()[0]
        move = policy != RECOMPUTE
        chat = DisaggregatedChat(name, engines[:1], engines[1:], move_answers=move)  # type: ignore[arg-type]
    answers: list[list[int]] = [[] for _ in queries]
    rounds = []
    for t in range(cfg.turns):
        head = system if t == 0 else None
        news = [chatml_turn(tokenizer, q[t], head, a) for q, a in zip(queries, answers, strict=True)]
        sampling = SamplingParams(max_tokens=cfg.max_tokens)
        before = _counters(engines)
        results = await asyncio.gather(*(chat.turn(f"c{c}", new, sampling) for c, new in enumerate(news)))
        after = _counters(engines)
        answers = [r.tokens for r in results]
        n = len(queries)
        new_tokens = statistics.fmean(len(m) + len(r.tokens) for m, r in zip(news, results, strict=True))
        rounds.append(
            {
                "results": results,
                "prefill_tokens": (after[0] - before[0]) / n,
                "exchange_bytes": (after[1] - before[1]) / n,
                "new_tokens": new_tokens,
            }
        )
    for c in range(len(queries)):
        await chat.end(f"c{c}")
    return rounds


def _counters(engines: list[LLMEngine]) -> tuple[int, int]:
    stats = [e.stats() for e in engines]
    return sum(s.prefill_tokens_computed for s in stats), sum(s.remote_attention_bytes for s in stats)


def run_policies(model: str, cfg: RealConfig) -> dict[str, Any]:
    """Every policy on two fresh engines of ``model``; per-turn figures and the answers' agreement."""
    engine_cfg = EngineConfig(dtype="float32", num_kv_blocks=1024)
    engines = [LLMEngine.from_pretrained(model, engine_cfg) for _ in range(2)]
    try:
        tokenizer = engines[0].tokenizer
        system = TextPool(tokenizer).text(random.Random(f"pd-{cfg.seed}"), cfg.system_tokens)
        queries = conversations(tokenizer, cfg.conversations, cfg.turns, cfg.seed, *cfg.user_tokens)
        runs: dict[str, list[dict[str, Any]]] = {}
        for policy in RUNS:
            runs[policy] = asyncio.run(_policy(policy, engines, tokenizer, system, queries, cfg))
            log(f"real engines: {policy} done")
        kv_per_token = _kv_bytes_per_token(engines[0])
    finally:
        for e in engines:
            e.shutdown()
    answers = {p: [[r.tokens for r in rnd["results"]] for rnd in runs[p]] for p in RUNS}
    return {
        "per_turn": {p: [_turn_row(t, rnd) for t, rnd in enumerate(runs[p])] for p in RUNS},
        "answers_identical": all(answers[p] == answers["colocated"] for p in RUNS),
        "kv_bytes_per_token": kv_per_token,
    }


def _turn_row(t: int, rnd: dict[str, Any]) -> dict[str, float]:
    results: list[TurnResult] = rnd["results"]
    return {
        "turn": t + 1,
        "ttft_s": statistics.median(r.ttft_s for r in results),
        "kv_bytes_moved": statistics.mean(r.kv_bytes_moved for r in results),
        "exchange_bytes": rnd["exchange_bytes"],
        "prefill_tokens": rnd["prefill_tokens"],
        "answer_tokens": statistics.mean(len(r.tokens) for r in results),
        "new_tokens": rnd["new_tokens"],  # the turn's message (templated) and answer
    }


def _kv_bytes_per_token(engine: LLMEngine) -> int:
    cfg = engine.model_config
    dtype = engine.config.torch_dtype()
    return KVCache.bytes_per_block(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, dtype)


def table(real: dict[str, Any]) -> str:
    """Per policy and turn (`run_policies`): TTFT, KV moved, exchange bytes and prefill tokens per
    conversation."""
    rows = [
        [
            policy,
            str(t["turn"]),
            f"{t['ttft_s'] * 1000:.0f}",
            f"{t['kv_bytes_moved'] / 2**20:.2f}",
            f"{t['exchange_bytes'] / 2**20:.2f}",
            f"{t['prefill_tokens']:.0f}",
            f"{t['answer_tokens']:.0f}",
        ]
        for policy, turns in real["per_turn"].items()
        for t in turns
    ]
    heads = ["policy", "turn", "TTFT ms", "KV moved MiB", "exchange MiB", "prefill tokens", "answer tokens"]
    return markdown_table(heads, rows, [False] + [True] * 6)


def metrics(real: dict[str, Any]) -> dict[str, float | int]:
    """Bytes per turn after the first (turn 1 has no history to move), and Mutel's against new KV."""
    later = {p: turns[1:] or turns for p, turns in real["per_turn"].items()}

    def mean(policy: str, key: str) -> float:
        return statistics.fmean(t[key] for t in later[policy])

    mutel_moved, new_tokens = mean("mutel", "kv_bytes_moved"), mean("mutel", "new_tokens")
    return {
        "mutel_kv_mib_per_turn": mutel_moved / 2**20,
        "splitwise_kv_mib_per_turn": mean("splitwise", "kv_bytes_moved") / 2**20,
        "mutel_exchange_mib_per_turn": mean("mutel", "exchange_bytes") / 2**20,
        "mutel_moved_over_new_kv": mutel_moved / (new_tokens * real["kv_bytes_per_token"]),
        # The answers' KV recomputed instead of moved back: what each costs the next turn's TTFT.
        "ttft_recompute_over_move": mean(RECOMPUTE, "ttft_s") / mean("mutel", "ttft_s"),
        "answers_identical": int(real["answers_identical"]),
    }
