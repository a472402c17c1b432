"""The wire schema of Parrot serve: pydantic models shared by the client and the server.

One source of truth for every JSON body. Errors are always `{"error": {"type", "message"}}`.
This module imports nothing but pydantic, so a client install stays light.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

FinishReason = Literal["stop", "length"]


class _Strict(BaseModel):
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


class GuidedConfig(_Strict):
    """Constrained decoding: the output must match a JSON Schema (``value``: the schema as JSON text), be a
    JSON object (no value), match a regex, be one of ``value``'s strings (``choice``), or be a sentence of
    an EBNF grammar with start rule ``root``. The engine masks every token that would break it."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    value: str | list[str] | None = None


class TokenLogprobConfig(BaseModel):
    """A generated token's log-probability and its ``top`` alternatives as [token id, logprob] pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list)


SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""The seeds the engine takes (what ``torch.Generator.manual_seed`` accepts: a 64-bit integer)."""

_SAMPLING_CHECKED = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


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
    return None


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
    guided: GuidedConfig | None = None
    # Each generated token's log-probability, with its top this many alternatives (0: the token's only).
    logprobs: int | None = Field(default=None, ge=0, le=20)


# ----------------------------------------------------------------------------------------- engine API
MAX_TENANT_CHARS = 128  # an engine request's ``tenant``: an id, not data
_TENANT_DOC = (
    "who sent it (the manager sends a session's tenant): tenants take turns in the engine's waiting "
    "queue, so one tenant's flood never holds back another's next request; None: one tenant in all"
)


class EngineFillRequest(_Strict):
    """Append tokens (or text, tokenized by the engine without special tokens) to a context.

    A new ``context_id`` is created, forked from ``parent_context_id`` when given: from all of the parent's
    tokens, or from its first ``parent_len`` (``0 <= parent_len <=`` the parent's length; only with
    ``parent_context_id``, and only when ``context_id`` is new).
    """

    context_id: int
    token_ids: list[int] | None = None
    text: str | None = None
    parent_context_id: int | None = None
    # Fork from the parent's first this many tokens (full blocks shared, a partial one copied on write);
    # None: the whole parent.
    parent_len: int | None = Field(default=None, ge=0)
    # Its place in the engine's waiting queue under scheduling "sjf", as `EngineGenerateRequest.priority`.
    priority: float | None = Field(default=None, allow_inf_nan=False)
    tenant: str | None = Field(default=None, max_length=MAX_TENANT_CHARS, description=_TENANT_DOC)

    @model_validator(mode="after")
    def _one_input(self) -> EngineFillRequest:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("give exactly one of token_ids or text")
        return self


class EngineFillResponse(BaseModel):
    context_id: int
    num_tokens: int  # the context's length after the fill


class EngineGenerateRequest(_Strict):
    """Generate from the end of a context (forked from ``parent_context_id`` first, if new: from its first
    ``parent_len`` tokens when given, as in `EngineFillRequest`)."""

    context_id: int
    parent_context_id: int | None = None
    # Fork from the parent's first this many tokens; None: the whole parent (see `EngineFillRequest`).
    parent_len: int | None = Field(default=None, ge=0)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    stream: bool = False
    # While this generate runs, the engine's running requests reserve at most this many tokens (prompt
    # tokens of their own + tokens still to generate), its own included; None: no latency cap.
    latency_cap: int | None = Field(default=None, ge=1)
    # Lower starts sooner when the engine runs scheduling "sjf" (the manager sends the predicted output
    # length); it orders only the waiting queue, with aging. None: ranked as an average request.
    priority: float | None = Field(default=None, allow_inf_nan=False)
    tenant: str | None = Field(default=None, max_length=MAX_TENANT_CHARS, description=_TENANT_DOC)


class EngineGenerateResponse(BaseModel):
    context_id: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprobConfig] | None = None  # when the sampling asked for them


class EngineStreamChunk(BaseModel):
    """One server-sent event of a streaming generate: a token and the text it completes."""

    token_id: int
    text: str


class EngineFreeContextRequest(_Strict):
    context_id: int


class EngineFreeContextResponse(BaseModel):
    context_id: int
    freed: bool = True


