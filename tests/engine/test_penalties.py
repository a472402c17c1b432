"""Penalties and ``logit_bias``: the rule on a hand-worked row, the repetition penalty against Hugging Face's
``generate`` on the same weights, and biases steering the engine's greedy choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine import LLMEngine, SamplingParams
from server.engine.context import Context
from server.engine.errors import InvalidSamplingParamsError
from server.engine.penalties import penalize
from server.engine.request import Request
from tests.engine.conftest import _hf_model, prompts, run_prompt


def _request(prompt: list[int], output: list[int], sp: SamplingParams) -> Request:
    ctx = Context(context_id=1, parent_id=None, token_ids=[*prompt, *output])
    req = Request(context=ctx, on_finish=lambda *_: None, sampling=sp)
    req.output_ids = list(output)
    return req


def test_each_penalty_on_a_hand_worked_row() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    sp = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias={4: -10.0, 0: 1.0}
    )
    penalize(logits, [_request(prompt=[1], output=[3, 3, 2], sp=sp)])
    # token 0: biased +1, never seen; 1: in the prompt (negative: x2); 2: output once (positive: /2, then
    # -0.5 - 0.25); 3: output twice (/2, then -0.5 - 0.5); 4: biased -10.
    assert logits.tolist() == [[3.0, -2.0, 0.25 - 0.75, 1.5 - 1.0, -9.0]]
    plain = torch.tensor([[2.0, -1.0]])
    penalize(plain, [_request([0], [1, 1], SamplingParams())])
    assert plain.tolist() == [[2.0, -1.0]]  # no penalty: untouched


async def test_repetition_penalty_matches_hf_generate(engine: LLMEngine, gqa_model: Path) -> None:
    for prompt in prompts(3, seed=21, low=4, high=20):
        sp = SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.8)
        ours = await run_prompt(engine, prompt, sp)
        with torch.no_grad():
            out = _hf_model(gqa_model).generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=16,
                min_new_tokens=16,
                do_sample=False,
                repetition_penalty=1.8,
                pad_token_id=2,
            )
        assert ours == out[0, len(prompt) :].tolist()
        assert ours != await run_prompt(engine, prompt, SamplingParams(max_tokens=16, ignore_eos=True))


async def test_biases_and_penalties_steer_greedy_decoding(engine: LLMEngine) -> None:
    prompt = prompts(1, seed=23)[0]
    plain = await run_prompt(engine, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    forced = await run_prompt(
        engine, prompt, SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={77: 100})
    )
    assert forced == [77] * 8
    banned = await run_prompt(
        engine, prompt, SamplingParams(max_tokens=8, ignore_eos=True, logit_bias={plain[0]: -100})
    )
    assert banned[0] != plain[0]
    # The strongest presence penalty with a forced token: it still wins (bias 100 > penalty 2).
    sp = SamplingParams(max_tokens=4, ignore_eos=True, logit_bias={77: 100}, presence_penalty=2.0)
    assert await run_prompt(engine, prompt, sp) == [77] * 4
    # Logprobs stay the model's own (before biases), as vLLM reports them.
    cid = 990_001
    await engine.fill(cid, prompt)
    r = await engine.generate(cid, SamplingParams(max_tokens=1, logit_bias={77: 100}, logprobs=1))
    await engine.free_context(cid)
    assert r.token_ids == [77] and r.logprobs is not None and r.logprobs[0].top[0][0] == plain[0]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be a number in \(0, 100\]"),
        ({"logit_bias": {5: 101.0}}, r"logit_bias values must be numbers in \[-100, 100\]"),
        ({"logit_bias": {1 << 20: 1.0}}, "outside the vocabulary"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "over the 1024"),
    ],
)
async def test_bad_penalties_are_refused_naming_the_field(
    engine: LLMEngine, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message):
        await run_prompt(engine, [5, 6, 7], SamplingParams(max_tokens=2, **fields))  # type: ignore[arg-type]
