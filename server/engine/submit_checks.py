"""What a fill or generate must satisfy before the engine takes it: pure checks over the command and the
engine's limits, each failing only its own request with a typed error that says what to fix."""

from __future__ import annotations

import math

from server.engine.context import Context, blocks_for
from server.engine.engine_front import Submit
from server.engine.errors import InvalidRequestError, PromptTooLongError, TokenOutOfVocabError
from server.engine.sampling import MAX_LOGPROBS
from server.engine.wire import MAX_TENANT_CHARS


def check_submit(cmd: Submit, kind: str, vocab_size: int, parent_tokens: int | None) -> None:
    """The checks that need no context state: token ids in the vocabulary, the sampling, the latency cap,
    priority and tenant, ``parent_len`` (``parent_tokens``: the parent's length, when it exists) and a
    scoring fill's options."""
    bad = [t for t in cmd.token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise TokenOutOfVocabError(
            f"{kind}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    if cmd.sampling is not None:
        cmd.sampling.validate(vocab_size)
    if cmd.latency_cap is not None and cmd.latency_cap < 1:
        raise InvalidRequestError(
            f"{kind}: latency_cap must be a positive token count, not {cmd.latency_cap}"
        )
    if cmd.priority is not None and not _finite_number(cmd.priority):
        raise InvalidRequestError(
            f"{kind}: priority must be a finite number (lower starts sooner), not {cmd.priority!r}"
        )
    if cmd.tenant is not None and len(cmd.tenant) > MAX_TENANT_CHARS:
        raise InvalidRequestError(
            f"{kind}: tenant is {len(cmd.tenant)} characters, over {MAX_TENANT_CHARS}: send a short id"
        )
    if cmd.prompt_logprobs is not None:
        _check_scoring(cmd)
    if cmd.parent_len is not None:
        if cmd.parent_id is None:
            raise InvalidRequestError(
                f"{kind}: parent_len ({cmd.parent_len}) needs parent_context_id: it is how many of the "
                "parent's tokens a new context is forked from"
            )
        if isinstance(cmd.parent_len, bool) or not isinstance(cmd.parent_len, int) or cmd.parent_len < 0:
            top = "the parent's length" if parent_tokens is None else parent_tokens
            raise InvalidRequestError(
                f"{kind}: parent_len must be a token count in [0, {top}], not {cmd.parent_len!r}"
            )


def _check_scoring(cmd: Submit) -> None:
    """A scoring fill computes every token it fills: a new context of its own, none inherited."""
    top = cmd.prompt_logprobs
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(
            f"score: the top alternatives per token must be an integer in [0, {MAX_LOGPROBS}], not {top!r}"
        )
    if cmd.parent_id is not None or cmd.remote is not None:
        raise InvalidRequestError(
            "score: a scored prompt is computed whole, so it starts a new context without a parent or a "
            "remote prefix"
        )
    if not cmd.token_ids:
        raise InvalidRequestError("score: there are no tokens to score; send at least one")


def inherited(kind: str, parent: Context, parent_len: int | None) -> int:
    """The tokens a fork of ``parent`` takes: ``parent_len``, checked against the parent's length now."""
    n = len(parent.token_ids)
    if parent_len is None:
        return n
    if parent_len > n:
        raise InvalidRequestError(
            f"{kind}: parent_len {parent_len} is outside [0, {n}]: parent context "
            f"{parent.context_id} holds {n} tokens"
        )
    return parent_len


def check_length(
    kind: str, total: int, generate: bool, remote: int, max_model_len: int, block_size: int, num_blocks: int
) -> None:
    """A context of ``total`` tokens held here, after ``remote`` tokens held by another engine: within the
    model's window (with room for one more token to generate) and the KV cache."""
    if generate and total == 0:
        raise InvalidRequestError("generate: the context is empty; fill it with a prompt first")
    limit = max_model_len - 1 if generate else max_model_len
    if total + remote > limit:
        raise PromptTooLongError(
            f"{kind}: the context would hold {total + remote} tokens; this model's context window is "
            f"{max_model_len} tokens" + (" and generating needs room for one more" if generate else "")
        )
    if blocks_for(total + 1, block_size) > num_blocks:
        raise PromptTooLongError(
            f"{kind}: {total} tokens exceed the KV cache ({num_blocks} blocks of {block_size} tokens); "
            "raise num_kv_blocks or shorten the prompt"
        )


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
