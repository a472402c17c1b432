"""The dependent-chain benchmark (paper Fig. 11) in a tiny configuration: the three clients write the same
summaries step by step, Parrot's requests do not grow with the chain, and the script ends with its RESULT
line (harness correctness, not speed)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks import chain_dependent as cd
from benchmarks.experiments import by_name
from benchmarks.harness import app_jobs, measure, systems
from benchmarks.workloads import summary_chain
from benchmarks.workloads.text import document_chunks


def test_every_client_writes_the_same_summaries_and_a_difference_stops_the_run() -> None:
    baseline, parrot = cd.CLIENTS[cd.BASELINE], cd.CLIENTS[cd.PARROT]

    async def check(served: systems.Served) -> None:
        chunks = document_chunks(served.tokenizer, 3, 8)
        async with systems.connected({cd.SERVER: served}):
            outputs = await app_jobs.verify_summary_chain(served, chunks, 2)
            assert len(outputs) == 3 and all(outputs)
            # Chains over different documents cannot agree: `verify`'s check stops rather than time them.
            jobs = {
                "a": lambda: measure.timed(served, app_jobs.summary_chain(served, baseline, chunks[:2], 2)),
                "b": lambda: measure.timed(served, app_jobs.summary_chain(served, parrot, chunks[1:], 2)),
            }
            with pytest.raises(SystemExit, match="outputs differ"):
                await measure.agree(jobs)
        # The baseline renders each step from the previous summary: the text before Parrot's output.
        prompt = summary_chain.render_prompt(outputs[0], chunks[1])
        assert prompt.startswith(summary_chain.TEMPLATE.split("{{")[0]) and outputs[0] in prompt
        assert prompt.endswith(f"{chunks[1]}\nUpdated summary of the document so far: ")

    with systems.serve("tiny", [systems.baseline(cd.SERVER)], delay=None) as servers:
        asyncio.run(check(servers[cd.SERVER]))


def test_tiny_run_checks_outputs_and_ends_with_the_result_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "chain_dependent.json"
    cd.main([*by_name("chain_dependent").tiny_args, "--steps", "3", "--json", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("RESULT chain_dependent ")
    metrics = dict(item.split("=", 1) for item in last.split()[2:])
    assert list(metrics) == [
        "speedup_delay",
        "speedup_nodelay",
        "parrot_s",
        "baseline_s",
        "parrot_nodelay_s",
        "baseline_nodelay_s",
        "speedup_delay_submit_criteria",
        "speedup_nodelay_submit_criteria",
        "total_s",
    ]
    assert all(float(v) > 0 for v in metrics.values())

    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "chain_dependent" and payload["outputs_identical"] is True
    assert payload["config"]["steps"] == 3 and len(payload["prompt_tokens_per_step"]) == 3
    assert [s["network_delay"] for s in payload["settings"]] == [False, True]
    for setting in payload["settings"]:
        clients = setting["clients"]
        assert set(clients) == set(cd.CLIENTS)
        assert set(setting["speedup"]) == {cd.PARROT, cd.PARROT_SUBMIT}
        # The baseline sends one request per step; Parrot one batch (which opens its session), however
        # long the chain.
        assert clients[cd.BASELINE]["requests"] == 3
        assert clients[cd.PARROT]["requests"] == clients[cd.PARROT_SUBMIT]["requests"] == 1
        # Each timed chain starts from no KV an earlier one kept: Parrot prefills at least the first step's
        # whole prompt (a cache hit from the warm-up would leave a token or two per step).
        for name in (cd.PARROT, cd.PARROT_SUBMIT):
            for run in clients[name]["engine"]:
                assert run["prefill_tokens_computed"] >= payload["prompt_tokens_per_step"][0], name