class EngineStats(BaseModel):
    """Load and exact KV memory of one engine (what `LLMEngine.stats()` returns and `GET /stats` sends)."""

    model: str
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_peak: int = 0  # most blocks in use at once since the engine started or its peak was reset
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
    max_num_seqs: int = 0  # the most requests one step runs (0: not said)
    draining: bool = False  # it is shutting down gracefully: place no new work there; what runs finishes
    role: str = "both"  # "prefill" | "decode" | "both" (colocated): what the manager places there
    kv_leases: int = 0  # contexts' KV lent to other engines (disaggregated serving), held until released
    kv_bytes_moved: int = 0  # KV copied out of or into this engine instead of being recomputed
    remote_attention_bytes: int = 0  # queries and partial outputs exchanged with engines holding remote KV
    # Recent timing (moving averages; 0 until measured) and the prompt work queued: what the manager
    # predicts TTFT and TPOT from when it admits requests against SLOs (`server.serve.mutel.admit`).
    decode_step_s: float = 0.0
    prefill_s_per_token: float = 0.0
    queued_prefill_tokens: int = 0


class EngineInfo(BaseModel):
    """What a manager needs to drive an engine: the model, its window and its tokenizer's vocabulary."""

    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    blocks_total: int
    eos_token_ids: list[int]


class EngineTokenizerFiles(BaseModel):
    """``GET /tokenizer`` of an engine: its Hugging Face tokenizer as the text files ``save_pretrained``
    writes (tokenizer.json, tokenizer_config.json, ...), so a manager tokenizes prompts exactly as it does."""

    files: dict[str, str]


class EngineRegistration(_Strict):
    """``POST /v1/engines``: a remote engine (``python -m server.engine --manager URL``) joins a manager.

    ``url`` is where the manager reaches the engine's HTTP API; the manager reads the model, window and
    tokenizer from it (``GET /info``, ``GET /tokenizer``) before answering.
    """

    name: str = Field(min_length=1, max_length=128)
    url: str = Field(pattern=r"^https?://")


class BackendRegistration(_Strict):
    """``POST /v1/backends``: an OpenAI-compatible server (vLLM, SGLang, another Parrot) joins a running
    manager as an engine (`server.serve.openai_backend`). What cannot be read from it is given here: the
    tokens it runs at once, its latency cap, its context window where its model list does not say, the
    tokenizer (a model name or path on the manager's machine; default: the served model's id) and whether it
    schedules by priority."""

    url: str = Field(pattern=r"^https?://", max_length=2048)
    model: str | None = Field(default=None, min_length=1, max_length=512)
    tokenizer: str | None = Field(default=None, min_length=1, max_length=1024)
    capacity_tokens: int = Field(default=16384, ge=16, le=1 << 26)
    latency_cap_tokens: int | None = Field(default=None, ge=1, le=1 << 26)
    max_model_len: int | None = Field(default=None, ge=1, le=1 << 26)
    priority: bool = False


class BackendRegistered(BaseModel):
    """The manager's answer: the backend's engine id and the model it serves."""

    engine_id: int
    model: str


class EngineRegistered(BaseModel):
    """The manager's answer to a registration: the engine's id and how often it must send heartbeats
    (an engine silent for ``timeout_s`` is taken out of service)."""

    engine_id: int
    heartbeat_interval_s: float
    timeout_s: float


class EngineHeartbeat(_Strict):
    """``POST /v1/engines/{engine_id}/heartbeat``: the engine is alive; its current load."""

    stats: EngineStats


class EngineHeartbeatAnswer(BaseModel):
    """The manager's answer to a heartbeat. ``steps_running``: steps it placed on the engine that have not
    finished — a draining engine keeps serving until it is 0, since a step sends the engine several requests
    (fills, then generation) and one refused between them would run again elsewhere."""

    steps_running: int


class EngineStatus(BaseModel):
    """One engine of ``GET /v1/engines``: where it runs, whether it serves, and its stats."""

    engine_id: int
    name: str
    url: str | None  # None: in the manager's process
    alive: bool
    stats: EngineStats


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


