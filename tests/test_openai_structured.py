"""Structured output, tools, ``n`` and ``logprobs`` on the OpenAI endpoints, through the official client.

JSON answers are checked by `jsonschema`, a validator we did not write; the tiny model is random, so every
valid answer is valid by construction (the engine's grammar mask), not by the model's skill.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server.engine import LLMEngine, SamplingParams
from server.http.openai_tools import parse_tool_calls
from tests.test_openai_api import MESSAGES, PROMPT, base_url, client, engine  # noqa: F401  (fixtures)

# Bounded (string lengths, array sizes, number ranges), so that a random model finishes every answer.
ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "minLength": 1, "maxLength": 16},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "size": {"enum": ["small", "medium", "large"]},
        "extras": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "gift": {"type": "boolean"},
        "price": {"type": "number", "minimum": 0, "maximum": 1000},
    },
    "required": ["customer", "quantity", "size", "extras", "gift"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ORDER_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}


def test_json_schema_answers_validate_on_every_one_of_50_prompts(base_url: str) -> None:  # noqa: F811
    async def run() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(
                *[
                    c.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": f"Order #{i}: write it as JSON."}],
                        response_format=ORDER_FORMAT,
                        max_tokens=400,
                        temperature=1.0,
                        seed=i,
                    )
                    for i in range(50)
                ]
            )

    answers = asyncio.run(run())
    texts = [a.choices[0].message.content for a in answers]
    for a, text in zip(answers, texts, strict=True):
        assert a.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), ORDER)
    assert len(set(texts)) > 25


def test_json_object_and_vllm_structured_outputs(client: openai.OpenAI) -> None:  # noqa: F811
    obj = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},  # vLLM's completions take it too
    )
    assert obj.choices[0].text.startswith("{")
    regex = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
    )
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"
    choice = client.chat.completions.create(
        model="tiny", messages=MESSAGES, extra_body={"structured_outputs": {"choice": ["red", "green"]}}
    )
    assert choice.choices[0].message.content in ("red", "green")


def test_n_choices_are_each_prompts_own_seeded_samples(client: openai.OpenAI) -> None:  # noqa: F811
    many = client.completions.create(model="tiny", prompt=[PROMPT, "Hi"], max_tokens=6, n=3, seed=5)
    assert [c.index for c in many.choices] == list(range(6))
    for k in range(3):  # the k-th sample of a prompt is the seed + k sample
        one = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, seed=5 + k)
        assert many.choices[k].text == one.choices[0].text
    assert len({c.text for c in many.choices[:3]}) > 1
    assert many.usage is not None and many.usage.completion_tokens <= 6 * 6
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, n=2, max_tokens=5, stream=True, seed=1
        )
    )
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_logprobs_on_both_endpoints_equal_the_engines(client: openai.OpenAI, engine: LLMEngine) -> None:  # noqa: F811
    ids = engine.tokenizer.encode(PROMPT)

    async def ref() -> Any:
        await engine.fill(1 << 51, ids)
        try:
            return await engine.generate(1 << 51, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
        finally:
            await engine.free_context(1 << 51)

    expected = asyncio.run(ref())
    got = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = got.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == 6 and len(lp.top_logprobs) == 6  # type: ignore[arg-type]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs])
    assert "".join(lp.tokens) == got.choices[0].text  # type: ignore[arg-type]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]  # type: ignore[index]
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3, temperature=0
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].token == content[0].top_logprobs[0].token  # greedy: the likeliest
    streamed = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens  # streamed: the same, chunk by chunk


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_is_valid_by_construction(client: openai.OpenAI, stream: bool) -> None:  # noqa: F811
    kwargs: Any = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris for 3 days?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
    }
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    else:
        chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
        last = next(c for c in chunks if c.choices[0].delta.tool_calls)
        calls, finish = last.choices[0].delta.tool_calls, last.choices[0].finish_reason
    assert finish == "tool_calls" and calls is not None and len(calls) == 1
    call = calls[0]
    assert call.id and call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
    params = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), params)  # type: ignore[union-attr]


def test_a_named_tool_choice_calls_that_function_and_history_renders(client: openai.OpenAI) -> None:  # noqa: F811
    first = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,  # one call: a random model might list calls until max_tokens
        max_tokens=100,
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_time"  # type: ignore[union-attr]
    follow = client.chat.completions.create(  # the call and its answer go back into the conversation
        model="tiny",
        messages=[
            {"role": "user", "content": "What time is it?"},
            first.choices[0].message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
        ],
        tools=[WEATHER, TIME],
        max_tokens=8,
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_auto_tool_choice_reads_hermes_calls_and_leaves_text_alone() -> None:
    functions = {"get_weather": WEATHER["function"]}
    text = 'Sure.<tool_call>[{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}]</tool_call>'
    content, calls = parse_tool_calls(text, functions, constrained=False)
    assert content == "Sure." and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Lima", "days": 2}
    single = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'
    assert parse_tool_calls(single, functions, constrained=False)[0] is None
    for plain in (
        "no call here",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        "<tool_call>{",
        '<tool_call>[{"name": "get_weather", "argu',
    ):
        assert parse_tool_calls(plain, functions, constrained=False) == (plain, [])


@pytest.mark.parametrize("constrained", [True, False])
def test_a_list_of_calls_cut_by_max_tokens_keeps_its_complete_calls(constrained: bool) -> None:
    functions = {"get_weather": WEATHER["function"], "get_time": TIME["function"]}
    calls = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Li'
    text = calls if constrained else f"Checking.<tool_call>{calls}"
    content, got = parse_tool_calls(text, functions, constrained=constrained)
    assert [c.function.name for c in got] == ["get_time"] and json.loads(got[0].function.arguments) == {}
    assert content == (None if constrained else "Checking.")
    two = '[ {"name": "get_time", "arguments": {}} , {"name": "get_time", "arguments": {}} ,'
    assert len(parse_tool_calls(two, functions, constrained=True)[1]) == 2


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
            "not both",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "among",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"max_tokens": 100_000}, "max_tokens", "context window is"),
        ({"n": 0}, "n", "n must be in"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    ],
)
def test_bad_structured_requests_answer_400_naming_the_field(
    base_url: str,  # noqa: F811
    body: dict[str, Any],
    param: str,
    message: str,
) -> None:
    r = httpx.post(f"{base_url}/chat/completions", json={"model": "tiny", "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"] and error["code"] == error["type"]


def test_a_guided_schema_the_compiler_refuses_is_a_400(base_url: str) -> None:  # noqa: F811
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
    r = httpx.post(
        f"{base_url}/chat/completions", json={"model": "tiny", "messages": MESSAGES, "response_format": fmt}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_sampling_params", r.text
