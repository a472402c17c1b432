"""KV reuse everywhere, with exact prefill counts from the engine's stats on the tiny model:
prefixes shared at Semantic Variable boundaries (values included, one session or two), producer contexts
that consumers continue, chat turns over the OpenAI endpoint, cache salts, and greedy outputs identical with
sharing on and off. Every server runs in-process (`server.launch`); each test ends with the KV accounting
back at zero once sessions end and caches are dropped."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import parrot as P
import pytest

from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig

BLOCK = 16
SYSTEM = " ".join(f"Reviewer rule {i}: judge the document on point {i} and be brief." for i in range(10))
GREEDY = {"temperature": 0.0, "ignore_eos": True}
STOP_TOKEN = 2903  # the tiny model's favourite greedy token: a stop token it reaches at once


@contextmanager
def served(sharing: bool = True, **config: object) -> Iterator[LaunchedServer]:
    manager_config = ManagerConfig(prefix_sharing=sharing, **config)  # type: ignore[arg-type]
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=512), manager_config=manager_config) as s:
        yield s


def prefilled(s: LaunchedServer) -> int:
    return s.engines[0].stats().prefill_tokens_computed


def drop_and_check_blocks(s: LaunchedServer) -> None:
    """Every KV block comes back once the sessions are gone and the manager's caches are dropped."""
    s.run(s.manager.drop_cache())
    stats = s.engines[0].stats()
    assert stats.blocks_used == 0 and stats.contexts == 0, stats


def encode(s: LaunchedServer, text: str) -> list[int]:
    return s.engines[0].tokenizer.encode(text)


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


WRITE = P.SemanticFunction.from_template(
    "Write a short document about {{input:topic}}.\nDocument:{{output:doc}}",
    name="write",
    sampling=P.SamplingConfig(max_tokens=40, **GREEDY),
)
REVIEW = P.SemanticFunction.from_template(
    SYSTEM + "\nDocument:{{input:doc}}\nReviewer {{input:who}} says:{{output:review}}",
    name="review",
    sampling=P.SamplingConfig(max_tokens=6, **GREEDY),
)
WHO = ["one", "two", "three", "four", "five", "six"]


def review_prompts(s: LaunchedServer, doc: str) -> list[list[int]]:
    return [encode(s, f"{SYSTEM}\nDocument:{doc}\nReviewer {w} says:") for w in WHO]


def six_reviews(sharing: bool) -> tuple[str, list[str], list[str], int, int, int, int, int]:
    """Doc, reviews of session 1 (doc from a call), of session 2 (doc as a value), their prefills, the
    shared part of the review prompts in tokens and the sum of their tails, and the writer's prompt."""
    with served(sharing) as s:
        with P.Session(s.url) as one:
            doc = WRITE(topic=one.variable("gardens"))
            reviews = [REVIEW(doc=doc, who=one.variable(w)) for w in WHO]
            first = [r.get() for r in reviews]
            text = doc.get()
        prefill_one = prefilled(s)
        with P.Session(s.url) as two:
            again = [REVIEW(doc=two.variable(text), who=two.variable(w)) for w in WHO]
            second = [r.get() for r in again]
        prefill_two = prefilled(s) - prefill_one
        prompts = review_prompts(s, text)
        shared = min(common(prompts[0], p) for p in prompts[1:])
        tails = sum(len(p) - shared for p in prompts)
        writer = len(encode(s, "Write a short document about gardens.\nDocument:"))
        drop_and_check_blocks(s)
    return text, first, second, prefill_one, prefill_two, shared, tails, writer


def test_six_reviewers_of_a_generated_document_prefill_the_shared_part_once() -> None:
    text, first, second, one, two, shared, tails, writer = six_reviews(sharing=True)
    assert shared > 3 * BLOCK  # the document is part of what the six prompts share
    # Session 1: the writer's prompt, then the shared part (system text *and* the document) once, then
    # each reviewer's tail — a block of slack per call for the boundary token and block alignment.
    assert one - writer <= shared + tails + len(WHO) * BLOCK, (one, writer, shared, tails)
    # Session 2 sends the same document as a value: only its tails are new.
    assert two <= tails + len(WHO) * BLOCK, (two, tails)
    off = six_reviews(sharing=False)
    assert off[0] == text and off[1] == first and off[2] == second  # greedy answers identical
    assert one < off[3] and two < off[4]


