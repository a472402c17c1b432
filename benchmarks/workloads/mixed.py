"""A mixed load: chat turns arriving as a Poisson process while map-reduce summary apps arrive in the
background (the paper's section 8.5, Fig. 19).

Chat turns are ShareGPT-like (`benchmarks.workloads.chat`: log-normal prompt and reply lengths, greedy,
EOS ignored, so every reply has exactly its drawn length); the apps arrive at times drawn uniformly over
the same window (a Poisson process conditioned on its count), each over its own document of
``chunks`` chunks (uniform) with the prompts of `benchmarks.map_reduce`. All text is random spans of the
stdlib docstrings, counted with the simulator's tokenizer. Deterministic from the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.common import Spread, render_template
from benchmarks.map_reduce import MapReduceDoc
from benchmarks.workloads.chat import SHAREGPT_LIKE, ChatLengths, TextPool

__all__ = ["CHAT_TEMPLATE", "ChatRequest", "Workload", "make_workload"]

# The constant text is under the manager's `min_shared_prefix_tokens` (16): no prefix sharing across chats.
CHAT_TEMPLATE = """User: {{input:message}}
Assistant: {{output:reply}}"""


@dataclass(frozen=True)
class ChatRequest:
    """One chat turn: arrival (seconds after the start), the user's message and the reply's length."""

    arrival: float
    message: str
    prompt_tokens: int
    max_tokens: int

    @property
    def prompt(self) -> str:
        """The rendered prompt (what a request-centric client sends; Parrot's server renders the same)."""
        return render_template(CHAT_TEMPLATE, {"message": self.message})


@dataclass(frozen=True)
class Workload:
    """Everything that arrives during one run: chat turns, and map-reduce apps as (arrival, document)."""

    seed: int
    chats: tuple[ChatRequest, ...]
    apps: tuple[tuple[float, MapReduceDoc], ...]

    def summary(self) -> dict[str, Any]:
        """Sizes of what is offered (token counts and chunks: median, range)."""
        chunks = [len(doc.chunks) for _, doc in self.apps]
        return {
            "seed": self.seed,
            "chats": len(self.chats),
            "chat_prompt_tokens": Spread.of(c.prompt_tokens for c in self.chats).as_dict(),
            "chat_output_tokens": Spread.of(c.max_tokens for c in self.chats).as_dict(),
            "apps": len(self.apps),
            "chunks_per_app": Spread.of(chunks).as_dict(),
            "map_calls": sum(chunks),
        }


def make_workload(
    seed: int,
    *,
    window: float,
    chat_rate: float,
    apps: int,
    chunks: tuple[int, int],
    chunk_tokens: int,
    map_tokens: int,
    reduce_tokens: int,
    chat_lengths: ChatLengths = SHAREGPT_LIKE,
) -> Workload:
    """Chat turns at ``chat_rate`` per second during ``window`` seconds and ``apps`` map-reduce apps
    over the same window, each over ``chunks`` (min, max) chunks of ``chunk_tokens`` tokens."""
    from server.sim import tiny_tokenizer

    rng, tokenizer = random.Random(seed), tiny_tokenizer()
    pool = TextPool(tokenizer)
    turns: list[ChatRequest] = []
    t = rng.expovariate(chat_rate)
    while t < window:
        want, out = chat_lengths.sample(rng)
        turn = ChatRequest(t, pool.text(rng, want), 0, out)
        turns.append(replace(turn, prompt_tokens=len(tokenizer.encode(turn.prompt))))
        t += rng.expovariate(chat_rate)
    docs = []
    for at in sorted(rng.uniform(0.0, window) for _ in range(apps)):
        parts = tuple(pool.text(rng, chunk_tokens) for _ in range(rng.randint(*chunks)))
        docs.append((at, MapReduceDoc(parts, map_tokens, reduce_tokens)))
    return Workload(seed, tuple(turns), tuple(docs))
