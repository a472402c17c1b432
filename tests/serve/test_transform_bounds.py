"""Output transforms that a hostile client cannot use against the server: specs checked up front, patterns
run by RE2 (linear time, bounded memory), every output bounded, and the process runner that applies them off
the event loop with a time limit."""

from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from collections.abc import Iterator

from parrot.protocol import CallError, TransformSpec
from pydantic import ValidationError

from server.serve.transform_runner import TransformRunner
from server.serve.transforms import (
    DEFAULT_LIMITS,
    TransformError,
    TransformLimitError,
    TransformLimits,
    TransformPatternError,
    apply_transforms,
    validate_transforms,
)
from tests.serve.test_transforms import check_result, run


# ------------------------------------------------------------------------------------- spec validation
@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"type": "eval"}, "Input should be 'strip', 'json'"),
        (
            {"type": "json", "pattern": "x"},
            "'json' does not take option(s) ['pattern'] (it takes: json_schema, key)",
        ),
        ({"type": "strip", "key": "a"}, "transform 'strip' does not take option(s) ['key'] (it takes: none)"),
        ({"type": "csv_list", "findall": True}, "does not take option(s) ['findall']"),
        ({"type": "json", "bogus": 1}, "Extra inputs are not permitted"),
        ({"type": "json", "key": "a..b"}, "key path 'a..b' has an empty segment"),
        ({"type": "regex"}, "transform 'regex' needs a non-empty 'pattern'"),
        ({"type": "regex", "pattern": "(a)", "group": True}, "valid integer"),
    ],
)
def test_bad_specs_are_rejected_up_front(spec: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(says)):
        validate_transforms([spec])
    with pytest.raises(ValidationError):  # before any transform runs on the text
        apply_transforms([{"type": "strip"}, spec], "text")


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"type": "regex", "pattern": "("}, "missing )"),
        ({"type": "regex", "pattern": "(a)(b)"}, "it has 2 groups; choose one with 'group'"),
        ({"type": "regex", "pattern": "(a)", "group": 2}, "group 2 is out of range: it has 1 group(s)"),
        ({"type": "regex", "pattern": "(?P<x>a)", "group": "y"}, "no group named 'y' (named: ['x'])"),
        # What Python's `re` could not bound: 5,000-deep nesting (RecursionError) and a 2 MB alternation
        # (seconds to compile). The spec itself takes them as text; the server refuses them by size.
        ({"type": "regex", "pattern": "(" * 5000 + "a" + ")" * 5000}, "over the 1000-char limit"),
        ({"type": "regex", "pattern": "|".join(["abcdef"] * 300_000)}, "over the 1000-char limit"),
    ],
)
def test_patterns_are_checked_by_the_server_with_re2(spec: dict[str, Any], says: str) -> None:
    assert TransformSpec.model_validate(spec).pattern == spec["pattern"]  # no compile while validating
    with pytest.raises(TransformPatternError, match=re.escape(says)):
        validate_transforms([spec])
    with pytest.raises(TransformPatternError):  # before any transform runs on the text
        apply_transforms([{"type": "strip"}, spec], "text")


def test_spec_models_and_dicts_are_both_accepted() -> None:
    specs = [TransformSpec(type="json", key="a"), {"type": "render"}]
    assert validate_transforms(specs) == [TransformSpec(type="json", key="a"), TransformSpec(type="render")]
    assert apply_transforms(specs, '{"a": [1]}').value == "[1]"
    # The spec round-trips through its JSON wire form.
    spec = TransformSpec(type="regex", pattern=r"(?P<n>\d+)", group="n", findall=True)
    assert TransformSpec.model_validate_json(spec.model_dump_json()) == spec


# ------------------------------------------------------------------------------- bounds: RE2 and limits
# A catastrophic pattern: with Python's `re` it backtracks for ever on a short text without "QQQ".
CATASTROPHIC = "(.*.*)*QQQ"


