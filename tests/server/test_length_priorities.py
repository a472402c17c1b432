"""SSJF through the manager: each step and OpenAI request carries its predicted output length to the engine as
its priority (fill and generate alike), the predictor learns from what finished, a client's own `priority`
wins, the switch turns it off, and the state survives a restart through its file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import parrot as P
import pytest

from server.engine import EngineConfig, LLMEngine
from server.engine.sampling import SamplingParams
from server.launcher import LaunchedServer, launch
from server.serve.length_predictor import LengthPredictor
from server.serve.manager import ManagerConfig
from server.serve.output_lengths import MAX_GROUPS, OutputLengths, template_key


class Priorities:
    """Records the ``priority`` of every fill and generate an engine receives (by context id)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.fills: dict[int, float | None] = {}
        self.generates: dict[int, float | None] = {}
        fill, submit = engine.fill, engine.submit_generate

        async def recorded_fill(context_id: int, *args: Any, priority: float | None = None, **kw: Any) -> int:
            self.fills[context_id] = priority
            return await fill(context_id, *args, priority=priority, **kw)

        def recorded_submit(context_id: int, *args: Any, priority: float | None = None, **kw: Any) -> Any:
            self.generates[context_id] = priority
            return submit(context_id, *args, priority=priority, **kw)

        engine.fill = recorded_fill  # type: ignore[method-assign]
        engine.submit_generate = recorded_submit  # type: ignore[method-assign]

    def clear(self) -> None:
        self.fills.clear()
        self.generates.clear()


@pytest.fixture(scope="module")
def server() -> Iterator[LaunchedServer]:
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=256, scheduling="sjf")) as s:
        yield s


@pytest.fixture
def recorded(server: LaunchedServer) -> Iterator[Priorities]:
    engine = server.engines[0]
    fill, submit = engine.fill, engine.submit_generate
    rec = Priorities(engine)
    yield rec
    engine.fill, engine.submit_generate = fill, submit  # type: ignore[method-assign]


def test_each_step_carries_its_prediction_on_fill_and_generate(
    server: LaunchedServer, recorded: Priorities
) -> None:
    predictor = server.manager.length_predictor
    assert predictor is not None
    seen = predictor.observed
    fn = P.SemanticFunction.from_template(
        "Tell me about {{input:x}}: {{output:y}}", name="about", sampling=P.SamplingConfig(max_tokens=12)
    )
    with P.Session(server.url):
        for i in range(6):
            assert isinstance(fn(x=f"topic {i}").get(), str)
    assert predictor.observed == seen + 6  # every finished step trained it
    sent = [recorded.generates[c] for c in sorted(recorded.generates)]
    assert len(sent) == 6 and all(p is not None and 1 <= p <= 12 for p in sent)
    # The fill of a step goes in the same queue position as its generate.
    for context_id, priority in recorded.generates.items():
        assert recorded.fills[context_id] == priority


def test_predictions_follow_what_a_function_writes(server: LaunchedServer) -> None:
    lengths = server.manager.lengths
    assert lengths is not None
    # `stop` on every token-free newline is not controllable on a random model: teach the predictor
    # directly through the manager's own estimator, as finished steps do, and read what it would send.
    sampling = SamplingParams(max_tokens=200)
    for i in range(8):
        estimate = lengths.estimate(template_key("terse", 0), f"question {i}", 10, sampling)
        lengths.observe(estimate, 3)
        estimate = lengths.estimate(template_key("verbose", 0), f"question {i}", 10, sampling)
        lengths.observe(estimate, 150)
    terse = lengths.estimate(template_key("terse", 0), "question 99", 10, sampling).predicted
    verbose = lengths.estimate(template_key("verbose", 0), "question 99", 10, sampling).predicted
    assert terse <= 6 and 100 <= verbose <= 200


def test_openai_requests_get_predictions_and_a_client_priority_wins(
    server: LaunchedServer, recorded: Priorities
) -> None:
    predictor = server.manager.length_predictor
    assert predictor is not None
    seen = predictor.observed
    body = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ((context_id, predicted),) = recorded.generates.items()
    assert predicted is not None and 1 <= predicted <= 5
    assert recorded.fills[context_id] == predicted
    assert predictor.observed == seen + 1
    recorded.clear()
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "priority": 7.5}, timeout=60)
    assert r.status_code == 200, r.text
    assert list(recorded.generates.values()) == [7.5] and list(recorded.fills.values()) == [7.5]
    recorded.clear()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "priority": -2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    assert list(recorded.generates.values()) == [-2.0]


@pytest.mark.parametrize("bad", ["1e999", '"soon"', "null"])
def test_a_bad_client_priority_is_refused(server: LaunchedServer, bad: str) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        content='{"prompt": "x", "max_tokens": 2, "priority": ' + bad + "}",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    if bad == "null":  # the same as not sending one
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 422, r.text
    assert "priority" in r.json()["error"]["message"]


