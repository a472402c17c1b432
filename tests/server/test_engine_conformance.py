"""Every kind of engine behind the one `Engine` interface, through the same calls: in process, remote over
HTTP, a disaggregated prefill + decode pair, and an OpenAI-compatible server upstream (Parrot's own ``/v1``).
A new kind of engine passes this module or is not one.

Fill and fork (lengths), greedy generate (a fork gives the tokens its parent gives), a stream (its tokens are
its result's), cancel (the stream ends, the context stays usable), free (the context is gone), stats, scoring
a prompt (or the typed refusal of a kind that cannot), and
failures answered with the same error types whatever the kind. And no module outside where engines are
built branches on an engine's class: kinds differ only in the interface's traits.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from server.cluster.openai_backend import OpenAIBackendConfig, OpenAIBackendEngine
from server.cluster.remote_engine import RemoteEngine
from server.engine import EngineConfig, EngineError, LLMEngine, SamplingParams
from server.engine.api import create_engine_app
from server.engine.interface import Engine
from server.launcher import build_engines, launch
from tests.security.conftest import serving

CONFIG = EngineConfig(num_kv_blocks=128)
KINDS = ["in-process", "remote", "disaggregated", "openai-upstream"]
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


@asynccontextmanager
async def _engine(kind: str) -> AsyncIterator[Engine]:
    if kind == "in-process":
        with LLMEngine.from_pretrained("tiny", CONFIG) as engine:
            yield engine
    elif kind == "remote":
        with (
            LLMEngine.from_pretrained("tiny", CONFIG) as local,
            serving(create_engine_app(local, cluster_token=None)) as url,
        ):
            remote = await RemoteEngine.connect(url, "conformance")
            try:
                yield remote
            finally:
                await remote.aclose()
    elif kind == "disaggregated":
        [pair] = build_engines("tiny", 2, CONFIG, disaggregate=True)
        try:
            yield pair
        finally:
            pair.shutdown()
    else:
        with launch("tiny", engine_config=CONFIG) as upstream:
            backend = await asyncio.to_thread(OpenAIBackendEngine.connect, OpenAIBackendConfig(upstream.url))
            try:
                yield backend
            finally:
                await backend.aclose()


async def _error_type(call: asyncio.Future[object] | object) -> str:
    with pytest.raises(EngineError) as caught:
        await call  # type: ignore[misc]
    return caught.value.error_type


@pytest.mark.parametrize("kind", KINDS)
async def test_every_kind_answers_the_engine_calls_alike(kind: str) -> None:
    async with _engine(kind) as engine:
        assert isinstance(engine, Engine) and engine.model_name and engine.max_model_len > 0
        prompt = engine.tokenizer.encode("Once upon a time there was", add_special_tokens=False)

        # Fill and fork.
        assert await engine.fill(1, prompt) == len(prompt)
        assert await engine.fill(2, [prompt[0]], parent_context_id=1) == len(prompt) + 1
        assert await engine.fill(3, [], parent_context_id=1) == len(prompt)

        # Greedy generate: a fork of the parent gives what the parent gives.
        first = await engine.generate(3, GREEDY)
        again = await engine.generate(4, GREEDY, parent_context_id=1)
        assert len(first.token_ids) == 4 and again.token_ids == first.token_ids
        assert first.finish_reason == "length"

        # A stream yields its result's tokens.
        stream = engine.submit_generate(5, GREEDY, parent_context_id=1, stream=True)
        streamed = [t async for t in stream]
        assert streamed == (await stream.result()).token_ids == first.token_ids

        # Cancel: the stream ends early; the context is then freed like any other.
        long = engine.submit_generate(6, SamplingParams(max_tokens=200, ignore_eos=True), 1, stream=True)
        got = [await anext(long)]
        long.cancel()
        with pytest.raises((EngineError, StopAsyncIteration)):  # aborted, or ended at the cancel
            while True:
                got.append(await anext(long))
        assert len(got) < 200
        await engine.free_context(6)

        # Free: the context is gone.
        await engine.free_context(4)
        assert await _error_type(engine.generate(4, GREEDY)) == "unknown_context"

        # Stats, whatever the kind.
        assert engine.stats().model_copy() is not None

        # A stream with logprobs: each token's is there by the time the token is read (an upstream server's
        # are not relayed: refused at submit).
        if kind != "openai-upstream":
            with_lps = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1)
            lp_stream = engine.submit_generate(9, with_lps, parent_context_id=1, stream=True)
            seen: list[int] = []
            async for token in lp_stream:
                seen.append(token)
                assert lp_stream.logprobs[len(seen) - 1].token_id == token
            final = (await lp_stream.result()).logprobs
            assert seen == first.token_ids and final is not None and final == lp_stream.logprobs
            await engine.free_context(9)

        # Scoring a prompt: each token after the first, from the fill's prefill; the greedy token is the
        # likeliest alternative where it is scored. An upstream server keeps its logits: it says it cannot.
        scoring = engine.score(8, [*prompt, first.token_ids[0]], top=2)
        if kind == "openai-upstream":
            assert await _error_type(scoring) == "unsupported_by_engine"
        else:
            scored = await scoring
            assert [s.token_id for s in scored] == [*prompt[1:], first.token_ids[0]]
            assert scored[-1].top[0] == (first.token_ids[0], scored[-1].logprob)
            assert (await engine.generate(8, GREEDY)).finish_reason == "length"

        # Failures keep their types.
        assert await _error_type(engine.fill(7, [engine.vocab_size + 5])) == "token_out_of_vocab"
        assert await _error_type(engine.generate(99, GREEDY)) == "unknown_context"
        assert await _error_type(engine.fill(1, prompt, parent_context_id=3)) == "context_exists"


# Where engines are built (or are themselves an engine kind): the only places that may name engine classes
# in an isinstance check.
BUILDERS = {"server/launcher.py", "server/cluster/ray_engines.py", "server/sim/engine.py"}
ENGINE_CLASSES = {"LLMEngine", "RemoteEngine", "DisaggregatedEngine", "OpenAIBackendEngine", "SimEngine"}


def test_no_module_outside_the_builders_branches_on_an_engine_class() -> None:
    root = Path(__file__).resolve().parents[2]
    found = []
    for path in sorted((root / "server").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in BUILDERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if named & ENGINE_CLASSES:
                    found.append(f"{rel}:{node.lineno}")
    assert not found, f"branches on an engine class (use an `Engine` trait instead): {found}"