def test_catastrophic_pattern_is_linear_on_re2() -> None:
    text = "The quick brown fox jumps over the lazy dog again and again " * 4
    with pytest.raises(TransformError, match=re.escape(f"pattern {CATASTROPHIC!r} does not match")):
        run(text, {"type": "regex", "pattern": CATASTROPHIC})
    check_result(run(text + "QQQ", {"type": "regex", "pattern": CATASTROPHIC, "group": 0}), text + "QQQ")


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        (r"(a)\1", r"invalid escape sequence: \1"),  # a backreference
        (r"foo(?=bar)", "invalid perl operator: (?="),  # look-ahead
        (r"(?<!x)y", "invalid perl operator: (?<!"),  # look-behind
        (r"a++", "bad repetition operator: ++"),  # possessive
        (r"end\Z", r"invalid escape sequence: \Z"),  # Python's \Z is RE2's \z
        (r"(?x) a b", "invalid perl operator: (?x"),  # verbose mode
        (r"(?:(?:a{100}){100}){100}", "invalid repetition size"),  # a program over RE2's size bound
    ],
)
def test_patterns_re2_cannot_run_are_refused_up_front(pattern: str, reason: str) -> None:
    spec = {"type": "regex", "pattern": pattern}
    TransformSpec.model_validate(spec)  # valid for Python's re (the client's check) ...
    with pytest.raises(TransformPatternError) as info:  # ... but not what the server runs
        validate_transforms([spec])
    e = info.value
    assert isinstance(e, CallError)  # HTTP 400 at submit
    assert (e.pattern, e.transform_type) == (pattern, "regex")
    assert reason in e.reason and repr(pattern) in str(e) and "RE2" in str(e)
    with pytest.raises(TransformPatternError):  # before any transform runs on the text
        apply_transforms([{"type": "strip"}, spec], "text")


def test_pattern_length_is_bounded() -> None:
    limits = TransformLimits(max_pattern_chars=10)
    assert validate_transforms([{"type": "regex", "pattern": "a" * 10}], limits)
    with pytest.raises(TransformPatternError, match="11 chars is over the 10-char limit on patterns"):
        validate_transforms([{"type": "regex", "pattern": "a" * 11}], limits)
    with pytest.raises(TransformPatternError, match=f"{DEFAULT_LIMITS.max_pattern_chars + 1} chars is over"):
        validate_transforms([{"type": "regex", "pattern": "a" * (DEFAULT_LIMITS.max_pattern_chars + 1)}])


def test_re2_memory_is_bounded() -> None:
    # Twenty alternatives of a thousand repetitions: a program far over a 64 KiB budget.
    big = "(?:" + "|".join(f"{i}a{{1000}}" for i in range(20)) + ")"
    with pytest.raises(TransformPatternError, match="pattern too large"):
        validate_transforms([{"type": "regex", "pattern": big}], TransformLimits(re2_max_mem=1 << 16))


def test_findall_output_is_bounded() -> None:
    limits = TransformLimits(max_output_chars=1000)
    spec = {"type": "regex", "pattern": "x?", "findall": True}  # an (empty) match at every position
    assert len(apply_transforms([spec], "a" * 100, limits).data) == 101
    with pytest.raises(TransformLimitError) as info:
        apply_transforms([spec], "a" * 10_000, limits)
    assert info.value.limit == "output_size" and info.value.transform_type == "regex"
    assert "output_size limit exceeded: findall output is over 1000 chars" in str(info.value)


def test_every_transform_output_is_bounded() -> None:
    limits = TransformLimits(max_output_chars=20)
    assert apply_transforms([{"type": "csv_list"}], "a, b, c", limits).data == ["a", "b", "c"]
    with pytest.raises(TransformLimitError) as info:
        apply_transforms([{"type": "csv_list"}], ", ".join("abcdefgh"), limits)
    assert info.value.limit == "output_size" and info.value.transform_type == "csv_list"
    assert "output of 40 chars is over 20" in str(info.value)
    with pytest.raises(TransformLimitError, match="strip transform failed: output_size limit") as too_big:
        apply_transforms([{"type": "strip"}], "y" * 21, limits)
    assert too_big.value.text is None and too_big.value.error_type == "transform_limit"


def test_limits_must_be_sane() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        TransformLimits(time_s=0)
    with pytest.raises(ValueError, match="at least 64 KiB"):
        TransformLimits(re2_max_mem=1024)


