"""Sampling parameters checked where they are written, not where they are used.

The engine refuses a bad parameter too, but only when a call runs — for a semantic function that is the
``get`` of its output, far from the line that said ``temperature=-1``. `check_sampling` applies the
engine's rules (`server.engine.sampling.SamplingParams.validate`, which this light client cannot import)
on the client, so a semantic function, a LangChain model or a LlamaIndex LLM refuses them when it is
defined. `parrot.protocol.SamplingConfig` itself stays unconstrained: it is the wire schema, and the
server answers a bad value on the wire with its own typed error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["SEED_RANGE", "check_sampling"]

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds the engine takes (what ``torch.Generator.manual_seed`` accepts: a 64-bit integer)."""

_CHECKED = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def check_sampling(params: object, *, where: str = "") -> None:
    """Raise `ValueError` naming the first sampling parameter of ``params`` the engine would refuse.

    ``params`` is a `parrot.protocol.SamplingConfig` or anything with its attributes (a LangChain model's
    fields, a call's resolved parameters); an attribute that is missing or None is not given, and not
    checked. ``where`` prefixes the message (e.g. ``"ChatParrot: "``) so the error names what was being
    defined.
    """
    problem = _problem(*(getattr(params, name, None) for name in _CHECKED))
    if problem is not None:
        raise ValueError(f"{where}{problem}")


def _problem(
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: Sequence[str] | None,
) -> str | None:
    # bool is an int to Python but never a token count or a seed anyone meant.
    if max_tokens is not None and (isinstance(max_tokens, bool) or max_tokens < 1):
        return f"max_tokens must be an integer >= 1, got {max_tokens!r}"
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        return f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}"
    if top_p is not None and not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1] (1 disables it), got {top_p!r}"
    if top_k is not None and top_k < 0:
        return f"top_k must be >= 0 (0 disables it), got {top_k!r}"
    if seed is not None and (isinstance(seed, bool) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        return f"seed must be a 64-bit integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed!r}"
    if stop is not None and any(not s for s in stop):
        return f"stop strings must be non-empty, got {list(stop)!r}"
    return None
