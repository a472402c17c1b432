"""Requests in flight inside the engine loop, and what they report back."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from server.engine.context import Context
from server.engine.guided import Guide
from server.engine.sampling import SamplingParams, TokenLogprob

FinishReason = Literal["stop", "length"]
_request_ids = itertools.count()


@dataclass(frozen=True)
class GenerateResult:
    """What `generate` returns: the new tokens, their text (stop string cut off) and why it ended."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token, when the sampling asked for them


@dataclass(eq=False)
class Request:
    """A fill (``sampling is None``) or a generate, extending one context."""

    context: Context
    on_finish: Callable[[object, BaseException | None], None]
    sampling: SamplingParams | None = None
    on_token: Callable[[int, TokenLogprob | None], None] | None = None  # a sampled token, its logprob
    generator: torch.Generator | None = None
    request_id: int = field(default_factory=lambda: next(_request_ids))
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0  # context length when the generate started
    # True once this generate is decoding its own tokens; a preempted request recomputes as prefill.
    decoding: bool = False
    finished: bool = False
    handle: object = None  # the caller-side handle this request answers to
    # While this generate runs, the engine's running requests reserve at most this many tokens in all
    # (`server.engine.scheduler`); None: no latency cap.
    latency_cap: int | None = None
    # Lower starts sooner when the engine orders its waiting queue shortest-first (``scheduling="sjf"``,
    # `server.engine.ordering`); the manager sends the predicted output length. None: an average request.
    priority: float | None = None
    # Who sent it (the manager sends the session's tenant): tenants take turns in the waiting queue
    # (`server.engine.ordering`); None: traffic that names no tenant, one tenant in all.
    tenant: str | None = None
    guide: Guide | None = None  # a guided generate's grammar state
    logprobs: list[TokenLogprob] | None = None  # each token's, when the sampling asked for them
    # A scoring fill's: the log-probability of each filled token after the first, given those before it
    # (entry i scores token i + 1), with ``prompt_top`` alternatives each; None: not a scoring fill.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_top: int = 0

    @property
    def is_generate(self) -> bool:
        return self.sampling is not None

    def result(self, text: str, reason: FinishReason) -> GenerateResult:
        """What this generate answers, ending now with ``text`` and ``reason``."""
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return GenerateResult(list(self.output_ids), text, reason, self.prompt_tokens, logprobs)
