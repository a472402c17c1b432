"""An OpenAI request's answer once it ran (`server.serve.request_run`): what its prompts' echo says, its
usage, and the whole (not streamed) completion or chat response; `openai_stream` sends the same answer as
server-sent events.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from parrot.openai_types import (
    ChatFinishReason,
    OpenAIAssistantMessage,
    OpenAIChatChoice,
    OpenAIChatCompletionResponse,
    OpenAICompletionChoice,
    OpenAICompletionLogprobs,
    OpenAICompletionResponse,
    OpenAIUsage,
    PromptLogprobs,
)

from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams
from server.http.openai_logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from server.http.openai_requests import ChatTools
from server.http.openai_tools import parse_tool_calls
from server.serve.request_run import RequestChoice, RequestRun


@dataclass(frozen=True)
class PromptEcho:
    """What an answer says of its prompts. ``texts`` (completions' ``echo``): each prompt's text leads its
    choices' text and, with ``top`` (the request's ``logprobs``), its tokens' log-probabilities lead
    theirs. ``prompt_logprobs`` (vLLM's extension): each prompt token's log-probability, rank and this many
    alternatives. Both come from the prompt's own prefill (`Engine.score`). ``generate`` False
    (``max_tokens=0``): the prompt is the whole answer."""

    texts: list[str] | None = None
    top: int | None = None
    prompt_logprobs: int | None = None
    generate: bool = True

    @property
    def score_top(self) -> int | None:
        """The alternatives per prompt token to score with (None: the prompt is not scored)."""
        tops = [t for t in (self.top, self.prompt_logprobs) if t is not None]
        return max(tops) if tops else None


@dataclass(frozen=True)
class AnswerMeta:
    """What every part of one answer repeats: its id, creation time and model."""

    id: str
    created: int
    model: str
    # A stream whose client asked for usage: every chunk before the usage chunk says ``"usage": null``, as
    # OpenAI's spec has it; else chunks carry no usage field.
    include_usage: bool = False

    @property
    def chunk_exclude(self) -> set[str]:
        """The fields a streamed chunk leaves out."""
        return set() if self.include_usage else {"usage"}


@dataclass(frozen=True)
class AnswerForm:
    """How a run is answered: what every part repeats (``meta``), the route (chat or completions), the
    sampling it ran with, and what the request asked the answer to carry: token ids (completions'
    ``return_token_ids``), tool calls parsed from the text, its prompts echoed."""

    meta: AnswerMeta
    chat: bool
    sampling: SamplingParams
    with_ids: bool = False
    tools: ChatTools | None = None
    echo: PromptEcho | None = None


def usage(choices: list[RequestChoice]) -> OpenAIUsage:
    """Token counts as OpenAI's and vLLM's: each prompt once, however many choices (``n``) it has."""
    prompt = sum(c.prompt_tokens for c in choices if c.choice == 0)
    completion = sum(len(c.result.token_ids) for c in choices if c.result is not None)
    return OpenAIUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def whole_answer(
    run: RequestRun, form: AnswerForm
) -> OpenAIChatCompletionResponse | OpenAICompletionResponse:
    """The answer of a run that was not streamed (every choice completed)."""
    tokenizer = run.engine.tokenizer
    meta, tools, echo = form.meta, form.tools, form.echo
    if form.chat:
        return _chat_response(
            meta, run.choices, tokenizer, tools, choice_prompt_logprobs(tokenizer, run.choices[0], echo)
        )
    return _text_response(meta, run.choices, tokenizer, form.with_ids, echo)


def _results(choices: list[RequestChoice]) -> list[GenerateResult]:
    results = [c.result for c in choices]
    assert all(r is not None for r in results), "a whole answer is built once every choice completed"
    return results  # type: ignore[return-value]


def _text_response(
    meta: AnswerMeta,
    choices: list[RequestChoice],
    tokenizer: Any,
    with_ids: bool,
    echo: PromptEcho | None,
) -> OpenAICompletionResponse:
    """The answer; ``with_ids`` (return_token_ids): each choice carries its prompt's and answer's ids;
    ``echo``: each choice's prompt leads its text (and its log-probabilities, when scored)."""
    answers = [
        OpenAICompletionChoice(
            index=i,
            text=r.text if echo is None or echo.texts is None else echo.texts[c.prompt_no] + r.text,
            finish_reason=r.finish_reason,
            logprobs=_completion_logprobs(tokenizer, c, r, echo),
            token_ids=r.token_ids if with_ids else None,
            prompt_token_ids=c.prompt if with_ids else None,
            prompt_logprobs=choice_prompt_logprobs(tokenizer, c, echo),
        )
        for i, (c, r) in enumerate(zip(choices, _results(choices), strict=True))
    ]
    return OpenAICompletionResponse(
        id=meta.id, created=meta.created, model=meta.model, choices=answers, usage=usage(choices)
    )


def _completion_logprobs(
    tokenizer: Any, choice: RequestChoice, result: GenerateResult, echo: PromptEcho | None
) -> OpenAICompletionLogprobs | None:
    """A completion choice's log-probabilities, its echoed prompt's first where they were asked for."""
    if result.logprobs is None:
        return None
    if echo is None or echo.texts is None or choice.scored is None:
        return completion_logprobs(tokenizer, result.logprobs)
    return completion_logprobs(
        tokenizer, echoed_logprobs(choice, echo) + result.logprobs, first=choice.prompt[0]
    )


def echoed_logprobs(choice: RequestChoice, echo: PromptEcho) -> list[Any]:
    """An echoed prompt's tokens' log-probabilities with the alternatives the request's ``logprobs`` asked
    for (it was scored with the larger of that and ``prompt_logprobs``)."""
    assert choice.scored is not None
    top = echo.top or 0
    return [replace(lp, top=lp.top[:top], rank=None) for lp in choice.scored]


def choice_prompt_logprobs(
    tokenizer: Any, choice: RequestChoice, echo: PromptEcho | None
) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs`` of a choice's prompt, where the request asked for them."""
    if echo is None or echo.prompt_logprobs is None or choice.scored is None:
        return None
    return prompt_logprobs(tokenizer, choice.scored, echo.prompt_logprobs)


def _chat_response(
    meta: AnswerMeta,
    choices: list[RequestChoice],
    tokenizer: Any,
    tools: ChatTools | None,
    prompt_lps: PromptLogprobs | None,
) -> OpenAIChatCompletionResponse:
    answers = []
    for i, r in enumerate(_results(choices)):
        message, finish = assistant_message(r, tools)
        logprobs = None if r.logprobs is None else chat_logprobs(tokenizer, r.logprobs)
        answers.append(OpenAIChatChoice(index=i, message=message, finish_reason=finish, logprobs=logprobs))
    return OpenAIChatCompletionResponse(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        choices=answers,
        usage=usage(choices),
        prompt_logprobs=prompt_lps,
    )


def assistant_message(
    result: GenerateResult, tools: ChatTools | None
) -> tuple[OpenAIAssistantMessage, ChatFinishReason]:
    """The assistant's message and finish reason: with tools, the calls it made are ``tool_calls``."""
    if tools is None:
        return OpenAIAssistantMessage(content=result.text), result.finish_reason
    content, calls = parse_tool_calls(result.text, tools.functions, constrained=tools.guide is not None)
    if not calls:  # e.g. a constrained list cut short by max_tokens: the text as it is
        return OpenAIAssistantMessage(content=result.text), result.finish_reason
    finish: ChatFinishReason = "tool_calls" if result.finish_reason == "stop" else result.finish_reason
    return OpenAIAssistantMessage(content=content, tool_calls=calls), finish
