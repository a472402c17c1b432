"""Output-length prediction for shortest-predicted-job-first scheduling (SSJF). Pure: no I/O but
the explicit `LengthPredictor.save` / `LengthPredictor.load`.

SSJF predicts a request's output length from its prompt with a small proxy model and finds L1 regression
its best formulation. We have no model hub, and what a BERT learns from the prompt we get in part for free:
the server knows which semantic function (template) a call comes from and sees every completed request. So:

* **features** (`features`): a bias, the prompt's and ``max_tokens``' log sizes, stop settings, the
  template's identity, and hashed word unigrams and bigrams of the prompt's *last* `TAIL_WORDS` words (the
  instruction that decides the length sits at the end: "answer in one word", "list ten"; for a chat, the
  last turn — SSJF's truncated recent history). Hashing is crc32, stable across processes, so a saved
  state keeps its meaning; the feature count is bounded whatever the prompt's size (a prediction is a few
  hundred dictionary reads).
* **model**: a sparse linear regression of ``log(length)`` trained online with L1 loss (AdaGrad steps on
  its subgradient) from every finished request. In log space an L1 fit is a median fit of the *relative*
  error, which suits lengths spanning 1 to thousands.
* **similar requests** (`server.serve.length_neighbours`): the lengths the most similar recent requests
  wrote (TF-IDF over the same features): what a request without a template (an OpenAI request) is predicted
  by until the regression has learned, and often after.
* **per-template prior**: the running mean of ``log(length)`` per template.

The estimates are blended by the inverse of each one's mean absolute error so far, to the 4th power (in
log space, measured before learning from each request): the template prior's and the regression's on that
template, the neighbours' and the regression's over all requests. A function whose answers keep one length
is predicted well after two calls, one whose length depends on its input by the others.

A request that ignores EOS and has no stop strings writes exactly ``max_tokens``: predicted as such.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import tempfile
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from server.serve.length_neighbours import SimilarRequests

__all__ = [
    "BUCKET_EDGES",
    "LengthFeatures",
    "LengthPredictor",
    "LengthPredictorStateError",
    "bucket",
    "bucket_accuracy",
    "features",
    "mae",
]

TAIL_WORDS = 64  # words of the prompt's end that carry the instruction
NEAR_WORDS = 12  # the very end, weighed again on its own
HASH_BUCKETS = 1 << 18
BUCKET_EDGES = (16, 64, 128, 256)  # five length buckets, as SSJF's classification variant
_STATE_VERSION = 2  # 2: the similar requests too (a version-1 file loads without them)
# The running errors of the whole-traffic estimates: a plain mean over the first requests, then a moving
# mean over about this many (recent traffic counts most).
_ERROR_WINDOW = 64
# Templates whose statistics are kept (least recently seen go first): function names come from clients,
# so the table is bounded whatever they send; the hashed weights are bounded by `HASH_BUCKETS`.
MAX_TEMPLATES = 1 << 16
_WORD = re.compile(r"\w+")


class LengthPredictorStateError(ValueError):
    """A saved predictor state cannot be read (corrupt, or written by an incompatible version)."""


@dataclass(frozen=True)
class LengthFeatures:
    """What is known of a request before it runs, as the predictor reads it."""

    template_key: str | None
    max_tokens: int
    exact: bool  # ignores EOS with no stop strings: writes exactly max_tokens
    active: tuple[tuple[int, float], ...]  # sparse features: (index, value)


def _index(text: str) -> int:
    return zlib.crc32(text.encode()) % HASH_BUCKETS


def features(
    template_key: str | None,
    prompt_text: str,
    prompt_tokens: int,
    max_tokens: int,
    *,
    has_stop: bool = False,
    ignore_eos: bool = False,
) -> LengthFeatures:
    """The request's features (see the module docstring); bounded in size whatever the prompt."""
    # Only the tail is read: a 1 MB prompt costs what a 64-word one does.
    words = _WORD.findall(prompt_text[-16 * TAIL_WORDS :].lower())[-TAIL_WORDS:]
    active: dict[int, float] = {}
    # The whole tail, and apart from it its last `NEAR_WORDS` words (where "answer in one word" sits),
    # each group normalized so that its size does not change its weight.
    for prefix, group in (("", words), ("n", words[-NEAR_WORDS:])):
        grams = [f"{prefix}w:{w}" for w in group] + [
            f"{prefix}b:{a} {b}" for a, b in itertools.pairwise(group)
        ]
        weight = 1.0 / math.sqrt(len(grams)) if grams else 0.0
        for g in grams:
            i = _index(g)
            active[i] = active.get(i, 0.0) + weight
    dense = {
        "bias": 1.0,
        "prompt": math.log1p(max(prompt_tokens, 0)) / 8,
        "max": math.log1p(max(max_tokens, 0)) / 8,
        "stop": 1.0 if has_stop else 0.0,
        "eos": 1.0 if ignore_eos else 0.0,
    }
    for name, value in dense.items():
        if value:
            active[_index(f"d:{name}")] = value
    if template_key is not None:
        active[_index(f"t:{template_key}")] = 1.0
    exact = ignore_eos and not has_stop
    return LengthFeatures(template_key, max(1, max_tokens), exact, tuple(sorted(active.items())))


