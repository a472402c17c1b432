"""Structured output and tool calls on the OpenAI endpoints, as pure functions over the request.

``response_format`` and vLLM's ``structured_outputs`` become a `GuidedDecoding` constraint. Tools are
offered to the model in its chat template when the template takes them, else in a system message in the
Hermes format most small instruct models (SmolLM2 among them) were trained on: tool signatures inside
``<tools>`` and calls answered as JSON inside ``<tool_call>``. ``tool_choice="required"`` or a named
function constrains the answer to a JSON list of calls (valid by construction, as vLLM does); ``"auto"``
lets the model choose and parses the calls it made.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from parrot.openai_types import OpenAIChatMessage, OpenAIFunctionCall, OpenAIToolCall

from server.engine.errors import InvalidSamplingParamsError
from server.engine.guided import guided_from_structured_outputs
from server.engine.sampling import GuidedDecoding


class ToolRequestError(ValueError):
    """A ``tools``, ``tool_choice`` or ``response_format`` the server cannot honour; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def guided_for_request(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> GuidedDecoding | None:
    """The constraint ``response_format`` (OpenAI's) or ``structured_outputs`` (vLLM's) asks for."""
    if response_format is not None and structured_outputs is not None:
        raise ToolRequestError("give response_format or structured_outputs, not both", "response_format")
    if structured_outputs is not None:
        try:
            return guided_from_structured_outputs(structured_outputs)
        except InvalidSamplingParamsError as e:
            raise ToolRequestError(str(e), "structured_outputs") from None
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ToolRequestError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                "response_format",
            )
        return GuidedDecoding("json_schema", json.dumps(schema))
    raise ToolRequestError(
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
        "response_format",
    )


def functions_of(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """The function tools by name (their OpenAI ``function`` objects); other tool types are refused."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolRequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                "tools",
            )
        out[fn["name"]] = fn
    return out


def chosen_functions(functions: dict[str, dict[str, Any]], tool_choice: Any) -> tuple[str, list[str]]:
    """``(mode, names)``: mode "none", "auto" or "required" and the functions a call may name."""
    if not functions:
        if tool_choice not in (None, "none", "auto"):
            raise ToolRequestError("tool_choice needs tools", "tool_choice")
        return "none", []
    if tool_choice in (None, "auto"):
        return "auto", list(functions)
    if tool_choice in ("none", "required"):
        return tool_choice, ([] if tool_choice == "none" else list(functions))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name not in functions:
        raise ToolRequestError(
            f"tool_choice must be 'none', 'auto', 'required' or a function among {sorted(functions)}, "
            f"got {tool_choice!r}",
            "tool_choice",
        )
    return "required", [name]


def calls_schema(functions: dict[str, dict[str, Any]], names: list[str], parallel: bool) -> GuidedDecoding:
    """A JSON list of calls ``[{"name": ..., "arguments": {...}}]`` to the named functions, each call's
    arguments valid under its function's parameter schema; laid out compactly (a machine format: every
    token goes to the calls, so more of them fit in ``max_tokens``)."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": name},
                "arguments": functions[name].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in names
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return GuidedDecoding("json_schema", json.dumps(schema), compact=True)


def tool_system_prompt(functions: dict[str, dict[str, Any]]) -> str:
    """The Hermes-format tool preamble for a chat template that does not take ``tools`` itself."""
    signatures = json.dumps(list(functions.values()))
    return (
        "You can call functions. Given the user's question and the functions below, decide whether one or "
        "more function calls answer it. If none fits, or a required argument is missing, answer in plain "
        f"text instead.\n\nThe functions you can call:\n<tools>{signatures}</tools>\n\n"
        "To call functions, answer with nothing but the calls, in this format:\n"
        '<tool_call>[{"name": "function_name", "arguments": {"argument": "value"}}]</tool_call>'
    )


def render_messages(messages: list[OpenAIChatMessage]) -> list[dict[str, str]]:
    """The messages as a chat template takes them: ``developer`` as ``system``; an assistant's tool calls
    and a tool's answer as text in the same Hermes format the tools were offered in."""
    out = []
    for m in messages:
        content = m.text()
        if m.tool_calls:
            calls = [
                {"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls
            ]
            content = (content + "\n" if content else "") + f"<tool_call>{json.dumps(calls)}</tool_call>"
        if m.role == "tool":
            content = f"<tool_response>{content}</tool_response>"
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def with_tool_preamble(
    messages: list[dict[str, str]], functions: dict[str, dict[str, Any]]
) -> list[dict[str, str]]:
    """``messages`` with the tool preamble added to (or as) the system message."""
    preamble = tool_system_prompt(functions)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + preamble}, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def parse_tool_calls(
    text: str, functions: dict[str, dict[str, Any]], constrained: bool
) -> tuple[str | None, list[OpenAIToolCall]]:
    """The content and the calls of an answer: a constrained answer is the JSON list itself; a free one
    holds calls inside ``<tool_call>`` tags (a call naming no offered function stays content). A list cut
    short (``max_tokens``) keeps the calls it completed."""
    if constrained:
        return None, [_call(c) for c in _as_calls(_complete_json(text), functions)]
    calls: list[OpenAIToolCall] = []
    for block in _TOOL_CALL.findall(text):
        calls.extend(_call(c) for c in _as_calls(_complete_json(block), functions))
    if not calls:
        return text, []
    content = _TOOL_CALL.sub("", text).strip()
    return content or None, calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _complete_json(text: str) -> Any:
    """The JSON value of ``text``; of a list cut short, its complete items (None if not JSON at all)."""
    value = _loads(text)
    if value is not None or not text.lstrip().startswith("["):
        return value
    decoder, items = json.JSONDecoder(), list[Any]()
    at = text.index("[") + 1
    while True:
        at = _after_space(text, at)
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)
        at = _after_space(text, at)
        if not text.startswith(",", at):
            return items
        at += 1


def _after_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _as_calls(value: Any, functions: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    items = value if isinstance(value, list) else [value]
    return [
        c
        for c in items
        if isinstance(c, dict) and c.get("name") in functions and isinstance(c.get("arguments", {}), dict)
    ]


def _call(call: dict[str, Any]) -> OpenAIToolCall:
    arguments = json.dumps(call.get("arguments", {}))
    function = OpenAIFunctionCall(name=call["name"], arguments=arguments)
    return OpenAIToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=function)


def _arguments(text: str) -> Any:
    parsed = _loads(text)
    return parsed if parsed is not None else text
