"""The wire schema of Parrot serve: pydantic models shared by the client and the server.

One source of truth for every JSON body of the session API (sessions, variables, calls, batches, the live
view's DAG). The template grammar is `parrot.template`, the OpenAI wire format `parrot.openai_types` (both
re-exported here); the engine's own API is the server's (`server.engine.wire`). Errors are always
`{"error": {"type", "message"}}`.
This module imports nothing but pydantic, so a client install stays light.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from parrot.openai_types import (
    ChatFinishReason as ChatFinishReason,
    FinishReason as FinishReason,
    OpenAIAssistantMessage as OpenAIAssistantMessage,
    OpenAIChatChoice as OpenAIChatChoice,
    OpenAIChatChunkChoice as OpenAIChatChunkChoice,
    OpenAIChatCompletionChunk as OpenAIChatCompletionChunk,
    OpenAIChatCompletionRequest as OpenAIChatCompletionRequest,
    OpenAIChatCompletionResponse as OpenAIChatCompletionResponse,
    OpenAIChatDelta as OpenAIChatDelta,
    OpenAIChatLogprobs as OpenAIChatLogprobs,
    OpenAIChatMessage as OpenAIChatMessage,
    OpenAICompletionChoice as OpenAICompletionChoice,
    OpenAICompletionLogprobs as OpenAICompletionLogprobs,
    OpenAICompletionRequest as OpenAICompletionRequest,
    OpenAICompletionResponse as OpenAICompletionResponse,
    OpenAIDetokenizeRequest as OpenAIDetokenizeRequest,
    OpenAIDetokenizeResponse as OpenAIDetokenizeResponse,
    OpenAIFunctionCall as OpenAIFunctionCall,
    OpenAIModelCard as OpenAIModelCard,
    OpenAIModelList as OpenAIModelList,
    OpenAIStreamOptions as OpenAIStreamOptions,
    OpenAITextPart as OpenAITextPart,
    OpenAITokenizeRequest as OpenAITokenizeRequest,
    OpenAITokenizeResponse as OpenAITokenizeResponse,
    OpenAITokenLogprob as OpenAITokenLogprob,
    OpenAIToolCall as OpenAIToolCall,
    OpenAITopLogprob as OpenAITopLogprob,
    OpenAIUsage as OpenAIUsage,
    _OpenAIRequest as _OpenAIRequest,
    _OpenAISamplingRequest as _OpenAISamplingRequest,
)
from parrot.template import (
    _HSPACE as _HSPACE,
    MAX_TEMPLATE_PLACEHOLDERS as MAX_TEMPLATE_PLACEHOLDERS,
    ROLES as ROLES,
    Role as Role,
    TemplateError as TemplateError,
    TemplatePiece as TemplatePiece,
    TemplatePlaceholder as TemplatePlaceholder,
    TemplateText as TemplateText,
    _check_placeholder as _check_placeholder,
    _line_col as _line_col,
    _parse_placeholder as _parse_placeholder,
    _scan as _scan,
    _snippet as _snippet,
    escape_text as escape_text,
    parse_template as parse_template,
    placeholder_names as placeholder_names,
    render_template as render_template,
)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    type: str
    message: str
    # As OpenAI's error objects: the request field at fault, and a machine-readable code.
    param: str | None = None
    code: str | None = None
    # In the answer to a batch: the index of the operation that failed (the ones before it were applied).
    op_index: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class GuidedConfig(StrictModel):
    """Constrained decoding: the output must match a JSON Schema (``value``: the schema as JSON text), be a
    JSON object (no value), match a regex, be one of ``value``'s strings (``choice``), or be a sentence of
    an EBNF grammar with start rule ``root``. The engine masks every token that would break it."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    value: str | list[str] | None = None
    # JSON only: no whitespace between its tokens beyond ", " and ": " (vLLM's disable_any_whitespace); else
    # up to 16 characters of it in a row, where a model writes its own layout.
    compact: bool = False


