"""CUDA-graph decode (`server.engine.cuda_graphs`): buckets, static buffers and padding, checked on CPU with a
graph backend that re-runs the recorded step (the real capture is a ``gpu`` test in test_cuda_engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from server.engine import EngineConfig, LLMEngine, cuda_graphs
from tests.engine.conftest import prompts, run_prompt


class ReplayingBackend:
    """Records a step by running it, and replays it by running it again (what a graph does, minus speed)."""

    def __init__(self) -> None:
        self.captured = 0

    def capture(self, step: Callable[[], None]) -> Callable[[], None]:
        step()
        self.captured += 1
        return step

    def replay(self, graph: Callable[[], None]) -> None:
        graph()


def test_batch_sizes_and_buckets() -> None:
    assert cuda_graphs.graph_batch_sizes(1) == [1]
    assert cuda_graphs.graph_batch_sizes(6) == [1, 2, 4, 6]
    assert cuda_graphs.graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert cuda_graphs.graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert cuda_graphs.graph_batch_sizes(0) == []
    sizes = cuda_graphs.graph_batch_sizes(40)
    assert [cuda_graphs.bucket_for(n, sizes) for n in (1, 3, 5, 9, 17, 33, 40, 41)] == [
        1, 4, 8, 16, 32, 40, 40, None,
    ]  # fmt: skip


def test_eager_unless_on_a_gpu() -> None:
    assert cuda_graphs.graph_backend(EngineConfig(device="cpu")) is None
    assert cuda_graphs.graph_backend(EngineConfig(device="cuda", cuda_graphs=False)) is None
    assert isinstance(cuda_graphs.graph_backend(EngineConfig(device="cuda")), cuda_graphs.CudaGraphBackend)


def _engine(path: Path, backend: object | None, **overrides: object) -> LLMEngine:
    config = EngineConfig(**{"device": "cpu", "dtype": "float32", "num_kv_blocks": 128, "max_num_seqs": 6,
                             **overrides})  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cuda_graphs, "graph_backend", lambda _config: backend)
        return LLMEngine.from_pretrained(path, config)


async def test_replayed_decode_equals_eager(gqa_model: Path) -> None:
    batch = prompts(5, seed=31, low=2, high=70)  # 5 rows: bucket 6, one padding row
    backend = ReplayingBackend()
    with _engine(gqa_model, backend) as graphed:
        ours = await asyncio.gather(*(run_prompt(graphed, p) for p in batch))
        single = await run_prompt(graphed, batch[0])  # bucket 1
        runner = graphed.core.runner
        assert runner.graphs is not None and runner.graphs.replays > 0
        assert graphed.stats().blocks_used == 0  # padding never took a block
    sizes = cuda_graphs.graph_batch_sizes(6)
    assert backend.captured == len(sizes) + len([s for s in sizes if s >= 2])  # plain, and grouped from 2
    with _engine(gqa_model, None) as eager:
        assert eager.core.runner.graphs is None
        expected = await asyncio.gather(*(run_prompt(eager, p) for p in batch))
    assert ours == expected and single == expected[0]


async def _forks(
    engine: LLMEngine, prefixes: list[list[int]], suffixes: list[list[int]], lone: list[int] | None = None
) -> list[list[int]]:
    """Each suffix forks one of ``prefixes`` (round robin); ``lone`` shares nothing. Greedy tokens of all."""
    for i, p in enumerate(prefixes):
        await engine.fill(100 + i, p)
    fills = [engine.fill(i + 1, s, parent_context_id=100 + i % len(prefixes)) for i, s in enumerate(suffixes)]
    ids = list(range(1, len(suffixes) + 1))
    if lone is not None:
        fills.append(engine.fill(50, lone))
        ids.append(50)
    await asyncio.gather(*fills)
    return list(await asyncio.gather(*(run_generate(engine, i) for i in ids)))


@pytest.mark.parametrize("groups,members", [(1, 3), (2, 5)])  # 3 rows: bucket 4, one padding row
async def test_grouped_steps_replay_their_own_graphs_and_agree(
    gqa_model: Path, groups: int, members: int
) -> None:
    prefixes = prompts(groups, seed=32, low=40, high=41)
    suffixes = prompts(members, seed=33, low=1, high=9)
    lone = prompts(1, seed=34, low=30, high=31)[0]  # a row outside every group

    async def run(backend: object | None, mode: str) -> tuple[list[list[int]], int, int]:
        with _engine(gqa_model, backend, shared_prefix_decode=mode) as eng:
            out = await _forks(eng, prefixes, suffixes, lone)
            graphs = eng.core.runner.graphs
            return out, eng.stats().grouped_decode_steps, graphs.grouped_replays if graphs else 0

    graphed, grouped_steps, grouped_replays = await run(ReplayingBackend(), "always")
    assert grouped_steps > 0 and grouped_replays == grouped_steps  # every grouped step replayed a graph
    eager, eager_grouped, _ = await run(None, "always")
    plain, none, _ = await run(ReplayingBackend(), "never")
    assert eager_grouped > 0 and none == 0
    assert graphed == eager == plain


async def test_more_groups_than_a_graph_holds_run_eagerly(
    gqa_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPH_GROUPS", 1)
    prefixes = prompts(2, seed=35, low=40, high=41)
    suffixes = prompts(4, seed=36, low=1, high=9)
    with _engine(gqa_model, ReplayingBackend(), shared_prefix_decode="always") as eng:
        out = await _forks(eng, prefixes, suffixes)
        graphs = eng.core.runner.graphs
        assert graphs is not None and graphs.max_groups == 1
        assert eng.stats().grouped_decode_steps > 0 and graphs.grouped_replays == 0
    with _engine(gqa_model, None, shared_prefix_decode="never") as eager:
        assert out == await _forks(eager, prefixes, suffixes)


def test_failed_grouped_capture_keeps_the_plain_graphs(
    gqa_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain = len(cuda_graphs.graph_batch_sizes(6))

    class FailsGrouped(ReplayingBackend):
        def capture(self, step: Callable[[], None]) -> Callable[[], None]:
            if self.captured >= plain:
                raise RuntimeError("capture not supported")
            return super().capture(step)

    with _engine(gqa_model, FailsGrouped()) as engine:
        graphs = engine.core.runner.graphs
        assert graphs is not None and not graphs.has_grouped
    assert "grouped steps failed" in caplog.text
    with _engine(gqa_model, FailsGrouped(), shared_prefix_decode="never") as engine:  # none asked
        assert engine.core.runner.graphs is not None and not engine.core.runner.graphs.has_grouped


async def run_generate(engine: LLMEngine, cid: int) -> list[int]:
    from tests.engine.conftest import GREEDY

    return (await engine.generate(cid, GREEDY)).token_ids


def test_failed_capture_falls_back_to_eager(gqa_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken(ReplayingBackend):
        def capture(self, step: Callable[[], None]) -> Callable[[], None]:
            raise RuntimeError("capture not supported")

    with _engine(gqa_model, Broken()) as engine:
        assert engine.core.runner.graphs is None
    assert "CUDA graph capture failed" in caplog.text


def test_engine_flags_as_vllm_names_them() -> None:
    from server.engine.__main__ import engine_config, parse_args

    config = engine_config(parse_args(["--gpu-memory-utilization", "0.4", "--enforce-eager"]))
    assert config.gpu_memory_utilization == 0.4 and not config.cuda_graphs
    assert engine_config(parse_args([])).cuda_graphs
    with pytest.raises(SystemExit):
        parse_args(["--gpu-memory-utilization", "1.5"])
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=0.0)


def test_gpu_kv_budget_is_this_engines_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """KV = utilization x total - weights - activations, never more than is free; a clear error if none."""
    import torch

    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.4)
    assert config.kv_cache_bytes(model_bytes=14 * gib, activation_bytes=2 * gib) == 16 * gib
    # Less free than the share allows (another engine holds the rest): what is free, less 2% slack.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    assert config.kv_cache_bytes(model_bytes=14 * gib) == 10 * gib - 80 * gib // 50
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        EngineConfig(device="cuda", gpu_memory_utilization=0.1).kv_cache_bytes(model_bytes=14 * gib)


async def test_the_mode_switches_while_the_engine_serves(gqa_model: Path) -> None:
    """`set_shared_prefix_decode` takes effect from the next step; an engine started with "never" captured
    no grouped graphs, so its grouped steps then run eagerly, with the same tokens."""
    from server.engine.errors import InvalidRequestError

    prefixes, suffixes = prompts(1, seed=37, low=40, high=41), prompts(3, seed=38, low=1, high=9)
    with _engine(gqa_model, ReplayingBackend(), shared_prefix_decode="never") as eng:
        plain = await _forks(eng, prefixes, suffixes)
        assert eng.stats().grouped_decode_steps == 0
        for cid in (100, 1, 2, 3):  # the same contexts again, from scratch
            await eng.free_context(cid)
        assert await eng.set_shared_prefix_decode("always") == "never"
        grouped = await _forks(eng, prefixes, suffixes)
        graphs = eng.core.runner.graphs
        assert eng.stats().grouped_decode_steps > 0 and graphs is not None and graphs.grouped_replays == 0
        with pytest.raises(InvalidRequestError, match="'auto', 'always' or 'never'"):
            await eng.set_shared_prefix_decode("sometimes")
    assert grouped == plain
