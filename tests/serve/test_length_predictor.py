"""The output-length predictor (SSJF): learns a synthetic relation, uses per-template priors and similar past
requests, survives a restart through its file, and never fails on odd prompts."""

from __future__ import annotations

import json
import math
import random
import tracemalloc
from pathlib import Path

import pytest

from server.serve.length_neighbours import MAX_FEATURES, SimilarRequests
from server.serve.length_predictor import (
    HASH_BUCKETS,
    TAIL_WORDS,
    LengthPredictor,
    LengthPredictorStateError,
    bucket,
    bucket_accuracy,
    features,
    mae,
)

# The instruction at the end of the prompt decides the answer's length (as in a real chat workload).
KINDS = {"answer in one word": 2, "list ten examples of": 40, "write a detailed explanation of": 300}
TOPICS = [
    "rivers",
    "tides",
    "volcanoes",
    "bridges",
    "compilers",
    "gardens",
    "orbits",
    "bees",
    "glaciers",
    "printing",
]


def _requests(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind, length = rng.choice(list(KINDS.items()))
        filler = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(0, 30)))
        prompt = f"Context: {filler}\n\nUser: {kind} {rng.choice(TOPICS)}.\nAssistant:"
        out.append((prompt, max(1, round(length * rng.uniform(0.8, 1.2)))))
    return out


def _f(prompt: str, template: str | None = None, max_tokens: int = 512, **kw: bool):  # type: ignore[no-untyped-def]
    return features(template, prompt, len(prompt.split()), max_tokens, **kw)


def test_it_learns_the_length_an_instruction_asks_for() -> None:
    p = LengthPredictor()
    for prompt, length in _requests(600, seed=1):
        p.observe(_f(prompt), length)
    test = _requests(200, seed=2)
    pairs = [(p.predict(_f(prompt)), length) for prompt, length in test]
    constant = sorted(t for _, t in test)[len(test) // 2]  # the best constant under L1: the median
    baseline = mae((constant, t) for _, t in test)
    assert bucket_accuracy(pairs) >= 0.9
    assert mae(pairs) < 0.35 * baseline, (mae(pairs), baseline)  # 30 vs 104 tokens here
    assert bucket_accuracy((constant, t) for _, t in test) < 0.5  # the thresholds fail a constant


def test_a_templates_prior_predicts_it_after_a_few_calls() -> None:
    p = LengthPredictor()
    rng = random.Random(3)
    for _ in range(5):  # a function whose answers are ~50 tokens, prompts unlike anything seen
        p.observe(_f(f"Summarize: {rng.random()}", template="summarize"), rng.randint(45, 55))
    guess = p.predict(_f("Summarize: something new", template="summarize"))
    assert 40 <= guess <= 60, guess
    assert p.predict(_f("Summarize: something new", template="other")) != guess or guess == 1


def test_similar_requests_predict_unseen_prompts_after_a_few_examples() -> None:
    """No template (an OpenAI request): after 24 requests the regression alone is still far off, the lengths
    of the most similar earlier requests are not."""
    p = LengthPredictor()
    for prompt, length in _requests(24, seed=7):
        p.observe(_f(prompt), length)
    test = _requests(200, seed=8)
    pairs = [(p.predict(_f(prompt)), length) for prompt, length in test]
    alone = [(math.exp(p._regression(_f(prompt))), length) for prompt, length in test]
    assert bucket_accuracy(pairs) >= 0.8 and bucket_accuracy(alone) < 0.7  # measured 0.835 and 0.63
    assert mae(pairs) < 0.5 * mae(alone)  # 27 vs 90 tokens


def test_similar_requests_keep_a_bounded_index() -> None:
    similar = SimilarRequests(capacity=3, k=2)
    assert similar.estimate([(1, 1.0)]) is None  # nothing kept yet
    rows = [([(1, 1.0), (10 + n, 1.0)], float(n)) for n in range(5)] + [([(2, 1.0), (99, 1.0)], 7.0)]
    for active, y in rows:
        similar.add(active, y)
    assert len(similar) == 3 and similar.estimate([(10, 1.0)]) is None  # the oldest are gone whole
    assert [similar.estimate([(i, 1.0)]) for i in (13, 14, 99)] == pytest.approx([3.0, 4.0, 7.0])
    assert similar.estimate([(1, 1.0)]) == pytest.approx(3.5)  # the two kept requests with feature 1, equally
    assert similar.estimate([(1, 1.0), (14, 1.0)]) > 3.5  # the rarer feature pulls toward its request
    assert similar.estimate([(12345, 1.0)]) is None  # nothing shares it
    copy = SimilarRequests.from_state(json.loads(json.dumps(similar.state())), capacity=3, k=2)
    assert copy.estimate([(13, 1.0), (14, 0.5)]) == similar.estimate([(13, 1.0), (14, 0.5)])


def test_learning_keeps_no_memory_per_request() -> None:
    """What the predictor keeps lives in arrays allocated up front: after the ring is full, 1,000 more
    requests of new words leave its traced memory where it was (per-request objects made during a burst
    would pin the allocator's memory of that burst once it ends)."""
    p = LengthPredictor()
    requests = [
        (f"{prompt} about topic{n} and word{n}x", length)
        for n, (prompt, length) in enumerate(_requests(1600, seed=12))
    ]
    tracemalloc.start()
    try:
        for prompt, length in requests[:600]:
            p.observe(_f(prompt), length)
        before = tracemalloc.get_traced_memory()[0]
        for prompt, length in requests[600:]:
            p.observe(_f(prompt), length)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(p.similar) == 512 and p.observed == 1600
    assert after - before < 64 * 1024, f"{after - before} bytes kept for 1,000 requests"


def test_a_request_with_too_many_features_is_refused() -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_FEATURES} features"):
        SimilarRequests().add([(i, 1.0) for i in range(MAX_FEATURES + 1)], 1.0)


