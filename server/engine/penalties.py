"""Penalties and biases on a step's logits, before sampling, as OpenAI's and vLLM's samplers apply them:
``logit_bias`` added to named tokens, then the repetition penalty (over the prompt and the output: a positive
logit divided by it, a negative one multiplied) and the presence and frequency penalties (over the output:
subtracted once, and per occurrence). Pure functions of the requests and the logits."""

from __future__ import annotations

import torch

from server.engine.request import Request
from server.engine.sampling import SamplingParams

__all__ = ["needs_penalties", "penalize"]


def needs_penalties(sp: SamplingParams) -> bool:
    """Whether ``sp`` changes the logits before sampling."""
    return bool(sp.logit_bias or sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0)


def penalize(logits: torch.Tensor, reqs: list[Request]) -> None:
    """Apply each request's penalties and biases to its row of ``logits`` ([N, vocab], float32), in place
    (in inference mode: the model's logits are inference tensors)."""
    with torch.inference_mode():
        _penalize(logits, reqs)


def _penalize(logits: torch.Tensor, reqs: list[Request]) -> None:
    for row, req in zip(logits, reqs, strict=True):
        sp = req.sampling
        if sp is None or not needs_penalties(sp):
            continue
        if sp.logit_bias:
            ids = torch.tensor(list(sp.logit_bias), device=row.device)
            bias = torch.tensor(
                [float(v) for v in sp.logit_bias.values()], dtype=row.dtype, device=row.device
            )
            row.index_add_(0, ids, bias)
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(req.context.token_ids, device=row.device).unique()
            values = row[seen]
            row[seen] = torch.where(
                values > 0, values / sp.repetition_penalty, values * sp.repetition_penalty
            )
        if (sp.presence_penalty or sp.frequency_penalty) and req.output_ids:
            ids, counts = torch.tensor(req.output_ids, device=row.device).unique(return_counts=True)
            row.index_add_(0, ids, -(sp.frequency_penalty * counts.to(row.dtype) + sp.presence_penalty))
