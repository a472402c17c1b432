"""Process entry points for the attention-parallelism test over torch.distributed (spawned, so importable)."""

from __future__ import annotations

import asyncio
from multiprocessing.queues import Queue
from typing import Any

import torch.distributed as dist

from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.remote_kv import RemotePrefix
from server.engine.remote_kv_dist import DistKVSource, KVServer

CONFIG = EngineConfig(dtype="float32", num_kv_blocks=64)


def _join(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)


def holder(port: int, model: str, prompt: list[int], to_decoder: Queue[Any], done: Queue[Any]) -> None:
    """Rank 0: prefill the prompt, sample the first token, lease the prompt's KV and serve attention."""
    _join(0, port)
    engine = LLMEngine.from_pretrained(model, CONFIG)
    server = KVServer(engine.kv_source).start()

    async def prefill() -> tuple[list[int], object]:
        await engine.fill(1, prompt)
        first = (await engine.generate(1, SamplingParams(max_tokens=1, ignore_eos=True))).token_ids
        return first, await engine.lease_kv(1, len(prompt))

    to_decoder.put(asyncio.run(prefill()))
    done.get(timeout=300)
    to_decoder.put(server.calls)
    engine.shutdown()


def decoder(port: int, model: str, max_tokens: int, from_holder: Queue[Any], results: Queue[Any]) -> None:
    """Rank 1: decode over the holder's prompt KV; report the tokens and the bytes exchanged."""
    _join(1, port)
    engine = LLMEngine.from_pretrained(model, CONFIG)
    first, lease = from_holder.get(timeout=300)

    async def decode() -> list[int]:
        await engine.fill(100, first, remote=RemotePrefix(DistKVSource(0, "holder"), lease))
        sampling = SamplingParams(max_tokens=max_tokens - 1, ignore_eos=True)
        return first + (await engine.generate(100, sampling)).token_ids

    tokens = asyncio.run(decode())
    results.put((tokens, engine.stats().remote_attention_bytes))
    engine.shutdown()