class TokenLogprobConfig(BaseModel):
    """A generated token's log-probability and its ``top`` alternatives as [token id, logprob] pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)
    rank: int | None = None  # a scored prompt token's rank (1: the likeliest)


SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds the engine takes (what ``torch.Generator.manual_seed`` accepts: a 64-bit integer)."""

_SAMPLING_CHECKED = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
MAX_LOGIT_BIAS = 1024
"""Tokens one request's ``logit_bias`` may name (OpenAI's own bound on each bias: [-100, 100])."""


def sampling_problem(params: object) -> str | None:
    """What is wrong with the sampling parameters of ``params`` (a `SamplingConfig` or anything with its
    attributes; one missing or None is not given), or None: the engine's rules, which the client applies
    where parameters are written (`parrot.sampling.check_sampling`) and the engine where they are used."""
    max_tokens, temperature, top_p, top_k, seed, stop = (getattr(params, n, None) for n in _SAMPLING_CHECKED)
    # bool is an int to Python but never a token count or a seed anyone meant.
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        return f"max_tokens must be an integer >= 1, got {max_tokens!r}"
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        return f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}"
    if top_p is not None and not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1] (1 disables it), got {top_p!r}"
    if top_k is not None and top_k < 0:
        return f"top_k must be >= 0 (0 disables it), got {top_k!r}"
    if seed is not None and (isinstance(seed, bool) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        return f"seed must be a 64-bit integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {seed!r}"
    if stop is not None and any(not s for s in stop):
        return f"stop strings must be non-empty, got {list(stop)!r}"
    return _penalty_problem(params)


def _penalty_problem(params: object) -> str | None:
    """`sampling_problem` for the penalties and ``logit_bias``."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name, None)
        if value is not None and not (_finite(value) and -2.0 <= value <= 2.0):
            return f"{name} must be a number in [-2, 2] (0 disables it), got {value!r}"
    repetition = getattr(params, "repetition_penalty", None)
    if repetition is not None and not (_finite(repetition) and 0 < repetition <= 100):
        return f"repetition_penalty must be a number in (0, 100] (1 disables it), got {repetition!r}"
    bias = getattr(params, "logit_bias", None) or {}
    if len(bias) > MAX_LOGIT_BIAS:
        return f"logit_bias names {len(bias)} tokens, over the {MAX_LOGIT_BIAS} one request may bias"
    bad = [(t, v) for t, v in bias.items() if not (_finite(v) and -100 <= v <= 100)]
    if bad:
        return f"logit_bias values must be numbers in [-100, 100], got {dict(bad[:5])!r}"
    return None


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class SamplingConfig(StrictModel):
    """Sampling parameters; ``temperature == 0`` is greedy. The engine checks ranges with clear errors."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    guided: GuidedConfig | None = None
    # Each generated token's log-probability, with its top this many alternatives (0: the token's only).
    logprobs: int | None = Field(default=None, ge=0, le=20)
    # As OpenAI's and vLLM's: presence and frequency penalties (in [-2, 2]) lower the logits of the tokens
    # generated so far, once and per occurrence; a repetition penalty (> 0; 1 is off) divides the positive
    # logits (multiplies the negative ones) of every token of the prompt and the output; logit_bias adds
    # to the named token ids' logits (in [-100, 100]).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = Field(default_factory=dict)


# ----------------------------------------------------------------------------------------- transforms
class TransformSpec(StrictModel):
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
    # ``json`` only: a JSON Schema the output is generated under (constrained decoding), so the text it
    # parses is valid by construction. It must be the output's first transform.
    json_schema: dict[str, object] | None = None

    # Which options each transform accepts; a ClassVar so it is not a wire field.
    OPTIONS: ClassVar[dict[str, frozenset[str]]] = {
        "strip": frozenset(),
        "json": frozenset({"key", "json_schema"}),
        "csv_list": frozenset(),
        "regex": frozenset({"pattern", "group", "findall"}),
        "numbered_list": frozenset(),
        "markdown_list": frozenset(),
        "xml": frozenset({"key"}),
        "render": frozenset(),
    }

    @model_validator(mode="after")
    def _check_options(self) -> TransformSpec:
        given = {
            name for name in ("key", "pattern", "group", "json_schema") if getattr(self, name) is not None
        }
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
        # The pattern itself (its syntax, size and groups) is checked by the server, which compiles it with
        # RE2 under a size and memory bound; compiling it here with Python's `re` would run an unbounded
        # compile (deep nesting, huge alternations) while the request is still being validated.
        if not self.pattern:
            raise ValueError("transform 'regex' needs a non-empty 'pattern'")


# ------------------------------------------------------------------------------------------------ calls
Criteria = Literal["latency", "throughput"]


# A server started with API keys (``--api-key``) needs one to open a session; a session's requests carry it in
# this header, beside their session token in ``Authorization``. Clients read the key from the variable.
API_KEY_HEADER = "X-API-Key"
API_KEY_ENV = "PARROT_API_KEY"

# Ids a client may choose for its variables (so a whole DAG can be sent in one request, see `BatchRequest`).
VAR_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class PlaceholderSpec(StrictModel):
    """What one template placeholder is bound to in a call.

    An input gives exactly one of ``var_id`` (an existing variable of the session, possibly still pending)
    or ``value`` (literal text, inserted verbatim: never parsed as template text). An output never gives
    ``value``; its optional ``var_id`` is the id of the variable it produces — a new id the client chose
    (`VAR_ID_PATTERN`), or a pending variable the client created unset — and without one the server makes
    a fresh variable; either way its id comes back in `SubmitCallResponse.outputs`. Only outputs take
    ``transforms`` (applied to the generated text in order) and ``sampling``.
    The cross-checks live in the server (`server.serve.call_checks`, a 400), not here (a 422 is for
    malformed JSON).
    """

    name: str
    role: Role
    var_id: str | None = None
    value: str | None = None
    transforms: list[TransformSpec] = Field(default_factory=list)
    sampling: SamplingConfig | None = None


class SubmitCallRequest(StrictModel):
    """``POST /v1/sessions/{sid}/calls``: one semantic function call, its prompt unrendered.

    ``criteria`` marks the call's outputs as wanted with that objective right away (as a ``get`` would).
    """

    template: str
    placeholders: list[PlaceholderSpec]
    func_name: str | None = None
    model: str | None = None
    criteria: Criteria | None = None
    # The call's prompt KV is shared only with calls and requests carrying the same salt (it overrides the
    # session's); None: the session's salt, or shared with everyone.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Special-token strings (``<|im_end|>``) in the call's input values are control tokens; by default they
    # are plain text, so a user's text cannot forge a turn. Only for values the caller controls. None (not
    # sent) is false: a client that does not opt in sends nothing a server without the field would refuse.
    parse_special_tokens: bool | None = None


class SubmitCallResponse(BaseModel):
    """The submitted call's id and the fresh variable created for each output (name -> var_id)."""

    call_id: str
    outputs: dict[str, str]


class CallError(ValueError):
    """A call's placeholder specs disagree with its template or with each other (HTTP 400)."""


# ------------------------------------------------------------------------------- sessions and variables
VariableStatus = Literal["pending", "ready", "failed"]
ValueKind = Literal["text", "json"]
CRITERIA: tuple[Criteria, ...] = ("latency", "throughput")


# What a client-chosen session id and token (`BatchRequest.create`) must look like: a token is a secret of
# at least 256 bits in URL-safe base64 (``secrets.token_urlsafe(32)``), an id is not secret.
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"
SESSION_TOKEN_PATTERN = r"^[A-Za-z0-9_-]{43,256}$"


class CreateSessionRequest(StrictModel):
    """``POST /v1/sessions`` (the body is optional). ``cache_salt``: the session's prompts share KV only
    with calls and requests carrying the same salt — never with other sessions' by default — closing the
    timing side channel by which a faster answer tells that someone sent the same prefix before."""

    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class CreateSessionResponse(BaseModel):
    """``POST /v1/sessions``: the new session's id and its bearer token.

    Every session-scoped call carries ``Authorization: Bearer <token>``; ``DELETE /v1/sessions/{sid}``
    frees everything the session owns.
    """

    session_id: str
    token: str


class CreateVariableRequest(StrictModel):
    """``POST /v1/sessions/{sid}/variables``: a new variable, set when ``value`` is given, else pending.

    ``var_id`` is the id the client wants for it (409 if the session already has it); the server picks
    one when it is omitted.
    """

    name: str | None = None
    value: str | None = None
    var_id: str | None = Field(default=None, pattern=VAR_ID_PATTERN)


class VariableCreated(BaseModel):
    """The id of a variable just created."""

    var_id: str


class SetVariableRequest(StrictModel):
    """``PUT /v1/sessions/{sid}/variables/{vid}``: give a pending variable its value (once: 409 after)."""

    value: str


class GetVariableQuery(StrictModel):
    """The query of ``GET /v1/sessions/{sid}/variables/{vid}`` (a long poll).

    ``criteria`` marks the variable wanted with that objective (what triggers objective deduction);
    ``timeout`` is how many seconds the server waits for a pending variable before answering 504
    (None: the server's own default).
    """

    criteria: Criteria | None = None
    timeout: float | None = Field(default=None, ge=0)


# `GetVariableResponse.error_type` of a variable whose output transform failed (a parser refused the text,
# a key path missing from the parsed value...): the one type a client reads ``llm_output`` under.
TRANSFORM_FAILED = "transform_failed"


class GetVariableResponse(BaseModel):
    """A variable's state: ``value`` is set when ``status == "ready"``, ``error`` when ``"failed"``.

    A value is text; ``kind == "json"`` says it is the JSON text of a structured value (from a transform).

    A failed variable also says why as data. ``error_type`` is the type of the root cause — the same for a
    variable that failed because an input did: `TRANSFORM_FAILED` (a transform failed on the output),
    ``"transform_limit"`` (a transform over its time or size bound), an engine's error type
    (``"engine_failed"``, ``"prompt_too_long"``...), ``"request_too_large"``, ``"no_engine"``,
    ``"model_not_found"``, ``"cancelled"`` (the session went), ``"internal_error"``. ``llm_output`` is,
    when a transform's parser refused the model's text (invalid JSON or XML, a regex that does not match),
    that whole text — which ``error`` quotes only the start of; None otherwise, and for a text over the
    server's bound (64 Ki characters: whole or absent, never cut). Both are None from a server older than
    these fields.
    """

    var_id: str
    status: VariableStatus
    value: str | None = None
    kind: ValueKind = "text"
    error: str | None = None
    error_type: str | None = None
    llm_output: str | None = None


class StepInfo(BaseModel):
    """What the server did with one step of a call (``GET /v1/sessions/{sid}/steps``): its output variable,
    objective (``criteria``, ``task_group``), state, engine, tries, prompt tokens and how many of them were
    forked from a kept context instead of computed, and its queue and run times in seconds."""

    call_id: str
    index: int
    var_id: str
    function: str | None
    criteria: Criteria | None
    task_group: str | None
    state: Literal["queued", "running", "done", "failed"]
    engine: str | None
    attempts: int
    prompt_tokens: int
    prefill_tokens_saved: int
    queue_s: float | None
    run_s: float | None
    error: str | None


DagStepState = Literal["waiting", "queued", "running", "done", "failed"]


class DagVariable(BaseModel):
    """A variable of a session's DAG (``GET /v1/sessions/{sid}/dag``): its status, who produces it, and the
    start of its value (``value``, cut at the server's bound, 4,096 characters; ``truncated`` says so: the
    whole value is at ``GET /v1/sessions/{sid}/dag/variables/{var_id}``)."""

    var_id: str
    name: str | None
    status: VariableStatus
    kind: ValueKind = "text"
    producer: str | None = None  # "call_id:index" of the step that generates it; None: the client sets it
    value: str | None = None
    truncated: bool = False
    error: str | None = None


class DagStep(StepInfo):
    """A step of a session's DAG: what `StepInfo` says once it was dispatched, plus the variables it reads
    (``inputs``). ``state`` is ``waiting`` until its inputs are set and something asked for its output;
    a step that failed before it ran (an input failed) has no engine and no times."""

    state: DagStepState  # type: ignore[assignment]  # StepInfo's states plus "waiting"
    inputs: list[str]


class SessionDag(BaseModel):
    """One session's dataflow as the server ran it: every call's steps (in submission order) and every
    variable, joined with the step records (``GET /v1/sessions/{sid}/dag``)."""

    session_id: str
    steps: list[DagStep]
    variables: list[DagVariable]


class VariableStreamEvent(BaseModel):
    """One server-sent event of ``GET /v1/sessions/{sid}/variables/{var_id}/stream``: more of the producing
    step's text (``delta``, before transforms), ``restart`` (the step runs again on another engine: drop the
    text so far), or the variable's answer (``final``, as a get answers it), which is the last event.
    """

    delta: str | None = None
    restart: bool = False
    final: GetVariableResponse | None = None


# ------------------------------------------------------------------------------------------------ batches
class BatchCreateVariable(CreateVariableRequest):
    op: Literal["create_variable"] = "create_variable"


class BatchSetVariable(SetVariableRequest):
    op: Literal["set_variable"] = "set_variable"
    var_id: str


class BatchSubmitCall(SubmitCallRequest):
    op: Literal["submit_call"] = "submit_call"


BatchOp = Annotated[BatchCreateVariable | BatchSetVariable | BatchSubmitCall, Field(discriminator="op")]


class BatchGet(GetVariableQuery):
    """The variable a batch waits for once its operations are applied (a long poll, as a GET)."""

    var_id: str


class BatchRequest(StrictModel):
    """``POST /v1/sessions/{sid}/batch``: operations applied in order, then optionally one ``get``.

    With client-chosen variable ids (``var_id`` on created variables and outputs) a whole DAG — inputs,
    calls consuming each other's outputs, and the get of its result — is one round trip. Operations are
    applied one by one: if one fails, the answer is that operation's error with its ``op_index`` (an
    index equal to ``len(ops)`` is the get's own error): the ones before it stay applied, the ones after
    it are not. On success the answer is NDJSON, sent as it happens: a `BatchApplied` line as soon as the
    operations are applied, then — with a get — a `BatchGetAnswer` line when the variable is settled or
    the get's timeout has passed.
    """

    ops: list[BatchOp] = Field(default_factory=list, max_length=10_000)
    get: BatchGet | None = None
    # Create the session first if it does not exist yet — with the path's id and the bearer token as its
    # token, both chosen by the client (`SESSION_ID_PATTERN`, `SESSION_TOKEN_PATTERN`) — so that a session
    # opens with its first batch: one round trip fewer than ``POST /v1/sessions`` before it.
    create: CreateSessionRequest | None = None


class BatchApplied(BaseModel):
    """First line of a batch's answer: every operation was applied; their answers in order."""

    results: list[VariableCreated | GetVariableResponse | SubmitCallResponse]


class BatchGetAnswer(BaseModel):
    """Second line of a batch's answer, with a get: the variable (``status == "pending"`` if the get's
    timeout passed first: get it again)."""

    get: GetVariableResponse
