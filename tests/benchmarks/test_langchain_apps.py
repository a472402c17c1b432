"""The LangChain apps benchmark (paper Fig. 11, 14) in a tiny configuration: both clients write the same
answers, Parrot's compiled chains take the same few requests however many calls the app makes, and the
script ends with its RESULT line (harness correctness, not speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import langchain_apps as lc
from tests.benchmarks.test_frameworks import tiny_run


def test_tiny_run_checks_answers_and_ends_with_the_result_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    metrics, payload = tiny_run(lc.main, "langchain_apps", lc.APPS, capsys, tmp_path)
    assert list(metrics) == [
        "map_reduce_speedup",
        "chain_summary_speedup",
        "map_reduce_speedup_nodelay",
        "chain_summary_speedup_nodelay",
        "map_reduce_parrot_s",
        "map_reduce_langchain_s",
        "chain_summary_parrot_s",
        "chain_summary_langchain_s",
        "total_s",
    ]
    assert payload["outputs_identical"] is True
    cfg = lc.TINY
    for setting in payload["settings"]:
        clients = setting["clients"]
        assert set(clients) == set(lc.CLIENTS) and set(setting["speedup"]) == {lc.LANGCHAIN}
        # LangChain: one request per call (the map calls and the combine; one per refine step). Parrot:
        # one submission (opening its session), the answer read with it, whatever the app's size.
        calls = cfg.map_chunks + 1 if setting["app"] == "map_reduce" else cfg.chain_steps
        assert clients[lc.LANGCHAIN]["requests"] == calls
        assert clients[lc.PARROT]["requests"] == 1
        assert all(len(c["seconds"]) == cfg.repeats for c in clients.values())


def test_the_map_reduce_chain_maps_each_chunk_then_combines() -> None:
    from langchain_core.language_models.fake import FakeListLLM

    chain = lc.map_reduce_chain(FakeListLLM(responses=["one", "two"]), FakeListLLM(responses=["all"]))
    assert chain.invoke(["a", "b"]) == "all"
    chunks = lc.make_chunks(3, 5)
    assert len(chunks) == 3 and all(len(c.split()) == 5 for c in chunks) and len(set(chunks)) == 3