# ------------------------------------------------------------------------------------- template grammar
# A semantic function's prompt is sent unrendered: constant text plus placeholders.
#
#   placeholder  :=  "{{" ws role ws ":" ws name ws "}}"     ws: spaces or tabs only, any amount
#   role         :=  "input" | "output"
#   name         :=  a Python identifier (str.isidentifier)
#
# Literal braces: "{{{{" is a literal "{{" — the one escape (`escape_text` applies it) — and any other "{{"
# opens a placeholder. Read left to right, a run of "{" is: "{{{{" -> literal "{{"; else "{{{" -> a literal
# "{" (the next two may open a placeholder); else "{{" -> a placeholder; else a lone, literal "{". So
# "{{{input:x}}}" is "{", the placeholder, "}"; and "{{{{{{input:x}}" is "{{" and the placeholder.
# Every "}" outside a placeholder ("}}" included) is plain text and needs no escape: JSON and code in
# prompts close "}}" all the time, and outside a placeholder "}}" cannot be mistaken for anything.
# Strict on purpose: a typo such as "{{inptu:x}}" is an error, never silently sent to the model as text.
#
# Rules beyond the grammar, each a `TemplateError` naming what to fix and where:
#   * at least one output (a call exists to produce something);
#   * two outputs need constant text between them: generation of the first needs a boundary before the
#     second begins (the text after an output is what separates it from the next);
#   * an output name appears once (an output is produced once); an input may appear any number of times;
#   * a name is either an input or an output, never both.

Role = Literal["input", "output"]
# The most placeholders one template may hold (each one is a boundary the server tracks and renders).
MAX_TEMPLATE_PLACEHOLDERS = 4096
ROLES: tuple[Role, ...] = ("input", "output")
_HSPACE = " \t"


@dataclass(frozen=True)
class TemplateText:
    """Constant text of a template (escapes already undone: ``text`` is what the model sees).

    ``start``/``end`` locate the piece in the template source; they are not part of equality.
    """

    text: str
    start: int = field(default=0, compare=False)
    end: int = field(default=0, compare=False)


@dataclass(frozen=True)
class TemplatePlaceholder:
    """A ``{{role:name}}`` placeholder; ``start``/``end`` locate it in the source (not part of equality)."""

    role: Role
    name: str
    start: int = field(default=0, compare=False)
    end: int = field(default=0, compare=False)


TemplatePiece = TemplateText | TemplatePlaceholder


