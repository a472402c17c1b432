"""A ShareGPT-like multi-turn chat workload, generated deterministically from a seed.

Distributions (`WorkloadSpec`, the defaults): turns per conversation geometric with p = 0.25, cut at 8
(mean 3.6; ShareGPT's conversations average a few rounds, with a long tail); each user prompt lognormal with
median 100 tokens and sigma 0.9 (mean ~150); each answer lognormal with median 250 tokens and sigma 0.7
(mean ~320), at least 2 tokens (one from the prefill, one decoded) and at most 1024; think time before each
later turn exponential with mean 10 s (the user reads the answer and types). A conversation ends early when
its next turn would not fit the model's 4k window. Conversations start as a Poisson process; they are made
at 1 conversation per second and `at_rate` rescales the start times only, so every rate runs the very same
conversations (think times are the users' and do not scale), and more of them at a higher rate: the first
``count`` of a seed are the same whatever the count.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

__all__ = ["Conversation", "Turn", "WorkloadSpec", "at_rate", "sharegpt_like"]


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    output_tokens: int
    think_s: float  # after the previous answer ends (0 for the first turn)


@dataclass(frozen=True)
class Conversation:
    id: int
    start_s: float
    turns: tuple[Turn, ...]

    @property
    def tokens(self) -> int:
        return sum(t.prompt_tokens + t.output_tokens for t in self.turns)


@dataclass(frozen=True)
class WorkloadSpec:
    turn_p: float = 0.25
    max_turns: int = 8
    prompt_median: float = 100.0
    prompt_sigma: float = 0.9
    output_median: float = 250.0
    output_sigma: float = 0.7
    max_output: int = 1024
    think_mean_s: float = 10.0
    max_context: int = 4096
    seed: int = 0


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(0.0, sigma) * median)))


def sharegpt_like(spec: WorkloadSpec, count: int) -> list[Conversation]:
    """``count`` conversations starting at 1 per second (Poisson), seeded by ``spec.seed``."""
    rng = random.Random(spec.seed)
    out, start = [], 0.0
    for cid in range(count):
        wanted = 1
        while wanted < spec.max_turns and rng.random() > spec.turn_p:
            wanted += 1
        turns: list[Turn] = []
        context = 0
        for k in range(wanted):
            prompt = _lognormal(rng, spec.prompt_median, spec.prompt_sigma, 4, 2048)
            output = _lognormal(rng, spec.output_median, spec.output_sigma, 2, spec.max_output)
            think = rng.expovariate(1 / spec.think_mean_s) if k else 0.0
            if context + prompt + output > spec.max_context:
                break
            turns.append(Turn(prompt, output, think))
            context += prompt + output
        if not turns:  # a first turn too long for the window: shorten it rather than lose the conversation
            turns.append(Turn(spec.max_context // 4, spec.max_context // 4, 0.0))
        out.append(Conversation(cid, start, tuple(turns)))
        start += rng.expovariate(1.0)
    return out


def at_rate(spec: WorkloadSpec, rate: float, duration_s: float) -> list[Conversation]:
    """The conversations that start in ``duration_s`` seconds at ``rate`` per second (instead of 1)."""
    span = rate * duration_s  # the same window at 1 per second
    count = math.ceil(span * 1.2) + 10
    while (pool := sharegpt_like(spec, count))[-1].start_s < span:
        count *= 2
    return [replace(c, start_s=c.start_s / rate) for c in pool if c.start_s < span]
