"""How long a simulated engine step takes: a linear model over the step's features.

``seconds = base + prefill_token * prefill_tokens + prefill_pair * prefill_attention
+ decode_seq * decode_seqs + kv_token * kv_tokens_read``, where ``kv_tokens_read`` is what the decodes read
of the KV cache (a shared prefix read once per step when ``shared_prefix_decode`` is on, as the engine's
shared-prefix kernel does). The features are `server.engine.step_features.StepFeatures`, the very numbers
the real engine traces per step, so a model is either

* **fitted** to the real engine: `fit_latency_model` over `LLMEngine.step_trace` (non-negative least
  squares, so every coefficient keeps its physical sign), or
* **given as data**: a profile in ``server/sim/profiles/<name>.json`` (`load_profile`), e.g. a GPU profile
  for GPU-scale experiments on a machine without one. Each profile states where its numbers come from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from server.engine.step_features import StepFeatures, StepRecord

__all__ = ["PROFILES_DIR", "LatencyModel", "fit_latency_model", "load_profile", "profile_names"]

PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class LatencyModel:
    """Per-step time coefficients (seconds) and the engine shape they describe.

    ``kv_tokens``: KV cache capacity in tokens; ``max_model_len``: context window; ``source``: where the
    numbers come from (a measurement, or a derivation), so every figure built on them can say so.
    """

    name: str
    base: float
    prefill_token: float
    prefill_pair: float
    decode_seq: float
    kv_token: float
    kv_tokens: int = 65536
    max_model_len: int = 16384
    shared_prefix_decode: bool = True
    source: str = ""

    def seconds(self, f: StepFeatures) -> float:
        """Predicted wall time of a step with features ``f``."""
        kv_read = f.decode_kv_tokens - (f.decode_kv_shared if self.shared_prefix_decode else 0)
        return (
            self.base
            + self.prefill_token * f.prefill_tokens
            + self.prefill_pair * f.prefill_attention
            + self.decode_seq * f.decode_seqs
            + self.kv_token * kv_read
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def _row(f: StepFeatures, shared: bool) -> list[float]:
    kv_read = f.decode_kv_tokens - (f.decode_kv_shared if shared else 0)
    return [1.0, f.prefill_tokens, f.prefill_attention, f.decode_seqs, kv_read]


def fit_latency_model(
    records: Sequence[StepRecord],
    name: str,
    *,
    kv_tokens: int,
    max_model_len: int,
    shared_prefix_decode: bool = False,
    source: str = "",
) -> LatencyModel:
    """Least-squares fit (non-negative coefficients) of step time to step features.

    Steps are weighted by 1/time so short decode steps count as much as long prefills (what matters is
    relative error per step); steps that ran no model are left out. ``shared_prefix_decode`` says whether
    the traced engine read shared prefixes once (its grouping was on and paid off) — the feature used for
    KV reads follows it.
    """
    # A step that ran no model (every chunk 0 tokens: a generate's first token sampled from a stored hidden
    # state) costs sampling alone; its time says nothing of these coefficients and, weighted by 1/time,
    # would outweigh the real steps.
    records = [r for r in records if r.features.prefill_tokens or r.features.decode_seqs]
    if len(records) < 5:
        raise ValueError(f"need at least 5 traced model steps to fit a latency model, got {len(records)}")
    x = np.array([_row(r.features, shared_prefix_decode) for r in records], dtype=np.float64)
    y = np.array([r.seconds for r in records], dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-6)
    scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # columns on one scale: the solver is then well posed
    coef, _ = nnls((x / scale) * w[:, None], y * w)
    coef = coef / scale
    return LatencyModel(
        name,
        base=float(coef[0]),
        prefill_token=float(coef[1]),
        prefill_pair=float(coef[2]),
        decode_seq=float(coef[3]),
        kv_token=float(coef[4]),
        kv_tokens=kv_tokens,
        max_model_len=max_model_len,
        shared_prefix_decode=shared_prefix_decode,
        source=source,
    )


def profile_names() -> list[str]:
    """The latency profiles shipped as data."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> LatencyModel:
    """A shipped profile by name (`profile_names`) or a JSON file written by `LatencyModel.to_json`."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no latency profile {str(name_or_path)!r}: give a JSON file or one of {profile_names()}"
        )
    data = json.loads(path.read_text())
    try:
        return LatencyModel(**data)
    except TypeError as e:
        raise ValueError(f"{path} is not a latency profile: {e}") from e
