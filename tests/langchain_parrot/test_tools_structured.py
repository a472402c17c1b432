"""`ChatParrot.bind_tools` and `ChatParrot.with_structured_output` on the embedded server (tiny model).

The tiny model is random: every call and every object here is valid by construction (the server's
constrained decoding), not by the model's skill. So all schemas are bounded (enums, number ranges), which a
random model finishes too, and arguments are checked with `jsonschema`, a validator we did not write. The
bodies the model sends are read off its own httpx clients (event hooks), on their way to the real server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

import httpx
import jsonschema
import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_parrot import ChatParrot, UnsupportedInputError
from langchain_parrot.tools import parse_tool_calls, stream_tool_call_chunks
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from server.launcher import LaunchedServer

from .conftest import PromptRecorder


class Weather(BaseModel):
    """The weather in a city over the next days."""

    city: Literal["Paris", "Tokyo", "Lima"]
    days: int = Field(ge=1, le=7)


class Clock(TypedDict):
    """The time in a time zone."""

    zone: Literal["UTC", "CET"]


def convert(amount: Annotated[int, Field(ge=1, le=100)], currency: Literal["EUR", "USD"]) -> float:
    """Convert an amount of money.

    Args:
        amount: how much to convert
        currency: the currency to convert into
    """
    return float(amount)


@tool
def roll(sides: Literal[4, 6, 20]) -> int:
    """Roll a die with this many sides."""
    return sides


LOOKUP_SCHEMA: dict[str, Any] = {  # a JSON schema with a title: a tool, or a structured output schema
    "title": "lookup",
    "description": "Look a word up in a dictionary.",
    "type": "object",
    "properties": {
        "word": {"enum": ["parrot", "macaw"]},
        "lang": {"enum": ["en", "fr"]},
    },
    "required": ["word", "lang"],
    "additionalProperties": False,
}
OPENAI_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
# One of each kind bind_tools takes, by id.
TOOLS: dict[str, Any] = {
    "openai_tool": OPENAI_TOOL,
    "openai_function": OPENAI_TOOL["function"],
    "json_schema": LOOKUP_SCHEMA,
    "pydantic": Weather,
    "typeddict": Clock,
    "function": convert,
    "base_tool": roll,
}
ROLL_CHOICE = {"type": "function", "function": {"name": "roll"}}
TOOL_ROOM = 64  # tokens: a whole forced call to any tool above, in a one-call list


class Sent:
    """The JSON bodies of the chat requests a model sent, read by event hooks on its own httpx clients."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def record(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))

    async def arecord(self, request: httpx.Request) -> None:
        self.record(request)

    @property
    def last(self) -> dict[str, Any]:
        return self.bodies[-1]


@pytest.fixture
def sent() -> Sent:
    return Sent()


def recording_chat(url: str, sent: Sent, **clients: Any) -> ChatParrot:
    """A greedy tiny-model ChatParrot on ``url`` with the given httpx clients."""
    return ChatParrot(base_url=url, model="tiny", temperature=0, max_tokens=TOOL_ROOM, **clients)


@pytest.fixture
def chat(served: LaunchedServer, sent: Sent) -> Iterator[ChatParrot]:
    """A ChatParrot whose request bodies land in ``sent`` (sync calls)."""
    with httpx.Client(event_hooks={"request": [sent.record]}) as client:
        yield recording_chat(served.url, sent, http_client=client)


@pytest.fixture
async def achat(served: LaunchedServer, sent: Sent) -> AsyncIterator[ChatParrot]:
    """A ChatParrot whose request bodies land in ``sent``, sync and async calls (an async client belongs
    to the test's event loop, so it is made and closed there)."""
    with httpx.Client(event_hooks={"request": [sent.record]}) as client:
        async with httpx.AsyncClient(event_hooks={"request": [sent.arecord]}) as aclient:
            yield recording_chat(served.url, sent, http_client=client, http_async_client=aclient)


def openai_tool(kind: Any) -> dict[str, Any]:
    return convert_to_openai_tool(kind)


