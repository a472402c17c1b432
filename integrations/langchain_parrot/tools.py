"""Tool calling for `ChatParrot`: LangChain tools, tool choices, tool calls and tool results in the
OpenAI shapes of the server's ``/v1/chat/completions`` (``tools``, ``tool_choice``, ``message.tool_calls``,
``role: "tool"`` messages), and back.

The server offers the tools to the model in its chat template (or a Hermes-format system message) and, for
a forced choice (``"required"`` or a named function), constrains the answer to a JSON list of calls whose
arguments are valid under each tool's parameter schema (see ``server/http/openai_tools.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, cast

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.messages.tool import InvalidToolCall, ToolCall, ToolCallChunk, tool_call_chunk
from langchain_core.output_parsers.openai_tools import make_invalid_tool_call, parse_tool_call
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from langchain_parrot.errors import UnsupportedInputError
from langchain_parrot.messages import message_text, to_wire_messages

__all__ = [
    "ToolLike",
    "check_wire_tools",
    "openai_tool_choice",
    "openai_tools",
    "parse_tool_calls",
    "stream_tool_call_chunks",
    "to_wire_messages_with_tools",
]

ToolLike = dict[str, Any] | type | Callable[..., Any] | BaseTool
"""What `ChatParrot.bind_tools` takes: an OpenAI tool or function dict, a JSON schema with a ``title``, a
pydantic class, a TypedDict, a function with a docstring, or a LangChain `BaseTool`."""

# tool_choice values the server takes as they are; LangChain's "any" means OpenAI's "required".
_CHOICE_KEYWORDS = frozenset({"auto", "none", "required"})

# Content blocks that repeat an AI message's tool calls (Anthropic's "tool_use", LangChain v1 output's
# "tool_call"): the calls go in the OpenAI ``tool_calls`` field, so these are dropped from the text.
_CALL_BLOCKS = frozenset({"tool_use", "tool_call", "invalid_tool_call"})


def openai_tools(tools: Sequence[ToolLike], strict: bool | None = None) -> list[dict[str, Any]]:
    """``tools`` as OpenAI function tools (LangChain's own `convert_to_openai_tool`)."""
    return [convert_to_openai_tool(tool, strict=strict) for tool in tools]


def _function_choice(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def openai_tool_choice(tool_choice: dict[str, Any] | str | bool | None, names: Sequence[str]) -> Any:
    """LangChain's ``tool_choice`` as OpenAI's, for tools named ``names``; None: leave it to the server
    (which means ``"auto"`` when tools are given).

    A tool's name forces that tool; ``"any"`` (LangChain's word) and ``"required"`` force some tool;
    ``True`` forces the only tool; ``"auto"``, ``"none"`` and a dict go as they are. Anything else is a
    `ValueError` here rather than a 400 from the server.
    """
    if tool_choice is None or tool_choice is False:
        return None
    if isinstance(tool_choice, dict):
        return tool_choice
    if tool_choice is True:
        if len(names) != 1:
            raise ValueError(
                f"tool_choice=True forces the only tool, but {len(names)} tools are bound ({list(names)}): "
                "name the tool to call, or use 'any'"
            )
        return _function_choice(names[0])
    if isinstance(tool_choice, str):
        if tool_choice in names:  # a tool's name wins over a keyword, as in ChatOpenAI
            return _function_choice(tool_choice)
        if tool_choice == "any":
            return "required"
        if tool_choice in _CHOICE_KEYWORDS:
            return tool_choice
    raise ValueError(
        f"tool_choice must be 'auto', 'none', 'any', 'required', True, a dict or one of the bound tools' "
        f"names {list(names)}; got {tool_choice!r}"
    )


def check_wire_tools(tools: Any, owner: str) -> None:
    """Refuse, before a request, a call-time ``tools`` that is not a list of OpenAI function tools.

    ``bind_tools`` converts every kind of tool; ``invoke(..., tools=...)`` and ``.bind(tools=...)`` pass
    theirs through, as ChatOpenAI does, so a malformed one is named here instead of by a 400.
    """
    items = tools if isinstance(tools, (list, tuple)) else [tools]
    for i, tool in enumerate(items):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(function, dict)
            and isinstance(function.get("name"), str)
        ):
            raise TypeError(
                f"{owner} got unsupported call argument tools[{i}]={tool!r}: the server takes OpenAI "
                "function tools {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}; "
                "bind_tools(...) converts pydantic classes, functions, BaseTools and dicts into them"
            )


# ------------------------------------------------------------------------------------- messages out
def to_wire_messages_with_tools(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """The chat endpoint's messages for ``messages``, tool calls and tool results included: an AI message
    with tool calls becomes an assistant message with OpenAI ``tool_calls``, a `ToolMessage` a ``tool``
    message. Every other message converts as `to_wire_messages` does (names kept).

    A tool result must answer a call an earlier AI message made (OpenAI's rule too): one that does not is
    an `UnsupportedInputError`, since the model would read an answer to a question it never asked.
    """
    wire: list[dict[str, Any]] = []
    calls_made: set[str] = set()
    for message in messages:
        if isinstance(message, AIMessage) and (message.tool_calls or message.invalid_tool_calls):
            item = _assistant_with_calls(message)
            calls_made.update(call["id"] for call in item["tool_calls"])
            wire.append(item)
        elif isinstance(message, ToolMessage):
            if message.tool_call_id not in calls_made:
                raise UnsupportedInputError(
                    f"a ToolMessage answers tool call {message.tool_call_id!r}, which no earlier AI message "
                    f"made (calls made so far: {sorted(calls_made) or 'none'})"
                )
            wire.append(
                {"role": "tool", "tool_call_id": message.tool_call_id, "content": message_text(message)}
            )
        else:
            wire.extend(to_wire_messages([message], names=True))
    return wire


def _assistant_with_calls(message: AIMessage) -> dict[str, Any]:
    content = message.content
    if not isinstance(content, str):
        content = [b for b in content if not (isinstance(b, dict) and b.get("type") in _CALL_BLOCKS)]
    text = message_text(message.model_copy(update={"content": content}))
    # The id only pairs a result with its call (the model sees names and arguments), so a call made
    # without one (LangChain allows it) is sent with an empty id rather than refused.
    calls = [
        _wire_call(call.get("id"), call["name"], json.dumps(call["args"], ensure_ascii=False))
        for call in message.tool_calls
    ]
    calls += [  # kept as the model wrote them, so the conversation shows what it really answered
        _wire_call(call.get("id"), call.get("name") or "", call.get("args") or "")
        for call in message.invalid_tool_calls
    ]
    item: dict[str, Any] = {"role": "assistant", "content": text or None, "tool_calls": calls}
    if message.name:
        item["name"] = message.name
    return item


def _wire_call(call_id: str | None, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id or "", "type": "function", "function": {"name": name, "arguments": arguments}}


# --------------------------------------------------------------------------------------- answers in
def parse_tool_calls(raw_calls: list[dict[str, Any]] | None) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    """An answer's OpenAI ``tool_calls`` as LangChain tool calls, and those whose arguments are not JSON
    as invalid tool calls (LangChain's own parser, so errors read as ChatOpenAI's do)."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for raw in raw_calls or []:
        try:
            parsed = parse_tool_call(raw, return_id=True)
        except Exception as e:  # LangChain's parser raises OutputParserException, or KeyError on odd shapes
            invalid.append(make_invalid_tool_call(raw, str(e)))
        else:
            if parsed is not None:
                calls.append(cast(ToolCall, parsed))
    return calls, invalid


def stream_tool_call_chunks(raw_calls: list[dict[str, Any]] | None) -> list[ToolCallChunk]:
    """A streamed delta's ``tool_calls`` as tool call chunks (added up, they parse into tool calls)."""
    chunks = []
    for raw in raw_calls or []:
        function = raw.get("function") or {}
        chunks.append(
            tool_call_chunk(
                name=function.get("name"),
                args=function.get("arguments"),
                id=raw.get("id"),
                index=raw.get("index"),
            )
        )
    return chunks
