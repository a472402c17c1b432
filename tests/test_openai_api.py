"""The OpenAI-compatible endpoints, driven by the official `openai` client against a real uvicorn server.

Every answer is checked against the engine's own greedy generate on the same tokens, and every request must
leave no engine context behind.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import kernels  # noqa: F401  (before transformers, so TRITON_INTERPRET from conftest applies)
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.engine.api import error_response
from server.http.openai_api import create_openai_router
from server.serve.manager import Manager, ManagerConfig

_ref_ids = itertools.count(1 << 50)  # the reference generates' own context ids


def _manager(engine: LLMEngine) -> Manager:
    """A manager over ``engine`` alone that keeps no context after a request (the fixtures check that every
    context is freed)."""
    return Manager([engine], ManagerConfig(openai_prefix_cache=False))


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    eng = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=256))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def base_url(engine: LLMEngine) -> Iterator[str]:
    app = FastAPI()
    app.include_router(create_openai_router(_manager(engine).openai))

    @app.exception_handler(RequestValidationError)
    async def _schema_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_schema", str(exc.errors()))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(5)


@pytest.fixture
def client(base_url: str, engine: LLMEngine) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30) as c:
        yield c
    # No request may leak a context; a stream frees its contexts just after its last event.
    deadline = time.monotonic() + 2
    while engine.stats().contexts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().contexts == 0


def reference(engine: LLMEngine, token_ids: list[int], **sampling: object) -> tuple[str, str, int]:
    """The engine's own (text, finish_reason, completion tokens) for a prompt, under greedy sampling."""

    async def run() -> tuple[str, str, int]:
        cid = next(_ref_ids)
        await engine.fill(cid, token_ids)
        try:
            r = await engine.generate(cid, SamplingParams(temperature=0.0, **sampling))  # type: ignore[arg-type]
        finally:
            await engine.free_context(cid)
        return r.text, r.finish_reason, len(r.token_ids)

    return asyncio.run(run())


def chat_tokens(engine: LLMEngine, messages: list[dict[str, str]]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(text, add_special_tokens=False)


PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a haiku about parrots."},
]


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].object == "model" and models[0].owned_by == "parrot"


def test_model_card_publishes_the_chat_format(client: openai.OpenAI, engine: LLMEngine) -> None:
    """What a client needs to render chat prompts as the server does, on the list and on retrieve."""
    card = client.models.retrieve("tiny").model_dump()
    tok = engine.tokenizer
    assert card["chat_template"] == tok.chat_template
    assert card["max_model_len"] == engine.max_model_len
    assert card["bos_token"] == tok.bos_token
    assert card["adds_bos_token"] == (tok.encode("a")[0] == tok.bos_token_id)
    assert card["eos_tokens"] == [tok.convert_ids_to_tokens(i) for i in sorted(engine.eos_token_ids)]
    assert client.models.list().data[0].model_dump() == card
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("nope")


def test_completion_equals_engine_generate(client: openai.OpenAI, engine: LLMEngine) -> None:
    ids = engine.tokenizer.encode(PROMPT)  # with BOS, as the server does
    text, finish, n = reference(engine, ids, max_tokens=12)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, user="me")
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny"
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert (choice.text, choice.finish_reason, choice.index) == (text, finish, 0)
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids),
        n,
        len(ids) + n,
    )
    # token ids as the prompt: exactly those tokens, no BOS added
    r2 = client.completions.create(model="tiny", prompt=ids[1:], max_tokens=6, temperature=0)
    assert r2.choices[0].text == reference(engine, ids[1:], max_tokens=6)[0]


def test_batch_prompts(client: openai.OpenAI, engine: LLMEngine) -> None:
    prompts = ["Hello there", "A parrot is", "def main():"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    want = [reference(engine, engine.tokenizer.encode(p), max_tokens=8) for p in prompts]
    assert [(c.text, c.finish_reason) for c in r.choices] == [(t, f) for t, f, _ in want]
    assert r.usage is not None and r.usage.completion_tokens == sum(n for _, _, n in want)
    assert r.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)


