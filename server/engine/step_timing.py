"""How long the engine's recent steps took: what a manager predicts time to first token and time per output
token from (Mutel's early rejection, `server.cluster.mutel.admit`)."""

from __future__ import annotations

from dataclasses import dataclass

# A step with at least this many prefill tokens is timed as prefill (per token); one with fewer, as a
# decode step. Mixed steps count where most of their time goes.
PREFILL_STEP_TOKENS = 16


@dataclass
class StepTiming:
    """Exponential moving averages of the decode step time and of the prefill time per token (0: none
    measured yet)."""

    alpha: float = 0.2
    decode_step_s: float = 0.0
    prefill_s_per_token: float = 0.0

    def observe(self, elapsed_s: float, prefill_tokens: int, decodes: int) -> None:
        if prefill_tokens >= PREFILL_STEP_TOKENS:
            self.prefill_s_per_token = self._ema(self.prefill_s_per_token, elapsed_s / prefill_tokens)
        elif decodes:
            self.decode_step_s = self._ema(self.decode_step_s, elapsed_s)

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)
