"""``echo`` with ``logprobs`` through the whole server (the manager's placement, kept contexts and engines):
in-process engines score the prompt as the engine does; disaggregated pairs score on their prefill engine;
an OpenAI upstream answers a typed 400 naming what cannot score."""

from __future__ import annotations

import httpx
import pytest

from server.engine import EngineConfig
from server.launcher import LaunchedServer, launch

CONFIG = EngineConfig(num_kv_blocks=128)


def _echo(served: LaunchedServer, prompt: list[int], max_tokens: int = 1) -> httpx.Response:
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)


def _scores(served: LaunchedServer, prompt: list[int]) -> list[float]:
    engine = served.engines[0]

    async def run() -> list[float]:
        cid = 1 << 52
        try:
            return [s.logprob for s in await engine.score(cid, prompt, 1)]
        finally:
            await engine.free_context(cid)

    return served.run(run())


@pytest.mark.parametrize("disaggregate", [False, True], ids=["engines", "prefill-decode-pair"])
def test_echoed_logprobs_through_the_manager_equal_the_engine_scores(disaggregate: bool) -> None:
    with launch("tiny", engines=2, engine_config=CONFIG, disaggregate=disaggregate) as served:
        prompt = served.engines[0].tokenizer.encode("Once upon a time there was", add_special_tokens=False)
        for _ in range(2):  # the second finds the first's context kept: it is still scored whole
            r = _echo(served, prompt)
            assert r.status_code == 200, r.text
            logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert logprobs[0] is None and logprobs[1 : len(prompt)] == _scores(served, prompt)
        r = _echo(served, prompt, max_tokens=0)
        assert r.json()["choices"][0]["logprobs"]["token_logprobs"][1:] == _scores(served, prompt)


def test_an_upstream_that_cannot_score_answers_a_typed_400() -> None:
    with (
        launch("tiny", engines=1, engine_config=CONFIG) as backend,
        launch("tiny", engines=0, openai_backends=[backend.url]) as front,
    ):
        r = _echo(front, [5, 6, 7])
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["type"] == "unsupported_by_engine" and "cannot score prompts" in error["message"]
        plain = httpx.post(
            f"{front.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=60
        )
        assert plain.status_code == 200  # it serves on
