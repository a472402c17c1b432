"""OpenAI's wire format, as the server's ``/v1`` routes speak it: requests, responses and stream chunks.

Pydantic only, like the rest of the client's schema (`parrot.protocol` re-exports every name here).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

FinishReason = Literal["stop", "length"]


# `POST /v1/completions`, `POST /v1/chat/completions` and `GET /v1/models`, in OpenAI's wire format so the
# official clients work unchanged. Requests ignore fields they do not know (clients send extras such as
# `user`); options that would change the result but are not supported (n > 1, echo, logprobs, penalties,
# tools, ...) are declared here so that the server can reject them with a 400 naming the option.


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenAIStreamOptions(_OpenAIRequest):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage`` and no choices."""

    include_usage: bool = False


class _OpenAISamplingRequest(_OpenAIRequest):
    """The sampling fields both endpoints share. ``temperature`` defaults to 1 as in OpenAI's API."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: OpenAIStreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (as in vLLM): top-k sampling, ignoring the end-of-sequence token, a repetition penalty.
    top_k: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    # Extension (as vLLM's): each prompt token's log-probability, with its rank and this many alternatives.
    prompt_logprobs: int | None = None
    # Extension (as vLLM's): the prompt's KV is reused only by requests carrying the same salt, so another
    # tenant cannot learn from a faster answer that this prompt was seen before.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Extension (as vLLM's): the request's place in the queue of an engine that schedules by priority
    # (lower starts sooner: the server's engines with scheduling="sjf"; aging bounds every wait). Without
    # it the server predicts the output length and uses that.
    priority: float | None = Field(default=None, allow_inf_nan=False)
    # ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}``:
    # JSON output by constrained decoding (the engine masks tokens that would break it).
    response_format: dict[str, object] | None = None
    # Extension (as vLLM's): exactly one of ``json`` (a schema), ``json_object``, ``regex``, ``choice`` or
    # ``grammar`` (EBNF, start rule ``root``).
    structured_outputs: dict[str, object] | None = None


class OpenAICompletionRequest(_OpenAISamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a text, a batch of texts, token ids, or a batch of those.

    ``max_tokens`` defaults to 16 (None: up to the end of the context window).
    """

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    # Extension (as vLLM's): each choice carries its token ids (and the prompt's); streamed, each chunk
    # carries the ids of its text. What lets another Parrot use this server as an engine.
    return_token_ids: bool | None = None


class OpenAITextPart(_OpenAIRequest):
    """One part of a message's content given as a list; only text parts are supported."""

    type: Literal["text"]
    text: str


class OpenAIFunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class OpenAIToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCall


class OpenAIChatMessage(_OpenAIRequest):
    """One chat message; ``developer`` is treated as ``system``, and list content is joined text parts.
    An assistant message may carry ``tool_calls`` (and no content); a ``tool`` message answers one."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[OpenAITextPart] | None = None
    name: str | None = None
    tool_calls: list[OpenAIToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class OpenAIChatCompletionRequest(_OpenAISamplingRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is the newer name of ``max_tokens``.

    Without either, generation may run to the end of the context window (as vLLM does).
    """

    messages: list[OpenAIChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, object]] | None = None
    tool_choice: str | dict[str, object] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, object]] | None = None
    # Extension: special-token strings in message contents are control tokens (by default they are plain
    # text, so a user's message cannot forge a turn). Only for contents the caller controls.
    parse_special_tokens: bool = False


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class OpenAICompletionLogprobs(BaseModel):
    """A completion choice's ``logprobs``: per token its text, log-probability, the top alternatives
    (text -> logprob) and its offset in the choice's text."""

    tokens: list[str]
    # None for an echoed prompt's first token, which nothing before it predicts
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class OpenAIPromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry of one token: its log-probability, rank (1: the likeliest; None for
    an alternative whose rank was not computed) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# Per prompt token (the first: None, nothing predicts it), the token and its alternatives by token id.
PromptLogprobs = list[dict[str, OpenAIPromptLogprob] | None]


class OpenAICompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: OpenAICompletionLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids (streamed: in the first chunk)
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs (vLLM's extension)


class OpenAICompletionResponse(BaseModel):
    """A ``text_completion``; streaming sends the same object per chunk, with ``usage`` None."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[OpenAICompletionChoice]
    usage: OpenAIUsage | None = None


class OpenAIAssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[OpenAIToolCall] | None = None


class OpenAITopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class OpenAITokenLogprob(OpenAITopLogprob):
    top_logprobs: list[OpenAITopLogprob]


class OpenAIChatLogprobs(BaseModel):
    content: list[OpenAITokenLogprob]


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class OpenAIChatChoice(BaseModel):
    index: int
    message: OpenAIAssistantMessage
    finish_reason: ChatFinishReason
    logprobs: OpenAIChatLogprobs | None = None


class OpenAIChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[OpenAIChatChoice]
    usage: OpenAIUsage
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs (vLLM's extension)


class OpenAIChatDelta(BaseModel):
    """A streamed message piece: ``role`` in the first chunk, then ``content`` (or ``tool_calls``); both
    absent in the last."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, object]] | None = None


class OpenAIChatChunkChoice(BaseModel):
    index: int
    delta: OpenAIChatDelta
    finish_reason: ChatFinishReason | None = None
    logprobs: OpenAIChatLogprobs | None = None  # the chunk's tokens', when logprobs were asked for


class OpenAIChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[OpenAIChatChunkChoice]
    usage: OpenAIUsage | None = None


class OpenAIModelCard(BaseModel):
    """A served model. Beyond OpenAI's fields: its context window (``max_model_len``, as vLLM names it) and
    what a client needs to render chat messages exactly as the server does (the tokenizer's chat template,
    its BOS text and whether encoding adds BOS, the EOS texts), so a compiled chat chain needs no local copy
    of the tokenizer."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "parrot"
    max_model_len: int | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    adds_bos_token: bool | None = None
    eos_tokens: list[str] = Field(default_factory=list)


class OpenAIModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModelCard]


class OpenAITokenizeRequest(_OpenAIRequest):
    """``POST /tokenize`` (vLLM's): a text's token ids under the model's tokenizer."""

    model: str | None = None
    prompt: StrictStr
    add_special_tokens: bool = True


class OpenAITokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class OpenAIDetokenizeRequest(_OpenAIRequest):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[StrictInt]


class OpenAIDetokenizeResponse(BaseModel):
    prompt: str


def openai_sampling(params: Any) -> dict[str, Any]:
    """The sampling part of an OpenAI-style request body from ``params`` (a `parrot.protocol.SamplingConfig`,
    the engine's sampling parameters, or anything with their attributes; ``max_tokens`` None: up to the
    window): ``max_tokens``, ``temperature`` and
    ``top_p`` always, the rest only where it differs from the default, the server's extensions (``top_k``,
    ``ignore_eos``, ``repetition_penalty``) named as vLLM names them."""
    body: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.top_k:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    logit_bias = getattr(params, "logit_bias", None)
    if logit_bias:
        body["logit_bias"] = {str(t): v for t, v in logit_bias.items()}
    return body
