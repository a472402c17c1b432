"""LangChain messages as the ``{"role", "content"}`` dicts of the server's chat endpoint.

One conversion serves both paths: the body of ``POST /v1/chat/completions`` (`ChatParrot` used directly)
and the messages a `ChatFormat` renders into a template (`compile_chain`), so both see the same roles and
the same text. Anything neither takes as text (images, audio, files) is an `UnsupportedInputError` here,
before a request. Tool calls and tool results are `langchain_parrot.tools`' (the chat endpoint takes them);
a compiled chain's template renders text turns only, so there they are refused too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from langchain_parrot.errors import UnsupportedInputError

__all__ = ["message_text", "to_wire_messages"]

# The roles the server's chat endpoint takes ("developer" is read as "system" there).
_ROLES = frozenset({"system", "developer", "user", "assistant"})


def message_text(message: BaseMessage) -> str:
    """The text of a message: its string content, or its text blocks joined.

    Raises `UnsupportedInputError` for any other block (image, audio, file, tool use...).
    """
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise UnsupportedInputError(
                f"a {message.type} message has a {kind!r} content block: the Parrot server takes text only"
            )
    return "".join(parts)


def _role(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        if message.tool_calls or message.invalid_tool_calls:
            raise UnsupportedInputError(
                "an AI message with tool calls in a prompt rendered as text (a compiled chain's template "
                "takes text turns only): call the model directly, as bind_tools does, for tool calling"
            )
        return "assistant"
    if isinstance(message, ChatMessage):
        role = "user" if message.role == "human" else "assistant" if message.role == "ai" else message.role
        if role not in _ROLES:
            raise UnsupportedInputError(
                f"chat message role {message.role!r} is not one the server takes ({sorted(_ROLES)})"
            )
        return role
    if isinstance(message, (ToolMessage, FunctionMessage)):
        raise UnsupportedInputError(
            f"a {type(message).__name__} in a prompt rendered as text (a compiled chain's template takes "
            "text turns only): call the model directly, as bind_tools does, to send tool results"
        )
    raise UnsupportedInputError(f"unsupported message type {type(message).__name__} ({message.type!r})")


def to_wire_messages(messages: Sequence[BaseMessage], *, names: bool = False) -> list[dict[str, Any]]:
    """``[{"role", "content"}]`` for ``messages``; with ``names``, a message's ``name`` is kept too."""
    wire: list[dict[str, Any]] = []
    for message in messages:
        item: dict[str, Any] = {"role": _role(message), "content": message_text(message)}
        if names and message.name:
            item["name"] = message.name
        wire.append(item)
    return wire
