"""`ParrotLLM`: a LlamaIndex `LLM` served by Parrot, which sends prompt templates unrendered.

LlamaIndex's query engines call ``llm.predict(prompt_template, **values)``. Instead of rendering the text
on the client, `ParrotLLM.predict` (and ``apredict``, ``stream``, ``astream``, ``structured_predict``)
turns the template into a Parrot semantic function — constant text plus ``{{input:...}}`` placeholders
bound to the values, see `llamaindex_parrot.unrendered` — and submits it in a session of its own, so the
server sees the prompt's structure (shared prefixes across calls and sessions). The text the server
renders is LlamaIndex's rendering, checked on every call.

``complete`` / ``chat`` (and streams) receive text LlamaIndex already rendered; they use the server's
OpenAI-compatible endpoints. Every method has a truly asynchronous version (``httpx.AsyncClient`` or an
``async with`` `parrot.Session`); nothing blocking runs on the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, model_validator
from llama_index.core.indices.prompt_helper import PromptHelper
from llama_index.core.instrumentation.events.llm import (
    LLMPredictEndEvent,
    LLMPredictStartEvent,
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM
from llama_index.core.output_parsers.pydantic import PydanticOutputParser
from llama_index.core.program.llm_program import LLMTextCompletionProgram
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.types import Model, PydanticProgramMode, TokenAsyncGen, TokenGen
from parrot.protocol import SamplingConfig
from parrot.sampling import PENALTIES, check_sampling
from parrot.tokens import ServerTokenizer
from parrot.urls import BASE_URL_ENV, DEFAULT_BASE_URL, ServerURL, server_root

from llamaindex_parrot.completions import OpenAIEndpoint, chat_body, choice_text, completion_body, delta_text
from llamaindex_parrot.dag import Plan, arun_plan, astream_plan, run_plan, stream_plan
from llamaindex_parrot.server_info import ServedModel, served_model
from llamaindex_parrot.unrendered import UnrenderedCall, Value, unrender

__all__ = ["ParrotLLM"]

dispatcher = instrument.get_dispatcher(__name__)

# Per-call keyword arguments that `complete` / `chat` / `structured_predict(llm_kwargs=...)` accept.
SAMPLING_OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", *PENALTIES)

# LlamaIndex's own default for num_output (llama_index.core.constants.DEFAULT_NUM_OUTPUTS).
DEFAULT_MAX_TOKENS = 256


class ParrotLLM(LLM):
    """A LlamaIndex LLM on a Parrot server (``api_base``, e.g. ``server.launch(...).url``).

    ``api_base`` (first positional argument; ``base_url`` is an alias; default ``$PARROT_BASE_URL``, else
    ``http://127.0.0.1:9000``) is the server's root or, as LlamaIndex's ``OpenAILike`` takes it, its
    ``/v1``. ``model`` names the served model (None: the server's choice). ``context_window`` defaults to
    the server's; a smaller one packs prompts for a smaller window. Constructing the LLM sends nothing:
    unless both are given, the LLM asks the server once, on first use of `metadata` or `prompt_helper`
    (``GET /v1/models``: an unreachable server raises `parrot.ConnectionError` naming the URL, an unknown
    model or a window over the server's raises `ValueError`).
    ``max_tokens`` is the output length of every call and the ``num_output`` LlamaIndex reserves for it.
    Sampling defaults to greedy (``temperature=0``), so outputs are reproducible; values the engine would
    refuse (``temperature=-1``, ``top_p=0``, ``max_tokens=0``) raise at construction.

    ``unrendered=False`` makes ``predict`` & co. render on the client and send one ``/v1/completions``
    request per call, like any OpenAI-style LLM (the request-centric baseline of the benchmarks).
    ``tokenizer`` is what `prompt_helper` counts with: ``"server"`` for the served model's own tokenizer
    (the server's ``POST /tokenize``, answers cached), a ``text -> token ids`` function (e.g.
    `llamaindex_parrot.load_tokenizer` on the model's files), or None for LlamaIndex's global tokenizer.
    ``timeout`` bounds each HTTP request, ``get_timeout`` the wait for a call's value (None: no bound).
    ``api_key`` (default: ``$PARROT_API_KEY``) is sent to a server whose OpenAI routes require one.
    """

    api_base: ServerURL = Field(
        default_factory=lambda: os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL,
        validate_default=True,
        description="The Parrot server, e.g. http://127.0.0.1:9000 (or .../v1); kept as its root.",
    )
    model: str | None = Field(default=None, description="The served model to use (None: the server's).")
    model_name: str | None = Field(
        default=None, description="The model's name as the server reports it (None: asked on first use)."
    )
    context_window: int | None = Field(
        default=None, gt=0, description="Tokens of prompt plus output (None: the server's, on first use)."
    )
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, gt=0, description="Tokens generated per call.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="Top-k sampling (0: off).")
    seed: int | None = Field(default=None, description="Sampling seed (for temperature > 0).")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    presence_penalty: float = Field(
        default=0.0,
        ge=-2.0,
        le=2.0,
        description="Lowers the logits of tokens already generated, once (OpenAI's).",
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="Lowers them per occurrence (OpenAI's)."
    )
    repetition_penalty: float = Field(
        default=1.0,
        gt=0.0,
        le=100.0,
        description="Divides the positive logits of the prompt's and output's tokens (vLLM's; 1 is off).",
    )
    timeout: float = Field(default=60.0, gt=0, description="Seconds for each HTTP request.")
    api_key: str | None = Field(
        default_factory=lambda: os.environ.get("PARROT_API_KEY") or None,
        exclude=True,
        repr=False,
        description="The server's API key, when its OpenAI routes require one.",
    )
    get_timeout: float | None = Field(default=600.0, description="Seconds to wait for a call's value.")
    unrendered: bool = Field(default=True, description="Send prompt templates unrendered (semantic calls).")
    tokenizer: Callable[[str], list] | Literal["server"] | None = Field(
        default=None, exclude=True, description="Token counter for LlamaIndex's prompt packing."
    )

    _served: tuple[tuple[str, str | None], ServedModel] | None = PrivateAttr(default=None)
    _server_tokenizer: ServerTokenizer | None = PrivateAttr(default=None)

    def __init__(self, api_base: str | None = None, *, base_url: str | None = None, **kwargs: Any) -> None:
        if api_base is not None and base_url is not None and server_root(api_base) != server_root(base_url):
            raise ValueError(
                f"api_base={api_base!r} and base_url={base_url!r} name different servers: give one of them"
            )
        url = api_base if api_base is not None else base_url
        if url is not None:
            kwargs["api_base"] = url
        super().__init__(**kwargs)

    @model_validator(mode="after")
    def _check_sampling(self) -> ParrotLLM:
        # The Field bounds cover the numbers; seeds and stop strings the engine refuses are caught here.
        self.sampling()
        return self

    @classmethod
    def class_name(cls) -> str:
        return "ParrotLLM"

    @property
    def base_url(self) -> str:
        """The server's root URL (`api_base`; the name the parrot client and LangChain use)."""
        return self.api_base

    def served(self) -> ServedModel:
        """The model this LLM calls and its context window. Unless both ``model`` and ``context_window``
        were given, the server is asked on first use, once per server and model. Raises
        `parrot.ConnectionError` for an unreachable server and `ValueError` for a model it does not serve
        or a ``context_window`` over the model's."""
        if self.model is not None and self.context_window is not None:
            return ServedModel(self.model, self.context_window)  # nothing to ask
        key = (self.api_base, self.model)  # a `model_copy` may point elsewhere: its own answer
        if self._served is None or self._served[0] != key:
            self._served = (key, served_model(self.api_base, self.model, self.timeout, self.api_key))
        served = self._served[1]
        if self.context_window is not None and self.context_window > served.context_window:
            raise ValueError(
                f"context_window={self.context_window} is over the {served.context_window} tokens that "
                f"{served.name!r} takes at {self.api_base}: pass at most {served.context_window}"
            )
        return served

    @property
    def metadata(self) -> LLMMetadata:
        """The server's context window and model (see `served`); ``num_output`` is ``max_tokens``. Not a
        chat model: LlamaIndex picks its text prompts, which `predict` sends unrendered."""
        served = self.served()
        return LLMMetadata(
            context_window=self.context_window or served.context_window,
            num_output=self.max_tokens,
            is_chat_model=False,
            is_function_calling_model=False,
            model_name=self.model_name or served.name,
        )

    @property
    def _endpoint(self) -> OpenAIEndpoint:
        # Built on use (it holds no connection), so a `model_copy` with another URL or timeout is right.
        return OpenAIEndpoint(self.api_base, self.timeout, self.api_key)

    def tokenize(self, text: str) -> list[int]:
        """The token ids of ``text`` under the served model's tokenizer (``POST /tokenize``, no special
        tokens; answers cached): what ``tokenizer="server"`` counts with."""
        if self._server_tokenizer is None or self._server_tokenizer.model != self.model:
            self._server_tokenizer = ServerTokenizer(self._endpoint.post, self.model)
        return self._server_tokenizer.encode(text)

    def prompt_helper(self, **kwargs: Any) -> PromptHelper:
        """LlamaIndex's `PromptHelper` for this LLM: its window and output length, counting tokens with
        ``tokenizer`` (the server's for ``"server"``, LlamaIndex's global tokenizer when None). ``kwargs``
        go to `PromptHelper.from_llm_metadata` (``chunk_overlap_ratio``, ``chunk_size_limit``, ...)."""
        tokenizer = self.tokenize if self.tokenizer == "server" else self.tokenizer
        return PromptHelper.from_llm_metadata(self.metadata, tokenizer=tokenizer, **kwargs)

    def sampling(self, **overrides: Any) -> SamplingConfig:
        """The sampling of a call: this LLM's settings with per-call ``overrides`` (see SAMPLING_OPTIONS).
        Raises `ValueError` for a value the engine would refuse, before anything is sent."""
        if unknown := sorted(set(overrides) - set(SAMPLING_OPTIONS)):
            raise TypeError(
                f"ParrotLLM does not take {unknown}; per-call options are {list(SAMPLING_OPTIONS)}"
            )
        options: dict[str, Any] = {name: getattr(self, name) for name in SAMPLING_OPTIONS}
        options.update(overrides)
        if isinstance(options["stop"], str):
            options["stop"] = [options["stop"]]
        config = SamplingConfig(**options)
        check_sampling(config, where="ParrotLLM: ")
        return config

    # ------------------------------------------------------------------------------- unrendered calls
    def unrendered_call(
        self, prompt: BasePromptTemplate, values: Mapping[str, Value], *, allow_rendered: bool = True
    ) -> UnrenderedCall:
        """``prompt`` with ``values`` as the semantic call `predict` submits (LlamaIndex's rendering,
        unrendered). Values may be `parrot.Variable`s of the current session (the synthesizers' DAGs).
        Raises `MissingTemplateVariableError` when a template variable has no value."""
        return unrender(
            lambda kw: self._get_prompt(prompt, **kw), prompt, values, llm=self, allow_rendered=allow_rendered
        )

    def _run(self, call: UnrenderedCall, sampling: SamplingConfig) -> str:
        return run_plan(self, self._one_call_plan(call, sampling)) or ""

    async def _arun(self, call: UnrenderedCall, sampling: SamplingConfig) -> str:
        return await arun_plan(self, self._one_call_plan(call, sampling)) or ""

    @dispatcher.span
    def predict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        """Answer ``prompt`` filled with ``prompt_args``: one unrendered semantic call (greedy by default)."""
        if not self.unrendered:
            return super().predict(prompt, **prompt_args)
        dispatcher.event(LLMPredictStartEvent(template=prompt, template_args=prompt_args))
        self._log_template_data(prompt, **prompt_args)
        output = self._parse_output(self._run(self.unrendered_call(prompt, prompt_args), self.sampling()))
        dispatcher.event(LLMPredictEndEvent(output=output))
        return output

    @dispatcher.span
    async def apredict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        """``async`` form of `predict`."""
        if not self.unrendered:
            return await super().apredict(prompt, **prompt_args)
        dispatcher.event(LLMPredictStartEvent(template=prompt, template_args=prompt_args))
        self._log_template_data(prompt, **prompt_args)
        text = await self._arun(self.unrendered_call(prompt, prompt_args), self.sampling())
        output = self._parse_output(text)
        dispatcher.event(LLMPredictEndEvent(output=output))
        return output

    # The unrendered streams read the call's output variable as the server writes it (Variable.stream).
    @dispatcher.span
    def stream(self, prompt: BasePromptTemplate, **prompt_args: Any) -> TokenGen:
        """`predict` as a token stream: the unrendered call's answer as the server writes it."""
        if not self.unrendered:
            return super().stream(prompt, **prompt_args)
        if prompt.output_parser is not None or self.output_parser is not None:
            raise NotImplementedError("Output parser is not supported for streaming.")  # as LlamaIndex
        call = self.unrendered_call(prompt, prompt_args)
        return stream_plan(self, self._one_call_plan(call, self.sampling()))

    @dispatcher.span
    async def astream(self, prompt: BasePromptTemplate, **prompt_args: Any) -> TokenAsyncGen:
        """``async`` form of `stream`."""
        if not self.unrendered:
            return await super().astream(prompt, **prompt_args)
        if prompt.output_parser is not None or self.output_parser is not None:
            raise NotImplementedError("Output parser is not supported for streaming.")
        call = self.unrendered_call(prompt, prompt_args)
        return await astream_plan(self, self._one_call_plan(call, self.sampling()))

    def _one_call_plan(self, call: UnrenderedCall, sampling: SamplingConfig) -> Callable[[], Plan]:
        """A plan (`llamaindex_parrot.dag`) of one call: one call runs and streams as the synthesizers' DAGs
        do (for a stream: submitted before it returns; the session never the reader's current one; closed
        however the reading ends)."""

        def plan() -> Plan:
            return call.submit(sampling, model=self.model)
            yield  # (a generator: a plan)

        return plan

    def _structured_call(
        self, output_cls: type[Model], prompt: BasePromptTemplate, prompt_args: dict[str, Any]
    ) -> tuple[UnrenderedCall, PydanticOutputParser]:
        """The call LlamaIndex's text-completion program makes: the prompt with the output class's JSON
        format instructions (its output parser), through ``completion_to_prompt`` and without the system
        prompt, exactly as `LLMTextCompletionProgram` renders it for ``complete``."""
        parser = PydanticOutputParser(output_cls=output_cls)
        program: LLMTextCompletionProgram[Model] = LLMTextCompletionProgram.from_defaults(
            output_parser=parser, prompt=prompt, llm=self
        )
        template = program.prompt

        def render(kw: dict[str, Any]) -> str:
            return self._to_prompt(template.format(llm=self, **kw))

        return unrender(render, template, prompt_args, llm=self), parser

    def _uses_program(self) -> bool:
        """Whether structured predictions go through LlamaIndex's own programs instead (by mode)."""
        modes = (PydanticProgramMode.DEFAULT, PydanticProgramMode.LLM)
        return not self.unrendered or self.pydantic_program_mode not in modes

    @staticmethod
    def _parsed(parser: PydanticOutputParser, output_cls: type[Model], text: str) -> Model:
        # Parsed here with LlamaIndex's own parser (its JSON extraction), so results and errors match it.
        result = parser.parse(text)
        if not isinstance(result, output_cls):
            raise TypeError(
                f"structured_predict expected a {output_cls.__name__}, got {type(result).__name__}"
            )
        return result

    @dispatcher.span
    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        """An ``output_cls`` instance: the prompt with LlamaIndex's JSON format instructions, sent as one
        unrendered call; the answer is parsed on the client by LlamaIndex's `PydanticOutputParser`.
        ``llm_kwargs`` are per-call sampling options."""
        if self._uses_program():
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        call, parser = self._structured_call(output_cls, prompt, prompt_args)
        result = self._parsed(parser, output_cls, self._run(call, self.sampling(**(llm_kwargs or {}))))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        """``async`` form of `structured_predict`."""
        if self._uses_program():
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        call, parser = self._structured_call(output_cls, prompt, prompt_args)
        text = await self._arun(call, self.sampling(**(llm_kwargs or {})))
        result = self._parsed(parser, output_cls, text)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    def _to_prompt(self, text: str) -> str:
        """``completion_to_prompt`` applied (LlamaIndex gives every LLM one; unset, the text as it is)."""
        convert = self.completion_to_prompt
        return text if convert is None else convert(text)

    # ------------------------------------------------------------------------- OpenAI-compatible calls
    def _completion(
        self, prompt: str, formatted: bool, stream: bool, kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        text = prompt if formatted else self._to_prompt(prompt)
        return completion_body(self.model, text, self.sampling(**kwargs), stream)

    def _chat(self, messages: Sequence[ChatMessage], stream: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
        return chat_body(self.model, messages, self.sampling(**kwargs), stream)

    @staticmethod
    def _chat_response(text: str, raw: dict[str, Any], delta: str | None = None) -> ChatResponse:
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=text), raw=raw, delta=delta
        )

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete rendered text (``completion_to_prompt`` applied unless ``formatted``): one
        ``/v1/completions`` request. ``kwargs``: per-call sampling options."""
        data = self._endpoint.post("/v1/completions", self._completion(prompt, formatted, False, kwargs))
        return CompletionResponse(text=choice_text(data, chat=False), raw=data)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """``async`` form of `complete`."""
        data = await self._endpoint.apost(
            "/v1/completions", self._completion(prompt, formatted, False, kwargs)
        )
        return CompletionResponse(text=choice_text(data, chat=False), raw=data)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """`complete`, streamed token by token (server-sent events)."""
        body = self._completion(prompt, formatted, True, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for chunk in self._endpoint.stream("/v1/completions", body):
                if delta := delta_text(chunk, chat=False):
                    text += delta
                    yield CompletionResponse(text=text, delta=delta, raw=chunk)

        return gen()

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """``async`` form of `stream_complete`."""
        body = self._completion(prompt, formatted, True, kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for chunk in self._endpoint.astream("/v1/completions", body):
                if delta := delta_text(chunk, chat=False):
                    text += delta
                    yield CompletionResponse(text=text, delta=delta, raw=chunk)

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer a conversation (the model's chat template applies on the server): one
        ``/v1/chat/completions`` request."""
        data = self._endpoint.post("/v1/chat/completions", self._chat(messages, False, kwargs))
        return self._chat_response(choice_text(data, chat=True), data)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """``async`` form of `chat`."""
        data = await self._endpoint.apost("/v1/chat/completions", self._chat(messages, False, kwargs))
        return self._chat_response(choice_text(data, chat=True), data)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """`chat`, streamed token by token."""
        body = self._chat(messages, True, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for chunk in self._endpoint.stream("/v1/chat/completions", body):
                if delta := delta_text(chunk, chat=True):
                    text += delta
                    yield self._chat_response(text, chunk, delta)

        return gen()

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """``async`` form of `stream_chat`."""
        body = self._chat(messages, True, kwargs)

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for chunk in self._endpoint.astream("/v1/chat/completions", body):
                if delta := delta_text(chunk, chat=True):
                    text += delta
                    yield self._chat_response(text, chunk, delta)

        return gen()
