"""Whether our greedy tokens are Hugging Face's own choices, near-ties aside: HF's model run teacher-forced
over each prompt and the tokens a system generated, and at every generated position the margin between HF's
highest logit and the logit of the token that system picked (0: HF's argmax too).

On random weights greedy tokens of two bf16 implementations part ways at near-ties (the 7B shape's agreed
with HF's ``generate`` on 0% of requests in the fifth H100 run, SmolLM2's on 81-100%): a count of equal
sequences cannot tell that from a wrong engine, margins can. Margins are in bf16 ulps of the position's
highest logit (the spacing bf16 resolves there), whatever dtype ran. The yardstick is HF against itself:
its own ``generate`` tokens, teacher-forced the same way, differ from its forced argmax at near-ties too
(cached decode and one full forward round differently). Forced, every position is judged on its own prefix,
so a near-tie costs one token, not the rest of the sequence: a correct engine's share of tokens that are
HF's forced argmax is close to HF's own, its margins a few ulps against a top-two gap of many; a wrong one's
share falls towards chance.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.harness.generators import Outputs
from server.engine.compute_thread import on_own_thread

__all__ = ["agreement", "forced_margins", "token_margins"]

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2**-7: the spacing of bf16 in [1, 2)


def token_margins(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V], tokens [n]: per position the highest logit minus the chosen token's, and the gap
    between the two highest; both in bf16 ulps of the highest logit."""
    logits = logits.float()
    top = logits.topk(2, dim=-1).values
    chosen = logits.gather(-1, tokens[:, None].to(logits.device))[:, 0]
    ulp = BF16_EPS * torch.exp2(torch.floor(torch.log2(top[:, 0].abs().clamp_min(1e-30))))
    return (top[:, 0] - chosen) / ulp, (top[:, 0] - top[:, 1]) / ulp


@torch.inference_mode()
def forced_margins(
    model: Any, prompts: Sequence[list[int]], outputs: Outputs, batch: int = 8
) -> list[tuple[list[float], list[float]]]:
    """Per request, `token_margins` of its generated tokens under ``model`` (a HF causal LM) run over the
    prompt and those tokens: (margins, top-two gaps), one per generated token."""
    device = next(model.parameters()).device
    found = []
    for at in range(0, len(prompts), batch):
        seqs = [
            list(p) + list(o) for p, o in zip(prompts[at : at + batch], outputs[at : at + batch], strict=True)
        ]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):  # right-padded: positions start at 0 for every row, pads come after
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        hidden = model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        for i, (p, o) in enumerate(zip(prompts[at : at + batch], outputs[at : at + batch], strict=True)):
            rows = hidden[i, len(p) - 1 : len(p) - 1 + len(o)]  # the positions that predict each token
            margins, gaps = token_margins(model.lm_head(rows), torch.tensor(o))
            found.append((margins.tolist(), gaps.tolist()))
    return found


def agreement(model: Any, prompts: Sequence[list[int]], ours: Outputs, theirs: Outputs) -> dict[str, Any]:
    """Our tokens and HF's own ``generate`` tokens (``theirs``) both teacher-forced through ``model``: the
    share of each one's tokens that are HF's forced argmax, each one's largest margin, the median top-two gap
    at our positions, and how many of our requests hold a token that is not."""
    # On a thread that ends, as HF's generate runs (`hf_generate`): no thread pool left on this one.
    mine, own = on_own_thread(
        lambda: [forced_margins(model, prompts, tokens) for tokens in (ours, theirs)], "hf-forced"
    )
    margins, own_margins = ([x for m, _ in found for x in m] for found in (mine, own))
    return {
        "forced_token_agree": sum(x == 0 for x in margins) / len(margins),
        "forced_token_agree_hf_self": sum(x == 0 for x in own_margins) / len(own_margins),
        "forced_margin_max_ulps": max(margins),
        "forced_margin_max_ulps_hf_self": max(own_margins),
        "forced_gap_median_ulps": statistics.median(g for _, gaps in mine for g in gaps),
        "forced_requests_off": sum(any(m) for m, _ in mine),
    }
