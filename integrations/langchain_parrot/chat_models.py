"""`ChatParrot`: a LangChain chat model served by a Parrot server.

Used directly (``invoke``, ``batch``, ``stream`` and their async forms) it behaves like any OpenAI-style
chat model: the messages go to the server's ``/v1/chat/completions``, which renders them with the model's
chat template. Inside `compile_chain` the same model becomes part of an unrendered semantic function call
(see `langchain_parrot.compile`), which needs `chat_format` to render the messages exactly as the server's
chat endpoint would.

```python
from langchain_parrot import ChatParrot

chat = ChatParrot(base_url="http://127.0.0.1:9000", max_tokens=64)
chat.invoke("Write a haiku about parrots")
```

Tools and structured output (`ChatParrot.bind_tools`, `ChatParrot.with_structured_output`) always go to the
chat endpoint, which enforces a forced tool call or a JSON schema by constrained decoding.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import (
    BaseOutputParser,
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, Field, PrivateAttr

from langchain_parrot._base import CallParams, ParrotModelBase
from langchain_parrot.chat_format import ChatFormat
from langchain_parrot.tools import (
    ToolLike,
    check_wire_tools,
    openai_tool_choice,
    openai_tools,
    parse_tool_calls,
    stream_tool_call_chunks,
    to_wire_messages_with_tools,
)

__all__ = ["ChatParrot", "usage_metadata"]

_CHAT_PATH = "/v1/chat/completions"

# Request fields beyond sampling that a call may carry: `ChatParrot.bind_tools` and
# `ChatParrot.with_structured_output` bind them, and they go into the request body as they are.
_REQUEST_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")

StructuredOutputMethod = Literal["json_schema", "function_calling", "json_mode"]
_METHODS: tuple[StructuredOutputMethod, ...] = ("json_schema", "function_calling", "json_mode")


def usage_metadata(usage: dict[str, Any] | None) -> UsageMetadata | None:
    """LangChain's usage metadata from an OpenAI-style ``usage`` object (None when absent)."""
    if not usage:
        return None
    prompt = int(usage.get("prompt_tokens", 0))
    completion = int(usage.get("completion_tokens", 0))
    return UsageMetadata(
        input_tokens=prompt,
        output_tokens=completion,
        total_tokens=int(usage.get("total_tokens", prompt + completion)),
    )


