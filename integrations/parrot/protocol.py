"""The wire schema of Parrot serve: pydantic models shared by the client and the server.

One source of truth for every JSON body. Errors are always `{"error": {"type", "message"}}`.
This module imports nothing but pydantic, so a client install stays light.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

FinishReason = Literal["stop", "length"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class SamplingConfig(_Strict):
    """Sampling parameters; ``temperature == 0`` is greedy. The engine checks ranges with clear errors."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False


# ----------------------------------------------------------------------------------------- engine API
class EngineFillRequest(_Strict):
    """Append tokens (or text, tokenized by the engine without special tokens) to a context.

    A new ``context_id`` is created, forked from ``parent_context_id`` when given.
    """

    context_id: int
    token_ids: list[int] | None = None
    text: str | None = None
    parent_context_id: int | None = None

    @model_validator(mode="after")
    def _one_input(self) -> EngineFillRequest:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("give exactly one of token_ids or text")
        return self


class EngineFillResponse(BaseModel):
    context_id: int
    num_tokens: int  # the context's length after the fill


class EngineGenerateRequest(_Strict):
    """Generate from the end of a context (forked from ``parent_context_id`` first, if new)."""

    context_id: int
    parent_context_id: int | None = None
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    stream: bool = False


class EngineGenerateResponse(BaseModel):
    context_id: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


class EngineStreamChunk(BaseModel):
    """One server-sent event of a streaming generate: a token and the text it completes."""

    token_id: int
    text: str


class EngineFreeContextRequest(_Strict):
    context_id: int


class EngineFreeContextResponse(BaseModel):
    context_id: int
    freed: bool = True


class EngineStatsResponse(BaseModel):
    """Load and exact KV memory of one engine."""

    model: str
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    contexts: int
    running: int
    waiting: int
    tokens_in_last_step: int
    prefill_tokens_computed: int
    decode_tokens_computed: int
    steps: int
    preemptions: int
    evictions: int
    grouped_decode_steps: int
    max_model_len: int


class EngineInfo(BaseModel):
    """What a manager needs to drive an engine: the model, its window and its tokenizer's vocabulary."""

    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    blocks_total: int
    eos_token_ids: list[int]


# ----------------------------------------------------------------------------------------- transforms
class TransformSpec(_Strict):
    """One declarative output transform, applied server-side to a call's output text (in list order).

    A whitelist of named transforms with plain options — never code. Each option is valid only for the
    transform types listed in ``OPTIONS``; anything else is rejected here, at submit time, not when the
    output arrives. ``key`` is a dotted path into the parsed value (``"a.b.0"``: dict key, then list index).
    ``group`` picks a regex group by number or name; when omitted it is the only group, or the whole match
    for a pattern without groups (what ``re.findall`` returns).
    """

    type: Literal["strip", "json", "csv_list", "regex", "numbered_list", "markdown_list", "xml", "render"]
    key: str | None = None
    pattern: str | None = None
    group: StrictInt | StrictStr | None = None  # strict: a bool or "1" is not a group number
    findall: bool = False

    # Which options each transform accepts; a ClassVar so it is not a wire field.
    OPTIONS: ClassVar[dict[str, frozenset[str]]] = {
        "strip": frozenset(),
        "json": frozenset({"key"}),
        "csv_list": frozenset(),
        "regex": frozenset({"pattern", "group", "findall"}),
        "numbered_list": frozenset(),
        "markdown_list": frozenset(),
        "xml": frozenset({"key"}),
        "render": frozenset(),
    }

    @model_validator(mode="after")
    def _check_options(self) -> TransformSpec:
        given = {name for name in ("key", "pattern", "group") if getattr(self, name) is not None}
        if self.findall:
            given.add("findall")
        allowed = self.OPTIONS[self.type]
        if extra := sorted(given - allowed):
            hint = ", ".join(sorted(allowed)) or "none"
            raise ValueError(f"transform {self.type!r} does not take option(s) {extra} (it takes: {hint})")
        if self.key is not None and (not self.key or any(not part for part in self.key.split("."))):
            raise ValueError(f"key path {self.key!r} has an empty segment; write it like 'a.b.0'")
        if self.type == "regex":
            self._check_regex()
        return self

    def _check_regex(self) -> None:
        if not self.pattern:
            raise ValueError("transform 'regex' needs a non-empty 'pattern'")
        try:
            compiled = re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"invalid regex pattern {self.pattern!r}: {e}") from None
        n = compiled.groups
        if self.group is None:
            if n > 1:
                raise ValueError(f"pattern {self.pattern!r} has {n} groups; choose one with 'group'")
        elif isinstance(self.group, int):
            if not 0 <= self.group <= n:
                raise ValueError(f"group {self.group} is out of range: {self.pattern!r} has {n} group(s)")
        elif self.group not in compiled.groupindex:
            names = sorted(compiled.groupindex) or "none"
            raise ValueError(f"pattern {self.pattern!r} has no group named {self.group!r} (named: {names})")
