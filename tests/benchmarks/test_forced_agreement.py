"""Teacher-forced agreement with Hugging Face (`benchmarks.harness.forced_agreement`): margins in bf16 ulps,
HF's own tokens agree with themselves, and tokens that are not its choices show."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.forced_agreement import agreement, token_margins


def test_margins_and_gaps_in_bf16_ulps_of_the_highest_logit() -> None:
    logits = torch.tensor([[5.0, 4.96875, 1.0], [2.0, 3.0, 1.0], [-0.5, -0.75, -0.625]])
    margins, gaps = token_margins(logits, torch.tensor([1, 1, 2]))
    # bf16 spacing: 2**-5 in [4, 8), 2**-6 in [2, 4), 2**-8 in [0.25, 0.5) (of |-0.5|).
    assert margins.tolist() == [1.0, 0.0, 32.0]
    assert gaps.tolist() == [1.0, 64.0, 32.0]


@pytest.fixture(scope="module")
def small_llama() -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=500, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _greedy(model: object, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_hf_tokens_are_its_forced_argmax_and_shifted_ones_are_not(small_llama: object) -> None:
    prompts = [[3, 17, 42, 9, 100, 7], [250, 11, 12], [5] * 9]
    theirs = [_greedy(small_llama, p, 6) for p in prompts]
    same = agreement(small_llama, prompts, theirs, theirs)
    assert same["forced_token_agree"] == same["forced_token_agree_hf_self"] == 1.0
    assert same["forced_margin_max_ulps"] == 0 and same["forced_requests_off"] == 0
    assert same["forced_gap_median_ulps"] > 0
    # A wrong engine: each request's third token replaced by another one.
    wrong = [[*t[:2], (t[2] + 1) % 500, *t[3:]] for t in theirs]
    off = agreement(small_llama, prompts, wrong, theirs)
    assert off["forced_requests_off"] == 3 and off["forced_margin_max_ulps"] > 0
    assert off["forced_token_agree"] < 1.0 and off["forced_token_agree_hf_self"] == 1.0
