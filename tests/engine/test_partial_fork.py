"""Forks from the first k tokens of a context (``parent_len``): outputs, exact block accounting, prefill
counts, errors, the HTTP API and `RemoteEngine`, deferred forks and the simulated engine.

The engine is built from the conftest's ``gqa_model`` (a tiny random LLaMA with peaked logits): the embedded
``"tiny"`` model's greedy output repeats one token whatever the prompt, so equal outputs would prove nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from server.cluster.remote_engine import RemoteEngine, RemoteEngineError
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.api import create_engine_app
from server.engine.context import blocks_for
from server.engine.errors import InvalidRequestError
from server.engine.wire import EngineInfo
from server.sim import LatencyModel, SimEngine, run, tiny_tokenizer
from server.sim.cluster import sim_model_config
from tests.engine.conftest import prompts

B = 16
L = 50  # the parent's length: 3 full blocks and 2 tokens
PARENT = 1
SCRATCH = 10**6
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
TAIL = prompts(1, seed=77, low=20, high=21)[0]  # 20 tokens: more than a block


@pytest.fixture
def fresh(gqa_model: Path) -> Iterator[LLMEngine]:
    """An engine of its own, so block counts are exact."""
    with LLMEngine.from_pretrained(gqa_model, EngineConfig(dtype="float32", num_kv_blocks=128)) as eng:
        yield eng


@pytest.fixture
async def parent(fresh: LLMEngine) -> list[int]:
    """The parent context ``PARENT``, filled with ``L`` tokens (so it keeps its last hidden state)."""
    tokens = prompts(1, seed=5, low=L, high=L + 1)[0]
    await fresh.fill(PARENT, tokens)
    return tokens


async def _scratch(engine: LLMEngine, tokens: list[int]) -> list[int]:
    """Greedy tokens of ``tokens`` filled into a new context, with no fork."""
    await engine.fill(SCRATCH, tokens)
    out = (await engine.generate(SCRATCH, GREEDY)).token_ids
    await engine.free_context(SCRATCH)
    return out


async def _free_all(engine: LLMEngine, *context_ids: int) -> None:
    for cid in context_ids:
        await engine.free_context(cid)
    stats = engine.stats()
    assert stats.blocks_used == 0 and stats.contexts == 0


def _used(engine: LLMEngine) -> int:
    return engine.stats().blocks_used


# ------------------------------------------------------------------------------------------ outputs
@pytest.mark.parametrize("k", [32, 21, L, 0])  # a block boundary, inside a block, the whole parent, nothing
async def test_fork_then_tail_equals_the_full_prompt(fresh: LLMEngine, parent: list[int], k: int) -> None:
    assert await fresh.fill(2, TAIL, PARENT, parent_len=k) == k + len(TAIL)
    forked = (await fresh.generate(2, GREEDY)).token_ids
    assert forked == await _scratch(fresh, parent[:k] + TAIL)
    await _free_all(fresh, 2, PARENT)


@pytest.mark.parametrize("k", [32, 21, 17, 1, L])  # 17, 1: the recomputed token is alone in its block
async def test_generate_straight_from_a_prefix(fresh: LLMEngine, parent: list[int], k: int) -> None:
    """Nothing filled after the fork: the last inherited token is recomputed to sample from."""
    forked = (await fresh.generate(2, GREEDY, PARENT, parent_len=k)).token_ids
    assert forked == await _scratch(fresh, parent[:k])
    stream = [t async for t in fresh.generate_stream(3, GREEDY, PARENT, parent_len=k)]
    assert stream == forked
    await _free_all(fresh, 2, 3, PARENT)


async def test_outputs_differ_by_prefix(fresh: LLMEngine, parent: list[int]) -> None:
    """A sanity check that the comparisons above can fail: different prefixes, different continuations."""
    outs = [(await fresh.generate(2 + k, GREEDY, PARENT, parent_len=k)).token_ids for k in (21, 32, L)]
    assert len({tuple(o) for o in outs}) == 3


# ------------------------------------------------------------------------------------------ blocks
async def test_block_accounting_is_exact(fresh: LLMEngine, parent: list[int]) -> None:
    original = (await fresh.generate(9, GREEDY, PARENT)).token_ids
    await fresh.free_context(9)
    table = fresh.core.contexts
    used = blocks_for(L, B)
    assert _used(fresh) == used

    # At a block boundary: the fork shares 2 full blocks; the tail takes blocks of its own, nothing else.
    assert await fresh.fill(2, [], PARENT, parent_len=32) == 32
    assert _used(fresh) == used
    await fresh.fill(2, TAIL)
    used += blocks_for(len(TAIL), B)
    assert _used(fresh) == used
    assert table.get(2).block_table[:2] == table.get(PARENT).block_table[:2]

    # Inside a block: 1 full block shared, the partial one copied when the tail writes into it.
    assert await fresh.fill(3, [], PARENT, parent_len=21) == 21
    assert _used(fresh) == used
    await fresh.fill(3, TAIL)
    used += 1 + blocks_for(21 + len(TAIL) - 2 * B, B)  # the copy, and the blocks past it
    assert _used(fresh) == used
    child, par = table.get(3).block_table, table.get(PARENT).block_table
    assert child[0] == par[0] and child[1] != par[1]

    # No fill: the recomputed last token lands in the shared block 1, which is copied first.
    await fresh.generate(4, SamplingParams(max_tokens=1), PARENT, parent_len=32)
    used += 1
    assert _used(fresh) == used
    # The recomputed token alone in block 1 (k = 17): that block is dropped, then allocated afresh.
    await fresh.generate(5, SamplingParams(max_tokens=1), PARENT, parent_len=17)
    used += 1
    assert _used(fresh) == used
    # Nothing inherited: no block shared, none used.
    await fresh.fill(6, [], PARENT, parent_len=0)
    assert _used(fresh) == used and table.get(6).block_table == []

    # The parent is untouched: same tokens, same continuation.
    assert table.get(PARENT).token_ids == parent
    assert (await fresh.generate(7, GREEDY, PARENT)).token_ids == original
    await _free_all(fresh, 2, 3, 4, 5, 6, 7, PARENT)


async def test_prefill_computes_only_the_tail(fresh: LLMEngine, parent: list[int]) -> None:
    def prefill() -> int:
        return fresh.stats().prefill_tokens_computed

    before = prefill()
    await fresh.fill(2, TAIL, PARENT, parent_len=21)
    await fresh.generate(2, GREEDY)
    assert prefill() - before == len(TAIL)

    before = prefill()
    await fresh.generate(3, GREEDY, PARENT, parent_len=32)
    assert prefill() - before == 1  # the last inherited token, recomputed

    before = prefill()
    await fresh.generate(4, GREEDY, PARENT, parent_len=L)
    assert prefill() - before == 0  # the whole parent: its stored last hidden state is sampled from

    before = prefill()
    await fresh.fill(5, TAIL, PARENT, parent_len=0)
    assert prefill() - before == len(TAIL)
    await _free_all(fresh, 2, 3, 4, 5, PARENT)


# ------------------------------------------------------------------------------------------ errors
async def test_bad_parent_len_is_an_invalid_request(fresh: LLMEngine, parent: list[int]) -> None:
    before = fresh.stats()

    async def invalid(call: object, match: str) -> None:
        with pytest.raises(InvalidRequestError, match=match) as e:
            await call  # type: ignore[misc]
        assert e.value.error_type == "invalid_request"

    await invalid(fresh.fill(2, [7], PARENT, parent_len=L + 1), rf"outside \[0, {L}\]")
    await invalid(fresh.generate(2, GREEDY, PARENT, parent_len=L + 1), rf"outside \[0, {L}\]")
    await invalid(fresh.fill(2, [7], PARENT, parent_len=-1), rf"\[0, {L}\], not -1")
    await invalid(fresh.fill(2, [7], 99, parent_len=-1), r"\[0, the parent's length\]")
    await invalid(fresh.fill(2, [7], parent_len=3), "needs parent_context_id")
    await invalid(fresh.generate(2, GREEDY, parent_len=3), "needs parent_context_id")
    await invalid(fresh.generate(2, GREEDY, PARENT, parent_len=0), "context is empty")
    after = fresh.stats()
    assert (after.contexts, after.blocks_used) == (before.contexts, before.blocks_used)  # nothing made

    # On an existing context nothing is forked, so parent_len does not apply (even with its own parent).
    await fresh.fill(3, [7], PARENT, parent_len=10)
    await invalid(fresh.fill(3, [8], PARENT, parent_len=10), "already exists")
    await invalid(fresh.generate(3, GREEDY, PARENT, parent_len=10), "already exists")
    await invalid(fresh.fill(PARENT, [8], parent_len=10), "needs parent_context_id")
    assert fresh.context_length(3) == 11
    # A fork of nothing is an empty context: a generate on it has nothing to continue.
    assert await fresh.fill(4, [], PARENT, parent_len=0) == 0
    await invalid(fresh.generate(4, GREEDY), "context is empty")
    await _free_all(fresh, 3, 4, PARENT)


# ------------------------------------------------------------------------------------------ HTTP
@pytest.fixture
async def client(fresh: LLMEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_engine_app(fresh, cluster_token=None))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        yield c


async def test_http_api(fresh: LLMEngine, client: httpx.AsyncClient, parent: list[int]) -> None:
    r = await client.post(
        "/fill", json={"context_id": 2, "parent_context_id": PARENT, "parent_len": 21, "token_ids": TAIL}
    )
    assert r.status_code == 200 and r.json()["num_tokens"] == 21 + len(TAIL)
    sampling = {"max_tokens": 8, "ignore_eos": True}
    r = await client.post("/generate", json={"context_id": 2, "sampling": sampling})
    assert r.json()["token_ids"] == await _scratch(fresh, parent[:21] + TAIL)

    expected = await _scratch(fresh, parent[:32])
    body = {"context_id": 3, "parent_context_id": PARENT, "parent_len": 32, "sampling": sampling}
    r = await client.post("/generate", json=body)
    assert r.status_code == 200 and r.json()["token_ids"] == expected
    assert r.json()["prompt_tokens"] == 32
    async with client.stream("POST", "/generate", json={**body, "context_id": 4, "stream": True}) as r:
        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["token_ids"] == expected

    for path, extra, status, etype in [
        ("/fill", {"parent_len": L + 1, "token_ids": [7]}, 400, "invalid_request"),
        ("/fill", {"parent_len": -1, "token_ids": [7]}, 422, "invalid_schema"),
        ("/generate", {"parent_len": -1}, 422, "invalid_schema"),
        ("/generate", {"parent_len": L + 1}, 400, "invalid_request"),
    ]:
        r = await client.post(path, json={"context_id": 5, "parent_context_id": PARENT, **extra})
        assert r.status_code == status and r.json()["error"]["type"] == etype, r.json()
    r = await client.post("/fill", json={"context_id": 5, "parent_len": 3, "token_ids": [7]})
    assert r.status_code == 400 and "parent_context_id" in r.json()["error"]["message"]
    await _free_all(fresh, 2, 3, 4, PARENT)


async def test_remote_engine(fresh: LLMEngine, client: httpx.AsyncClient, parent: list[int]) -> None:
    info = EngineInfo.model_validate((await client.get("/info")).json())
    remote = RemoteEngine("http://engine", "remote", info, fresh.tokenizer, client)
    assert await remote.fill(2, TAIL, PARENT, parent_len=21) == 21 + len(TAIL)
    assert (await remote.generate(2, GREEDY)).token_ids == await _scratch(fresh, parent[:21] + TAIL)
    expected = await _scratch(fresh, parent[:32])
    assert (await remote.generate(3, GREEDY, PARENT, parent_len=32)).token_ids == expected
    handle = remote.submit_generate(4, GREEDY, PARENT, stream=True, parent_len=32)
    assert [t async for t in handle] == expected
    with pytest.raises(RemoteEngineError, match=rf"\[0, {L}\]") as e:
        await remote.fill(5, [7], PARENT, parent_len=L + 1)
    assert e.value.http_status == 400
    await _free_all(fresh, 2, 3, 4, PARENT)


# ------------------------------------------------------------------------------------------ deferred
async def test_fork_from_a_busy_parent_keeps_parent_len(fresh: LLMEngine, parent: list[int]) -> None:
    """Forks asked while the parent generates wait for it, then take the first k tokens of its final state
    (k may reach into the tokens it generated meanwhile)."""
    n = 24
    running = fresh.submit_generate(PARENT, SamplingParams(max_tokens=n, ignore_eos=True), stream=False)
    results = await asyncio.gather(
        fresh.fill(2, TAIL, PARENT, parent_len=21),
        fresh.fill(3, TAIL, PARENT, parent_len=L + 5),  # longer than the parent when asked
        fresh.generate(4, GREEDY, PARENT, parent_len=32),
        fresh.fill(5, [7], PARENT, parent_len=L + n + 1),
        return_exceptions=True,
    )
    generated = (await running.result()).token_ids
    assert results[:2] == [21 + len(TAIL), L + 5 + len(TAIL)]
    assert results[2].token_ids == await _scratch(fresh, parent[:32])  # type: ignore[union-attr]
    assert isinstance(results[3], InvalidRequestError) and f"[0, {L + n}]" in str(results[3])
    assert (await fresh.generate(2, GREEDY)).token_ids == await _scratch(fresh, parent[:21] + TAIL)
    full = parent + generated[:5] + TAIL
    assert (await fresh.generate(3, GREEDY)).token_ids == await _scratch(fresh, full)
    await _free_all(fresh, 2, 3, 4, PARENT)


# ------------------------------------------------------------------------------------------ simulator
def test_simulated_engine_forks_a_prefix() -> None:
    """The simulated engine shares the bookkeeping: the same blocks, prefill counts and (position-made)
    tokens as a context of the same length built from scratch."""
    model = LatencyModel(
        "test",
        base=0.01,
        prefill_token=1e-4,
        prefill_pair=1e-8,
        decode_seq=2e-4,
        kv_token=1e-6,
        kv_tokens=4096,
    )

    async def main() -> None:
        eng = SimEngine(model, tiny_tokenizer(), sim_model_config(model), EngineConfig(device="cpu"))
        try:
            await eng.fill(PARENT, list(range(100, 100 + L)))
            assert await eng.fill(2, [7, 8, 9], PARENT, parent_len=21) == 24
            assert eng.stats().blocks_used == blocks_for(L, B) + 1  # the copied partial block
            before = eng.stats().prefill_tokens_computed
            forked = await eng.generate(3, GREEDY, PARENT, parent_len=32)
            assert eng.stats().prefill_tokens_computed - before == 1
            await eng.fill(4, list(range(32)))
            assert forked.token_ids == (await eng.generate(4, GREEDY)).token_ids
            await _free_all(eng, 2, 3, 4, PARENT)
        finally:
            eng.shutdown()

    run(main())
