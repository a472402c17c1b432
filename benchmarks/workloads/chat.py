"""ShareGPT-like chat turns: prompt and reply lengths from a stated distribution, text from bundled sources.

No ShareGPT data is downloaded. The lengths follow log-normal distributions clipped to a range, with
medians and spreads in the range published ShareGPT length statistics show for single turns (prompts of
a few hundred tokens, replies of one to three hundred); the text of a prompt is a random span of the
standard library's docstrings (`workload_text.stdlib_text`), so a run needs nothing but Python.
Multi-turn chat experiments take their user messages from `conversations`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from benchmarks.workloads.copilot import user_queries
from workload_text import stdlib_text


@dataclass(frozen=True)
class LogNormal:
    """A log-normal length in tokens: ``median`` and ``sigma`` (of the log), clipped to ``[lo, hi]``."""

    median: float
    sigma: float
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return int(min(self.hi, max(self.lo, round(rng.lognormvariate(math.log(self.median), self.sigma)))))


@dataclass(frozen=True)
class ChatLengths:
    """The stated distribution of one chat turn's prompt and reply lengths (tokens)."""

    prompt: LogNormal = field(default_factory=lambda: LogNormal(300.0, 0.6, 100, 800))
    reply: LogNormal = field(default_factory=lambda: LogNormal(140.0, 0.5, 50, 300))

    def sample(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, reply tokens) of one turn."""
        return self.prompt.sample(rng), self.reply.sample(rng)


SHAREGPT_LIKE = ChatLengths()


class TextPool:
    """Spans of the bundled text, ``n`` tokens long under ``tokenizer`` (a Hugging Face tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = tokenizer(stdlib_text(0), add_special_tokens=False).input_ids

    def text(self, rng: random.Random, n: int) -> str:
        """A random span of ``n`` tokens, decoded (re-encoding may give a few tokens more or less)."""
        if n >= len(self._ids):
            raise ValueError(f"a {n}-token span is longer than the text pool ({len(self._ids)} tokens)")
        start = rng.randrange(0, len(self._ids) - n)
        return str(self._tokenizer.decode(self._ids[start : start + n]))


def conversations(
    tokenizer: Any, count: int, turns: int, seed: int, min_tokens: int, max_tokens: int
) -> list[list[str]]:
    """The user messages of ``count`` conversations, ``turns`` each (`copilot.user_queries`: seeded,
    ``min_tokens``..``max_tokens`` tokens, no two alike)."""
    users = user_queries(tokenizer, count * turns, seed, min_tokens, max_tokens)
    return [users[c * turns : (c + 1) * turns] for c in range(count)]