def test_usage_counts_each_prompt_once_whatever_n(client: openai.OpenAI, engine: LLMEngine) -> None:
    prompts = ["Hello there", "A parrot is"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=3, n=3, temperature=0)
    assert len(r.choices) == 6 and r.usage is not None
    assert r.usage.prompt_tokens == sum(len(engine.tokenizer.encode(p)) for p in prompts)  # as vLLM's
    assert 6 <= r.usage.completion_tokens <= 18  # each of the six choices wrote its own
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, n=3)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_tokens(engine, MESSAGES))


def test_chat_equals_engine_generate(client: openai.OpenAI, engine: LLMEngine) -> None:
    ids = chat_tokens(engine, MESSAGES)
    text, finish, n = reference(engine, ids, max_tokens=10)
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=10,
        temperature=0,
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert (msg.role, msg.content, r.choices[0].finish_reason) == ("assistant", text, finish)
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
    legacy = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert legacy.choices[0].message.content == text


def test_streaming_completion(client: openai.OpenAI, engine: LLMEngine) -> None:
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == plain.choices[0].text
    finals = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].usage == plain.usage and not chunks[-1].choices


def test_streaming_batch(client: openai.OpenAI) -> None:
    prompts = ["one two three", "four five six"]
    plain = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0)
    texts = ["", ""]
    for c in client.completions.create(
        model="tiny", prompt=prompts, max_tokens=8, temperature=0, stream=True
    ):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in plain.choices]


def test_streaming_chat(client: openai.OpenAI) -> None:
    kwargs = {"model": "tiny", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    plain = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_stop_strings_never_streamed(client: openai.OpenAI, engine: LLMEngine) -> None:
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    full = base.choices[0].text
    assert len(full) > 6, full
    stop = full[4:7]  # cut the output in its middle
    want = full[: full.index(stop)]
    for stops in (stop, [stop, "\x00never"]):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stops)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
        streamed = "".join(
            ch.text
            for c in client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stops, stream=True
            )
            for ch in c.choices
        )
        assert streamed == want


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    kwargs = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 7,
    }
    a = client.completions.create(**kwargs)  # type: ignore[call-overload]
    b = client.completions.create(**kwargs)  # type: ignore[call-overload]
    assert a.choices[0].text == b.choices[0].text


def test_errors(client: openai.OpenAI, engine: LLMEngine) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert nf.value.status_code == 404 and "tiny" in str(nf.value)
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=17)
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 generates nothing"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="logprobs must be in"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="n must be in"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=0, stream=True)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=0, stream=True)  # type: ignore[arg-type]
    window = engine.max_model_len
    with pytest.raises(
        openai.BadRequestError, match=r"in max_completion_tokens\): lower max_completion_tokens"
    ):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=window)
    with pytest.raises(openai.BadRequestError, match=r"in max_tokens\): lower max_tokens"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=window)
    too_long = [5] * (engine.max_model_len + 10)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as tl:
            client.completions.create(model="tiny", prompt=too_long, max_tokens=2, stream=stream)
        assert tl.value.code == "context_length_exceeded"
        assert f"context window is {window} tokens, but the prompt holds {window + 10}" in tl.value.message
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="tiny", prompt={"not": "a prompt"}, max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])  # type: ignore[list-item]
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.completions.create(model="tiny", prompt=[], max_tokens=2)
    # a bad prompt in a batch fails the request and frees the good prompts' contexts too
    with pytest.raises(openai.APIStatusError) as batch:
        client.completions.create(model="tiny", prompt=[[5, 6, 7], too_long], max_tokens=2)
    assert batch.value.status_code == 400 and batch.value.code == "context_length_exceeded"
    assert client.models.list().data  # still serving


def test_error_shape(base_url: str) -> None:
    r = httpx.post(f"{base_url}/completions", json={"model": "tiny", "prompt": "hi", "best_of": 2})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert r.json() == {
        "error": {
            "type": "unsupported_option",
            "message": message,
            "param": "best_of",
            "code": "unsupported_option",
        }
    }