def test_exact_requests_and_bounds() -> None:
    p = LengthPredictor()
    assert p.predict(_f("anything", max_tokens=77, ignore_eos=True)) == 77  # writes exactly max_tokens
    for prompt, length in _requests(100, seed=4):
        p.observe(_f(prompt), length)
    for prompt in ("", " ", "x" * 1_000_000, "word " * 200_000, "\u00e9\u4e2d" * 1000):
        f = _f(prompt, max_tokens=20)
        assert 1 <= p.predict(f) <= 20
        assert len(f.active) <= 2 * TAIL_WORDS + 6  # bounded whatever the prompt's size
    assert p.predict(_f("write a detailed explanation of bees", max_tokens=1)) == 1


def test_state_round_trips_through_its_file(tmp_path: Path) -> None:
    p = LengthPredictor()
    for prompt, length in _requests(200, seed=5):
        p.observe(_f(prompt, template="chat"), length)
    path = tmp_path / "lengths.json"
    p.save(path)
    q = LengthPredictor.load(path)
    probes = [prompt for prompt, _ in _requests(50, seed=6)]
    assert [q.predict(_f(x, template="chat")) for x in probes] == [
        p.predict(_f(x, template="chat")) for x in probes
    ]
    assert q.observed == p.observed == 200
    assert len(q.similar) == len(p.similar) > 0


def test_a_version_1_state_file_still_loads(tmp_path: Path) -> None:
    p = LengthPredictor()
    for prompt, length in _requests(50, seed=9):
        p.observe(_f(prompt, template="chat"), length)
    path = tmp_path / "lengths.json"
    p.save(path)
    state = json.loads(path.read_text())
    state["version"] = 1
    del state["similar"], state["errors"]
    path.write_text(json.dumps(state))
    q = LengthPredictor.load(path)
    assert q.observed == 50 and len(q.similar) == 0
    assert 1 <= q.predict(_f("answer in one word rivers", template="chat")) <= 512


def test_a_state_file_with_a_feature_outside_the_hash_is_a_clear_error(tmp_path: Path) -> None:
    p = LengthPredictor()
    for prompt, length in _requests(20, seed=13):
        p.observe(_f(prompt), length)
    path = tmp_path / "lengths.json"
    p.save(path)
    state = json.loads(path.read_text())
    state["weights"][str(HASH_BUCKETS)] = 1.0
    path.write_text(json.dumps(state))
    with pytest.raises(LengthPredictorStateError, match=f"outside the {HASH_BUCKETS} hashed features"):
        LengthPredictor.load(path)


@pytest.mark.parametrize(
    ("content", "why"),
    [("{not json", "not a length-predictor state"), ('{"version": 99}', "another predictor version")],
)
def test_a_bad_state_file_is_a_clear_error(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "lengths.json"
    path.write_text(content)
    with pytest.raises(LengthPredictorStateError, match=why):
        LengthPredictor.load(path)
    with pytest.raises(LengthPredictorStateError, match="not a length-predictor state"):
        LengthPredictor.load(tmp_path / "missing.json")


def test_buckets_and_metrics() -> None:
    assert [bucket(n) for n in (1, 16, 17, 64, 65, 128, 129, 256, 257)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]
    assert mae([(10, 12), (5, 1)]) == 3.0
    assert bucket_accuracy([(10, 12), (10, 100)]) == 0.5
