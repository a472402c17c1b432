"""GPTs-like apps: a long system prompt per app, shared by all of its users, and a stream of user requests.

The paper's section 8.3 (Fig. 17): each app is a template whose leading constant text is its system
prompt (stdlib docstrings of a stated size, counted with the simulator's tokenizer) followed by the
user's query. The system prompt ends in a newline, which no query merges with, so its tokens prefix every
prompt of the app whatever the query (a prompt ending in ``"User: "`` would merge that space into most
queries' first token, giving each app two shared prefixes). Each request picks an app uniformly, asks a
query of ``query_tokens`` tokens and generates ``output_tokens`` tokens (EOS ignored); it carries a
unit-rate exponential gap, so the same stream arrives as a Poisson process at any rate
(`benchmarks.harness.arrivals.arrival_times`). Deterministic from the seed; nothing downloaded.

A request is sent by either client: `Workload.parrot` (one semantic-function call of the app in a session
of its own, fetched with the latency criteria: the system prompt is the app's constant text, so the
server can share it) or `Workload.baseline` (the prompt rendered by the client, one ``/v1/completions``).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import httpx
import parrot as P

from benchmarks.harness.arrivals import arrival_times
from benchmarks.harness.clients import complete, greedy
from benchmarks.workloads.text import render_template
from workload_text import stdlib_text

__all__ = ["APP_NAMES", "App", "Request", "Workload", "make_workload"]

# The paper's four GPTs categories (section 8.3).
APP_NAMES = ("productivity", "programming", "image_generation", "data_analysis")


@dataclass(frozen=True)
class App:
    """One GPTs-like app: its template (system prompt, then the user's query) and the prompt's size."""

    name: str
    template: str
    system_tokens: int  # tokens of the leading constant text (the shared prefix), BOS included


@dataclass(frozen=True)
class Request:
    """One user request: which app, the query, how many tokens it generates, and its unit-rate gap."""

    app: int
    query: str
    query_tokens: int
    max_tokens: int
    gap: float  # exponential(1): the inter-arrival time at rate R is gap / R


@dataclass(frozen=True)
class Workload:
    """The apps and a long deterministic stream of requests; a run takes those that arrive in its time."""

    apps: list[App]
    requests: list[Request]

    def arrivals(self, rate: float, duration_s: float) -> list[tuple[Request, float]]:
        """The requests arriving within ``duration_s`` at ``rate`` req/s, with their arrival times."""
        times = arrival_times((r.gap for r in self.requests), rate, duration_s)
        return list(zip(self.requests, times, strict=False))

    def prompt(self, request: Request) -> str:
        """The request's whole prompt as a request-centric client renders it."""
        return render_template(self.apps[request.app].template, {"query": request.query})

    async def parrot(self, http: httpx.AsyncClient, request: Request) -> None:
        """The request through the `parrot` frontend: one call in its own session, fetched with the
        latency criteria."""
        app = self.apps[request.app]
        async with P.Session(str(http.base_url), client=http) as s:
            out = _function(app.template, app.name, request.max_tokens)(query=s.variable(request.query))
            await out.aget(criteria=P.LATENCY)

    async def baseline(self, http: httpx.AsyncClient, request: Request, model: str | None = None) -> None:
        """The request as a request-centric client sends it: the whole rendered prompt."""
        await complete(http, self.prompt(request), request.max_tokens, model=model)


@functools.cache
def _function(template: str, name: str, max_tokens: int) -> P.SemanticFunction:
    """An app's semantic function at one output length (made once: every request of the app reuses it)."""
    return P.SemanticFunction.from_template(
        template, name=name, sampling=P.SamplingConfig(**greedy(max_tokens))
    )


def make_workload(
    system_tokens: tuple[int, ...],
    requests: int,
    *,
    query_tokens: tuple[int, int] = (20, 60),
    output_tokens: tuple[int, int] = (64, 128),
    seed: int = 0,
) -> Workload:
    """Apps with system prompts of about ``system_tokens`` tokens each (their names cycle through
    `APP_NAMES`) and ``requests`` requests, deterministic from ``seed``."""
    from server.sim import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    rng = random.Random(seed)
    need = sum(system_tokens) + 20_000  # the system prompts, then a pool the queries are cut from
    chars = 4 * need
    while len(ids := tokenizer(stdlib_text(chars), add_special_tokens=False).input_ids) < need:
        chars *= 2
    apps: list[App] = []
    offset = 0
    for i, n in enumerate(system_tokens):
        name = APP_NAMES[i % len(APP_NAMES)] + (f"_{i}" if i >= len(APP_NAMES) else "")
        body = tokenizer.decode(ids[offset : offset + n])
        offset += n
        system = (
            f"You are a GPT for {name.replace('_', ' ')}. Answer the user's request following the "
            f"instructions, rules and examples below.\n\n{body}\n\nUser:\n"
        )
        template = system + "{{input:query}}\n\nAssistant:\n{{output:answer}}"
        apps.append(App(name, template, len(tokenizer.encode(system))))
    pool = ids[offset:]
    stream: list[Request] = []
    for _ in range(requests):
        app = rng.randrange(len(apps))
        n = rng.randint(*query_tokens)
        start = rng.randrange(len(pool) - n)
        query = tokenizer.decode(pool[start : start + n]).strip()
        max_tokens = rng.randint(*output_tokens)
        stream.append(Request(app, query, n, max_tokens, rng.expovariate(1.0)))
    return Workload(apps, stream)
