"""A mixed load: chat turns arriving as a Poisson process while map-reduce summary apps arrive in the
background (the paper's section 8.5, Fig. 19).

Chat turns are ShareGPT-like (`benchmarks.workloads.chat`: log-normal prompt and reply lengths, greedy,
EOS ignored, so every reply has exactly its drawn length); the apps arrive at times drawn uniformly over
the same window (a Poisson process conditioned on its count), each over its own document of
``chunks`` chunks (uniform) with the prompts of `benchmarks.workloads.map_reduce_app`. All text is random
spans of the stdlib docstrings, counted with the simulator's tokenizer. Deterministic from the seed.

A chat turn is sent by either client: `ChatRequest.parrot` (a latency-critical semantic-function call, its
reply fetched with the latency criteria) or `ChatRequest.baseline` (the rendered prompt, one
``/v1/completions``); an app, by the map-reduce clients of `benchmarks.workloads.map_reduce_app`.
`Workload.calls` is everything the workload offers, as one client sends it.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx
import parrot as P
from parrot.protocol import Criteria

from benchmarks.harness.clients import complete, greedy
from benchmarks.harness.stats import Spread
from benchmarks.workloads.chat import SHAREGPT_LIKE, ChatLengths, TextPool
from benchmarks.workloads.map_reduce_app import MapReduceDoc, baseline_map_reduce, parrot_map_reduce
from benchmarks.workloads.text import render_template

__all__ = ["CHAT_TEMPLATE", "SIZES", "ChatRequest", "Workload", "make_workload"]

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

    async def parrot(self, http: httpx.AsyncClient) -> str:
        """The turn through the `parrot` frontend: a latency-critical call, its reply fetched."""
        sampling = P.SamplingConfig(**greedy(self.max_tokens))
        chat = P.SemanticFunction.from_template(
            CHAT_TEMPLATE, name="chat", sampling=sampling, criteria=P.LATENCY
        )
        async with P.Session(str(http.base_url), client=http, timeout=3600.0):
            reply = chat(message=self.message)
            assert isinstance(reply, P.Variable)
            return str(await reply.aget(criteria=P.LATENCY))

    async def baseline(self, http: httpx.AsyncClient, model: str | None = None) -> str:
        """The turn as a request-centric client sends it: the rendered prompt, one completion."""
        return await complete(http, self.prompt, self.max_tokens, model=model)


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

    def calls(
        self,
        http: httpx.AsyncClient,
        *,
        baseline: bool,
        model: str | None = None,
        criteria: Criteria = "throughput",
    ) -> list[tuple[float, Callable[[], Awaitable[str]]]]:
        """Every chat turn, then every app, as ``(arrival, call)`` by one client: the request-centric
        baseline's (rendered prompts, naming ``model``) or Parrot's (each app's summary fetched with
        ``criteria``)."""

        def chat(c: ChatRequest) -> Awaitable[str]:
            return c.baseline(http, model) if baseline else c.parrot(http)

        def app(doc: MapReduceDoc) -> Awaitable[str]:
            if baseline:
                return baseline_map_reduce(http, doc, model=model)
            return parrot_map_reduce(http, doc, criteria=criteria, timeout=3600.0)

        out = [(c.arrival, functools.partial(chat, c)) for c in self.chats]
        return out + [(at, functools.partial(app, doc)) for at, doc in self.apps]


# The sizes `make_workload` takes besides the seed (an experiment's config fields of the same names).
SIZES = (
    "window",
    "chat_rate",
    "apps",
    "chunks",
    "chunk_tokens",
    "map_tokens",
    "reduce_tokens",
    "chat_lengths",
)


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
