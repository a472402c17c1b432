"""The OpenAI endpoints' requests turned into engine inputs: options checked (a 400 naming the field),
prompts tokenized (chat messages through the model's template, tools offered in it), and the sampling
parameters, with the constraint ``response_format``, ``structured_outputs`` or a required tool call asks
for. Pure functions of the request and the engine's tokenizer and limits; `server.http.openai_api` serves
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parrot.openai_types import OpenAIChatCompletionRequest, OpenAICompletionRequest
from parrot.protocol import MAX_LOGIT_BIAS

from server.engine.interface import Engine
from server.engine.sampling import MAX_LOGPROBS, GuidedDecoding, SamplingParams
from server.engine.special_text import SpecialText
from server.http.openai_tools import (
    ToolRequestError,
    calls_schema,
    chosen_functions,
    functions_of,
    guided_for_request,
    render_messages,
    with_tool_preamble,
)

# OpenAI's own default; a client that wants greedy output passes ``temperature=0``.
DEFAULT_TEMPERATURE = 1.0
MAX_N = 16  # choices per prompt (each is a generate of its own)
# Generations one request may ask for: its prompts times n (a 2 KiB body could otherwise ask for thousands).
MAX_GENERATIONS = 256


class OpenAIAPIError(Exception):
    """An error of the OpenAI layer itself (not the engine's); answered with its status and type, and the
    request field at fault (``param``) where one is."""

    http_status: int = 400
    error_type: str = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QuotaError(OpenAIAPIError):
    """The request's tenant is at one of its quotas (`server.serve.quotas`): retry once its earlier
    requests finish."""

    http_status = 429
    error_type = "quota_exceeded"


class UnsupportedOptionError(OpenAIAPIError):
    """A request option that would change the result but is not supported (n > 1, echo, logprobs...)."""

    error_type = "unsupported_option"


class ContextLengthError(OpenAIAPIError):
    """A prompt longer than the model's context window: OpenAI's ``context_length_exceeded``, which its
    clients (and the tools built on them) recognise."""

    error_type = "context_length_exceeded"


class InvalidPromptError(OpenAIAPIError):
    """A prompt that cannot be served as given (empty, or no messages to render)."""

    error_type = "invalid_prompt"


_UNUSED: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
}


def reject_unsupported(req: OpenAICompletionRequest | OpenAIChatCompletionRequest) -> None:
    """Raise `UnsupportedOptionError` for the first option set to a value this server cannot honour, and
    `OpenAIAPIError` for an out-of-range ``n`` or ``logprobs``."""
    for name, unused in _UNUSED.items():
        if name not in type(req).model_fields:
            continue
        value = getattr(req, name)
        if value not in unused:
            raise UnsupportedOptionError(f"{name}={value!r} is not supported by this server", name)
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise OpenAIAPIError(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    prompts = _prompt_count(req.prompt) if isinstance(req, OpenAICompletionRequest) else 1
    if prompts * (req.n or 1) > MAX_GENERATIONS:
        raise OpenAIAPIError(
            f"{prompts} prompts with n={req.n or 1} ask for {prompts * (req.n or 1)} generations, over the "
            f"{MAX_GENERATIONS} one request may ask for: send the prompts in several requests",
            "prompt",
        )
    top = req.logprobs if isinstance(req, OpenAICompletionRequest) else req.top_logprobs
    name = "logprobs" if isinstance(req, OpenAICompletionRequest) else "top_logprobs"
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise OpenAIAPIError(f"{name} must be in [0, {MAX_LOGPROBS}], got {top}", name)
    if isinstance(req, OpenAIChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise OpenAIAPIError("top_logprobs needs logprobs=true", "top_logprobs")
    if req.prompt_logprobs is not None:
        if not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
            raise OpenAIAPIError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                "prompt_logprobs",
            )
        if req.stream:
            raise UnsupportedOptionError(
                "prompt_logprobs are returned only without streaming; send stream=false", "prompt_logprobs"
            )


def guided_of(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> GuidedDecoding | None:
    try:
        return guided_for_request(response_format, structured_outputs)
    except ToolRequestError as e:
        raise OpenAIAPIError(str(e), e.param) from None


@dataclass(frozen=True)
class ChatTools:
    """A chat request's functions and how its answer is read: constrained to a list of calls (``guide``),
    or free text that may hold calls."""

    functions: dict[str, dict[str, Any]]
    guide: GuidedDecoding | None


def chat_tools(req: OpenAIChatCompletionRequest) -> ChatTools | None:
    try:
        functions = functions_of(req.tools)
        mode, names = chosen_functions(functions, req.tool_choice)
    except ToolRequestError as e:
        raise OpenAIAPIError(str(e), e.param) from None
    if mode == "none":
        return None
    parallel = req.parallel_tool_calls is not False
    return ChatTools(functions, calls_schema(functions, names, parallel) if mode == "required" else None)


def _prompt_count(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """How many prompts ``prompt`` holds: one text or token list, or a list of them."""
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


def completion_prompts(
    engine: Engine, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    """Token ids of each prompt: texts are encoded with special tokens added (BOS), like vLLM does."""
    if isinstance(prompt, str):
        batch: list[Any] = [prompt]
    elif not prompt:
        raise InvalidPromptError("prompt is an empty list")
    elif isinstance(prompt[0], int):
        batch = [prompt]
    else:
        batch = list(prompt)
    out: list[list[int]] = []
    for i, p in enumerate(batch):
        ids = engine.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p)
        if not ids:
            raise InvalidPromptError(f"prompt {i} has no tokens")
        out.append(ids)
    return out


def _token_biases(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON keys) by token id; its size is checked before its keys
    are read."""
    if bias is not None and len(bias) > MAX_LOGIT_BIAS:
        raise OpenAIAPIError(
            f"logit_bias names {len(bias)} tokens, over the {MAX_LOGIT_BIAS} one request may bias",
            "logit_bias",
        )
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise OpenAIAPIError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out


def prompt_texts(
    engine: Engine, prompt: str | list[str] | list[int] | list[list[int]], ids: list[list[int]]
) -> list[str]:
    """Each prompt as ``echo`` answers it: its text as sent, or its token ids (``ids``) decoded."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return [str(p) for p in prompt]
    return [str(engine.tokenizer.decode(p)) for p in ids]


def chat_prompt(engine: Engine, req: OpenAIChatCompletionRequest, tools: ChatTools | None) -> list[int]:
    """The messages rendered by the tokenizer's chat template, then encoded without adding BOS again; the
    tools offered through the template where it takes them, else in a system message. Messages are text:
    a special-token string in a message's content encodes as plain text, never as a control token
    (`SpecialText`); only the template's own markers are control tokens."""
    specials = SpecialText(()) if req.parse_special_tokens else SpecialText.of(engine.tokenizer)
    messages = [{**m, "content": specials.mask(m["content"])} for m in render_messages(req.messages)]
    extra: dict[str, Any] = {}
    if tools is not None:
        if "tools" in (getattr(engine.tokenizer, "chat_template", None) or ""):
            extra["tools"] = [{"type": "function", "function": fn} for fn in tools.functions.values()]
        else:
            messages = with_tool_preamble(messages, tools.functions)
    try:
        text = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **extra
        )
    except Exception as e:  # jinja errors: a template that refuses these messages (e.g. role order)
        raise InvalidPromptError(f"the chat template cannot render these messages: {e}") from e
    ids = specials.encode(engine.tokenizer, text, add_special_tokens=False)
    if not ids:
        raise InvalidPromptError("the rendered chat prompt has no tokens")
    return ids


