"""The shared-prompt benchmark's harness in a tiny configuration: the copilot workload is deterministic and as
long as asked, KV blocks are counted exactly, the script ends with its RESULT line and writes its JSON and
plot (harness correctness, not speed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import shared_prompt
from benchmarks.harness import engine_runs
from benchmarks.workloads import copilot
from server.engine.step_features import StepFeatures, StepRecord

BLOCK = 16
TINY = shared_prompt.TINY
SYSTEM_TOKENS, MAX_TOKENS, BATCHES = TINY.system_tokens, TINY.max_tokens, TINY.batches
TINY_ARGV = ["--tiny"]
# The same configuration spelled out with the size flags (what a reader can vary).
EXPLICIT_ARGV = [
    *["--system-tokens", str(SYSTEM_TOKENS), "--batches", *map(str, BATCHES), "--repeats", "1"],
    *[
        "--max-tokens",
        str(MAX_TOKENS),
        "--query-tokens",
        str(TINY.min_query_tokens),
        str(TINY.max_query_tokens),
    ],
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tok, _ = shared_prompt.model_facts("tiny")
    return tok


def test_the_workload_is_deterministic_from_the_seed_and_as_long_as_asked(tokenizer: Any) -> None:
    a = copilot.make_workload(tokenizer, 300, num_queries=6, seed=3)
    assert a == copilot.make_workload(tokenizer, 300, num_queries=6, seed=3)
    other = copilot.make_workload(tokenizer, 300, num_queries=6, seed=4)
    assert other.system_prompt != a.system_prompt and other.queries != a.queries

    assert len(copilot.text_tokens(tokenizer, a.system_prompt)) == 300
    assert a.system_prompt.startswith(copilot.PREAMBLE)
    assert len(set(a.queries)) == 6
    assert all(20 <= len(copilot.text_tokens(tokenizer, q)) <= 60 for q in a.queries)
    # The template is the system prompt, then the query and the answer; the client renders the same text.
    assert a.template.endswith("\n\nUser: {{input:query}}\nCopilot: {{output:answer}}")
    prompt = a.prompts(1)[0]
    assert prompt == a.system_prompt + "\n\nUser: " + a.queries[0] + "\nCopilot: "


def test_the_default_system_prompt_is_6k_tokens_and_the_benchmark_clips_it_to_the_window(
    tokenizer: Any,
) -> None:
    full = copilot.system_prompt(tokenizer)
    assert len(copilot.text_tokens(tokenizer, full)) == copilot.DEFAULT_SYSTEM_PROMPT_TOKENS == 6000
    cfg = shared_prompt.FULL
    used = shared_prompt.fit_system_tokens(cfg, 4096)
    assert used < 6000
    workload = copilot.make_workload(tokenizer, used, num_queries=4, max_query_tokens=cfg.max_query_tokens)
    longest = max(len(tokenizer.encode(p)) for p in workload.prompts(4))
    assert longest + cfg.max_tokens < 4096
    assert shared_prompt.fit_system_tokens(cfg, 100_000) == 6000  # a big window: as asked


def test_tiny_is_the_explicit_small_configuration() -> None:
    def config(argv: list[str]) -> shared_prompt.BenchConfig:
        return shared_prompt.arguments(argv)[1]

    assert config(TINY_ARGV) == TINY
    assert config(EXPLICIT_ARGV) == TINY
    assert config(["--quick", "--batches", "8", "4"]).batches == (4, 8)
    assert config(["--kernel-mode", "always"]).kernel_mode == "always"


def test_tpot_weights_each_step_by_its_decodes() -> None:
    trace = [
        StepRecord(StepFeatures(prefill_tokens=100, decode_seqs=0), 1.0),  # no output token waited on it
        StepRecord(StepFeatures(prefill_tokens=50, decode_seqs=1), 0.5),
        StepRecord(StepFeatures(decode_seqs=3), 0.1),
    ]
    assert engine_runs.tpot(trace) == pytest.approx((0.5 + 3 * 0.1) / 4)
    assert engine_runs.tpot(trace, pure=True) == pytest.approx(0.1)
    assert math.isnan(engine_runs.tpot([]))


def expected_peaks(tokenizer: Any, batch: int) -> tuple[int, list[int]]:
    """Blocks of the tiny run's batch, derived here from the tokens: Parrot's, and each no-sharing
    request's whole context."""
    workload = copilot.make_workload(
        tokenizer, SYSTEM_TOKENS, max(BATCHES), TINY.seed, TINY.min_query_tokens, TINY.max_query_tokens
    )
    prompts = [tokenizer.encode(p) for p in workload.prompts(batch)]
    # The manager's shared prefix: BOS + the system prompt + "\n\nUser: ", as far as every prompt agrees.
    constant = tokenizer.encode(workload.system_prompt + "\n\nUser: ")
    prefix = next(n for n in range(len(constant), 0, -1) if all(p[:n] == constant[:n] for p in prompts))
    # After generating G tokens a context has KV for its prompt and G - 1 of them.
    cached = [len(p) + MAX_TOKENS - 1 for p in prompts]
    ceil = lambda n: -(-n // BLOCK)  # noqa: E731
    # Parrot: the prefix's blocks once; each fork shares the prefix's full blocks and owns the rest (its
    # copy of the prefix's partial last block included).
    parrot = ceil(prefix) + sum(ceil(c) - prefix // BLOCK for c in cached)
    return parrot, [ceil(c) for c in cached]


def test_tiny_run_counts_blocks_exactly_ends_with_the_result_line_and_plots(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, tokenizer: Any
) -> None:
    out, png = tmp_path / "shared_prompt.json", tmp_path / "shared_prompt.png"
    shared_prompt.main([*TINY_ARGV, "--json", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith(f"RESULT shared_prompt speedup_b{max(BATCHES)}=")
    for metric in ("kernel_gain_b4=", "kv_saving_b4=", "speedup_b2=", f"system_tokens={SYSTEM_TOKENS}"):
        assert metric in lines[-1]

    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "shared_prompt"
    assert payload["system_prompt_tokens"] == {"asked": SYSTEM_TOKENS, "used": SYSTEM_TOKENS}
    # Checked, not assumed: the warm-up compares the systems' answers and every repeat's with the warm-up's
    # (a difference stops the run before the RESULT line).
    assert payload["outputs_identical"] is True
    assert [b["batch"] for b in payload["batches"]] == list(BATCHES)
    for row in payload["batches"]:
        parrot, contexts = expected_peaks(tokenizer, row["batch"])
        systems = row["systems"]
        assert systems["parrot"]["peak_blocks"] == [parrot]
        assert systems["parrot, no kernel"]["peak_blocks"] == [parrot]
        # Without sharing the peak is the sum of every request's whole context when all are alive at once;
        # on a loaded machine one may finish before the last is admitted, so the sum is a bound.
        (baseline_peak,) = systems["no sharing"]["peak_blocks"]
        assert max(contexts) <= baseline_peak <= sum(contexts)
        assert systems["parrot"]["expected_blocks"] == parrot
        assert systems["no sharing"]["expected_blocks"] == sum(contexts)
        assert systems["no sharing"]["requests"] == row["batch"]  # one completion per user, nothing else
        assert row["ratios"]["kv_saving"] == pytest.approx(baseline_peak / parrot)
        for s in systems.values():
            assert s["latency"]["n"] == 1 and len(s["seconds"]) == 1 and s["latency"]["median"] > 0
            assert s["tpot"]["median"] > 0
        # The no-kernel engine never groups decodes; the baseline has no shared blocks to group.
        assert systems["parrot, no kernel"]["grouped_decode_steps"] == [0]
        assert systems["no sharing"]["grouped_decode_steps"] == [0]

    shared_prompt.plot(payload, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
