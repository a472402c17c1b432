"""The manager over prefill + decode engine pairs (`python -m server --disaggregate`): chat turns, streamed or
not, and Semantic Variable calls give what one engine gives, the conversation's KV stays on the prefill
engine across turns, and the decode engine holds nothing once requests end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import parrot as P
import pytest

from server.cluster.disagg_engine import DisaggregatedEngine
from server.engine import EngineConfig, SamplingParams
from server.engine.errors import RequestAbortedError
from server.launcher import LaunchedServer, build_engines, launch

CONFIG = EngineConfig(num_kv_blocks=256)
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 12}
STORY = P.SemanticFunction.from_template(
    "Tell a story about {{input:topic}}.\nStory:{{output:story}} The end. Moral:{{output:moral}}",
    name="story",
    sampling=P.SamplingConfig(max_tokens=10, temperature=0.0, ignore_eos=True),
)


@pytest.fixture(scope="module")
def pair() -> Iterator[LaunchedServer]:
    with launch("tiny", engines=2, engine_config=CONFIG, disaggregate=True) as s:
        yield s


@pytest.fixture(scope="module")
def single() -> Iterator[LaunchedServer]:
    with launch("tiny", engines=1, engine_config=CONFIG) as s:
        yield s


def _chat(s: LaunchedServer, turns: list[str], stream: bool) -> list[str]:
    messages: list[dict[str, str]] = []
    answers = []
    for user in turns:
        messages.append({"role": "user", "content": user})
        body = {"messages": messages, "stream": stream, **GREEDY}
        if stream:
            parts = []
            with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = httpx.Response(200, content=line[6:]).json()
                        parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
            answer = "".join(parts)
        else:
            r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answer = r.json()["choices"][0]["message"]["content"]
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return answers


@pytest.mark.parametrize("stream", [False, True])
def test_chat_turns_equal_one_engine_and_reuse_the_conversation(
    pair: LaunchedServer, single: LaunchedServer, stream: bool
) -> None:
    (engine,) = pair.engines
    assert isinstance(engine, DisaggregatedEngine)
    turns = ["Tell me about gardens.", "And about rivers?", "Which is older?"]
    alone = single.engines[0]
    before = (engine.prefill.stats().prefill_tokens_computed, alone.stats().prefill_tokens_computed)
    assert _chat(pair, turns, stream) == _chat(single, turns, stream)
    # Both keep each turn's context as the next one's prefix: the same prefill (the pair's first answer
    # token is computed on the decode engine, where one engine computes it as a decode).
    assert engine.prefill.stats().prefill_tokens_computed - before[0] == (
        alone.stats().prefill_tokens_computed - before[1]
    )
    decode = engine.decode.stats()
    assert decode.remote_attention_bytes > 0 and decode.prefill_tokens_computed >= len(turns)
    assert decode.blocks_used == 0 and decode.contexts == 0
    assert engine.prefill.stats().kv_leases == 0


def test_semantic_calls_with_two_outputs_equal_one_engine(
    pair: LaunchedServer, single: LaunchedServer
) -> None:
    """Literal and variable inputs, a future (one call's output) feeding the next, sync and async gets."""

    def run(s: LaunchedServer) -> tuple[str, str, str, str]:
        with P.Session(s.url) as session:
            story, moral = STORY(topic=session.variable("a lighthouse"))
            again, _ = STORY(topic=moral)  # a future input: the server runs it after the first call
            literal, _ = STORY(topic="a harbour")
            later = asyncio.run(again.aget())
            return story.get(), moral.get(), later, literal.get()

    assert run(pair) == run(single)
    assert pair.engines[0].decode.stats().blocks_used == 0  # type: ignore[attr-defined]


def test_pairs_need_an_even_engine_count() -> None:
    with pytest.raises(ValueError, match="an even count, not 3"):
        build_engines("tiny", 3, CONFIG, disaggregate=True)


def test_a_cancelled_generation_frees_the_decode_side(pair: LaunchedServer) -> None:
    engine = pair.engines[0]
    assert isinstance(engine, DisaggregatedEngine)

    async def cancel_midway() -> list[int]:
        await engine.fill(7_000, engine.tokenizer.encode("A long story begins"))
        stream = engine.submit_generate(7_000, SamplingParams(max_tokens=200, ignore_eos=True))
        got = [await anext(stream) for _ in range(4)]
        stream.cancel()
        with pytest.raises(RequestAbortedError):  # as an engine's stream
            await stream.result()
        await asyncio.sleep(0.05)  # the clean-up runs shielded after the cancel
        await engine.free_context(7_000)
        return got

    assert len(pair.run(cancel_midway())) == 4
    decode, prefill = engine.decode.stats(), engine.prefill.stats()
    assert decode.blocks_used == 0 and decode.contexts == 0 and prefill.kv_leases == 0
