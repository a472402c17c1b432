"""The multi-agent benchmark: the workload is a deterministic DAG of the expected shape, and a tiny run of the
harness checks outputs, ends with its RESULT line, writes JSON and draws the figure (harness correctness,
not speed)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from parrot.template import parse_template, placeholder_names

from benchmarks import multi_agent
from benchmarks.workloads.multi_agent import (
    ARCHITECT,
    CODER,
    INTEGRATOR,
    MERGER,
    REVIEWER,
    REVISER,
    make_workflow,
    producers,
    stage_roles,
)

TINY = ["--tiny", "--no-delay-only"]


def test_the_workflow_is_a_deterministic_function_of_the_seed() -> None:
    a = make_workflow("BRIEF", files=4, rounds=3, seed=7)
    assert a == make_workflow("BRIEF", files=4, rounds=3, seed=7)
    other = make_workflow("BRIEF", files=4, rounds=3, seed=8)
    assert other.files != a.files  # the seed draws the file names
    assert len(set(a.files)) == 4 and all(name.endswith(".py") for name in a.files)
    assert len(a.calls) == 1 + 3 * (3 * 4 + 2)


def test_stages_have_the_expected_number_of_calls() -> None:
    wf = make_workflow("BRIEF", files=3, rounds=2, seed=0)
    one_round = [(CODER, 3), (INTEGRATOR, 1), (REVIEWER, 3), (REVISER, 3), (MERGER, 1)]
    assert stage_roles(wf) == [(ARCHITECT, 1), *one_round, *one_round]
    assert [c.output for c in wf.calls] == [out for stage in wf.stages for out in stage]  # topological
    assert wf.final == "changelog_r1" == wf.calls[-1].output


def test_dag_shape_every_prompt_extends_the_pool_and_parallel_stages_feed_their_consumer() -> None:
    wf = make_workflow("BRIEF", files=3, rounds=2, seed=0)
    edges = producers(wf)
    order = {c.output: i for i, c in enumerate(wf.calls)}
    for c in wf.calls:
        pieces = parse_template(c.template)
        assert placeholder_names(pieces, "output") == [c.output]
        assert list(c.inputs) == placeholder_names(pieces, "input")
        assert all(order[p] < order[c.output] for p in edges[c.output])  # inputs come from earlier calls
        assert c.template.startswith("BRIEF")  # the shared pool heads every prompt
    for stage in wf.stages:  # calls of one stage are independent of each other
        assert not any(p in stage for out in stage for p in edges[out])
    # Each parallel stage is a task group: every call of it feeds the next stage's first call.
    for stage, consumer in itertools.pairwise(wf.stages):
        if len(stage) > 1:
            assert set(stage) <= set(edges[consumer[0]])
    # A call's prompt extends the prompt + output of the call that last extended the pool: the architect,
    # the integrator (for reviewers and revisers) and the merger of the previous round (for coders).
    pool_of = {"code_r1_f0": "changelog_r0", "review_r1_f2": "notes_r1", "revised_r0_f1": "notes_r0"}
    for consumer, pool in pool_of.items():
        head = wf.call(pool).template.split("{{output:")[0] + f"{{{{input:{pool}}}}}"
        assert wf.call(consumer).template.startswith(head)


def test_tiny_run_checks_outputs_ends_with_the_result_line_and_plots(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "multi_agent.json"
    multi_agent.main([*TINY, "--json", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("RESULT multi_agent ")
    metrics = dict(item.split("=", 1) for item in lines[-1].split()[2:])
    assert metrics["speedup"] == "nan"  # the delay setting was not measured
    assert float(metrics["speedup_nodelay"]) > 0 and float(metrics["mem_ratio"]) > 0
    assert metrics["files"] == "2"
    # The simulator (GPU profile, virtual time): the same clients and DAG, its figures on the same line.
    for key in ("speedup_sim", "speedup_sim_no_sharing", "speedup_sim_no_deduction"):
        assert float(metrics[key]) > 0
    assert float(metrics["parrot_sim_s"]) > 0 and float(metrics["baseline_sim_s"]) > 0
    assert metrics["files_sim"] == "2" and list(metrics)[-1] == "total_s"
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "multi_agent" and payload["outputs_identical"] is True
    [sim_row] = payload["simulator"]["by_files"]
    assert sim_row["files"] == 2 and set(sim_row["first_jobs"]) == set(multi_agent.CLIENTS)
    # Requests until the answer: Parrot's one batch (opening its session); the baseline's one per call.
    assert sim_row["first_jobs"]["parrot"]["requests"] == 1
    assert sim_row["first_jobs"]["baseline"]["requests"] == sim_row["calls"] == 1 + 1 * (3 * 2 + 2)
    assert payload["simulator"]["profile"]["name"] == payload["config"]["sim"]["profile"]
    [row] = payload["by_files"]
    assert row["files"] == 2 and row["calls"] == 1 + 1 * (3 * 2 + 2)
    [setting] = row["settings"]
    clients = setting["clients"]
    assert set(clients) == set(multi_agent.CLIENTS)
    for name in multi_agent.CLIENTS:
        assert all(math.isfinite(s) and s > 0 for s in clients[name]["seconds"])
        assert row["first_jobs"][name]["peak_blocks"] > 0
    # Parrot: one batch (opening its session); the baseline: one completion per call.
    assert clients["parrot"]["requests"] == 1
    assert clients["baseline"]["requests"] == row["calls"]
    # Sharing: Parrot prefills less than the no-sharing ablation, which prefills what the baseline does.
    cold = {name: row["first_jobs"][name]["engine"] for name in multi_agent.CLIENTS}
    assert cold["parrot"]["prefill_tokens_computed"] < cold["parrot, no sharing"]["prefill_tokens_computed"]
    assert (
        cold["parrot, no sharing"]["prefill_tokens_computed"] == cold["baseline"]["prefill_tokens_computed"]
    )
    # Every timed run starts cold too: a repeat must not find the KV its earlier run kept (it would time a
    # cache hit the baseline cannot get).
    for name in multi_agent.CLIENTS:
        for run in clients[name]["engine"]:
            assert run["prefill_tokens_computed"] == cold[name]["prefill_tokens_computed"], name
    png = tmp_path / "multi_agent.png"
    multi_agent.plot(payload, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
