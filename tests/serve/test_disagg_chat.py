"""Multi-turn chat served colocated, Splitwise-like and Mutel-style over real engines: the same answers,
and the costs each policy is about (prefill tokens, KV bytes moved, attention exchanges)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from server.cluster.disagg_chat import POLICIES, DisaggregatedChat, TurnResult
from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.conftest import prompts, save_hf_model

SAMPLING = SamplingParams(max_tokens=10, ignore_eos=True)
TURNS = 3


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LLMEngine]]:
    path: Path = save_hf_model(tmp_path_factory.mktemp("disagg"))
    cfg = EngineConfig(dtype="float32", num_kv_blocks=128)
    made = [LLMEngine.from_pretrained(path, cfg) for _ in range(2)]
    yield made
    for e in made:
        e.shutdown()


def _chat(policy: str, engines: list[LLMEngine]) -> DisaggregatedChat:
    if policy == "colocated":
        return DisaggregatedChat("colocated", engines)
    return DisaggregatedChat(policy, engines[:1], engines[1:])  # type: ignore[arg-type]


async def _serve(chat: DisaggregatedChat, messages: list[list[int]]) -> list[TurnResult]:
    results = [await chat.turn("a", m, SAMPLING) for m in messages]
    await chat.end("a")
    return results


async def test_every_policy_gives_the_same_answers(engines: list[LLMEngine]) -> None:
    messages = prompts(TURNS, seed=21, low=8, high=20)
    runs = {policy: await _serve(_chat(policy, engines), messages) for policy in POLICIES}
    answers = {policy: [r.tokens for r in results] for policy, results in runs.items()}
    assert answers["splitwise"] == answers["colocated"]
    assert answers["mutel"] == answers["colocated"]
    assert all(e.stats().blocks_used == 0 for e in engines), "every policy frees what it held"
    assert all(e.stats().kv_leases == 0 for e in engines)

    kv_per_token = _kv_bytes_per_token(engines[0])
    history = 0
    for turn, message in enumerate(messages):
        colocated, splitwise, mutel = (runs[p][turn] for p in POLICIES)
        new = len(message) + (1 if turn else 0)  # the last answer's final token is computed next turn
        # Each keeps the conversation's KV (or moves it back), so a turn prefills only its new tokens.
        assert colocated.prefill_tokens == new
        assert mutel.prefill_tokens == new + 1  # + the first answer token, computed on the decode engine
        assert splitwise.prefill_tokens == new + 1
        assert colocated.kv_bytes_moved == 0 and colocated.exchange_bytes == 0
        # Splitwise moves the whole prompt forward and the whole conversation back; Mutel only the last
        # answer (all but its final token), never more than the turn's new tokens' KV.
        prompt = history + len(message)
        assert splitwise.kv_bytes_moved == kv_per_token * (
            (history - 1 if turn else 0) + prompt + prompt + SAMPLING.max_tokens - 1
        )
        moved_back = (SAMPLING.max_tokens - 1) * kv_per_token if turn else 0
        assert mutel.kv_bytes_moved == moved_back
        assert mutel.kv_bytes_moved <= (len(message) + SAMPLING.max_tokens) * kv_per_token
        assert mutel.exchange_bytes > 0
        assert mutel.ttft_s <= mutel.total_s
        history = prompt + SAMPLING.max_tokens


async def test_mutel_recomputing_answers_moves_no_kv(engines: list[LLMEngine]) -> None:
    messages = prompts(TURNS, seed=22, low=8, high=20)
    moving = await _serve(_chat("mutel", engines), messages)
    recomputing = await _serve(
        DisaggregatedChat("mutel", engines[:1], engines[1:], move_answers=False), messages
    )
    assert [r.tokens for r in recomputing] == [r.tokens for r in moving]
    assert all(r.kv_bytes_moved == 0 for r in recomputing)
    # Recomputing costs the answer's tokens (all but the final one, which is computed either way) as prefill.
    for turn in range(1, TURNS):
        assert recomputing[turn].prefill_tokens - moving[turn].prefill_tokens == SAMPLING.max_tokens - 1


def test_policies_are_checked(engines: list[LLMEngine]) -> None:
    with pytest.raises(ValueError, match="unknown policy 'vllm'"):
        DisaggregatedChat("vllm", engines)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mutel needs decode engines"):
        DisaggregatedChat("mutel", engines)


def _kv_bytes_per_token(engine: LLMEngine) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # float32
