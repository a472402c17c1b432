"""Log-probabilities in OpenAI's two answer shapes, from the engine's per-token `TokenLogprob` records."""

from __future__ import annotations

from typing import Any

from parrot.openai_types import (
    OpenAIChatLogprobs,
    OpenAICompletionLogprobs,
    OpenAIPromptLogprob,
    OpenAITokenLogprob,
    OpenAITopLogprob,
    PromptLogprobs,
)

from server.engine.sampling import TokenLogprob


def completion_logprobs(
    tokenizer: Any, logprobs: list[TokenLogprob], first: int | None = None, offset: int = 0
) -> OpenAICompletionLogprobs:
    """``/v1/completions``' legacy shape: parallel lists, the top alternatives as text -> logprob, each
    token's offset in the choice's text (a streamed chunk's start at ``offset``). With ``first`` (an echoed
    prompt's first token, which nothing predicts), it leads them with None values."""
    token_logprobs: list[float | None] = [lp.logprob for lp in logprobs]
    top_logprobs: list[dict[str, float] | None] = [
        {_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs
    ]
    ids = [lp.token_id for lp in logprobs]
    if first is not None:
        ids, token_logprobs, top_logprobs = [first, *ids], [None, *token_logprobs], [None, *top_logprobs]
    tokens = [_text(tokenizer, t) for t in ids]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return OpenAICompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
    )


def prompt_logprobs(tokenizer: Any, scored: list[TokenLogprob], top: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: None for the first prompt token (nothing predicts it), then per token
    by token id the token itself (its logprob, rank and text) and its ``top`` likeliest alternatives."""
    out: PromptLogprobs = [None]
    for lp in scored:
        entry = {
            str(lp.token_id): OpenAIPromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=_text(tokenizer, lp.token_id)
            )
        }
        for rank, (token_id, value) in enumerate(lp.top[:top], 1):
            entry.setdefault(
                str(token_id),
                OpenAIPromptLogprob(logprob=value, rank=rank, decoded_token=_text(tokenizer, token_id)),
            )
        out.append(entry)
    return out


def chat_logprobs(tokenizer: Any, logprobs: list[TokenLogprob]) -> OpenAIChatLogprobs:
    """``/v1/chat/completions``' shape: per token its text, bytes, logprob and top alternatives."""
    return OpenAIChatLogprobs(
        content=[
            OpenAITokenLogprob(
                **_top(tokenizer, lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[_top(tokenizer, t, v) for t, v in lp.top],
            )
            for lp in logprobs
        ]
    )


def _top(tokenizer: Any, token_id: int, logprob: float) -> OpenAITopLogprob:
    text = _text(tokenizer, token_id)
    return OpenAITopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def _text(tokenizer: Any, token_id: int) -> str:
    # A byte-level token that is part of a multi-byte character decodes to U+FFFD, as in vLLM's answers.
    return str(tokenizer.decode([token_id]))
