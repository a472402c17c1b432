"""The load tool's users (`benchmarks.load`): one session of a 3-call dependent chain, and a wave of them.

Each session is one user of the `parrot` frontend: it opens a ``P.Session``, submits a 3-call chain (call 2
reads call 1's output variable, call 3 call 2's; greedy, ``max_tokens`` tokens each, EOS ignored), gets the
three values and closes the session. A wave starts all its sessions at once (one ``asyncio`` task each,
with its own HTTP connections, as separate users have).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import parrot as P

from benchmarks.harness.output import log

# Distinct chain inputs: sessions of the same input must produce the same chain (greedy), which is how a
# wrong answer shows; several inputs keep the prefix cache from making every session one request.
SEEDS = [f"Story {i}: the {w} walked to the river and saw" for i, w in enumerate(["fox", "owl", "cat", "ox"])]


def chain_step(max_tokens: int) -> P.SemanticFunction:
    """The chain's one semantic function: step ``n`` continues the text so far (``prev``)."""
    return P.SemanticFunction.from_template(
        "Step {{input:n}} of a story. So far: {{input:prev}} Then: {{output:next}}",
        name="load_step",
        sampling=P.SamplingConfig(max_tokens=max_tokens, ignore_eos=True),
    )


@dataclass
class SessionOutcome:
    """What one session got: its input, its time, the chain's values and its failures."""

    seed: int
    seconds: float
    values: list[str | None]  # the three chain values; None: lost
    errors: list[str] = field(default_factory=list)  # "Type" or "Type 503", one per failure
    messages: list[str] = field(default_factory=list)


def _error_key(e: BaseException) -> str:
    status = getattr(e, "status", None)
    return f"{type(e).__name__} {status}" if status is not None else type(e).__name__


async def run_session(url: str, index: int, step: P.SemanticFunction, timeout_s: float) -> SessionOutcome:
    """One user: open a session, submit the 3-call chain, get every value, close the session."""
    seed = index % len(SEEDS)
    out = SessionOutcome(seed, math.nan, [None, None, None])
    started = time.perf_counter()
    try:
        # Its own HTTP client, as separate users have: one pool shared by a thousand long-polling sessions
        # spends the client's CPU on the pool's waiting list (quadratic), not on the server.
        async with P.Session(url, timeout=timeout_s, poll_timeout=min(30.0, timeout_s)):
            prev: str | P.Variable = SEEDS[seed]
            chain = []
            for n in range(3):
                prev = step(n=str(n + 1), prev=prev)
                chain.append(prev)
            for i in (2, 0, 1):  # the last first: one get runs the whole chain server-side
                try:
                    out.values[i] = await chain[i].aget(timeout=timeout_s)
                except P.ParrotError as e:
                    out.errors.append(_error_key(e))
                    out.messages.append(str(e))
            out.seconds = time.perf_counter() - started
    except Exception as e:  # opening or closing the session failed: whatever is missing is lost
        out.errors.append(_error_key(e))
        out.messages.append(f"{type(e).__name__}: {e}")
    return out


async def run_wave(
    url: str,
    sessions: int,
    *,
    max_tokens: int,
    timeout_s: float,
    first: int = 0,
    progress_s: float = 15.0,
) -> tuple[list[SessionOutcome], float]:
    """``sessions`` concurrent sessions (numbered from ``first``, which picks their inputs), each call
    ``max_tokens`` tokens and each session given ``timeout_s``; returns their outcomes and the wave's wall
    time."""
    step = chain_step(max_tokens)
    started = time.perf_counter()
    tasks = [asyncio.create_task(run_session(url, first + i, step, timeout_s)) for i in range(sessions)]
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=progress_s)
        if pending:
            elapsed = time.perf_counter() - started
            log(f"  {sessions - len(pending)}/{sessions} sessions done after {elapsed:.0f} s")
    return [t.result() for t in tasks], time.perf_counter() - started
