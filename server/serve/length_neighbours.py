"""Output lengths of similar past requests: the nearest-neighbour half of the length predictor (SSJF). Pure.

A request whose prompt reads like earlier ones ("write a short story about a violin" after three stories
about other things) will most likely write about as much as they did. The regression
(`server.serve.length_predictor`) learns that too, but slowly: an online linear fit needs many examples per
instruction, and a request without a semantic function (every OpenAI request) has no template prior to fall
back on. So the predictor also keeps the most recent finished requests' features and lengths, and predicts
from the ``k`` most similar: TF-IDF dot products (a feature every kept request has — a chat template's
boilerplate — weighs nothing, rare ones weigh most), the estimate being the similarity-weighted mean of
their log lengths.

Bounded: at most ``capacity`` requests are kept (the oldest go first) in a dense matrix over `COLUMNS`
hashed feature columns (8 MiB at the defaults); a query reads only its own features' columns — a few hundred
at most (`server.serve.length_predictor.features` bounds them) — so it costs O(features x capacity) numpy
work whatever the traffic. Everything kept lives in preallocated arrays, none in per-request Python objects:
a server keeps the last requests of a burst, and small objects made then would each pin a whole allocator
arena of that burst's memory after it ends (measured: RSS after a 1,000-session load).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np

__all__ = ["COLUMNS", "SimilarRequests"]

CAPACITY = 512
NEIGHBOURS = 5
COLUMNS = 1 << 12  # hashed feature columns (a feature index modulo this)
MAX_FEATURES = 256  # per kept request (`length_predictor.features` makes at most ~160)

Active = Sequence[tuple[int, float]]


def _columns(active: Active) -> tuple[np.ndarray, np.ndarray]:
    """``active``'s features folded onto `COLUMNS` (colliding ones summed): columns and values."""
    folded: dict[int, float] = {}
    for i, v in active:
        folded[i % COLUMNS] = folded.get(i % COLUMNS, 0.0) + v
    return np.fromiter(folded, np.intp, len(folded)), np.fromiter(folded.values(), np.float32, len(folded))


class SimilarRequests:
    """The last ``capacity`` finished requests' features and log lengths, and estimates from them."""

    def __init__(self, capacity: int = CAPACITY, k: int = NEIGHBOURS) -> None:
        if capacity < 1 or k < 1:
            raise ValueError(f"capacity and k must be >= 1, got {capacity} and {k}")
        self.capacity, self.k = capacity, k
        self._matrix = np.zeros((capacity, COLUMNS), np.float32)  # a row per kept request (a ring)
        self._targets = np.zeros(capacity)  # their log lengths
        self._order = np.zeros(capacity, np.int64)  # when each was added (ties go to the older)
        self._df = np.zeros(COLUMNS, np.int64)  # kept requests with each column
        # Each row's features as given (unfolded), for the state: indices, values and how many.
        self._indices = np.zeros((capacity, MAX_FEATURES), np.int64)
        self._values = np.zeros((capacity, MAX_FEATURES))
        self._counts = np.zeros(capacity, np.int64)
        self._added = 0

    def __len__(self) -> int:
        return min(self._added, self.capacity)

    def add(self, active: Active, log_length: float) -> None:
        """Keep a finished request (forgetting the oldest beyond ``capacity``); ``ValueError`` beyond
        `MAX_FEATURES` features."""
        if len(active) > MAX_FEATURES:
            raise ValueError(f"a request has at most {MAX_FEATURES} features, got {len(active)}")
        row = self._added % self.capacity
        if self._added >= self.capacity:  # the ring is full: this row's request goes
            old = np.flatnonzero(self._matrix[row])
            self._df[old] -= 1
            self._matrix[row, old] = 0.0
        columns, values = _columns(active)
        self._matrix[row, columns] = values
        self._df[columns[values != 0]] += 1  # what `flatnonzero` finds again when the row goes
        self._targets[row], self._order[row] = log_length, self._added
        n = self._counts[row] = len(active)
        self._indices[row, :n] = [i for i, _ in active]
        self._values[row, :n] = [v for _, v in active]
        self._added += 1

    def estimate(self, active: Active) -> float | None:
        """The similarity-weighted mean log length of the ``k`` kept requests most like ``active``; None
        when none shares a telling feature with it."""
        n = len(self)
        if n == 0:
            return None
        columns, values = _columns(active)
        idf = np.log((1 + n) / (1 + self._df[columns]))
        scores = self._matrix[:n, columns] @ (values * idf * idf)
        candidates = np.flatnonzero(scores > 0)
        if candidates.size == 0:
            return None
        # The k best, the older first among equals: the same answer whatever row each request sits in.
        best = candidates[np.lexsort((self._order[candidates], -scores[candidates]))][: self.k]
        weights = scores[best].astype(np.float64)
        return float(weights @ self._targets[best] / weights.sum())

    # ------------------------------------------------------------------------------------------- state
    def state(self) -> list[list[object]]:
        """The kept requests, oldest first, as JSON-ready ``[[[index, value], ...], log_length]`` pairs."""
        rows = sorted(range(len(self)), key=lambda r: self._order[r])
        return [[self._features(r), float(self._targets[r])] for r in rows]

    def _features(self, row: int) -> list[list[object]]:
        """Row ``row``'s features as given to `add`: ``[[index, value], ...]``."""
        n = int(self._counts[row])
        pairs = zip(self._indices[row, :n], self._values[row, :n], strict=True)
        return [[int(i), float(v)] for i, v in pairs]

    @classmethod
    def from_state(
        cls, rows: list[list[object]], capacity: int = CAPACITY, k: int = NEIGHBOURS
    ) -> SimilarRequests:
        """The requests `state` wrote (malformed rows raise ``ValueError``/``TypeError``)."""
        similar = cls(capacity, k)
        for row in rows:
            active, y = cast(Any, row)  # checked by the conversions: a malformed row raises here
            similar.add([(int(i), float(v)) for i, v in active], float(y))
        return similar