def sampling_for(
    req: OpenAICompletionRequest | OpenAIChatCompletionRequest,
    max_tokens: int | None,
    engine: Engine,
    prompts: list[list[int]],
    guided: GuidedDecoding | None = None,
    logprobs: int | None = None,
) -> SamplingParams:
    """Engine sampling parameters; no ``max_tokens`` means up to the end of the context window, or of the KV
    cache where that is smaller. A request whose prompt and ``max_tokens`` cannot fit the KV cache even
    alone is refused: generating would stop short where the cache ends, an answer cut with HTTP 200."""
    longest = max(len(p) for p in prompts)
    # Errors name the field the client sent (a chat request may use the newer name).
    field = (
        "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    )
    if longest >= engine.max_model_len:
        raise ContextLengthError(
            f"this model's context window is {engine.max_model_len} tokens, but the prompt holds {longest} "
            f"tokens: shorten it to at most {engine.max_model_len - 1} (room for one token to generate)",
            "messages" if isinstance(req, OpenAIChatCompletionRequest) else "prompt",
        )
    stats = engine.stats()
    cache_tokens = stats.blocks_total * stats.block_size
    if max_tokens is None:
        max_tokens = max(1, min(engine.max_model_len, cache_tokens) - longest)
    elif longest + max_tokens > engine.max_model_len:
        raise ContextLengthError(
            f"this model's context window is {engine.max_model_len} tokens, but {longest + max_tokens} were "
            f"asked for ({longest} in the prompt, {max_tokens} in {field}): lower {field} to at most "
            f"{engine.max_model_len - longest}",
            field,
        )
    if longest + max_tokens > cache_tokens:
        raise OpenAIAPIError(
            f"the prompt ({longest} tokens) and {field} ({max_tokens}) need {longest + max_tokens} tokens "
            f"of KV cache, which holds {cache_tokens} ({stats.blocks_total} blocks of {stats.block_size}): "
            f"lower {field} or shorten the prompt"
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_token_biases(req.logit_bias),
        max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        stop=stop,
        ignore_eos=bool(req.ignore_eos),
        guided=guided,
        logprobs=logprobs,
    )