def _line_col(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of a character offset."""
    line_start = text.rfind("\n", 0, offset) + 1
    return text.count("\n", 0, offset) + 1, offset - line_start + 1


def _snippet(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class TemplateError(ValueError):
    """A template that does not follow the grammar (HTTP 400 on the server).

    ``reason`` says what is wrong and how to fix it; ``offset`` (a character offset into the template),
    ``line`` and ``column`` (1-based) say where, or are None for a whole-template problem.
    """

    def __init__(self, reason: str, template: str | None = None, offset: int | None = None) -> None:
        self.reason = reason
        self.offset = offset
        self.line: int | None = None
        self.column: int | None = None
        where = "template"
        if template is not None and offset is not None:
            self.line, self.column = _line_col(template, offset)
            where = f"template, line {self.line}, column {self.column} (offset {offset})"
        super().__init__(f"{where}: {reason}")


def _parse_placeholder(template: str, start: int) -> TemplatePlaceholder:
    """Parse the placeholder whose ``{{`` is at ``start``."""
    close = template.find("}}", start + 2)
    # A placeholder never spans lines or contains another "{{": stopping there points at the real culprit
    # (the unclosed "{{") instead of some "}}" much later in the template. Both searches end at ``close``,
    # so parsing stays linear in the template's length however many placeholders it has.
    newline = template.find("\n", start + 2, max(close, 0))
    reopen = template.find("{{", start + 2, max(close, 0))
    if close < 0 or newline >= 0 or reopen >= 0:
        raise TemplateError(
            f"unclosed '{{{{' ({_snippet(template[start : start + 30])}): close the placeholder with '}}}}' "
            "on the same line, or write '{{{{' for a literal '{{'",
            template,
            start,
        )
    end = close + 2
    source = template[start:end]
    body = template[start + 2 : close]
    if ":" not in body:
        word = body.strip(_HSPACE)
        hint = (
            f"write {{{{input:{word}}}}} or {{{{output:{word}}}}}"
            if word.isidentifier()
            else "placeholders are {{input:NAME}} or {{output:NAME}}"
        )
        raise TemplateError(f"placeholder {source!r} has no role: {hint}", template, start)
    role, _, name = (part.strip(_HSPACE) for part in body.partition(":"))
    if role not in ROLES:
        close_matches = difflib.get_close_matches(role, ROLES, n=1)
        hint = f" (did you mean {close_matches[0]!r}?)" if close_matches else ""
        raise TemplateError(
            f"unknown role {role!r} in {source!r}: the role is 'input' or 'output'{hint}", template, start
        )
    if not name:
        raise TemplateError(
            f"placeholder {source!r} has an empty name: write {{{{{role}:NAME}}}}", template, start
        )
    if not name.isidentifier():
        raise TemplateError(
            f"placeholder name {name!r} in {source!r} is not a Python identifier "
            "(letters, digits and underscores, not starting with a digit)",
            template,
            start,
        )
    checked: Role = "input" if role == "input" else "output"  # narrows the str for type checkers
    return TemplatePlaceholder(checked, name, start, end)


def _scan(template: str) -> Iterator[TemplatePiece]:
    """Split a template into pieces by the grammar alone, lazily (so errors come in text order)."""
    chunks: list[str] = []  # literal text since the last placeholder
    text_start = 0
    i = 0
    n = len(template)
    while i < n:
        j = template.find("{", i)
        if j < 0:
            chunks.append(template[i:])
            break
        chunks.append(template[i:j])
        if template.startswith("{{{{", j):
            chunks.append("{{")
            i = j + 4
        elif template.startswith("{{{", j) or not template.startswith("{{", j):
            chunks.append("{")  # a lone "{", or a "{" before the last two of a run
            i = j + 1
        else:
            if text := "".join(chunks):
                yield TemplateText(text, text_start, j)
            chunks = []
            placeholder = _parse_placeholder(template, j)
            yield placeholder
            i = text_start = placeholder.end
    if text := "".join(chunks):
        yield TemplateText(text, text_start, n)


def _check_placeholder(
    template: str, piece: TemplatePlaceholder, first: TemplatePlaceholder, previous: TemplatePiece | None
) -> None:
    """The rules between placeholders, for ``piece`` given its name's first use and the piece before it."""

    def where() -> str:  # only when refusing: finding a line is linear in the template
        return "line {}, column {}".format(*_line_col(template, first.start))

    if first is not piece and first.role != piece.role:
        raise TemplateError(
            f"{piece.name!r} is used as both {first.role} (at {where()}) and {piece.role}: "
            "a name is either an input or an output; rename one",
            template,
            piece.start,
        )
    if first is not piece and piece.role == "output":
        raise TemplateError(
            f"output {piece.name!r} appears twice (first at {where()}): an output is produced once; "
            "rename one, or read it as an {{input:...}} in a following call",
            template,
            piece.start,
        )
    if piece.role == "output" and isinstance(previous, TemplatePlaceholder) and previous.role == "output":
        raise TemplateError(
            f"outputs {previous.name!r} and {piece.name!r} are adjacent: put constant text between "
            f"them so that {previous.name!r} has a boundary where it ends",
            template,
            piece.start,
        )


def parse_template(template: str) -> list[TemplatePiece]:
    """Parse a semantic function's template into constant text and placeholders, in order.

    Adjacent text is merged (two `TemplateText` are never neighbours); placeholders may be. Raises
    `TemplateError` (with the line and column) for a malformed placeholder, adjacent outputs, an output
    used twice, a name used as both input and output, more than `MAX_TEMPLATE_PLACEHOLDERS` placeholders,
    or a template without any output. Linear in the template's length. See the grammar
    in the comment above.
    """
    pieces: list[TemplatePiece] = []
    first_use: dict[str, TemplatePlaceholder] = {}
    placeholders = 0
    for piece in _scan(template):
        if isinstance(piece, TemplatePlaceholder):
            placeholders += 1
            if placeholders > MAX_TEMPLATE_PLACEHOLDERS:
                raise TemplateError(
                    f"over {MAX_TEMPLATE_PLACEHOLDERS} placeholders: split the call, or pass repeated text "
                    "as one input value",
                    template,
                    piece.start,
                )
            previous = pieces[-1] if pieces else None
            _check_placeholder(template, piece, first_use.setdefault(piece.name, piece), previous)
        pieces.append(piece)
    if not placeholder_names(pieces, "output"):
        raise TemplateError(
            "there is no {{output:NAME}} placeholder: a call must produce at least one output"
        )
    return pieces


def escape_text(text: str) -> str:
    """Escape constant text for a template: every ``{{`` becomes ``{{{{`` (nothing else needs escaping)."""
    return text.replace("{{", "{{{{")


def render_template(pieces: Sequence[TemplatePiece]) -> str:
    """The canonical template of ``pieces`` (escaped text, ``{{role:name}}`` without spaces).

    The inverse of `parse_template`: ``parse_template(render_template(p)) == p`` for valid pieces, and a
    template written canonically renders back to itself.
    """
    return "".join(
        escape_text(p.text) if isinstance(p, TemplateText) else f"{{{{{p.role}:{p.name}}}}}" for p in pieces
    )


def placeholder_names(pieces: Sequence[TemplatePiece], role: Role) -> list[str]:
    """The distinct names of ``role`` placeholders, in order of first appearance."""
    names = (p.name for p in pieces if isinstance(p, TemplatePlaceholder) and p.role == role)
    return list(dict.fromkeys(names))


# ------------------------------------------------------------------------------------------------ calls
Criteria = Literal["latency", "throughput"]


# A server started with API keys (``--api-key``) needs one to open a session; a session's requests carry it in
# this header, beside their session token in ``Authorization``. Clients read the key from the variable.
API_KEY_HEADER = "X-API-Key"
API_KEY_ENV = "PARROT_API_KEY"

# Ids a client may choose for its variables (so a whole DAG can be sent in one request, see `BatchRequest`).
VAR_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class PlaceholderSpec(_Strict):
    """What one template placeholder is bound to in a call.

    An input gives exactly one of ``var_id`` (an existing variable of the session, possibly still pending)
    or ``value`` (literal text, inserted verbatim: never parsed as template text). An output never gives
    ``value``; its optional ``var_id`` is the id of the variable it produces — a new id the client chose
    (`VAR_ID_PATTERN`), or a pending variable the client created unset — and without one the server makes
    a fresh variable; either way its id comes back in `SubmitCallResponse.outputs`. Only outputs take
    ``transforms`` (applied to the generated text in order) and ``sampling``.
    The cross-checks live in `check_call` (a 400 on the server), not here (a 422 is for malformed JSON).
    """

    name: str
    role: Role
    var_id: str | None = None
    value: str | None = None
    transforms: list[TransformSpec] = Field(default_factory=list)
    sampling: SamplingConfig | None = None


class SubmitCallRequest(_Strict):
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


def _names(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


def check_call(template: str, placeholders: Sequence[PlaceholderSpec]) -> list[TemplatePiece]:
    """Validate a call: the template's grammar, then its placeholder specs against it; return the pieces.

    Raises `TemplateError` for the template and `CallError` when: a name has two specs; a template
    placeholder has no spec, or a spec no placeholder; the roles differ; an input does not give exactly one
    of ``var_id``/``value``; an output gives ``value`` or a ``var_id`` that is not a valid id
    (`VAR_ID_PATTERN`); an input carries ``transforms`` or ``sampling`` (they describe generation).
    """
    pieces = parse_template(template)
    used = {p.name: p.role for p in pieces if isinstance(p, TemplatePlaceholder)}
    specs: dict[str, PlaceholderSpec] = {}
    for spec in placeholders:
        if spec.name in specs:
            raise CallError(f"placeholder {spec.name!r} has two specs: give one spec per name")
        specs[spec.name] = spec
    if missing := [name for name in used if name not in specs]:
        raise CallError(
            f"the template uses {_names(missing)} but no placeholder spec names them: add a spec for each"
        )
    if unused := [name for name in specs if name not in used]:
        raise CallError(
            f"placeholder spec(s) {_names(unused)} do not appear in the template: remove them, or add "
            f"{{{{{specs[unused[0]].role}:{unused[0]}}}}} to the template"
        )
    chosen = [spec.var_id for spec in specs.values() if spec.role == "output" and spec.var_id is not None]
    if len(set(chosen)) != len(chosen):
        raise CallError(f"two outputs ask for the same var_id ({chosen}): each output is its own variable")
    for name, spec in specs.items():
        if spec.role != used[name]:
            raise CallError(
                f"{name!r} is an {used[name]} in the template but its spec says role {spec.role!r}"
            )
        if spec.role == "input":
            if (spec.var_id is None) == (spec.value is None):
                got = "both" if spec.var_id is not None else "neither"
                raise CallError(
                    f"input {name!r} needs exactly one of var_id (a variable) or value (literal text); "
                    f"got {got}"
                )
            if spec.var_id == "":
                raise CallError(f"input {name!r} has an empty var_id")
            if spec.transforms or spec.sampling is not None:
                raise CallError(
                    f"input {name!r} has transforms or sampling: those apply to outputs only; "
                    "transform the producing call's output instead"
                )
        elif spec.value is not None:
            raise CallError(
                f"output {name!r} gives a value: the call generates it; remove 'value' (an output may give "
                "the 'var_id' it should get)"
            )
        elif spec.var_id is not None and not re.fullmatch(VAR_ID_PATTERN, spec.var_id):
            raise CallError(
                f"output {name!r} asks for var_id {spec.var_id!r}: a variable id is 1-64 characters among "
                "A-Z a-z 0-9 _ -"
            )
        else:
            _check_schema_transform(name, spec)
    return pieces


def schema_guide(transforms: Sequence[TransformSpec]) -> GuidedConfig | None:
    """The constraint an output's ``json`` transform with a schema puts on its generation, if it has one."""
    schema = next((t.json_schema for t in transforms if t.json_schema is not None), None)
    return None if schema is None else GuidedConfig(kind="json_schema", value=json.dumps(schema))


def _check_schema_transform(name: str, spec: PlaceholderSpec) -> None:
    """A schema'd ``json`` transform constrains the output text itself: it comes first (after ``strip`` at
    most, which keeps JSON valid), and the output's sampling brings no other constraint."""
    at = next((i for i, t in enumerate(spec.transforms) if t.json_schema is not None), None)
    if at is None:
        return
    if any(t.type != "strip" for t in spec.transforms[:at]) or any(
        t.json_schema is not None for t in spec.transforms[at + 1 :]
    ):
        raise CallError(
            f"output {name!r}: a json transform with a schema constrains the generated text, so it must be "
            "the output's first transform (after strip at most), and its only schema"
        )
    if spec.sampling is not None and spec.sampling.guided is not None:
        raise CallError(
            f"output {name!r} has both a json transform with a schema and guided sampling: keep one "
            "constraint"
        )


# ------------------------------------------------------------------------------- sessions and variables
VariableStatus = Literal["pending", "ready", "failed"]
ValueKind = Literal["text", "json"]
CRITERIA: tuple[Criteria, ...] = ("latency", "throughput")


# What a client-chosen session id and token (`BatchRequest.create`) must look like: a token is a secret of
# at least 256 bits in URL-safe base64 (``secrets.token_urlsafe(32)``), an id is not secret.
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"
SESSION_TOKEN_PATTERN = r"^[A-Za-z0-9_-]{43,256}$"


class CreateSessionRequest(_Strict):
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


class CreateVariableRequest(_Strict):
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


class SetVariableRequest(_Strict):
    """``PUT /v1/sessions/{sid}/variables/{vid}``: give a pending variable its value (once: 409 after)."""

    value: str


class GetVariableQuery(_Strict):
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


class SessionSummary(BaseModel):
    """One live session in the cluster view: its age, and its steps and variables by state."""

    session_id: str
    age_s: float
    idle_s: float
    calls: int
    steps: dict[str, int]  # DagStepState -> count
    variables: dict[str, int]  # VariableStatus -> count


class EngineView(EngineStatus):
    """An engine in the cluster view: its status plus how often sharing saved prefill there (steps that
    forked a kept context, and the prompt tokens they did not compute)."""

    prefix_hits: int = 0
    prefill_tokens_saved: int = 0


class ClusterView(BaseModel):
    """What the live view shows the cluster token's holder (``GET /v1/view``): engines and sessions."""

    engines: list[EngineView]
    sessions: list[SessionSummary]


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


class BatchRequest(_Strict):
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


# ------------------------------------------------------------------------------- OpenAI-compatible API
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
    # Extensions (as in vLLM): top-k sampling and ignoring the end-of-sequence token.
    top_k: int | None = None
    ignore_eos: bool | None = None
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
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class OpenAICompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    logprobs: OpenAICompletionLogprobs | None = None
    token_ids: list[int] | None = None  # with return_token_ids
    prompt_token_ids: list[int] | None = None  # with return_token_ids (streamed: in the first chunk)


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
    logprobs: None = None


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