class ChatParrot(ParrotModelBase, BaseChatModel):
    """Chat model on a Parrot server's OpenAI-compatible chat endpoint.

    Setup: a running server (``python -m server``) or ``server.launch()``; ``base_url`` points at it (env
    ``PARROT_BASE_URL``), as ``http://host:9000`` or, as OpenAI-style clients take it, ``http://host:9000/v1``.
    Key arguments: ``model`` (default: the server's), ``temperature`` (default 0,
    greedy), ``max_tokens`` (None: until EOS or the window's end), ``stop``, ``top_p``, ``top_k``,
    ``seed``, ``timeout`` and ``max_retries`` (transport errors and 429/502/503/504 are retried with
    backoff; a server that stays down raises `parrot.ConnectionError` naming the URL).

    ``batch`` sends its inputs concurrently; ``stream`` yields tokens as the engine generates them;
    responses carry ``usage_metadata`` and ``response_metadata`` (``model_name``, ``finish_reason``).
    Token counts (``get_num_tokens``, ``get_num_tokens_from_messages``, ``trim_messages(...,
    token_counter=chat)``) use the server's tokenizer. Sampling values the engine would refuse
    (``temperature=-1``, ``top_p=0``, ``max_tokens=0``) raise at construction.

    ``bind_tools`` offers tools (OpenAI function tools, made from pydantic classes, functions, BaseTools or
    dicts); answers carry ``tool_calls`` (streamed as ``tool_call_chunks``), and AI messages with tool
    calls and `ToolMessage` results go back in the conversation. ``with_structured_output`` returns
    pydantic objects or dicts by JSON schema (the default), a forced tool call, or JSON mode. A forced
    tool call and a JSON schema are enforced by constrained decoding: the answer is valid by construction
    when it ends within ``max_tokens``. The server takes no image, audio or file inputs.

    `compile_chain` renders this model's chat prompts server-side with the model's chat template, which the
    server publishes (``GET /v1/models``, read once on first compile); ``chat_format`` (a `ChatFormat`, or
    the path of the model's Hugging Face folder) overrides it. A model whose server publishes no chat
    template runs its steps of a compiled chain client-side.
    """

    chat_format: ChatFormat | str | Path | None = Field(default=None, exclude=True)
    """The model's chat template (`ChatFormat`, or a local Hugging Face folder), for `compile_chain`."""

    _format: ChatFormat | None = PrivateAttr(default=None)

    @property
    def _llm_type(self) -> str:
        return "parrot-chat"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_parrot", "chat_models"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "PARROT_API_KEY"}

    def resolved_chat_format(self) -> ChatFormat | None:
        """`chat_format` as a `ChatFormat` (a folder is loaded once); when not given, the chat template the
        server publishes for this model (``GET /v1/models``, read once); None when it publishes none."""
        if self._format is None:
            given = self.chat_format
            if isinstance(given, ChatFormat):
                self._format = given
            elif given is not None:
                self._format = ChatFormat.from_pretrained(given)
            else:
                self._format = ChatFormat.from_card(self._served_card())
        return self._format

    def _served_card(self) -> dict[str, Any]:
        """The server's ``/v1/models`` card of this model (of the default model when ``model`` is None)."""
        cards = self.connection.get("/v1/models").get("data") or []
        for card in cards:
            if self.model is None or card.get("id") == self.model:
                return dict(card)
        served = ", ".join(repr(c.get("id")) for c in cards) or "none"
        raise ValueError(
            f"the Parrot server at {self.base_url} does not serve {self.model!r}; it serves {served}"
        )

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._parrot_ls_params("chat", stop, kwargs)

    # ------------------------------------------------------------------------- tools, structured output
    def bind_tools(
        self,
        tools: Sequence[ToolLike],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` offered on every call (ChatOpenAI's ``bind_tools``).

        Args:
            tools: OpenAI tool or function dicts, JSON schemas with a ``title``, pydantic classes,
                TypedDicts, functions with docstrings or BaseTools (converted by LangChain's
                ``convert_to_openai_tool``).
            tool_choice: None or ``"auto"`` (the model decides), ``"none"``, ``"any"`` or ``"required"``
                (some tool must be called), a tool's name (that tool), True (the only tool), or an OpenAI
                ``{"type": "function", "function": {"name": ...}}``. A forced call is valid JSON under the
                tool's schema by construction.
            parallel_tool_calls: False allows one call per answer (the server's default allows several).
            strict: passed to ``convert_to_openai_tool`` (OpenAI's strict schemas: every property
                required, no others).
            kwargs: other call arguments to bind (``max_tokens``, ``stop``...).

        Raises:
            ValueError: a ``tool_choice`` that names no bound tool, or True with several tools.
        """
        formatted = openai_tools(tools, strict=strict)
        choice = openai_tool_choice(tool_choice, [tool["function"]["name"] for tool in formatted])
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: StructuredOutputMethod = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """This model answering in ``schema``: a pydantic object for a pydantic class, else a dict.

        Args:
            schema: a pydantic class (v2 or v1), a TypedDict, a JSON schema with a ``title``, an OpenAI
                tool or function dict, or (``json_schema`` only) an OpenAI ``{"name", "schema"}`` format;
                optional for ``json_mode``.
            method: ``"json_schema"`` (``response_format`` json_schema: the answer is generated under the
                schema), ``"function_calling"`` (a forced call of a tool made from the schema, also valid
                by construction) or ``"json_mode"`` (any JSON object; the prompt must ask for the keys).
            include_raw: answer ``{"raw": AIMessage, "parsed": ..., "parsing_error": ...}``, so a failed
                parse (say, an answer cut by ``max_tokens``) is returned rather than raised.
            strict: OpenAI's strict schemas (every property required, no others); not for ``json_mode``.

        Raises:
            ValueError: an unknown ``method``, an unknown keyword, no ``schema`` where one is needed, or
                ``strict`` with ``json_mode``.
        """
        if kwargs:
            raise ValueError(f"with_structured_output got unsupported arguments {sorted(kwargs)}")
        if method not in _METHODS:
            raise ValueError(f"with_structured_output method must be one of {list(_METHODS)}, got {method!r}")
        if schema is None and method != "json_mode":
            raise ValueError(f"with_structured_output(method={method!r}) needs a schema")
        if method == "json_mode" and strict is not None:
            raise ValueError("strict applies to a schema; json_mode asks for any JSON object")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        # What LangChain reports to callbacks and tracers (``ls_structured_output_format``), as ChatOpenAI.
        traced = (
            {"kwargs": {"method": method, "strict": strict}, "schema": schema} if schema is not None else None
        )
        parser: BaseOutputParser[Any]
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]  # type: ignore[arg-type]
            model = self.bind_tools(
                [schema],  # type: ignore[list-item]
                tool_choice=name,
                parallel_tool_calls=False,  # one object: a random or small model may repeat calls
                strict=strict,
                ls_structured_output_format=traced,
            )
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        else:
            response_format = (
                {"type": "json_object"} if method == "json_mode" else _json_schema_format(schema, strict)
            )
            model = self.bind(response_format=response_format, ls_structured_output_format=traced)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
        if not include_raw:
            return model | parser
        # LangChain's include_raw shape: a parse failure becomes ``parsing_error``, never an exception.
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=model) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")

    # ------------------------------------------------------------------------------------------ requests
    def _body(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], stream: bool
    ) -> dict[str, Any]:
        """The request body of one call: sampling from `call_params`, and the tool and response-format
        fields a call carries (checked here, so a malformed call-time ``tools`` fails before a request)."""
        fields = {k: kwargs.pop(k) for k in _REQUEST_FIELDS if k in kwargs}
        fields = {k: v for k, v in fields.items() if v is not None}
        if "tools" in fields:
            check_wire_tools(fields["tools"], type(self).__name__)
        params: CallParams = self.call_params(stop, **kwargs)
        body = {
            "messages": to_wire_messages_with_tools(messages),
            **params.body(),
            **fields,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _result(self, data: dict[str, Any]) -> ChatResult:
        choice = data["choices"][0]
        metadata = {
            "model_name": data.get("model"),
            "finish_reason": choice.get("finish_reason"),
            "model_provider": "parrot",
        }
        tool_calls, invalid_tool_calls = parse_tool_calls(choice["message"].get("tool_calls"))
        message = AIMessage(
            content=choice["message"].get("content") or "",  # null beside tool calls
            tool_calls=tool_calls,
            invalid_tool_calls=invalid_tool_calls,
            response_metadata=metadata,
            usage_metadata=usage_metadata(data.get("usage")),
        )
        generation = ChatGeneration(
            message=message, generation_info={"finish_reason": metadata["finish_reason"]}
        )
        return ChatResult(
            generations=[generation],
            llm_output={"token_usage": data.get("usage"), "model_name": data.get("model")},
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        body = self._body(messages, stop, kwargs, stream=False)
        return self._result(self.connection.post(_CHAT_PATH, body))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))
        body = self._body(messages, stop, kwargs, stream=False)
        return self._result(await self.connection.apost(_CHAT_PATH, body))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        body = self._body(messages, stop, kwargs, stream=True)
        tail = _StreamTail()
        for event in self.connection.stream(_CHAT_PATH, body):
            chunk = tail.take(event)
            if chunk is not None:
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        yield tail.last()

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        body = self._body(messages, stop, kwargs, stream=True)
        tail = _StreamTail()
        async for event in self.connection.astream(_CHAT_PATH, body):
            chunk = tail.take(event)
            if chunk is not None:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        yield tail.last()


def _json_schema_format(schema: Any, strict: bool | None) -> dict[str, Any]:
    """``response_format`` json_schema for ``schema``: OpenAI's own ``{"name", "schema"}`` as it is, else
    the name, description and parameters LangChain's ``convert_to_openai_tool`` makes of it."""
    if isinstance(schema, dict) and isinstance(schema.get("schema"), dict) and "name" in schema:
        spec = dict(schema)
    else:
        function = convert_to_openai_tool(schema, strict=strict)["function"]
        spec = {"name": function["name"], "schema": function.get("parameters") or {"type": "object"}}
        if function.get("description"):
            spec["description"] = function["description"]
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


class _StreamTail:
    """Turns streamed chat chunks into message chunks; keeps what belongs on the last one.

    Content deltas are yielded as they come (tool calls come whole in one delta, as ``tool_call_chunks``
    with their index); the finish reason, the model name and the usage (which the
    server sends after the last delta) go on one final chunk with ``chunk_position="last"``, so that
    input tokens and the model name are counted once when the chunks are added up.
    """

    def __init__(self) -> None:
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def take(self, event: dict[str, Any]) -> ChatGenerationChunk | None:
        self.model = event.get("model", self.model)
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            calls = stream_tool_call_chunks(delta.get("tool_calls"))
            if text or calls:
                return ChatGenerationChunk(message=AIMessageChunk(content=text, tool_call_chunks=calls))
        return None

    def last(self) -> ChatGenerationChunk:
        message = AIMessageChunk(
            content="",
            response_metadata={
                "model_name": self.model,
                "finish_reason": self.finish_reason,
                "model_provider": "parrot",
            },
            usage_metadata=usage_metadata(self.usage),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": self.finish_reason})
