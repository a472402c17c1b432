"""The GPTs-cluster benchmark's harness in tiny configurations: the rate search, the prefix sharing it
measures (counted exactly in prefill tokens), and the script's RESULT line (harness correctness, not
speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import gpts_cluster as g
from benchmarks.harness.rates import RatePoint
from benchmarks.harness.sim_runs import Work
from benchmarks.workloads.gpts import Workload
from server.sim import tiny_tokenizer

SMALL = g.BenchConfig(duration=5.0, warmup=0.0, max_rate=16.0)


@pytest.fixture(scope="module")
def workload() -> Workload:
    return g.workload_of(SMALL)


def fake_point(policy: str, rate: float, capacity: float) -> RatePoint:
    """A run whose latency is under the bound exactly below ``capacity``."""
    latency = 0.01 if rate <= capacity else 1.0
    return RatePoint(policy, rate, [latency], requests=1, last_arrival_s=0.0, work=Work(1.0, 0.0))


@pytest.mark.parametrize("capacity", [0.3, 3.0, 37.0, 100.0])
def test_the_search_brackets_the_highest_sustained_rate(capacity: float) -> None:
    cfg = g.BenchConfig(start_rate=4.0, bisect_steps=3, max_rate=512.0, min_rate=0.1)
    search = g.find_max_rate("parrot", None, cfg, lambda p, r, w, c: fake_point(p, r, capacity))  # type: ignore[arg-type]
    assert search.best <= capacity < search.first_failed
    assert search.first_failed / search.best <= 2 ** (1 / 2**3) + 1e-9  # three bisections of a doubling
    assert [p.rate for p in search.points] == sorted(p.rate for p in search.points)


def test_a_fixed_rate_is_measured_once() -> None:
    cfg = g.BenchConfig(rate=5.0)
    calls: list[float] = []

    def measure(policy: str, rate: float, w: Workload, c: g.BenchConfig) -> RatePoint:
        calls.append(rate)
        return fake_point(policy, rate, 10.0)

    search = g.find_max_rate("baseline", None, cfg, measure)  # type: ignore[arg-type]
    assert calls == [5.0] and search.best == 5.0 and math.isinf(search.first_failed)


def test_the_workload_is_deterministic_and_scales_with_the_rate(workload: Workload) -> None:
    again = g.workload_of(SMALL)
    assert again == workload
    tokenizer = tiny_tokenizer()
    sizes = [a.system_tokens for a in workload.apps]
    for app, want in zip(workload.apps, SMALL.system_tokens, strict=True):
        assert abs(app.system_tokens - want) <= 0.05 * want  # "about 1k, 3k, 5k, 7k tokens"
        assert app.template.count("{{input:query}}") == 1
    assert sizes == sorted(sizes)
    slow, fast = workload.arrivals(2.0, 5.0), workload.arrivals(4.0, 5.0)
    assert [j for j, _ in slow] == [j for j, _ in fast[: len(slow)]]  # the same requests, in order
    assert fast[0][1] == pytest.approx(slow[0][1] / 2)
    for job, _ in slow[:20]:
        assert 64 <= job.max_tokens <= 128
        assert 20 <= len(tokenizer.encode(job.query, add_special_tokens=False)) <= 66
        # The system prompt's tokens prefix the whole prompt's: one shared prefix per app, whatever the query.
        app = workload.apps[job.app]
        system = app.template[: app.template.index("{{")]
        assert tokenizer.encode(workload.prompt(job))[: app.system_tokens] == tokenizer.encode(system)


def test_sharing_prefills_each_system_prompt_at_most_once_per_engine(workload: Workload) -> None:
    """Exact prefill-token accounting: the baseline computes every prompt in full; Parrot computes each
    app's system prompt at most once per engine, plus each request's own suffix."""
    rate = 8.0
    tokenizer = tiny_tokenizer()
    arrivals = workload.arrivals(rate, SMALL.duration)
    prompts = [len(tokenizer.encode(workload.prompt(job))) for job, _ in arrivals]
    per_app = [sum(job.app == a for job, _ in arrivals) for a in range(len(workload.apps))]
    assert min(per_app) > SMALL.engines  # more requests per app than engines: sharing must show

    base = g.run_point(g.BASELINE, rate, workload, SMALL)
    parrot = g.run_point(g.PARROT, rate, workload, SMALL)
    for point in (base, parrot):
        assert point.failures == 0 and len(point.norm_latency) == len(arrivals)
        assert all(s["preemptions"] == 0 for s in point.work.engines)

    base_prefill = sum(s["prefill_tokens_computed"] for s in base.work.engines)
    assert base_prefill == sum(prompts)

    parrot_prefill = sum(s["prefill_tokens_computed"] for s in parrot.work.engines)
    suffixes = sum(
        n - workload.apps[job.app].system_tokens for (job, _), n in zip(arrivals, prompts, strict=True)
    )
    systems = sum(
        min(SMALL.engines, k) * a.system_tokens for k, a in zip(per_app, workload.apps, strict=True)
    )
    assert parrot_prefill <= suffixes + systems
    assert parrot_prefill < base_prefill / 2
    assert (
        sum(n for key, n in parrot.work.placements.items() if key.endswith("/context")) > 0
    )  # affinity placed some


def test_tiny_run_ends_with_the_result_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "gpts.json"
    g.main(["--rate", "4", "--duration", "2.5", "--warmup", "0", "--many-apps", "8", "--json", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("RESULT gpts_cluster ")
    metrics = dict(item.split("=", 1) for item in lines[-1].split()[2:])
    assert list(metrics) == [
        "parrot_rate",
        "baseline_rate",
        "no_affinity_rate",
        "no_kernel_rate",
        "capped_baseline_rate",
        "parrot_rate_many_apps",
        "no_affinity_rate_many_apps",
        "speedup_vs_baseline",
        "speedup_vs_no_affinity",
        "speedup_vs_no_kernel",
        "speedup_vs_capped_baseline",
        "speedup_vs_no_affinity_many_apps",
        "total_s",
    ]
    assert float(metrics["parrot_rate"]) == 4.0  # far below what Parrot sustains
    payload = json.loads(out.read_text())
    assert set(payload["policies"]) == set(g.POLICIES)
    assert set(payload["many_apps"]) == {g.PARROT, g.NO_AFFINITY}  # the affinity ablation at scale
    for policy in [*payload["policies"].values(), *payload["many_apps"].values()]:
        (only,) = policy["runs"]
        assert only["rate"] == 4.0 and only["failures"] == 0 and only["measured"] == only["requests"] > 0


def test_an_empty_table_renders_its_header() -> None:
    # A run where no policy sustained any rate has no rows: the report still prints (it crashed here).
    from benchmarks.harness.output import markdown_table

    table = markdown_table(["policy", "rate"], [], [False, True])
    assert table.splitlines()[0] == "| policy | rate |"


def test_apps_cycle_through_the_paper_sizes_and_policies_are_checked() -> None:
    assert g.app_sizes(6) == (1000, 3000, 5000, 7000, 1000, 3000)
    with pytest.raises(SystemExit, match="at least 1"):
        g.app_sizes(0)
    with pytest.raises(SystemExit, match="unknown policies"):
        g.main(["--tiny", "--policies", "parrot,vllm"])