# Unclosed JSON takes the partial-JSON repair path: ~0.5 s for these 2 MB on a fast core (linear in the
# size since langchain-core 1.x; it was quadratic before), far over the 0.05 s limit the test sets.
SLOW_JSON = '{"a": [' + "1," * 1_000_000


@pytest.fixture(scope="module")
def runner() -> Iterator[TransformRunner]:
    r = TransformRunner(workers=1)
    yield r
    r.close()


@pytest.mark.parametrize(
    ("specs", "text"),
    [
        ([{"type": "json", "key": "a.1"}], '```json\n{"a": [1, {"b": "c"}]}\n```'),
        ([{"type": "regex", "pattern": r"(?P<n>\d+)", "group": "n", "findall": True}], "1 22 333"),
        ([{"type": "numbered_list"}, {"type": "render"}], "1. a\n2. b"),
        ([{"type": "strip"}], "  lone \ud800 surrogate and caf\u00e9  "),
        ([], "no transforms"),
    ],
)
def test_runner_gives_what_apply_gives(
    runner: TransformRunner, specs: list[dict[str, Any]], text: str
) -> None:
    assert runner.run(specs, text) == apply_transforms(specs, text)


@pytest.mark.parametrize(
    ("specs", "text", "error"),
    [
        ([{"type": "json"}], "not json", TransformError),
        ([{"type": "regex", "pattern": CATASTROPHIC}], "x" * 24, TransformError),
        ([{"type": "regex", "pattern": r"(a)\1"}], "aa", TransformPatternError),
        # Over the output limit (made small, so that a loaded machine cannot hit the time limit first).
        ([{"type": "regex", "pattern": "x?", "findall": True}], "a" * 4_000, TransformLimitError),
    ],
)
def test_runner_raises_what_apply_raises(
    runner: TransformRunner, specs: list[dict[str, Any]], text: str, error: type[Exception]
) -> None:
    limits = TransformLimits(max_output_chars=1_000)
    with pytest.raises(error) as expected:
        apply_transforms(specs, text, limits)
    with pytest.raises(error) as got:
        runner.run(specs, text, limits)
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)
    assert got.value.text == expected.value.text  # type: ignore[attr-defined]


@pytest.mark.parametrize("transform", ["json", "xml"])
def test_runner_brings_back_the_whole_refused_text(runner: TransformRunner, transform: str) -> None:
    # Longer than the message quotes, with what the pipe's JSON must carry intact (a lone surrogate, a
    # newline, non-ASCII), and garbage to the parser.
    text = "<<not {json} nor xml>> caf\u00e9 \ud800\n" * 20
    with pytest.raises(TransformError) as info:
        runner.run([{"type": transform}], text)
    assert info.value.text == text and len(text) > 200 and "... (" in str(info.value)
    assert info.value.error_type == "transform_failed"


def test_runner_stops_a_runaway_transform_and_keeps_serving(runner: TransformRunner) -> None:
    killed = runner.killed
    limits = TransformLimits(time_s=0.05, max_output_chars=len(SLOW_JSON))
    with pytest.raises(TransformLimitError) as info:
        runner.run([{"type": "strip"}, {"type": "json"}], SLOW_JSON, limits)
    e = info.value
    assert (e.limit, e.transform_type) == ("time", "json")  # it names the transform that ran over
    assert (
        str(e)
        == "json transform failed: time limit exceeded: still running after 0.05 s; stopped (worker killed)"
    )
    assert runner.killed == killed + 1
    assert runner.run([{"type": "json", "key": "ok"}], '{"ok": true}').data is True  # a fresh worker


def test_runner_replaces_a_worker_that_died_while_idle(runner: TransformRunner) -> None:
    runner.run([{"type": "strip"}], "x")  # a worker is idle now
    (worker,) = runner._idle
    worker.proc.kill()
    worker.proc.wait()
    assert runner.run([{"type": "strip"}], " y ").value == "y"
    assert runner._idle and runner._idle[0] is not worker


def test_closed_runner_refuses_work() -> None:
    r = TransformRunner(workers=1)
    r.close()
    with pytest.raises(RuntimeError, match="closed"):
        r.run([{"type": "strip"}], "x")