def assert_valid_call(message: BaseMessage, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """``message`` holds exactly one call, to one of ``tools``, with arguments valid under its schema."""
    assert isinstance(message, AIMessage) and not message.invalid_tool_calls
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    functions = {t["function"]["name"]: t["function"] for t in tools}
    assert call["name"] in functions and call["type"] == "tool_call"
    assert isinstance(call["id"], str) and call["id"]
    jsonschema.validate(call["args"], functions[call["name"]].get("parameters") or {"type": "object"})
    return dict(call)


def same_calls(message: BaseMessage) -> list[tuple[str, dict[str, Any]]]:
    """The calls without their ids (a new id per answer)."""
    assert isinstance(message, AIMessage)
    return [(c["name"], c["args"]) for c in message.tool_calls]


# ----------------------------------------------------------------------------------------- bind_tools
@pytest.mark.parametrize("kind", list(TOOLS))
def test_each_kind_of_tool_is_sent_as_an_openai_tool_and_called_validly(
    chat: ChatParrot, sent: Sent, kind: str
) -> None:
    tool_ = TOOLS[kind]
    expected = openai_tool(tool_)
    name = expected["function"]["name"]
    message = chat.bind_tools([tool_], tool_choice=name, parallel_tool_calls=False).invoke("Go.")
    assert sent.last["tools"] == [expected]
    assert sent.last["tool_choice"] == {"type": "function", "function": {"name": name}}
    assert sent.last["parallel_tool_calls"] is False
    assert assert_valid_call(message, [expected])["name"] == name
    assert message.content == "" and message.response_metadata["finish_reason"] == "tool_calls"
    assert message.usage_metadata is not None and message.usage_metadata["output_tokens"] > 0


@pytest.mark.parametrize(
    ("choice", "wire"),
    [
        ("any", "required"),
        ("required", "required"),
        ("convert", {"type": "function", "function": {"name": "convert"}}),
        (
            {"type": "function", "function": {"name": "roll"}},
            {"type": "function", "function": {"name": "roll"}},
        ),
    ],
    ids=["any", "required", "name", "dict"],
)
def test_a_forced_tool_choice_gets_a_valid_call(chat: ChatParrot, sent: Sent, choice: Any, wire: Any) -> None:
    tools: list[Any] = [Weather, convert, roll]
    message = chat.bind_tools(tools, tool_choice=choice, parallel_tool_calls=False).invoke("Help me.")
    assert sent.last["tool_choice"] == wire
    call = assert_valid_call(message, [openai_tool(t) for t in tools])
    if isinstance(wire, dict):
        assert call["name"] == wire["function"]["name"]


def test_tool_choice_true_forces_the_only_tool(chat: ChatParrot, sent: Sent) -> None:
    message = chat.bind_tools([roll], tool_choice=True, parallel_tool_calls=False).invoke("Roll.")
    assert sent.last["tool_choice"] == {"type": "function", "function": {"name": "roll"}}
    assert assert_valid_call(message, [openai_tool(roll)])["name"] == "roll"


@pytest.mark.parametrize(
    ("choice", "wire"), [("auto", "auto"), ("none", "none"), (None, None), (False, None)]
)
def test_an_unforced_tool_choice_is_the_models_decision(
    chat: ChatParrot, sent: Sent, choice: Any, wire: str | None
) -> None:
    # The random model answers text here; what is checked is the request and that an answer comes back.
    message = chat.bind_tools([Weather], tool_choice=choice).invoke("Hello", max_tokens=4)
    assert sent.last.get("tool_choice") == wire
    assert sent.last["tools"] == [openai_tool(Weather)] and "parallel_tool_calls" not in sent.last
    assert isinstance(message, AIMessage) and message.response_metadata["finish_reason"] == "length"


def test_parallel_tool_calls_is_sent_as_given(chat: ChatParrot, sent: Sent) -> None:
    """Several calls may then come back (the random model makes one here; several calls in an answer
    are parsed in `test_answers_with_several_or_bad_calls_parse_like_chatopenais`)."""
    message = chat.bind_tools([roll], tool_choice="any", parallel_tool_calls=True).invoke("Roll.")
    assert sent.last["parallel_tool_calls"] is True
    assert isinstance(message, AIMessage) and message.tool_calls and not message.invalid_tool_calls
    for call in message.tool_calls:
        jsonschema.validate(call["args"], openai_tool(roll)["function"]["parameters"])


@pytest.mark.parametrize(
    ("tools", "choice", "match"),
    [
        ([Weather, roll], True, "only tool"),
        ([Weather], "get_weather", "one of the bound tools' names"),
        ([Weather], 3, "tool_choice must be"),
    ],
)
def test_a_tool_choice_that_names_no_bound_tool_is_refused_before_a_request(
    chat: ChatParrot, sent: Sent, tools: list[Any], choice: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        chat.bind_tools(tools, tool_choice=choice)
    assert sent.bodies == []


def test_tools_given_at_call_time_go_as_they_are(chat: ChatParrot, sent: Sent) -> None:
    """``invoke(tools=...)`` (or ``.bind(tools=...)``) takes OpenAI tools as ChatOpenAI does."""
    message = chat.invoke("Time?", tools=[OPENAI_TOOL], tool_choice="required", parallel_tool_calls=False)
    assert sent.last["tools"] == [OPENAI_TOOL]
    assert_valid_call(message, [OPENAI_TOOL])
    with pytest.raises(TypeError, match=r"tools\[0\].*bind_tools"):
        chat.invoke("Time?", tools=[Weather])
    assert len(sent.bodies) == 1


# ------------------------------------------------------------------------------------------ streaming
def test_streamed_tool_call_chunks_add_up_to_the_invoked_calls(chat: ChatParrot, sent: Sent) -> None:
    model = chat.bind_tools([Weather, convert], tool_choice="any", parallel_tool_calls=False)
    invoked = model.invoke("Weather?")
    chunks = list(model.stream("Weather?"))
    assert sent.last["stream"] is True and sent.last["tools"] == sent.bodies[0]["tools"]
    assert any(c.tool_call_chunks for c in chunks)
    for chunk in chunks:  # each chunk's pieces carry their list index, for adding up
        assert all(piece["index"] is not None for piece in chunk.tool_call_chunks)
    full = sum(chunks[1:], chunks[0])
    assert isinstance(full, AIMessageChunk) and full.chunk_position == "last"
    assert same_calls(full) == same_calls(invoked)
    assert full.response_metadata["finish_reason"] == "tool_calls"
    assert full.usage_metadata == invoked.usage_metadata


def test_a_streaming_model_invoke_parses_tool_calls_too(chat: ChatParrot, sent: Sent) -> None:
    """``streaming=True`` makes ``invoke`` read the stream (tokens to callbacks): same calls."""
    streaming = chat.model_copy(update={"streaming": True})
    model = streaming.bind_tools([Weather], tool_choice="any", parallel_tool_calls=False)
    message = model.invoke("Weather?")
    assert sent.last["stream"] is True
    assert same_calls(message) == same_calls(
        chat.bind_tools([Weather], tool_choice="any", parallel_tool_calls=False).invoke("Weather?")
    )


async def test_async_tool_calls_and_their_stream_match_the_sync_ones(achat: ChatParrot, sent: Sent) -> None:
    model = achat.bind_tools([Weather, roll], tool_choice="any", parallel_tool_calls=False)
    sync = model.invoke("Weather?")
    message = await model.ainvoke("Weather?")
    chunks = [c async for c in model.astream("Weather?")]
    full = sum(chunks[1:], chunks[0])
    assert same_calls(message) == same_calls(full) == same_calls(sync)
    assert_valid_call(message, [openai_tool(Weather), openai_tool(roll)])
    assert [b["stream"] for b in sent.bodies] == [False, False, True]


# -------------------------------------------------------------------------------------- tool results
def test_a_tool_result_goes_back_in_the_conversation(
    chat: ChatParrot, sent: Sent, served: LaunchedServer, recorder: PromptRecorder
) -> None:
    model = chat.bind_tools([Weather], tool_choice="any", parallel_tool_calls=False)
    question = HumanMessage("Weather in Lima?")
    ai = model.invoke([question])
    call = assert_valid_call(ai, [openai_tool(Weather)])
    result = ToolMessage("sunny-and-42", tool_call_id=call["id"], name="Weather")
    mark = recorder.mark()
    answer = chat.bind_tools([Weather]).invoke([question, ai, result], max_tokens=4)
    assert isinstance(answer, AIMessage)
    assert sent.last["messages"] == [
        {"role": "user", "content": "Weather in Lima?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": "Weather", "arguments": json.dumps(call["args"])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny-and-42"},
    ]
    # The model really saw the call and its result (the server renders both into the prompt).
    prompt = served.engines[0].tokenizer.decode(recorder.since(mark)[-1])
    assert "sunny-and-42" in prompt and json.dumps(call["args"]) in prompt


def test_history_tool_calls_drop_their_content_blocks_and_keep_invalid_calls(
    chat: ChatParrot, sent: Sent
) -> None:
    """An Anthropic-style AI message (a ``tool_use`` block beside ``tool_calls``) sends its text only; a
    call the model wrote badly (``invalid_tool_calls``) goes back as it was written."""
    ai = AIMessage(
        content=[{"type": "text", "text": "Let me check."}, {"type": "tool_use", "id": "a", "name": "roll"}],
        tool_calls=[{"name": "roll", "args": {"sides": 6}, "id": "a", "type": "tool_call"}],
        invalid_tool_calls=[
            {"name": "roll", "args": "{sides:", "id": "b", "error": "bad", "type": "invalid_tool_call"}
        ],
    )
    messages = [
        HumanMessage("Roll twice"),
        ai,
        ToolMessage("4", tool_call_id="a"),
        ToolMessage("?", tool_call_id="b"),
    ]
    chat.bind_tools([roll]).invoke(messages, max_tokens=2)
    assistant = sent.last["messages"][1]
    assert assistant["content"] == "Let me check."
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == ['{"sides": 6}', "{sides:"]
    assert [m.get("tool_call_id") for m in sent.last["messages"][2:]] == ["a", "b"]


def test_a_tool_result_answering_no_call_is_refused_before_a_request(chat: ChatParrot, sent: Sent) -> None:
    ai = AIMessage("", tool_calls=[{"name": "roll", "args": {"sides": 6}, "id": "a", "type": "tool_call"}])
    with pytest.raises(UnsupportedInputError, match="'b', which no earlier AI message made"):
        chat.invoke([HumanMessage("Roll"), ai, ToolMessage("4", tool_call_id="b")])
    assert sent.bodies == []


def test_answers_with_several_or_bad_calls_parse_like_chatopenais() -> None:
    """Several calls keep their order, whole or streamed (by index); arguments that are not JSON make
    an invalid tool call. The server's calls are valid by construction; a proxy's may not be."""
    raw = [
        {"id": "a", "type": "function", "function": {"name": "roll", "arguments": '{"sides": 6}'}},
        {"id": "b", "type": "function", "function": {"name": "roll", "arguments": '{"sides": 20}'}},
        {"id": "c", "type": "function", "function": {"name": "roll", "arguments": "sides=4"}},
    ]
    calls, invalid = parse_tool_calls(raw)
    assert [(c["id"], c["args"]) for c in calls] == [("a", {"sides": 6}), ("b", {"sides": 20})]
    assert [(c["id"], c["args"]) for c in invalid] == [("c", "sides=4")] and invalid[0]["error"]
    pieces = [
        AIMessageChunk(content="", tool_call_chunks=stream_tool_call_chunks([{"index": i, **call}]))
        for i, call in enumerate(raw)
    ]
    streamed = sum(pieces[1:], pieces[0])
    assert streamed.tool_calls == calls
    assert [c["id"] for c in streamed.invalid_tool_calls] == ["c"]


# ---------------------------------------------------------------------------- with_structured_output
SCHEMAS: dict[str, Any] = {"pydantic": Weather, "typeddict": Clock, "json_schema": LOOKUP_SCHEMA}


def check_structured(value: Any, schema: Any) -> None:
    """A pydantic schema answers its instance; any other a dict valid under the schema's JSON schema."""
    if schema is Weather:
        assert isinstance(value, Weather)
    else:
        assert isinstance(value, dict)
        jsonschema.validate(value, convert_to_openai_tool(schema)["function"]["parameters"])


@pytest.mark.parametrize("kind", list(SCHEMAS))
def test_json_schema_method_answers_in_the_schema(chat: ChatParrot, sent: Sent, kind: str) -> None:
    schema = SCHEMAS[kind]
    value = chat.with_structured_output(schema).invoke("Answer.")  # json_schema: the default method
    check_structured(value, schema)
    function = convert_to_openai_tool(schema)["function"]
    assert sent.last["response_format"] == {
        "type": "json_schema",
        "json_schema": {
            "name": function["name"],
            "schema": function["parameters"],
            "description": function["description"],
        },
    }
    assert "tools" not in sent.last


@pytest.mark.parametrize("kind", list(SCHEMAS))
def test_function_calling_method_answers_in_the_schema(chat: ChatParrot, sent: Sent, kind: str) -> None:
    schema = SCHEMAS[kind]
    value = chat.with_structured_output(schema, method="function_calling").invoke("Answer.")
    check_structured(value, schema)
    name = convert_to_openai_tool(schema)["function"]["name"]
    assert sent.last["tools"] == [convert_to_openai_tool(schema)]
    assert sent.last["tool_choice"] == {"type": "function", "function": {"name": name}}
    assert sent.last["parallel_tool_calls"] is False and "response_format" not in sent.last


def test_strict_reaches_the_schema_and_the_request(chat: ChatParrot, sent: Sent) -> None:
    chat.with_structured_output(Clock, strict=True).invoke("Answer.")
    spec = sent.last["response_format"]["json_schema"]
    assert spec["strict"] is True and spec["schema"]["additionalProperties"] is False
    chat.with_structured_output(Clock, method="function_calling", strict=True).invoke("Answer.")
    assert sent.last["tools"][0]["function"]["strict"] is True


def test_an_openai_response_format_schema_goes_as_it_is(chat: ChatParrot, sent: Sent) -> None:
    spec = {"name": "lookup", "schema": {k: v for k, v in LOOKUP_SCHEMA.items() if k != "title"}}
    value = chat.with_structured_output(spec).invoke("Answer.")
    assert sent.last["response_format"] == {"type": "json_schema", "json_schema": spec}
    jsonschema.validate(value, spec["schema"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_include_raw_answers_the_message_and_the_parsed_value(chat: ChatParrot, method: Any) -> None:
    out = chat.with_structured_output(Weather, method=method, include_raw=True).invoke("Answer.")
    assert set(out) == {"raw", "parsed", "parsing_error"}
    assert isinstance(out["raw"], AIMessage) and isinstance(out["parsed"], Weather)
    assert out["parsing_error"] is None


def test_include_raw_returns_a_cut_answer_and_its_parsing_error(chat: ChatParrot) -> None:
    """Three tokens cannot hold a Weather object: the parse fails, and include_raw says so instead of
    raising (without include_raw, the parser's error is raised)."""
    short = chat.model_copy(update={"max_tokens": 3})
    out = short.with_structured_output(Weather, include_raw=True).invoke("Answer.")
    assert out["raw"].response_metadata["finish_reason"] == "length"
    assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)
    with pytest.raises(OutputParserException):
        short.with_structured_output(Weather).invoke("Answer.")


def test_json_mode_asks_for_a_json_object(chat: ChatParrot, sent: Sent) -> None:
    """JSON mode constrains the answer to a JSON object (the random model never finishes one, so the
    parse fails, which include_raw reports)."""
    out = chat.with_structured_output(Weather, method="json_mode", include_raw=True).invoke("JSON please.")
    assert sent.last["response_format"] == {"type": "json_object"}
    assert str(out["raw"].content).startswith("{")
    assert (out["parsed"] is None) != (out["parsing_error"] is None)
    assert out["parsed"] is None or isinstance(out["parsed"], Weather)
    chat.with_structured_output(method="json_mode").invoke("JSON please.", max_tokens=2)  # no schema needed
    assert sent.last["response_format"] == {"type": "json_object"}


def test_structured_output_streams_and_runs_async(chat: ChatParrot) -> None:
    structured = chat.with_structured_output(LOOKUP_SCHEMA)
    value = structured.invoke("Answer.")
    parts = list(structured.stream("Answer."))
    assert parts and parts[-1] == value  # JSON streams as growing partial dicts
    assert all(set(part) <= set(LOOKUP_SCHEMA["properties"]) for part in parts)


async def test_structured_output_async_matches_sync(achat: ChatParrot, sent: Sent) -> None:
    for method in ("json_schema", "function_calling"):
        structured = achat.with_structured_output(Weather, method=method)  # type: ignore[arg-type]
        sync = structured.invoke("Answer.")
        assert await structured.ainvoke("Answer.") == sync
        streamed: AsyncIterator[Any] = structured.astream("Answer.")
        parts = [part async for part in streamed]
        assert parts[-1] == sync and all(isinstance(p, Weather) for p in parts)
    assert [b["stream"] for b in sent.bodies] == [False, False, True] * 2


@pytest.mark.parametrize(
    ("schema", "kwargs", "match"),
    [
        (
            Weather,
            {"method": "xml"},
            r"method must be one of \['json_schema', 'function_calling', 'json_mode'\]",
        ),
        (None, {"method": "json_schema"}, "needs a schema"),
        (Weather, {"method": "json_mode", "strict": True}, "strict"),
        (Weather, {"tools": []}, "unsupported arguments"),
    ],
)
def test_unsupported_structured_output_arguments_are_refused(
    chat: ChatParrot, sent: Sent, schema: Any, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        chat.with_structured_output(schema, **kwargs)
    assert sent.bodies == []


def test_structured_output_reports_its_schema_to_callbacks(chat: ChatParrot) -> None:
    """LangChain's ``ls_structured_output_format`` (tracing) names the method and the schema, and is never
    sent to the server."""
    seen: list[dict[str, Any]] = []

    class Handler(BaseCallbackHandler):
        def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
            seen.append(kwargs["options"])

    chat.with_structured_output(Clock, method="function_calling").invoke(
        "Answer.", config={"callbacks": [Handler()]}
    )
    options = seen[0]["ls_structured_output_format"]
    assert options["kwargs"] == {"method": "function_calling", "strict": None}
    assert options["schema"]["title"] == "Clock"
