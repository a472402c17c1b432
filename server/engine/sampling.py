"""Sampling parameters and the sampler (a pure function of logits and parameters)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from parrot.protocol import sampling_problem

from kernels.device_tensors import device_tensor
from server.engine.errors import GuidedDecodingTooCostlyError, InvalidSamplingParamsError
from server.engine.guide_cost import MAX_REPETITION_PRODUCT, repetition_product

_TINY = torch.finfo(torch.float32).tiny
# A client's constraint is bounded before anything compiles it: the grammar compiler's time and memory grow
# with the constraint's size (and with the vocabulary, which is fixed).
MAX_GUIDE_CHARS = 32_768
MAX_CHOICES = 256
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows
# The log-probability reported for a token that cannot be sampled (masked to -inf), as vLLM reports it:
# JSON has no -inf.
MIN_LOGPROB = -9999.0

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GuidedDecoding:
    """A constraint on a generate's output, enforced by masking every token that would break it.

    ``value`` by ``kind``: ``json_schema`` a JSON Schema (as JSON text), ``json_object`` None (any JSON
    object), ``regex`` a pattern, ``choice`` the strings allowed (one of them, exactly), ``grammar`` an EBNF
    grammar whose start rule is ``root`` (xgrammar's, as vLLM and SGLang take it). JSON may hold whitespace
    between its tokens, up to `server.engine.guided.MAX_JSON_WHITESPACE` characters in a row; ``compact``:
    none beyond ``", "`` and ``": "`` (vLLM's ``disable_any_whitespace``).
    """

    kind: GuidedKind
    value: str | tuple[str, ...] | None = None
    compact: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.value, list):
            object.__setattr__(self, "value", tuple(self.value))

    def validate(self) -> None:
        """Raise `InvalidSamplingParamsError` for a malformed or oversized constraint (before compiling)."""
        if self.kind not in get_args(GuidedKind):
            raise InvalidSamplingParamsError(
                f"guided decoding kind must be one of {list(get_args(GuidedKind))}, got {self.kind!r}"
            )
        if self.kind == "json_object":
            if self.value is not None:
                raise InvalidSamplingParamsError("guided json_object takes no value")
            return
        if self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value:
                raise InvalidSamplingParamsError("guided choice needs a non-empty list of strings")
            if len(self.value) > MAX_CHOICES:
                raise InvalidSamplingParamsError(f"guided choice allows at most {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or not c for c in self.value):
                raise InvalidSamplingParamsError("guided choice strings must be non-empty strings")
            size = sum(len(c) for c in self.value)
        else:
            if not isinstance(self.value, str) or not self.value:
                raise InvalidSamplingParamsError(f"guided {self.kind} needs a non-empty string")
            size = len(self.value)
        if size > MAX_GUIDE_CHARS:
            raise InvalidSamplingParamsError(
                f"guided {self.kind} is {size} characters; at most {MAX_GUIDE_CHARS} are accepted"
            )
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)  # type: ignore[arg-type]
            except ValueError as e:
                raise InvalidSamplingParamsError(f"guided json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidSamplingParamsError("guided json_schema must be a JSON object (a JSON Schema)")
        if self.kind == "regex" and (product := repetition_product(self.value)) > MAX_REPETITION_PRODUCT:  # type: ignore[arg-type]
            raise GuidedDecodingTooCostlyError(
                f"guided regex repeats up to {product} times when its bounded repetitions are expanded "
                f"(nested counts multiply), over {MAX_REPETITION_PRODUCT}: use * or + for long runs, or "
                "smaller counts"
            )


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability under the model, and the ``top`` likeliest tokens' (id, logprob);
    a scored prompt's tokens carry their ``rank`` too (1: the likeliest)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


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
    guided: GuidedDecoding | None = None  # constrained decoding (`server.engine.guided`); None: free
    logprobs: int | None = None  # report each token's log-probability and its top this many; None: not
    # Penalties and biases (`server.engine.penalties`; `parrot.protocol.SamplingConfig` says what each does)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.guided, Mapping):  # from a wire model's dump
            object.__setattr__(self, "guided", GuidedDecoding(**self.guided))

    def validate(self, vocab_size: int) -> None:
        """Raise `InvalidSamplingParamsError` naming the first bad field."""
        problem = sampling_problem(self)  # the rules the client checks too, where parameters are written
        if problem is not None:
            raise InvalidSamplingParamsError(problem)
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidSamplingParamsError(
                f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
            )
        bad = [
            t
            for t in self.logit_bias
            if isinstance(t, bool) or not (isinstance(t, int) and 0 <= t < vocab_size)
        ]
        if bad:
            raise InvalidSamplingParamsError(
                f"logit_bias names token ids {bad[:5]} outside the vocabulary [0, {vocab_size})"
            )
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise InvalidSamplingParamsError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (top alternatives per token), "
                f"got {self.logprobs!r}"
            )
        if self.guided is not None:
            self.guided.validate()


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


# Vocabulary chunk of the two-pass argmax (`greedy_tokens`).
_ARGMAX_CHUNK = 128


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[N, vocab]`` logits: the first index of each row's maximum.

    On CPU torch's argmax over a row is a scalar loop (SmolLM2's 49k vocabulary at 64 rows: 1.6 ms, fp32)
    where its max is vectorised (0.1 ms), so the row is cut into chunks: the first chunk holding the
    row's maximum (argmax of the chunk maxima), then the first maximum inside it (0.2 ms in all; the same
    index, ties and NaN included, since both passes take the first maximum).
    """
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab % _ARGMAX_CHUNK or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(rows, vocab // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best = chunks.amax(dim=-1).argmax(dim=-1)
    return best * _ARGMAX_CHUNK + chunks[torch.arange(rows), best].argmax(dim=-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row of ``logits`` ([N, vocab]) under each row's parameters.

    Every row is sampled where the logits are (on the GPU there), in one batch: temperature, top-k and
    top-p as tensors of per-row values, then inverse-CDF sampling. Each request's own generator (on the
    CPU) draws only its row's uniform number, so a seeded request picks the same tokens whatever else is
    in the batch; one transfer brings the N tokens back.
    """
    logits = logits.float()
    picked = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if p.temperature >= _TINY]  # below: greedy (the limit)
    if rows:
        chosen = [params[i] for i in rows]
        uniforms = torch.stack([torch.rand((), generator=generators[i]) for i in rows])
        picked[rows] = _sample_rows(logits[rows], chosen, uniforms.to(logits.device))
    return picked.tolist()


def _per_row(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return device_tensor(values, like.dtype, like.device).unsqueeze(1)


def _sample_rows(logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k and top-p over ``logits`` ([n, vocab], fp32), then the token whose cumulative
    probability first exceeds each row's uniform number (scaled to the kept mass)."""
    vocab = logits.shape[1]
    # Shifted by the max first (softmax does not change): a tiny temperature then sends the others to -inf
    # instead of overflowing every logit to inf (NaN probabilities).
    x = (logits - logits.amax(dim=1, keepdim=True)) / _per_row([p.temperature for p in params], logits)
    order = None
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        x, order = torch.sort(x, dim=1, descending=True)
        keep_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        ranks = torch.arange(vocab, device=x.device).unsqueeze(0)
        x = x.masked_fill(ranks >= _per_row(keep_k, x), float("-inf"))  # ties at the k-th are cut too
    probs = torch.softmax(x, dim=1)
    if order is not None:
        # The smallest set whose mass reaches top_p (the token that crosses it stays in); the likeliest
        # token always stays (a top_p below float32's range is 0).
        top_p = _per_row([p.top_p for p in params], probs)
        drop = (probs.cumsum(dim=1) - probs >= top_p) & (ranks > 0)
        probs = probs.masked_fill(drop, 0.0)
    cdf = probs.cumsum(dim=1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding can put the target at the total mass: the last token with any probability then.
    last = torch.where(probs > 0, torch.arange(vocab, device=probs.device), 0).amax(dim=1)
    index = torch.minimum(index, last)
    return index if order is None else order.gather(1, index.unsqueeze(1)).squeeze(1)


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], tops: list[int], ranks: bool = False
) -> list[TokenLogprob]:
    """Each row's token's log-probability and its ``tops[i]`` most likely alternatives, from ``logits``
    (the caller's: vLLM reports them before temperature, top-p/k and penalties); with ``ranks``, each
    token's rank among them all (1: the likeliest)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).clamp(min=MIN_LOGPROB)
    picked = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
    chosen = picked.squeeze(1).tolist()
    rank_of = (logprobs > picked).sum(dim=1).add(1).tolist() if ranks else [None] * len(tokens)
    k = max(tops, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    out = []
    for i, (token, lp) in enumerate(zip(tokens, chosen, strict=True)):
        top: tuple[tuple[int, float], ...] = ()
        if tops[i] and top_ids is not None and top_values is not None:
            ids, values = top_ids[i, : tops[i]].tolist(), top_values[i, : tops[i]].tolist()
            top = tuple(zip(ids, values, strict=True))
        out.append(TokenLogprob(token, lp, top, rank_of[i]))
    return out
