"""Shared setup of the LlamaIndex adapter's tests: one embedded server, the engine's tokenizer, offline
LlamaIndex, and a recorder of the prompts the server renders."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_socket
from llamaindex_parrot import ParrotLLM, load_tokenizer
from tokenizers import Tokenizer

from server.engine import EngineConfig
from server.engine.tiny import TOKENIZER_DIR
from server.launcher import LaunchedServer, launch
from workload_text import stdlib_text

# Routes a query may use between creating and deleting its session.
CALLS = ("POST", "/v1/sessions/{session_id}/calls")
BATCH = ("POST", "/v1/sessions/{session_id}/batch")
GET = ("GET", "/v1/sessions/{session_id}/variables/{var_id}")
SESSION = ("POST", "/v1/sessions")
DELETE = ("DELETE", "/v1/sessions/{session_id}")


@pytest.fixture(scope="session")
def served() -> Iterator[LaunchedServer]:
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=2048)) as s:
        yield s


@pytest.fixture(autouse=True)
def offline() -> None:
    """Only the local server may be reached: LlamaIndex defaults that download (tiktoken encodings, OpenAI
    models) fail the test instead. pytest-socket lifts this after each test."""
    pytest_socket.socket_allow_hosts(["127.0.0.1"])


@pytest.fixture(scope="session")
def tokenizer() -> Callable[[str], list[int]]:
    return load_tokenizer(TOKENIZER_DIR)


@pytest.fixture
def llm(served: LaunchedServer, tokenizer: Callable[[str], list[int]]) -> ParrotLLM:
    return ParrotLLM(served.url, max_tokens=8, tokenizer=tokenizer)


@pytest.fixture(scope="session")
def chunks() -> list[str]:
    """Eight deterministic text chunks of 120 engine tokens (stdlib docstrings)."""
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ids = tok.encode(stdlib_text(40_000), add_special_tokens=False).ids
    return [tok.decode(ids[i * 120 : (i + 1) * 120]).strip() for i in range(8)]


@pytest.fixture
def dead_url() -> str:
    """A local URL nothing listens on (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class Prompts:
    """What the server rendered: prompts of semantic calls, and texts sent to /v1/completions."""

    semantic: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)

    def clear(self) -> None:
        self.semantic.clear()
        self.completions.clear()


@pytest.fixture
def prompts(served: LaunchedServer, monkeypatch: pytest.MonkeyPatch) -> Prompts:
    """Record every prompt the server renders (the manager's `render_prompt`) and every text prompt
    ``/v1/completions`` tokenizes."""
    import server.serve.executor as manager_module

    seen = Prompts()
    render = manager_module.render_prompt

    def recording_render(*args: Any, **kwargs: Any) -> str:
        text = render(*args, **kwargs)
        seen.semantic.append(text)
        return text

    monkeypatch.setattr(manager_module, "render_prompt", recording_render)
    import server.http.openai_api as openai_module

    prompts_of = openai_module.completion_prompts

    def recording_prompts(engine: Any, prompt: Any) -> Any:
        seen.completions += [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        return prompts_of(engine, prompt)

    monkeypatch.setattr(openai_module, "completion_prompts", recording_prompts)
    return seen


class Traffic:
    """The requests the server answered since the last `take` (by method and route)."""

    def __init__(self, served: LaunchedServer) -> None:
        self._served = served
        self._last = Counter(served.request_counts)

    def take(self) -> Counter[tuple[str, str]]:
        now = Counter(self._served.request_counts)
        diff, self._last = now - self._last, now
        return diff


@pytest.fixture
def traffic(served: LaunchedServer) -> Traffic:
    return Traffic(served)


def one_round_trip(counts: Counter[tuple[str, str]]) -> None:
    """The query's calls went to the server in one submission, and its answer came with one get.

    A query's session opens with its one request submitting every call (the batch, which creates it) and at
    most one request getting the answer (the batch may carry the get itself); then it is deleted.
    """
    assert counts[SESSION] == 0 and counts[DELETE] == 1, counts
    submissions = counts[CALLS] + counts[BATCH]
    assert submissions == 1, f"{submissions} submission requests (want 1): {dict(counts)}"
    assert counts[GET] <= 1, dict(counts)
    other = set(counts) - {SESSION, DELETE, CALLS, BATCH, GET}
    assert not other, dict(counts)


async def while_ticking(run: Callable[[], Awaitable[Any]]) -> tuple[Any, int, float]:
    """``run()``'s result, how often a 2 ms ticker task ran meanwhile, and the seconds it took."""
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0.002)

    task = asyncio.create_task(ticker())
    started = time.perf_counter()
    result = await run()
    took = time.perf_counter() - started
    stop.set()
    await task
    return result, ticks, took