def test_client_gone_mid_stream_frees_context(base_url: str, engine: LLMEngine) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
    deadline = time.monotonic() + 5
    while engine.stats().contexts and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats().contexts == 0 and engine.stats().running == 0


async def test_a_request_the_kv_cache_cannot_hold_is_refused_not_cut() -> None:
    # An engine whose KV cache (8 blocks of 16: 128 tokens) is smaller than its context window (4,096):
    # a prompt + max_tokens over the cache would stop where the cache ends, a cut answer with HTTP 200.
    small = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=8))
    try:
        app = FastAPI()
        app.include_router(create_openai_router(_manager(small).openai))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 500, "temperature": 0}
            refused = await c.post("/v1/completions", json=body)
            assert refused.status_code == 400, refused.text
            assert "KV cache" in refused.json()["error"]["message"]
            # Without max_tokens, generation may run to the end of the cache, not of the context window.
            body.pop("max_tokens")
            body["ignore_eos"] = True
            answered = await c.post("/v1/completions", json=body)
            assert answered.status_code == 200, answered.text
            usage = answered.json()["usage"]
            assert usage["prompt_tokens"] + usage["completion_tokens"] <= 8 * 16
            assert answered.json()["choices"][0]["finish_reason"] == "length"
    finally:
        small.shutdown()


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_stream_chunks_say_usage_null_until_the_usage_chunk(base_url: str, route: str) -> None:
    """OpenAI's spec: with include_usage, every chunk carries ``usage`` (null) and the last one before
    ``[DONE]`` its value; without it, no chunk carries the field."""
    body: dict[str, object] = {"model": "tiny", "max_tokens": 4, "stream": True, "temperature": 0}
    body.update({"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES})
    for include in (True, False):
        with httpx.stream(
            "POST",
            f"{base_url}/{route}",
            json={**body, "stream_options": {"include_usage": include}},
            timeout=30,
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        if include:
            assert all("usage" in e and e["usage"] is None for e in events[:-1]) and len(events) > 2
            assert events[-1]["usage"]["completion_tokens"] == 4 and events[-1]["choices"] == []
        else:
            assert not any("usage" in e for e in events)


def test_penalties_and_logit_bias(client: openai.OpenAI, engine: LLMEngine) -> None:
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    forced = client.completions.create(**kwargs, logit_bias={"77": 100}, presence_penalty=0.5)  # type: ignore[call-overload]
    assert forced.choices[0].text == engine.tokenizer.decode([77] * 6)
    plain = client.completions.create(**kwargs)  # type: ignore[call-overload]
    repeated = client.completions.create(
        **kwargs, frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5}
    )  # type: ignore[call-overload]
    assert repeated.choices[0].text != plain.choices[0].text
    with pytest.raises(openai.BadRequestError, match="logit_bias keys must be token ids"):
        client.completions.create(**kwargs, logit_bias={"the": 5})  # type: ignore[call-overload]
    with pytest.raises(openai.BadRequestError, match="logit_bias names 1025 tokens, over the 1024"):
        client.completions.create(**kwargs, logit_bias={str(i): 1 for i in range(1025)})  # type: ignore[call-overload]
    with pytest.raises(openai.BadRequestError, match=r"presence_penalty must be a number in \[-2, 2\]"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, presence_penalty=3)  # type: ignore[arg-type]


def test_streamed_choices_interleave_as_they_are_generated(client: openai.OpenAI, base_url: str) -> None:
    kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(n=3, **kwargs)  # type: ignore[call-overload]
    order, texts = [], ["", "", ""]
    for c in client.completions.create(n=3, stream=True, **kwargs):  # type: ignore[call-overload]
        for ch in c.choices:
            order.append(ch.index)
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in whole.choices]
    assert order != sorted(order)  # a later choice's tokens came before an earlier one ended
    # A client that leaves mid-stream: every choice's context is freed (the fixture checks none is left).
    body = {**kwargs, "n": 3, "stream": True, "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())
