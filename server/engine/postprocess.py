"""After a step: the next token of each generate (sampled under its grammar's mask, with log-probabilities
where asked) and whether it ends there (`finish_reason`). Pure functions of the requests and the logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from server.engine.guided import mask_logits
from server.engine.penalties import penalize
from server.engine.request import FinishReason, Request
from server.engine.sampling import TokenLogprob, sample, token_logprobs

__all__ = ["finish_reason", "next_tokens", "prompt_logprobs"]

# Rows projected to logits at once when scoring a prompt (each a vocabulary of float32: ~200 KB for 49k)
SCORE_ROWS = 256


def next_tokens(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """The token each generate samples next from its ``logits`` row (float32; under its grammar's mask if
    guided, after its penalties and biases); the requests that asked get each token's log-probabilities
    appended, as vLLM reports them: over what the grammar allows, before penalties, biases, temperature
    and top-p/k."""
    mask_logits(logits, [r.guide for r in reqs])
    wanting = [i for i, r in enumerate(reqs) if r.logprobs is not None]
    reported = logits[wanting] if wanting else None  # a copy: the penalties write into `logits`
    penalize(logits, reqs)
    tokens = sample(logits, [r.sampling for r in reqs], [r.generator for r in reqs])  # type: ignore[misc]
    if reported is not None:
        tops = [reqs[i].sampling.logprobs or 0 for i in wanting]  # type: ignore[union-attr]
        for i, lp in zip(wanting, token_logprobs(reported, [tokens[i] for i in wanting], tops), strict=True):
            reqs[i].logprobs.append(lp)  # type: ignore[union-attr]
    return tokens


def prompt_logprobs(
    logits: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    token_ids: list[int],
    start: int,
    top: int,
) -> list[TokenLogprob]:
    """The log-probabilities of the tokens a prompt chunk predicts: ``rows`` are the final hidden states of
    ``token_ids[start:start + len(rows)]``, and row ``i`` scores ``token_ids[start + i + 1]`` where that
    exists (the prompt's last token predicts nothing yet), with its rank and ``top`` likeliest
    alternatives."""
    targets = token_ids[start + 1 : start + 1 + rows.shape[0]]
    out: list[TokenLogprob] = []
    for at in range(0, len(targets), SCORE_ROWS):
        part = targets[at : at + SCORE_ROWS]
        out.extend(token_logprobs(logits(rows[at : at + len(part)]).float(), part, [top] * len(part), True))
    return out


def finish_reason(
    req: Request,
    token: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    detokenize: Callable[[list[int]], str],
) -> tuple[FinishReason | None, str]:
    """Whether the generate ends with ``token`` (just appended to its output): "stop" (a stop token, EOS
    unless ignored, its grammar complete, or a stop string: the text is cut before it), "length"
    (``max_tokens``, or the model's window full), or None; with the output's text when it ends."""
    sp = req.sampling
    assert sp is not None
    reason: Literal["stop", "length"] | None = None
    text: str | None = None
    ended = token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_token_ids)
    if ended or (req.guide is not None and req.guide.finished):
        reason = "stop"
    elif sp.stop:
        text = detokenize(req.output_ids)
        cut = min((i for i in (text.find(s) for s in sp.stop) if i >= 0), default=-1)
        if cut >= 0:
            return "stop", text[:cut]
    if reason is None and (
        len(req.output_ids) >= sp.max_tokens
        or req.context.position_offset + len(req.context.token_ids) >= max_model_len
    ):
        reason = "length"
    if reason is None:
        return None, ""
    return reason, text if text is not None else detokenize(req.output_ids)
