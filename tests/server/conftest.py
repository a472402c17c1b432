"""Fixtures shared by the server tests."""

from __future__ import annotations

from collections.abc import Iterator

import parrot as P
import pytest

from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch

# A call whose output fails (a JSON transform on what the random tiny model writes): a failed future.
BROKEN = P.SemanticFunction.from_template(
    "Give JSON: {{output:j}}",
    name="broken",
    sampling=P.SamplingConfig(max_tokens=5, temperature=0.0, ignore_eos=True),
    transforms={"j": [P.transforms.json()]},
)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-engine", "two-engines"])
def one_or_two(request: pytest.FixtureRequest) -> Iterator[LaunchedServer]:
    """The tiny model served by one in-process engine, then by two: each test using it runs on both."""
    with launch("tiny", engines=request.param, engine_config=EngineConfig(num_kv_blocks=512)) as s:
        yield s
