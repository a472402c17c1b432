"""The engine's wire schema: the bodies of the engine HTTP API (`server.engine.api`: fill, generate, free,
stats) and of the manager's engine routes (registration, heartbeats, status).

Owned by the server, which serves both sides; the client package (`parrot`) never sends these.
"""

from __future__ import annotations

from parrot.openai_types import FinishReason
from parrot.protocol import SamplingConfig, StrictModel, TokenLogprobConfig
from pydantic import BaseModel, Field, model_validator

MAX_TENANT_CHARS = 128  # an engine request's ``tenant``: an id, not data
_TENANT_DOC = (
    "who sent it (the manager sends a session's tenant): tenants take turns in the engine's waiting "
    "queue, so one tenant's flood never holds back another's next request; None: one tenant in all"
)


class EngineFillRequest(StrictModel):
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
    # Score the filled tokens (`Engine.score`) with this many top alternatives each; None: a plain fill.
    # Scoring computes the whole prompt, so it starts a new context without a parent.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _one_input(self) -> EngineFillRequest:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("give exactly one of token_ids or text")
        return self


class EngineFillResponse(BaseModel):
    context_id: int
    num_tokens: int  # the context's length after the fill
    # With ``prompt_logprobs``: each filled token's after the first, given those before it
    prompt_logprobs: list[TokenLogprobConfig] | None = None


class EngineGenerateRequest(StrictModel):
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
    logprob: TokenLogprobConfig | None = None  # when the sampling asked for logprobs


class EngineFreeContextRequest(StrictModel):
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
    # predicts TTFT and TPOT from when it admits requests against SLOs (`server.cluster.mutel.admit`).
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


class EngineRegistration(StrictModel):
    """``POST /v1/engines``: a remote engine (``python -m server.engine --manager URL``) joins a manager.

    ``url`` is where the manager reaches the engine's HTTP API; the manager reads the model, window and
    tokenizer from it (``GET /info``, ``GET /tokenizer``) before answering.
    """

    name: str = Field(min_length=1, max_length=128)
    url: str = Field(pattern=r"^https?://")


class BackendRegistration(StrictModel):
    """``POST /v1/backends``: an OpenAI-compatible server (vLLM, SGLang, another Parrot) joins a running
    manager as an engine (`server.cluster.openai_backend`). What cannot be read from it is given here: the
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


class EngineHeartbeat(StrictModel):
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
