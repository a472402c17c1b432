"""The engine's HTTP API, through FastAPI's ASGI app and through a real server process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from server.engine import LLMEngine
from server.engine.api import create_engine_app
from tests.engine.conftest import hf_greedy, prompts
from tests.processes import free_port

TOKEN = "engine-api-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def client(engine: LLMEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_engine_app(engine, cluster_token=TOKEN))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine", headers=AUTH) as c:
        yield c


async def test_fill_generate_free_roundtrip(client: httpx.AsyncClient, gqa_model: Path) -> None:
    prompt = prompts(1, seed=30)[0]
    r = await client.post("/fill", json={"context_id": 70, "token_ids": prompt})
    assert r.status_code == 200 and r.json() == {"context_id": 70, "num_tokens": len(prompt)}
    r = await client.post(
        "/generate",
        json={"context_id": 71, "parent_context_id": 70, "sampling": {"max_tokens": 8, "ignore_eos": True}},
    )
    body = r.json()
    assert r.status_code == 200, body
    assert body["token_ids"] == hf_greedy(gqa_model, prompt, 8)
    assert body["finish_reason"] == "length" and body["completion_tokens"] == 8
    assert body["prompt_tokens"] == len(prompt)
    stats = (await client.get("/stats")).json()
    assert stats["contexts"] == 2 and stats["blocks_used"] > 0
    for cid in (70, 71):
        assert (await client.post("/free_context", json={"context_id": cid})).status_code == 200
    assert (await client.get("/stats")).json()["blocks_used"] == 0


async def test_fill_with_text(client: httpx.AsyncClient, engine: LLMEngine) -> None:
    r = await client.post("/fill", json={"context_id": 72, "text": "hello world"})
    assert r.json()["num_tokens"] == len(engine.tokenizer.encode("hello world", add_special_tokens=False))
    await client.post("/free_context", json={"context_id": 72})


async def test_streaming_generate(client: httpx.AsyncClient) -> None:
    prompt = prompts(1, seed=31)[0]
    await client.post("/fill", json={"context_id": 73, "token_ids": prompt})
    plain = (
        await client.post(
            "/generate",
            json={
                "context_id": 74,
                "parent_context_id": 73,
                "sampling": {"max_tokens": 10, "ignore_eos": True},
            },
        )
    ).json()
    events = []
    async with client.stream(
        "POST",
        "/generate",
        json={
            "context_id": 75,
            "parent_context_id": 73,
            "stream": True,
            "sampling": {"max_tokens": 10, "ignore_eos": True},
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    tokens = [json.loads(e) for e in events[:-2]]
    final = json.loads(events[-2])
    assert [t["token_id"] for t in tokens] == plain["token_ids"] == final["token_ids"]
    assert "".join(t["text"] for t in tokens) + final["text_delta"] == plain["text"]
    for cid in (73, 74, 75):
        await client.post("/free_context", json={"context_id": cid})


@pytest.mark.parametrize(
    "path,body,status,etype",
    [
        ("/generate", {"context_id": 9001}, 404, "unknown_context"),
        ("/free_context", {"context_id": 9001}, 404, "unknown_context"),
        ("/fill", {"context_id": 9002, "token_ids": [1, 99999]}, 400, "token_out_of_vocab"),
        ("/fill", {"context_id": 9003, "token_ids": [7] * 600}, 413, "prompt_too_long"),
        ("/fill", {"context_id": 9004, "token_ids": [1], "parent_context_id": 555}, 404, "unknown_context"),
        ("/fill", {"context_id": 9005}, 422, "invalid_schema"),
        ("/fill", {"context_id": "x", "token_ids": [1]}, 422, "invalid_schema"),
        ("/generate", {"context_id": 9006, "sampling": {"max_tokenz": 3}}, 422, "invalid_schema"),
    ],
)
async def test_errors_are_typed_json(
    client: httpx.AsyncClient, path: str, body: dict, status: int, etype: str
) -> None:
    r = await client.post(path, json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["type"] == etype and err["message"]


async def test_bad_sampling_and_stream_errors(client: httpx.AsyncClient) -> None:
    await client.post("/fill", json={"context_id": 76, "token_ids": [10, 11, 12]})
    r = await client.post("/generate", json={"context_id": 76, "sampling": {"max_tokens": 0}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_sampling_params"
    r = await client.post(
        "/generate", json={"context_id": 76, "stream": True, "sampling": {"max_tokens": -1}}
    )
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    await client.post("/free_context", json={"context_id": 76})


def test_cli_serves_http_and_answers_one_shot(gqa_model: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.engine", "--model", str(gqa_model), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ | {"PARROT_CLUSTER_TOKEN": TOKEN},
    )
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            pytest.fail("the engine server did not come up")
        assert httpx.get(f"{base}/info").status_code == 401  # only the cluster token's holder
        info = httpx.get(f"{base}/info", headers=AUTH).json()
        assert info["vocab_size"] == 4096 and info["max_model_len"] == 512
        prompt = prompts(1, seed=32)[0]
        fill = {"context_id": 1, "token_ids": prompt}
        httpx.post(f"{base}/fill", json=fill, headers=AUTH).raise_for_status()
        r = httpx.post(
            f"{base}/generate",
            json={"context_id": 1, "sampling": {"max_tokens": 5, "ignore_eos": True}},
            headers=AUTH,
        )
        assert r.json()["token_ids"] == hf_greedy(gqa_model, prompt, 5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "server.engine",
            "--model",
            str(gqa_model),
            "--prompt",
            "hello",
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.startswith("hello")
