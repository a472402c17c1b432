"""``echo`` on ``/v1/completions``: the prompt in the answer and, with ``logprobs``, its tokens'
log-probabilities from the prefill — the request lm-evaluation-harness's ``local-completions`` sends for
loglikelihood tasks (token-id prompts, ``echo=True, logprobs=1, max_tokens=1`` or ``0``) — equal to the
engine's own scores."""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import Any

import httpx
import openai
import pytest

from server.engine import LLMEngine, SamplingParams
from server.engine.sampling import TokenLogprob
from tests.test_openai_api import PROMPT, base_url, client, engine  # noqa: F401  (fixtures)

_ids = itertools.count(1 << 51)


def engine_scores(eng: LLMEngine, prompt: list[int], top: int) -> list[TokenLogprob]:
    """The engine's own scores of ``prompt``, in a context of its own."""

    async def run() -> list[TokenLogprob]:
        cid = next(_ids)
        try:
            return await eng.score(cid, prompt, top)
        finally:
            await eng.free_context(cid)

    return asyncio.run(run())


def greedy(eng: LLMEngine, prompt: list[int], n: int, top: int) -> tuple[list[int], list[TokenLogprob]]:
    async def run() -> tuple[list[int], list[TokenLogprob]]:
        cid = next(_ids)
        await eng.fill(cid, prompt)
        try:
            sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=top)
            r = await eng.generate(cid, sampling)
        finally:
            await eng.free_context(cid)
        assert r.logprobs is not None
        return r.token_ids, r.logprobs

    return asyncio.run(run())


def completions(url: str, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def loglikelihood(choice: dict[str, Any], context_len: int) -> tuple[float, bool]:
    """lm-eval's reading of an echoed answer (``parse_logprobs``): the continuation's summed logprob, and
    whether each of its tokens was the likeliest."""
    lps = choice["logprobs"]["token_logprobs"][context_len:-1]
    tops = choice["logprobs"]["top_logprobs"][context_len:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))


def test_lm_eval_loglikelihood_request_equals_the_engine_scores(base_url: str, engine: LLMEngine) -> None:  # noqa: F811
    context = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    continuation = engine.tokenizer.encode(" Paris", add_special_tokens=False)
    prompt = context + continuation
    answer = completions(base_url, prompt=[prompt], echo=True, logprobs=1, max_tokens=1, temperature=0)
    [choice] = answer["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    scored = engine_scores(engine, prompt, 1)
    assert lp["token_logprobs"][1 : len(prompt)] == [s.logprob for s in scored]  # exactly, not nearly
    generated, gen_lps = greedy(engine, prompt, 1, 1)
    assert lp["token_logprobs"][-1] == gen_lps[0].logprob
    assert choice["text"] == engine.tokenizer.decode(prompt) + engine.tokenizer.decode(generated)
    total, is_greedy = loglikelihood(choice, len(context))
    assert total == sum(s.logprob for s in scored[len(context) - 1 :])
    assert is_greedy == all(s.top[0][0] == s.token_id for s in scored[len(context) - 1 :])
    assert answer["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 1,
        "total_tokens": len(prompt) + 1,
    }


def test_max_tokens_0_answers_the_prompt_alone(base_url: str, engine: LLMEngine) -> None:  # noqa: F811
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in ("one two three", "A parrot is")]
    answer = completions(base_url, prompt=prompts, echo=True, logprobs=3, max_tokens=0)
    assert len(answer["choices"]) == 2
    for prompt, choice in zip(prompts, answer["choices"], strict=True):
        lp = choice["logprobs"]
        assert choice["text"] == engine.tokenizer.decode(prompt) and choice["finish_reason"] == "length"
        scored = engine_scores(engine, prompt, 3)
        assert lp["token_logprobs"] == [None, *(s.logprob for s in scored)]
        assert lp["tokens"] == [engine.tokenizer.decode([t]) for t in prompt]
        tops = [{engine.tokenizer.decode([t]): v for t, v in s.top} for s in scored]
        assert lp["top_logprobs"] == [None, *tops]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(prompt))]
    total = sum(len(p) for p in prompts)
    assert answer["usage"] == {"prompt_tokens": total, "completion_tokens": 0, "total_tokens": total}


def test_echo_of_a_text_prompt_leads_each_choice(client: openai.OpenAI, engine: LLMEngine) -> None:  # noqa: F811
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    echoed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, n=2
    )
    assert [c.text for c in echoed.choices] == [PROMPT + plain.choices[0].text] * 2
    assert echoed.choices[0].logprobs is None  # echo without logprobs scores nothing
    assert echoed.usage is not None and plain.usage is not None
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens  # counted once whatever n


