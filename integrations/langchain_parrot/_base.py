"""What `ParrotLLM` and `ChatParrot` share: connection settings, sampling parameters, request bodies,
token counting.

A call's parameters are resolved once (`ParrotModelBase.call_params`): the model's fields, overridden by
what the call or a ``.bind(...)`` gives. The same `CallParams` becomes an OpenAI-style request body for the
server's ``/v1/completions`` or ``/v1/chat/completions`` (the model used directly) and a
`parrot.SamplingConfig` for a semantic function call (the model inside a compiled chain), so both paths
sample alike. Sampling values the engine would refuse are refused here, when the model is made (or, for
a call's own keywords, before its request is sent).

Token counts (``get_token_ids``, hence LangChain's ``get_num_tokens``, ``get_num_tokens_from_messages``
and ``trim_messages(token_counter=model)``) come from the server's tokenizer (``POST /tokenize``): the
tokens the engine will see, not a stand-in tokenizer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from langchain_core.language_models import LangSmithParams
from langchain_core.utils import from_env, secret_from_env
from parrot.protocol import API_KEY_HEADER, SamplingConfig
from parrot.sampling import PENALTIES, check_sampling, openai_sampling
from parrot.tokens import ServerTokenizer
from parrot.urls import BASE_URL_ENV, DEFAULT_BASE_URL, ServerURL
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from langchain_parrot._http import ServerConnection

__all__ = ["DEFAULT_BASE_URL", "CallParams", "ParrotModelBase"]

# The call-time keywords a model takes (from ``invoke(..., **kwargs)`` or ``.bind(**kwargs)``).
_CALL_KWARGS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", *PENALTIES}
)


@dataclass(frozen=True)
class CallParams:
    """The resolved parameters of one model call."""

    model: str | None
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def body(self) -> dict[str, Any]:
        """The sampling part of an OpenAI-style request body (``max_tokens`` null: up to the window)."""
        body = openai_sampling(self)
        if self.model is not None:
            body["model"] = self.model
        return body

    def sampling(self) -> SamplingConfig:
        """The same parameters for a semantic function call (which needs a ``max_tokens``: the server
        reserves prompt + max_tokens for each call it places)."""
        if self.max_tokens is None:
            raise ValueError("a semantic call needs max_tokens")
        return SamplingConfig(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
        )


class ParrotModelBase(BaseModel):
    """Fields and helpers of the Parrot models (mixed into `ParrotLLM` and `ChatParrot`).

    Constructing a model never touches the network: the HTTP client is made on first use and reused.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    base_url: ServerURL = Field(
        default_factory=from_env(BASE_URL_ENV, default=DEFAULT_BASE_URL), validate_default=True
    )
    """The Parrot server (env ``PARROT_BASE_URL``; default ``http://127.0.0.1:9000``): its root or, as
    OpenAI-style clients take it, its ``/v1`` (``http://host:9000/v1``); kept as the root."""
    model: str | None = Field(default=None, alias="model_name")
    """The served model's name (``GET /v1/models``); None: the server's default model."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy (deterministic), the default."""
    max_tokens: int | None = None
    """Most tokens to generate; None: until EOS or the end of the context window."""
    top_p: float = 1.0
    top_k: int = 0
    """Top-k sampling (0 disables it)."""
    seed: int | None = None
    stop: list[str] | None = None
    """Stop sequences (a call's own ``stop`` replaces them); the output ends before the first one."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks use it for fixed output lengths)."""
    presence_penalty: float = 0.0
    """Lowers the logits of tokens already generated, once (OpenAI's; in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Lowers them per occurrence (OpenAI's; in [-2, 2])."""
    repetition_penalty: float = 1.0
    """Divides the positive logits of the prompt's and output's tokens (vLLM's; 1 is off)."""
    timeout: float | None = 120.0
    """Seconds each HTTP attempt may take (connect, each read, each write); None waits forever."""
    max_retries: int = 2
    """Retries (with exponential backoff) after a connection failure, a timeout or a 429/502/503/504."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("PARROT_API_KEY", default=None))
    """Sent as ``Authorization: Bearer`` (env ``PARROT_API_KEY``): a key of the server's ``--api-key``, or a
    proxy's in front of it."""
    streaming: bool = False
    """Use the streaming endpoint even for ``invoke`` (tokens reach callbacks as they are generated)."""
    http_client: httpx.Client | None = Field(default=None, exclude=True)
    """A sync httpx client of your own (proxies, transports); the model makes one otherwise."""
    http_async_client: httpx.AsyncClient | None = Field(default=None, exclude=True)
    """An async httpx client of your own; the model makes one per event loop otherwise."""

    _connection: ServerConnection | None = PrivateAttr(default=None)
    _tokenizer: ServerTokenizer | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_sampling(self) -> ParrotModelBase:
        self.call_params()  # the fields as a call without arguments takes them: checked there
        return self

    @property
    def connection(self) -> ServerConnection:
        """The model's `ServerConnection` (made on first use, then reused)."""
        if self._connection is None:
            headers = {}
            if self.api_key is not None:
                headers["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
                headers[API_KEY_HEADER] = self.api_key.get_secret_value()  # a session's, beside its token
            self._connection = ServerConnection(
                self.base_url,
                timeout=self.timeout,
                max_retries=self.max_retries,
                headers=headers,
                client=self.http_client,
                async_client=self.http_async_client,
            )
        return self._connection

    def call_params(self, stop: list[str] | None = None, **kwargs: Any) -> CallParams:
        """The parameters of one call: the fields, overridden by ``stop`` and the call's ``kwargs``.

        Raises `TypeError` for a keyword the server has no use for (say, ``tools``).
        """
        unknown = sorted(k for k in kwargs if k not in _CALL_KWARGS and not k.startswith("ls_"))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unsupported call argument(s) {unknown}; it takes "
                f"{sorted(_CALL_KWARGS)}"
            )
        given = {k: v for k, v in kwargs.items() if k in _CALL_KWARGS}
        if stop is None:
            stop = given.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        params = CallParams(
            model=given.get("model", self.model),
            max_tokens=given.get("max_tokens", self.max_tokens),
            temperature=given.get("temperature", self.temperature),
            top_p=given.get("top_p", self.top_p),
            top_k=given.get("top_k", self.top_k),
            seed=given.get("seed", self.seed),
            stop=list(stop if stop is not None else (self.stop or [])),
            ignore_eos=given.get("ignore_eos", self.ignore_eos),
            presence_penalty=given.get("presence_penalty", self.presence_penalty),
            frequency_penalty=given.get("frequency_penalty", self.frequency_penalty),
            repetition_penalty=given.get("repetition_penalty", self.repetition_penalty),
        )
        # Refused before any request goes out: a field's value when the model is made, a bound or per-call
        # one (``.bind(temperature=-1)``) when it is called.
        check_sampling(params, where=f"{type(self).__name__}: ")
        return params

    def get_token_ids(self, text: str) -> list[int]:
        """The token ids of ``text`` under the served model's tokenizer (the server's ``POST /tokenize``,
        without special tokens); ``custom_get_token_ids`` wins when set.

        LangChain's ``get_num_tokens`` and ``get_num_tokens_from_messages`` count with it, and so does
        ``trim_messages(..., token_counter=model)``. Answers are cached per model instance.
        """
        custom = getattr(self, "custom_get_token_ids", None)  # a field of LangChain's BaseLanguageModel
        if custom is not None:
            return list(custom(text))
        if self._tokenizer is None or self._tokenizer.model != self.model:
            self._tokenizer = ServerTokenizer(self.connection.post, self.model)
        return self._tokenizer.encode(text)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }

    def _parrot_ls_params(
        self, kind: Literal["chat", "llm"], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> LangSmithParams:
        params = self.call_params(stop, **{k: v for k, v in kwargs.items() if k in _CALL_KWARGS})
        ls = LangSmithParams(ls_provider="parrot", ls_model_type=kind, ls_temperature=params.temperature)
        model = params.model or self.model
        if model is not None:
            ls["ls_model_name"] = model
        if params.max_tokens is not None:
            ls["ls_max_tokens"] = params.max_tokens
        if params.stop:
            ls["ls_stop"] = params.stop
        return ls