def test_a_chat_turn_over_the_openai_endpoint_prefills_only_its_new_tokens() -> None:
    with served() as s, httpx.Client(base_url=s.url, timeout=60) as c:
        messages = [{"role": "system", "content": SYSTEM}]
        previous: list[int] = []
        for turn in range(5):
            messages.append({"role": "user", "content": f"Question {turn}: what does rule {turn} say?"})
            before = prefilled(s)
            r = c.post(
                "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            computed = prefilled(s) - before
            answer = r.json()["choices"][0]["message"]["content"]
            prompt = r.json()["usage"]["prompt_tokens"]
            tokenizer = s.engines[0].tokenizer
            ids = tokenizer.encode(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                add_special_tokens=False,
            )
            assert len(ids) == prompt
            new = prompt - common(previous, ids)
            assert computed <= new + 2 * BLOCK, (turn, computed, new)
            if turn:
                assert computed < prompt / 2  # the conversation so far is not prefilled again
            messages.append({"role": "assistant", "content": answer})
            previous = ids + tokenizer.encode(answer, add_special_tokens=False)
        drop_and_check_blocks(s)


def test_a_cache_salt_keeps_prefixes_apart() -> None:
    ask = P.SemanticFunction.from_template(
        SYSTEM + "\nQ: {{input:q}}\nA:{{output:a}}",
        name="ask",
        sampling=P.SamplingConfig(max_tokens=4, **GREEDY),
    )
    with served() as s:
        with P.Session(s.url) as plain:
            first = ask(q=plain.variable("why")).get()
        system = len(encode(s, SYSTEM))
        before = prefilled(s)
        with P.Session(s.url, cache_salt="tenant-b") as salted:
            salted_answer = ask(q=salted.variable("why")).get()
        assert prefilled(s) - before >= system  # nothing of the unsalted session's KV was reused
        before = prefilled(s)
        with P.Session(s.url, cache_salt="tenant-b") as same_salt:
            assert ask(q=same_salt.variable("why")).get() == first
        assert prefilled(s) - before < BLOCK  # the same salt shares
        before = prefilled(s)
        with P.Session(s.url) as unsalted:
            assert ask(q=unsalted.variable("why")).get() == first
        assert prefilled(s) - before < BLOCK
        assert salted_answer == first
        drop_and_check_blocks(s)


PROMPT = SYSTEM + "\nQuestion: what should a reviewer check first?\nAnswer:"


@pytest.mark.parametrize("ending", ["length", "stop-string", "eos"])
def test_a_consumer_continuing_its_producer_prefills_only_its_tail(ending: str) -> None:
    probe = continue_producer(True, {"max_tokens": 12})[0]
    if ending == "length":
        sampling: dict[str, object] = {"max_tokens": 12}
    elif ending == "stop-string":  # cut inside the second word's token: the value ends mid-token
        sampling = {"max_tokens": 12, "stop": [probe.split()[1][1:4]]}
    else:  # a stop token the model reaches, which ends generation as EOS does (and is not in the value)
        with served() as s:
            sampling = {"max_tokens": 12, "stop_token_ids": [encode(s, probe)[2]]}
    runs = {sharing: continue_producer(sharing, sampling) for sharing in (True, False)}
    (answer, critique, computed, producer, tail), off = runs[True], runs[False]
    assert (ending == "length") == (answer == probe)  # the ending really happened
    assert (answer, critique) == off[:2]  # greedy outputs identical with sharing on and off
    # The consumer's prompt is the producer's prompt, the value, then its own text: after the producer's
    # prefill, only the consumer's tail (and at most a block at the value's end) is computed.
    assert computed - producer <= tail + BLOCK, (computed, producer, tail)
    assert off[2] - off[3] > tail + 3 * BLOCK  # without sharing it prefills the whole prompt again


def continue_producer(sharing: bool, ending: dict[str, object]) -> tuple[str, str, int, int, int]:
    """The producer's value, the consumer's, prefill computed, the producer's prompt tokens, and the
    consumer's tail beyond the producer's prompt + value."""
    sampling = P.SamplingConfig(temperature=0.0, **ending)  # type: ignore[arg-type]
    answer_fn = P.SemanticFunction.from_template(
        PROMPT + "{{output:answer}}", name="answer", sampling=sampling
    )
    critic = P.SemanticFunction.from_template(
        PROMPT + "{{input:answer}}\nIs this right? Critique:{{output:critique}}",
        name="critic",
        sampling=P.SamplingConfig(max_tokens=4, **GREEDY),
    )
    with served(sharing) as s:
        with P.Session(s.url):
            answer = answer_fn()
            critique = critic(answer=answer)
            got = (answer.get(), critique.get())
        computed = prefilled(s)
        producer = len(encode(s, PROMPT))
        consumer = encode(s, f"{PROMPT}{got[0]}\nIs this right? Critique:")
        tail = len(consumer) - common(consumer, encode(s, PROMPT + got[0]))
        drop_and_check_blocks(s)
    return got[0], got[1], computed, producer, tail


def test_a_get_loop_runs_independent_calls_at_once() -> None:
    """`[o.get() for o in outs]` over six independent calls: eager dispatch runs them in one batch, where
    submitting each only after the previous one's get runs them one after another."""
    fn = P.SemanticFunction.from_template(
        "Story {{input:n}}:{{output:s}}", name="story", sampling=P.SamplingConfig(max_tokens=96, **GREEDY)
    )
    with served() as s:
        with P.Session(s.url):
            fn(n="warm-up").get()
            start = time.perf_counter()
            outs = [fn(n=str(i)) for i in range(6)]
            together = [o.get() for o in outs]
            concurrent = time.perf_counter() - start
            start = time.perf_counter()
            alone = [fn(n=str(i)).get() for i in range(6)]
            one_by_one = time.perf_counter() - start
        assert together == alone
        assert one_by_one / concurrent >= 2.5, (one_by_one, concurrent)


def test_lazy_dispatch_runs_a_step_only_once_a_get_reaches_it() -> None:
    fn = P.SemanticFunction.from_template(
        "Story {{input:n}}:{{output:s}}", name="story", sampling=P.SamplingConfig(max_tokens=4, **GREEDY)
    )
    for mode, runs_early in (("lazy", False), ("eager", True)):
        with served(dispatch=mode) as s, P.Session(s.url) as session:
            out = fn(n="one")
            session.flush()
            time.sleep(0.5)
            assert (prefilled(s) > 0) == runs_early, mode
            assert isinstance(out.get(), str) and prefilled(s) > 0