def test_a_streamed_echo_sends_the_prompt_first(client: openai.OpenAI) -> None:  # noqa: F811
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    only = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in only) == PROMPT


def test_echo_logprobs_are_log_probabilities(base_url: str, engine: LLMEngine) -> None:  # noqa: F811
    """A check independent of the engine's own scorer: each logprob is at most 0, and a position's 20
    likeliest alternatives never hold more than all of the probability mass."""
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    answer = completions(base_url, prompt=prompt, echo=True, logprobs=20, max_tokens=0)
    for lp, top in zip(
        answer["choices"][0]["logprobs"]["token_logprobs"][1:],
        answer["choices"][0]["logprobs"]["top_logprobs"][1:],
        strict=True,
    ):
        assert lp <= 0 and sum(math.exp(v) for v in top.values()) <= 1 + 1e-5
        assert len(top) <= 20


def test_echo_refusals_say_what_to_send(client: openai.OpenAI, engine: LLMEngine) -> None:  # noqa: F811
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 generates nothing"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0, logprobs=1)
    with pytest.raises(openai.BadRequestError, match="logprobs must be in"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0, echo=True, logprobs=21)
    assert client.models.list().data  # still serving


def test_vllm_prompt_logprobs_rank_each_token(base_url: str, engine: LLMEngine) -> None:  # noqa: F811
    prompt = engine.tokenizer.encode("one two three four", add_special_tokens=False)
    answer = completions(base_url, prompt=prompt, prompt_logprobs=2, max_tokens=1, temperature=0)
    entries = answer["choices"][0]["prompt_logprobs"]
    scored = engine_scores(engine, prompt, 2)
    assert entries[0] is None and len(entries) == len(prompt)
    for entry, s in zip(entries[1:], scored, strict=True):
        own = entry[str(s.token_id)]
        assert own["logprob"] == s.logprob and own["decoded_token"] == engine.tokenizer.decode([s.token_id])
        top_ids = [t for t, _ in s.top]
        # Its rank: its place among the two likeliest, or past them.
        assert own["rank"] == top_ids.index(s.token_id) + 1 if s.token_id in top_ids else own["rank"] > 2
        for rank, (t, v) in enumerate(s.top, 1):
            assert entry[str(t)]["logprob"] == v and entry[str(t)]["rank"] == rank
        assert len(entry) == len(set(top_ids) | {s.token_id})
    # With echo and logprobs=1 beside prompt_logprobs=3, each answers with its own count.
    both = completions(base_url, prompt=prompt, prompt_logprobs=3, echo=True, logprobs=1, max_tokens=0)
    choice = both["choices"][0]
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])
    assert all(3 <= len(e) <= 4 for e in choice["prompt_logprobs"][1:])


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client: openai.OpenAI, engine: LLMEngine) -> None:  # noqa: F811
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, tokenize=False
    )
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    entries = r.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert entries[0] is None and len(entries) == len(prompt)
    assert [s.logprob for s in engine_scores(engine, prompt, 1)] == [
        e[str(t)]["logprob"] for e, t in zip(entries[1:], prompt[1:], strict=True)
    ]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs are returned only without streaming"):
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1}
        )
    with pytest.raises(openai.BadRequestError, match=r"prompt_logprobs must be in \[0, 20\]"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": 21})


def test_streamed_logprobs_equal_the_whole_answers(client: openai.OpenAI) -> None:  # noqa: F811
    """Each chunk carries its own tokens' logprobs: together, the non-streamed answer's, offsets included;
    an echoed prompt's come in its first chunk."""
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    for echo in (False, True):
        whole = client.completions.create(echo=echo, **kwargs).choices[0].logprobs  # type: ignore[call-overload]
        chunks = list(client.completions.create(echo=echo, stream=True, **kwargs))  # type: ignore[call-overload]
        parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert whole is not None and parts
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in parts for x in getattr(p, field)] == getattr(whole, field)
        if echo:
            assert parts[0].token_logprobs[0] is None and chunks[0].choices[0].text == PROMPT
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    whole_chat = client.chat.completions.create(logprobs=True, top_logprobs=2, **chat)  # type: ignore[call-overload]
    streamed = list(client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **chat))  # type: ignore[call-overload]
    content = [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert whole_chat.choices[0].logprobs is not None
    assert content == whole_chat.choices[0].logprobs.content
