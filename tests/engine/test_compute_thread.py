"""Where an engine does its torch work: loading on a thread that ends, the KV cache and the runner on the
engine thread (`server.engine.compute_thread`: a second long-lived OpenMP pool slows the engine's)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import server.engine.engine as engine_module
import server.engine.model_runner as runner_module
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.compute_thread import on_own_thread


def test_on_own_thread_runs_on_a_thread_that_has_ended() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert on_own_thread(work) == 42
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_on_own_thread_raises_what_the_function_raised() -> None:
    def fail() -> None:
        raise ValueError("bad checkpoint")

    with pytest.raises(ValueError, match="bad checkpoint"):
        on_own_thread(fail)


def test_engine_loads_elsewhere_and_builds_on_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: dict[str, threading.Thread] = {}
    load, runner = engine_module.load_checkpoint, runner_module.ModelRunner

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        threads["load"] = threading.current_thread()
        return load(*args, **kwargs)

    def recording_runner(*args: Any, **kwargs: Any) -> Any:
        threads["runner"] = threading.current_thread()
        return runner(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_checkpoint", recording_load)
    monkeypatch.setattr(runner_module, "ModelRunner", recording_runner)
    with LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=64)) as engine:
        assert threads["load"] is not threading.current_thread()
        assert not threads["load"].is_alive()
        assert threads["runner"] is engine._thread  # the thread every step runs on

        async def answer() -> list[int]:
            await engine.fill(1, [5, 6, 7])
            return (await engine.generate(1, SamplingParams(max_tokens=3, ignore_eos=True))).token_ids

        assert len(asyncio.run(answer())) == 3


def test_a_failure_while_building_is_raised_by_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_runner(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("cannot pack the weights")

    monkeypatch.setattr(runner_module, "ModelRunner", broken_runner)
    with pytest.raises(RuntimeError, match="cannot pack the weights"):
        LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=64))
