"""Sampling parameters and the sampler (a pure function of logits and parameters)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from server.engine.errors import InvalidSamplingParamsError

# What `torch.Generator.manual_seed` takes (a signed or unsigned 64-bit integer); beyond it, it raises.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable them."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self, vocab_size: int) -> None:
        """Raise `InvalidSamplingParamsError` naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidSamplingParamsError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidSamplingParamsError(
                f"temperature must be a finite number >= 0, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidSamplingParamsError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidSamplingParamsError(
                f"seed must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}"
            )
        if any(not s for s in self.stop):
            raise InvalidSamplingParamsError("stop strings must be non-empty")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidSamplingParamsError(
                f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
            )


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request generator: seeded requests are reproducible whatever else is in the batch."""
    if params.temperature == 0.0:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed)
    return gen


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row of ``logits`` ([N, vocab]) under each row's parameters."""
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.temperature < _TINY:  # greedy; below float32's range it would divide by zero (the limit: greedy)
            continue
        # Per-request generators live on the CPU; one row of logits is cheap to bring there.
        # Shifted by the max first (softmax does not change): a tiny temperature then sends the others to
        # -inf instead of overflowing every logit to inf (NaN probabilities).
        row = logits[i].cpu()
        row = (row - row.max()) / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest set whose mass reaches top_p (the token that crosses it stays in)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            drop[0] = False  # the most likely token always stays (a top_p below float32's range is 0)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
