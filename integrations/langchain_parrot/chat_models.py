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
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import Field, PrivateAttr

from langchain_parrot._base import CallParams, ParrotModelBase
from langchain_parrot.chat_format import ChatFormat
from langchain_parrot.messages import to_wire_messages

__all__ = ["ChatParrot", "usage_metadata"]

_CHAT_PATH = "/v1/chat/completions"


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
    The server has no tool calling, structured output via tools, or image inputs.

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

    # ------------------------------------------------------------------------------------------ requests
    def _body(self, messages: list[BaseMessage], params: CallParams, stream: bool) -> dict[str, Any]:
        body = {"messages": to_wire_messages(messages, names=True), **params.body(), "stream": stream}
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
        message = AIMessage(
            content=choice["message"]["content"],
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
        body = self._body(messages, self.call_params(stop, **kwargs), stream=False)
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
        body = self._body(messages, self.call_params(stop, **kwargs), stream=False)
        return self._result(await self.connection.apost(_CHAT_PATH, body))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        body = self._body(messages, self.call_params(stop, **kwargs), stream=True)
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
        body = self._body(messages, self.call_params(stop, **kwargs), stream=True)
        tail = _StreamTail()
        async for event in self.connection.astream(_CHAT_PATH, body):
            chunk = tail.take(event)
            if chunk is not None:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        yield tail.last()


class _StreamTail:
    """Turns streamed chat chunks into message chunks; keeps what belongs on the last one.

    Content deltas are yielded as they come; the finish reason, the model name and the usage (which the
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
            text = choice.get("delta", {}).get("content")
            if text:
                return ChatGenerationChunk(message=AIMessageChunk(content=text))
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
