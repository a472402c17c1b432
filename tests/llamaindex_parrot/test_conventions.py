"""OpenAI and LlamaIndex conventions on the embedded tiny server: ``api_base`` as
``OpenAILike`` takes it (``base_url`` an alias; with or without ``/v1``), nothing sent at construction,
the server's tokenizer for prompt packing, sampling refused at construction."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.prompts.default_prompt_selectors import DEFAULT_TEXT_QA_PROMPT_SEL
from llamaindex_parrot import ParrotLLM, get_response_synthesizer

from server.launcher import LaunchedServer
from tests.llamaindex_parrot.conftest import Prompts, Traffic

PROMPT = PromptTemplate("Say {x}: ")
QUERY = "What do these say?"


@pytest.mark.parametrize("how", ["positional", "api_base", "base_url"])
@pytest.mark.parametrize("suffix", ["", "/v1/"])
def test_the_server_url_is_given_as_openai_like_takes_it(
    served: LaunchedServer, traffic: Traffic, how: str, suffix: str
) -> None:
    url = served.url + suffix
    llm = ParrotLLM(url, max_tokens=4) if how == "positional" else ParrotLLM(max_tokens=4, **{how: url})
    assert not traffic.take()  # constructing it asked the server nothing
    assert llm.api_base == llm.base_url == served.url  # kept as the server root
    reference = ParrotLLM(served.url, max_tokens=4, model="tiny", context_window=4096)
    assert llm.predict(PROMPT, x="hi") == reference.predict(PROMPT, x="hi")
    assert llm.complete("Once").text == reference.complete("Once").text


def test_the_url_defaults_to_the_environment(served: LaunchedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARROT_BASE_URL", served.url + "/v1")
    assert ParrotLLM().api_base == served.url


def test_urls_that_disagree_or_are_not_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="name different servers"):
        ParrotLLM("http://127.0.0.1:1", base_url="http://127.0.0.1:2")
    assert ParrotLLM("http://127.0.0.1:1", base_url="http://127.0.0.1:1/v1").api_base == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match=r"(?s)api_base.*must start with http:// or https://"):
        ParrotLLM("127.0.0.1:9000")


def test_the_server_is_asked_once_on_first_use(served: LaunchedServer, traffic: Traffic) -> None:
    llm = ParrotLLM(served.url, max_tokens=4)
    copy = llm.model_copy(update={"unrendered": False})
    assert not traffic.take()
    meta = llm.metadata
    assert meta.context_window == served.engines[0].max_model_len and meta.model_name == "tiny"
    assert traffic.take() == Counter({("GET", "/v1/models"): 1})
    assert llm.metadata == meta and llm.prompt_helper().context_window == meta.context_window
    assert not traffic.take()  # remembered
    assert copy.metadata == meta  # a copy made before the first use asks for itself, once
    assert copy.metadata == meta
    assert traffic.take() == Counter({("GET", "/v1/models"): 1})


def test_the_servers_tokenizer_packs_prompts_as_the_engines_own(
    served: LaunchedServer, tokenizer: Callable[[str], list[int]], chunks: list[str], prompts: Prompts
) -> None:
    server_counted = ParrotLLM(served.url, max_tokens=8, context_window=640, tokenizer="server")
    assert server_counted.tokenize(chunks[0]) == tokenizer(chunks[0])
    local = server_counted.model_copy(update={"tokenizer": tokenizer})
    expected = get_response_synthesizer(local, "compact").get_response(QUERY, chunks[:5])
    packed_locally = list(prompts.semantic)
    prompts.clear()
    assert get_response_synthesizer(server_counted, "compact").get_response(QUERY, chunks[:5]) == expected
    assert prompts.semantic == packed_locally and len(packed_locally) > 1  # the same packing, several calls


BAD_SAMPLING = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": 1 << 64}, "seed must be a 64-bit integer"),
    ({"stop": [""]}, "stop strings must be non-empty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SAMPLING)
def test_bad_sampling_fails_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParrotLLM("http://127.0.0.1:9", **kwargs)


def test_penalties_reach_the_server_with_every_call(llm: ParrotLLM, traffic: Traffic) -> None:
    """As LlamaIndex's OpenAI LLM takes them: OpenAI's presence and frequency penalties, vLLM's repetition
    penalty; on the LLM or per call, on the semantic path and on /v1/completions alike."""
    penalised = llm.model_copy(update={"repetition_penalty": 1.3, "frequency_penalty": 0.5})
    sampling = penalised.sampling(presence_penalty=0.25)
    assert (sampling.repetition_penalty, sampling.frequency_penalty, sampling.presence_penalty) == (
        1.3,
        0.5,
        0.25,
    )
    assert penalised.predict(DEFAULT_TEXT_QA_PROMPT_SEL, context_str="a", query_str="b")
    assert penalised.complete("x", presence_penalty=0.25).text is not None
    assert traffic.take()


def test_bad_per_call_sampling_fails_before_any_request(llm: ParrotLLM, traffic: Traffic) -> None:
    assert llm.metadata.context_window  # the model card, read once on first use
    traffic.take()
    with pytest.raises(ValueError, match="ParrotLLM: temperature must be"):
        llm.complete("x", temperature=-1)
    with pytest.raises(ValueError, match=r"ParrotLLM: top_p must be in \(0, 1\]"):
        llm.chat([ChatMessage(role="user", content="hi")], top_p=0)
    assert not traffic.take()
