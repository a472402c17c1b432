"""Attention parallelism and KV transfer between engines (Mutel): the same greedy tokens as one
engine, exact KV accounting, typed errors, and a lost KV holder failing only its own requests."""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels import torch_path
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.errors import ContextBusyError, InvalidRequestError
from server.engine.kv_transfer import KVBlob
from server.engine.remote_kv import KVSourceLostError, RemotePrefix, exchange_bytes
from tests.engine import dist_workers
from tests.engine.conftest import prompts

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _first(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(gqa_model: Path) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """A prefill engine (also the colocated reference) and a decode engine, in one process."""
    cfg = EngineConfig(dtype="float32", num_kv_blocks=128, max_num_batched_tokens=256)
    engines = (LLMEngine.from_pretrained(gqa_model, cfg), LLMEngine.from_pretrained(gqa_model, cfg))
    yield engines
    for e in engines:
        e.shutdown()


async def _split_turn(
    prefill: LLMEngine, decode: LLMEngine, holder: int, reader: int, prompt: list[int], max_tokens: int
) -> tuple[list[int], object]:
    """Prefill ``prompt`` into ``holder`` and sample the first token there; decode the rest on ``decode``
    over the leased prompt KV. Returns the tokens and the lease."""
    await prefill.fill(holder, prompt)
    first = (await prefill.generate(holder, _first())).token_ids
    lease = await prefill.lease_kv(holder, len(prompt))
    await decode.fill(reader, first, remote=RemotePrefix(prefill.kv_source, lease))
    rest = (await decode.generate(reader, _first(max_tokens - 1))).token_ids
    return first + rest, lease


async def test_a_conversation_decoded_over_remote_kv_equals_one_engine(
    pair: tuple[LLMEngine, LLMEngine],
) -> None:
    prefill, decode = pair
    turn1, turn2 = prompts(2, seed=11, low=20, high=40)
    # Colocated: both turns on one engine, turn 2 continuing turn 1's context.
    await prefill.fill(1, turn1)
    ref1 = (await prefill.generate(1, GREEDY)).token_ids
    await prefill.fill(2, turn2, 1)
    ref2 = (await prefill.generate(2, GREEDY)).token_ids

    got1, lease = await _split_turn(prefill, decode, 10, 100, turn1, 12)
    assert got1 == ref1
    assert decode.stats().remote_attention_bytes > 0
    assert decode.stats().prefill_tokens_computed + decode.stats().decode_tokens_computed <= 12
    # Turn 2 on the prefill engine: the decode engine's KV of turn 1 moves back once (all but the last
    # sampled token, which nobody computed yet), then only the new tokens are prefilled.
    moved = await decode.export_kv(100)
    assert list(moved.token_ids) == got1[:-1]
    computed = prefill.stats().prefill_tokens_computed
    await prefill.import_kv(11, moved, 10, parent_len=len(turn1))
    await prefill.fill(11, got1[-1:] + turn2)
    assert prefill.stats().prefill_tokens_computed - computed == 1 + len(turn2)
    got2, lease2 = await _split_turn_continue(prefill, decode, 11, 101, 12)
    assert got2 == ref2

    for cid in (100, 101):
        await decode.free_context(cid)
    await prefill.release_kv(lease)
    await prefill.release_kv(lease2)
    for cid in (1, 2, 10, 11):
        await prefill.free_context(cid)
    assert decode.stats().blocks_used == 0 and prefill.stats().blocks_used == 0


async def _split_turn_continue(
    prefill: LLMEngine, decode: LLMEngine, holder: int, reader: int, max_tokens: int
) -> tuple[list[int], object]:
    first = (await prefill.generate(holder, _first())).token_ids
    lease = await prefill.lease_kv(holder, prefill.context_length(holder) - 1)
    await decode.fill(reader, first, remote=RemotePrefix(prefill.kv_source, lease))
    rest = (await decode.generate(reader, _first(max_tokens - 1))).token_ids
    return first + rest, lease


class _Recorded:
    """A `KVSource` that notes when its queries go out and when their answer is taken."""

    def __init__(self, inner: Any, events: list[str]) -> None:
        self.inner, self.events, self.name = inner, events, inner.name

    def start_attention(self, *args: Any) -> Any:
        self.events.append("sent")
        pending = self.inner.start_attention(*args)
        events = self.events

        class Answer:
            def result(self) -> Any:
                events.append("answered")
                return pending.result()

        return Answer()


async def test_the_local_partial_is_computed_while_the_remote_one_is_under_way(
    pair: tuple[LLMEngine, LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefill, decode = pair
    (prompt,) = prompts(1, seed=12, low=20, high=40)
    await prefill.fill(30, prompt)
    reference = (await prefill.generate(30, _first(4))).token_ids
    events: list[str] = []
    partial = torch_path.paged_decode_partial

    def noted(*args: Any) -> Any:
        events.append("partial")
        return partial(*args)

    monkeypatch.setattr(torch_path, "paged_decode_partial", noted)
    await prefill.fill(31, prompt)
    first = (await prefill.generate(31, _first())).token_ids
    lease = await prefill.lease_kv(31, len(prompt))
    await decode.fill(300, first, remote=RemotePrefix(_Recorded(prefill.kv_source, events), lease))
    rest = (await decode.generate(300, _first(3))).token_ids
    assert first + rest == reference
    # Per layer of each step: the queries out, the decode side's own partial, then the holder's answer
    # (whose partial, in this process, runs when it is taken).
    layers = [events[i : i + 4] for i in range(0, len(events), 4)]
    assert layers and all(x == ["sent", "partial", "answered", "partial"] for x in layers), events
    await decode.free_context(300)
    await prefill.release_kv(lease)
    for cid in (30, 31):
        await prefill.free_context(cid)


async def test_splitwise_style_transfer_equals_one_engine(pair: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = pair
    (prompt,) = prompts(1, seed=12, low=30, high=50)
    await prefill.fill(1, prompt)
    ref = (await prefill.generate(1, GREEDY)).token_ids
    await prefill.fill(2, prompt)
    first = (await prefill.generate(2, _first())).token_ids
    blob = await prefill.export_kv(2, 0, len(prompt))
    assert blob.nbytes == 2 * len(prompt) * _kv_bytes_per_token_per_side(prefill)
    before = decode.stats().prefill_tokens_computed
    await decode.import_kv(20, blob)
    await decode.fill(20, first)
    rest = (await decode.generate(20, _first(11))).token_ids
    assert first + rest == ref
    assert decode.stats().prefill_tokens_computed - before == 1  # the first token's KV only
    assert decode.stats().kv_bytes_moved >= blob.nbytes
    for e, cid in ((prefill, 1), (prefill, 2), (decode, 20)):
        await e.free_context(cid)


def _kv_bytes_per_token_per_side(engine: LLMEngine) -> int:
    cfg = engine.model_config
    return cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4


async def test_a_recomputed_remote_context_attends_its_prefix_in_a_mixed_batch(
    pair: tuple[LLMEngine, LLMEngine],
) -> None:
    """A fill of several tokens after a remote prefix (what preemption recomputes) runs as one row per
    token beside local decodes and local fills in the same steps, and continues exactly."""
    prefill, decode = pair
    prompt, other, third = prompts(3, seed=13, low=20, high=40)
    await prefill.fill(1, prompt)
    ref = (await prefill.generate(1, GREEDY)).token_ids
    await prefill.fill(2, prompt)
    lease = await prefill.lease_kv(2)
    await decode.fill(30, other)
    local_ref = (await decode.generate(30, GREEDY)).token_ids
    await decode.free_context(30)
    remote = RemotePrefix(prefill.kv_source, lease)

    async def remote_turn() -> list[int]:
        await decode.fill(31, ref[:5], remote=remote)
        return (await decode.generate(31, _first(7))).token_ids

    async def local_turn() -> list[int]:
        await decode.fill(32, other)
        return (await decode.generate(32, GREEDY)).token_ids

    async def local_fill() -> int:
        return await decode.fill(33, third)

    got, local, _ = await asyncio.gather(remote_turn(), local_turn(), local_fill())
    assert ref[:5] + got == ref
    assert local == local_ref
    for cid in (31, 32, 33):
        await decode.free_context(cid)
    await prefill.release_kv(lease)
    for cid in (1, 2):
        await prefill.free_context(cid)


async def test_a_lease_pins_its_blocks_until_released(pair: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, _ = pair
    (prompt,) = prompts(1, seed=14, low=40, high=41)  # 40 tokens: 3 blocks of 16, the last partial
    await prefill.fill(5, prompt)
    assert prefill.stats().blocks_used == 3
    lease = await prefill.lease_kv(5)
    assert lease.num_tokens == 40 and len(lease.blocks) == 3 and prefill.stats().kv_leases == 1
    # Extending the context copies the leased partial block instead of writing into it.
    await prefill.fill(5, [9, 10])
    assert prefill.stats().blocks_used == 4
    await prefill.free_context(5)
    assert prefill.stats().blocks_used == 3  # the lease still holds its blocks
    await prefill.release_kv(lease)
    assert prefill.stats().blocks_used == 0 and prefill.stats().kv_leases == 0
    with pytest.raises(InvalidRequestError, match="not held here"):
        await prefill.release_kv(lease)


async def test_bad_exchanges_get_typed_errors(pair: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = pair
    await prefill.fill(6, [5, 6, 7])
    with pytest.raises(InvalidRequestError, match=r"covers 1\.\.3"):
        await prefill.lease_kv(6, 4)
    lease = await prefill.lease_kv(6)
    remote = RemotePrefix(prefill.kv_source, lease)
    await decode.fill(60, [8], remote=remote)
    with pytest.raises(InvalidRequestError, match="already exists"):
        await decode.fill(60, [9], remote=remote)
    with pytest.raises(InvalidRequestError, match="neither forked nor forked from"):
        await decode.fill(61, [9], 60)
    with pytest.raises(InvalidRequestError, match="only a context whose KV is all here"):
        await decode.lease_kv(60)
    with pytest.raises(InvalidRequestError, match="not within"):
        await prefill.export_kv(6, 0, 9)
    wrong = KVBlob((1, 2), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(InvalidRequestError, match="this engine's model needs"):
        await decode.import_kv(62, wrong)
    assert 62 not in decode.core.contexts
    stream = prefill.submit_generate(6, _first(3))
    with pytest.raises(ContextBusyError):
        await prefill.lease_kv(6)
    await stream.result()
    await decode.free_context(60)
    await prefill.release_kv(lease)
    await prefill.free_context(6)


async def test_a_lost_kv_holder_fails_only_its_requests(gqa_model: Path) -> None:
    cfg = EngineConfig(dtype="float32", num_kv_blocks=64)
    holder, decode = LLMEngine.from_pretrained(gqa_model, cfg), LLMEngine.from_pretrained(gqa_model, cfg)
    try:
        prompt, other = prompts(2, seed=15, low=10, high=20)
        await decode.fill(1, other)
        ref = (await decode.generate(1, GREEDY)).token_ids
        await holder.fill(1, prompt)
        lease = await holder.lease_kv(1)
        await decode.fill(2, [7], remote=RemotePrefix(holder.kv_source, lease))
        holder.shutdown()
        doomed = decode.submit_generate(2, _first(50))
        await decode.fill(3, other)
        survivor = decode.submit_generate(3, GREEDY)
        with pytest.raises(KVSourceLostError, match="stopped"):
            await doomed.result()
        assert (await survivor.result()).token_ids == ref
        await decode.free_context(2)  # the failed context's local blocks come back like any other
        await decode.free_context(1)
        await decode.free_context(3)
        assert decode.stats().blocks_used == 0
    finally:
        holder.shutdown()
        decode.shutdown()


def test_exchange_bytes_counts_queries_out_and_partials_back() -> None:
    # 2 rows, 4 heads of 16 in float32, 3-block tables: (2*4*16*4 + 2*4*4) out, 2*4*17*4 back.
    assert exchange_bytes(2, 4, 16, torch.float32, 3) == 512 + 32 + 544


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_attention_parallelism_across_two_processes_over_gloo(gqa_model: Path) -> None:
    """The holder and the decoder are ranks of one gloo process group: same tokens as one engine."""
    (prompt,) = prompts(1, seed=16, low=30, high=50)
    reference = LLMEngine.from_pretrained(gqa_model, dist_workers.CONFIG)
    try:

        async def colocated() -> list[int]:
            await reference.fill(1, prompt)
            return (await reference.generate(1, GREEDY)).token_ids

        expected = asyncio.run(colocated())
    finally:
        reference.shutdown()
    ctx = multiprocessing.get_context("spawn")
    handoff, done, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=dist_workers.holder, args=(port, str(gqa_model), prompt, handoff, done)),
        ctx.Process(target=dist_workers.decoder, args=(port, str(gqa_model), 12, handoff, results)),
    ]
    for p in procs:
        p.start()
    try:
        tokens, exchanged = results.get(timeout=300)
        done.put(True)
        calls = handoff.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert tokens == expected
    # One exchange per layer (the test model has 2) per decoder step that runs the model: the first
    # token's KV, then 10 decodes (the second token is sampled from the first step's hidden state).
    assert calls == 11 * 2
    assert exchanged > 0


def test_engine_roles_are_configured_checked_and_reported(gqa_model: Path) -> None:
    from server.engine.__main__ import engine_config, parse_args

    assert engine_config(parse_args(["--role", "prefill"])).role == "prefill"
    assert engine_config(parse_args([])).role == "both"
    with pytest.raises(ValueError, match="unknown engine role 'prefil'"):
        EngineConfig(role="prefil")  # type: ignore[arg-type]
    with LLMEngine.from_pretrained(gqa_model, EngineConfig(dtype="float32", role="decode")) as engine:
        assert engine.stats().role == "decode"


async def test_the_step_token_budget_can_change_while_serving(gqa_model: Path) -> None:
    with LLMEngine.from_pretrained(gqa_model, EngineConfig(dtype="float32", num_kv_blocks=64)) as engine:
        await engine.set_token_budget(16)
        await engine.fill(1, list(range(7, 107)))  # 100 tokens in chunks of 16: 7 steps
        assert engine.stats().steps == 7
        await engine.set_token_budget(64)
        await engine.fill(1, list(range(7, 107)))  # 2 more steps
        assert engine.stats().steps == 9
        with pytest.raises(InvalidRequestError, match="positive token count"):
            await engine.set_token_budget(0)


async def test_import_continues_the_last_computed_token(pair: tuple[LLMEngine, LLMEngine]) -> None:
    """Imported KV may stand in for a context's pending tokens (a sampled token's), must start with them,
    and may leave tokens pending after it."""
    prefill, _ = pair
    (prompt,) = prompts(1, seed=17, low=20, high=30)
    await prefill.fill(1, prompt)
    ref = (await prefill.generate(1, GREEDY)).token_ids
    await prefill.fill(2, prompt)
    first = (await prefill.generate(2, _first())).token_ids  # pending in context 2
    blob = await prefill.export_kv(1, len(prompt), len(prompt) + 5)  # the KV of ref[:5]
    with pytest.raises(InvalidRequestError, match="must start with them"):
        await prefill.import_kv(2, KVBlob(blob.token_ids[1:], blob.k[:, 1:], blob.v[:, 1:]))
    assert await prefill.import_kv(2, blob, pending=[ref[5]]) == len(prompt) + 6
    computed = prefill.stats().prefill_tokens_computed
    rest = (await prefill.generate(2, _first(6))).token_ids  # computes the pending token first
    assert first + ref[1:6] + rest == ref
    assert prefill.stats().prefill_tokens_computed - computed == 1
    for cid in (1, 2):
        await prefill.free_context(cid)