_TemplateStats = tuple[int, float, float, float]


def _updated(stats: _TemplateStats | None, target: float, model: float) -> _TemplateStats:
    """A template's running statistics after one more finished request (errors measured before learning
    from it: what a prediction would have missed)."""
    if stats is None:
        return (1, target, 0.0, abs(model - target))
    count, mean, prior_error, model_error = stats
    n = count + 1
    return (
        n,
        mean + (target - mean) / n,
        prior_error + (abs(mean - target) - prior_error) / count,
        model_error + (abs(model - target) - model_error) / n,
    )


def _running(error: tuple[int, float], new: float) -> tuple[int, float]:
    """A running mean |error| after one more request (``(count, mean)``; see `_ERROR_WINDOW`)."""
    count, mean = error
    count += 1
    return count, mean + (new - mean) / min(count, _ERROR_WINDOW)


class LengthPredictor:
    """Online L1 regression of log output length plus per-template priors (see the module docstring)."""

    def __init__(self, learning_rate: float = 0.1) -> None:
        self.learning_rate = learning_rate
        # Arrays over every hashed feature (2 MiB each), not dicts: a dict's float objects, replaced at every
        # update, would pin allocator arenas of a burst's memory after it ends (`length_neighbours`).
        self._weights = np.zeros(HASH_BUCKETS)
        self._squares = np.zeros(HASH_BUCKETS)  # AdaGrad: summed squared subgradients per coordinate
        # key -> (count, mean log length, mean |error| of that mean, mean |error| of the regression)
        self._templates: OrderedDict[str, _TemplateStats] = OrderedDict()
        self.similar = SimilarRequests()
        # Running mean |error| (log space) over all requests, and how many it has seen: the regression's
        # and the neighbours'.
        self._model_error = (0, 1.0)
        self._similar_error = (0, 1.0)
        self.observed = 0

    def _regression(self, f: LengthFeatures) -> float:
        return sum(float(self._weights[i]) * v for i, v in f.active)

    def _log_estimate(self, f: LengthFeatures) -> float:
        # Each estimate weighed by the inverse of its mean absolute error so far (see the module docstring).
        model = self._regression(f)
        estimates = [(model, self._model_error[1])]
        similar = self.similar.estimate(f.active)
        if similar is not None:
            estimates.append((similar, self._similar_error[1]))
        stats = self._templates.get(f.template_key) if f.template_key is not None else None
        if stats is not None:
            count, mean, prior_error, model_error = stats
            if count < 2:
                return mean
            estimates[0] = (model, model_error)  # the regression as it does on this template
            estimates.append((mean, prior_error))
        # Sharpened (4th power): the estimates learn from the same requests, so their errors are correlated
        # and an even blend drags the best toward the others (measured: the regression's compressed guesses
        # cost SJF a fifth of its gain on the SSJF workload); close ones still average.
        weights = [1.0 / (error + 0.05) ** 4 for _, error in estimates]
        return sum(w * e for w, (e, _) in zip(weights, estimates, strict=True)) / sum(weights)

    def predict(self, f: LengthFeatures) -> int:
        """The predicted output length in tokens, within [1, max_tokens]."""
        if f.exact:
            return f.max_tokens
        estimate = math.exp(min(self._log_estimate(f), 20.0))
        return max(1, min(f.max_tokens, round(estimate)))

    def observe(self, f: LengthFeatures, length: int) -> None:
        """Learn from a finished request that wrote ``length`` tokens."""
        target = math.log(max(1, length))
        model = self._regression(f)  # before learning: what the prediction would have been
        similar = self.similar.estimate(f.active)
        self._model_error = _running(self._model_error, abs(model - target))
        if similar is not None:
            self._similar_error = _running(self._similar_error, abs(similar - target))
        self.similar.add(f.active, target)
        if f.template_key is not None:
            self._templates[f.template_key] = _updated(self._templates.get(f.template_key), target, model)
            self._templates.move_to_end(f.template_key)
            if len(self._templates) > MAX_TEMPLATES:
                self._templates.popitem(last=False)
        error = model - target
        sign = 0.0 if error == 0 else math.copysign(1.0, error)  # the L1 loss's subgradient
        if sign and f.active:
            index = np.fromiter((i for i, _ in f.active), np.intp, len(f.active))
            g = sign * np.fromiter((v for _, v in f.active), np.float64, len(f.active))
            touched = g != 0
            index, g = index[touched], g[touched]
            self._squares[index] += g * g
            self._weights[index] -= self.learning_rate * g / np.sqrt(self._squares[index])
        self.observed += 1

    # ------------------------------------------------------------------------------------------- state
    def save(self, path: str | Path) -> None:
        """Write the state as JSON, atomically (a crash leaves the old file whole)."""
        path = Path(path)
        updated = np.flatnonzero(self._squares)  # the coordinates ever updated (their squares are > 0)
        state = {
            "version": _STATE_VERSION,
            "hash_buckets": HASH_BUCKETS,
            "learning_rate": self.learning_rate,
            "observed": self.observed,
            "weights": {str(i): float(self._weights[i]) for i in updated},
            "squares": {str(i): float(self._squares[i]) for i in updated},
            "templates": {k: list(v) for k, v in self._templates.items()},
            "errors": [list(self._model_error), list(self._similar_error)],
            "similar": self.similar.state(),
        }
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(state, out)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> LengthPredictor:
        """A predictor from a file `save` wrote; `LengthPredictorStateError` says what is wrong otherwise."""
        try:
            state = json.loads(Path(path).read_text())
            if state.get("version") not in (1, _STATE_VERSION) or state.get("hash_buckets") != HASH_BUCKETS:
                raise LengthPredictorStateError(
                    f"{path}: written by another predictor version (state version {state.get('version')!r}, "
                    f"hash buckets {state.get('hash_buckets')!r}; this reads versions 1-{_STATE_VERSION}):"
                    " delete the file to start learning afresh"
                )
            p = cls(float(state["learning_rate"]))
            p.observed = int(state["observed"])
            for name, array in (("weights", p._weights), ("squares", p._squares)):
                for i, w in state[name].items():
                    if not 0 <= int(i) < HASH_BUCKETS:
                        raise ValueError(f"feature {i} outside the {HASH_BUCKETS} hashed features")
                    array[int(i)] = float(w)
            p._templates = OrderedDict(
                (str(k), (int(c), float(m), float(e), float(r)))
                for k, (c, m, e, r) in state["templates"].items()
            )
            if state["version"] >= 2:
                p._model_error, p._similar_error = ((int(n), float(e)) for n, e in state["errors"])
                p.similar = SimilarRequests.from_state(state["similar"])
            return p
        except LengthPredictorStateError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise LengthPredictorStateError(
                f"{path}: not a length-predictor state ({type(e).__name__}: {e}); delete it or point "
                "--length-predictor elsewhere"
            ) from e


# ----------------------------------------------------------------------------------------------- metrics
def bucket(length: int, edges: Sequence[int] = BUCKET_EDGES) -> int:
    """Which of ``len(edges) + 1`` buckets ``length`` falls in (bucket i: up to ``edges[i]`` tokens)."""
    return sum(length > e for e in edges)


def mae(pairs: Iterable[tuple[int, int]]) -> float:
    """Mean absolute error of (predicted, true) pairs; NaN for none."""
    errors = [abs(p - t) for p, t in pairs]
    return sum(errors) / len(errors) if errors else math.nan


def bucket_accuracy(pairs: Iterable[tuple[int, int]], edges: Sequence[int] = BUCKET_EDGES) -> float:
    """Share of (predicted, true) pairs in the same length bucket (SSJF reports 0.615 with 5 buckets)."""
    hits = [bucket(p, edges) == bucket(t, edges) for p, t in pairs]
    return sum(hits) / len(hits) if hits else math.nan
