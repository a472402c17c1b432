"""`ParrotLLM`: a LangChain text-completion model served by a Parrot server.

Used directly it behaves like any OpenAI-style completion model on the server's ``/v1/completions``;
``batch`` sends all its prompts in one request (the endpoint takes a list). Inside `compile_chain` it
becomes part of an unrendered semantic function call; since the manager tokenizes a call's prompt exactly
as ``/v1/completions`` does, both paths give the same output for the same text.

```python
from langchain_parrot import ParrotLLM

llm = ParrotLLM(base_url="http://127.0.0.1:9000", max_tokens=32)
llm.invoke("The parrot said")
```
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from langchain_parrot._base import ParrotModelBase

__all__ = ["ParrotLLM"]

_COMPLETIONS_PATH = "/v1/completions"


class ParrotLLM(ParrotModelBase, BaseLLM):
    """Completion model on a Parrot server's OpenAI-compatible ``/v1/completions``.

    Arguments as `ChatParrot` (``base_url``, ``model``, ``temperature`` default 0, ``max_tokens`` None:
    until EOS or the window's end, ``stop``, ``top_p``, ``top_k``, ``seed``, ``timeout``,
    ``max_retries``). Results carry ``finish_reason`` in each generation's info and the token usage in
    ``llm_output["token_usage"]``; ``stream`` yields text as the engine generates it; ``get_num_tokens``
    counts with the server's tokenizer.
    """

    @property
    def _llm_type(self) -> str:
        return "parrot"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_parrot", "llms"]

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "PARROT_API_KEY"}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return self._parrot_ls_params("llm", stop, kwargs)

    def _body(
        self, prompt: str | list[str], stop: list[str] | None, kwargs: dict[str, Any], stream: bool
    ) -> dict:
        body = {"prompt": prompt, **self.call_params(stop, **kwargs).body(), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    @staticmethod
    def _result(data: dict[str, Any], count: int) -> LLMResult:
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != count:
            raise ValueError(f"the server answered {len(choices)} completions for {count} prompts")
        generations = [
            [Generation(text=c["text"], generation_info={"finish_reason": c.get("finish_reason")})]
            for c in choices
        ]
        return LLMResult(
            generations=generations,
            llm_output={"token_usage": data.get("usage"), "model_name": data.get("model")},
        )

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming and len(prompts) == 1:
            return self._from_chunks(list(self._stream(prompts[0], stop, run_manager, **kwargs)))
        # One request for every prompt: the endpoint takes a batch, and the engine runs it as one.
        data = self.connection.post(_COMPLETIONS_PATH, self._body(prompts, stop, kwargs, stream=False))
        return self._result(data, len(prompts))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming and len(prompts) == 1:
            return self._from_chunks(
                [c async for c in self._astream(prompts[0], stop, run_manager, **kwargs)]
            )
        data = await self.connection.apost(_COMPLETIONS_PATH, self._body(prompts, stop, kwargs, stream=False))
        return self._result(data, len(prompts))

    @staticmethod
    def _from_chunks(chunks: list[GenerationChunk]) -> LLMResult:
        total = GenerationChunk(text="")
        for chunk in chunks:
            total += chunk
        info = dict(total.generation_info or {})
        usage = info.pop("token_usage", None)
        return LLMResult(
            generations=[[Generation(text=total.text, generation_info=info)]],
            llm_output={"token_usage": usage, "model_name": info.get("model_name")},
        )

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        tail = _CompletionTail()
        for event in self.connection.stream(_COMPLETIONS_PATH, self._body(prompt, stop, kwargs, stream=True)):
            chunk = tail.take(event)
            if chunk is not None:
                if run_manager is not None:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        yield tail.last()

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        tail = _CompletionTail()
        body = self._body(prompt, stop, kwargs, stream=True)
        async for event in self.connection.astream(_COMPLETIONS_PATH, body):
            chunk = tail.take(event)
            if chunk is not None:
                if run_manager is not None:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        yield tail.last()


class _CompletionTail:
    """Text chunks as they stream; the finish reason, model and usage on one last empty chunk."""

    def __init__(self) -> None:
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def take(self, event: dict[str, Any]) -> GenerationChunk | None:
        self.model = event.get("model", self.model)
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices", []):
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if choice.get("text"):
                return GenerationChunk(text=choice["text"])
        return None

    def last(self) -> GenerationChunk:
        info = {"finish_reason": self.finish_reason, "model_name": self.model, "token_usage": self.usage}
        return GenerationChunk(text="", generation_info=info)