def test_length_prediction_off_sends_no_priority() -> None:
    config = ManagerConfig(length_prediction=False)
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=128), manager_config=config) as s:
        assert s.manager.length_predictor is None
        rec = Priorities(s.engines[0])
        fn = P.SemanticFunction.from_template(
            "Say {{input:x}} {{output:y}}", sampling=P.SamplingConfig(max_tokens=3)
        )
        with P.Session(s.url):
            assert isinstance(fn(x="a").get(), str)
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        assert set(rec.generates.values()) == {None} and len(rec.generates) == 2


def test_the_predictor_state_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "lengths.json"
    config = ManagerConfig(length_predictor_path=str(path))
    fn = P.SemanticFunction.from_template(
        "Write {{input:x}}: {{output:y}}", name="write", sampling=P.SamplingConfig(max_tokens=4)
    )
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=128), manager_config=config) as s:
        with P.Session(s.url):
            for i in range(3):
                fn(x=str(i)).get()
        assert s.manager.length_predictor is not None
        observed = s.manager.length_predictor.observed
    assert observed == 3 and path.exists()  # saved at shutdown
    saved = LengthPredictor.load(path)
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=128), manager_config=config) as s:
        restored = s.manager.length_predictor
        assert restored is not None and restored.observed == saved.observed == 3


def test_a_task_group_shares_one_priority_and_groups_are_bounded() -> None:
    lengths = OutputLengths()
    sampling = SamplingParams(max_tokens=100)
    for _ in range(10):
        e = lengths.estimate("long#0", "write a detailed essay", 10, sampling)
        lengths.observe(e, 90)
        e = lengths.estimate("short#0", "one word", 10, sampling)
        lengths.observe(e, 2)
    first = lengths.estimate("short#0", "one word", 10, sampling, group="call/0")
    second = lengths.estimate("long#0", "write a detailed essay", 10, sampling, group="call/0")
    assert second.predicted > 3 * first.predicted  # each is predicted for itself ...
    assert second.priority == first.priority == first.predicted  # ... and the group keeps the first's place
    for i in range(MAX_GROUPS + 10):
        lengths.estimate(None, "x", 1, sampling, group=f"g{i}")
    later = lengths.estimate("long#0", "write a detailed essay", 10, sampling, group="call/0")
    assert later.priority == later.predicted  # the oldest groups were forgotten, memory stays bounded


def test_the_server_refuses_to_start_on_a_corrupt_predictor_file(tmp_path: Path) -> None:
    path = tmp_path / "lengths.json"
    path.write_text("{not json")
    run = subprocess.run(
        [sys.executable, "-m", "server", "--model", "tiny", "--port", "0", "--length-predictor", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "not a length-predictor state" in run.stderr and "--length-predictor" in run.stderr


def _peak_running_steps(capacity: int, margin: float | None) -> int:
    """How many of 4 concurrent steps (prompt ~20 tokens, max_tokens 30, predicted 6) one engine with room for
    ``capacity`` tokens ran at once."""
    config = ManagerConfig(engine_capacity_tokens=capacity, admit_by_predicted_length=margin)
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=256), manager_config=config) as s:
        lengths = s.manager.lengths
        assert lengths is not None
        sampling = SamplingParams(max_tokens=30)
        for i in range(6):  # the function is known to write 6 tokens
            lengths.observe(lengths.estimate(template_key("brief", 0), f"note {i}", 20, sampling), 6)
        peak = 0
        fill = s.engines[0].fill

        async def counted(*args: Any, **kw: Any) -> int:
            nonlocal peak
            peak = max(peak, s.manager.placement.running_steps(0))
            return await fill(*args, **kw)

        s.engines[0].fill = counted  # type: ignore[method-assign]
        fn = P.SemanticFunction.from_template(
            "Write a brief note about item number {{input:x}}: {{output:y}}",
            name="brief",
            sampling=P.SamplingConfig(max_tokens=30),
            criteria=P.THROUGHPUT,
        )
        with P.Session(s.url):
            outs = [fn(x=str(i)) for i in range(4)]
            assert all(isinstance(o.get(), str) for o in outs)  # every step completes either way
        return peak


def test_admission_by_predicted_length_fits_more_steps_in_the_same_capacity() -> None:
    # ~20 prompt tokens + 30 max_tokens = ~50 per step: one fits in 70 tokens of capacity; counted with
    # their predicted 6 tokens (margin 1.5 -> 9 reserved) three of them do.
    assert _peak_running_steps(70, None) == 1
    assert _peak_running_steps(70, 1.5) >= 2


@pytest.mark.parametrize("margin", [0.5, float("nan"), float("inf")])
def test_a_bad_admission_margin_is_refused(margin: float) -> None:
    with pytest.raises(ValueError, match="admit_by_predicted_length"):
        ManagerConfig(admit_by_predicted_length=margin)
