"""`ManagerConfig`: what a manager's parts (`server.serve.manager`) are tuned by, one typed field each."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from server.cluster.mutel import Slo
from server.serve.quotas import Quotas


@dataclass
class ManagerConfig:
    session_ttl: float = 600.0  # seconds without calls before a session and all it owns are freed
    quotas: Quotas = field(default_factory=Quotas)  # what one client / session may hold at once
    default_get_timeout: float = 60.0
    max_get_timeout: float = 300.0
    # Prompt prefixes at least this long (tokens) that several queued steps share (or a call's leading
    # constant text) become shared engine contexts.
    min_shared_prefix_tokens: int = 16
    max_cached_prefixes: int = 256  # per engine, every cache salt included; least recently used go first
    # Whether the OpenAI endpoints reuse cached prefixes and keep finished requests' KV (as vLLM's automatic
    # prefix caching does), their requests placed by the scheduler as steps are. Off: each request goes to
    # the least loaded engine, fills its whole prompt and frees its context — the request-centric baseline
    # of the benchmarks (the paper's vLLM without sharing, behind a load balancer).
    openai_prefix_cache: bool = True
    # Scheduling (server.serve.scheduler): tokens an engine runs at once (None: its KV cache in tokens),
    # and at most while it runs latency-critical work; rounds before a waiting step goes first.
    engine_capacity_tokens: int | None = None
    # Steps placed on one engine at once; None: twice the batch it reports (`EngineStats.max_num_seqs`),
    # enough to keep it fed, and no count cap for an engine that does not say. The rest wait in the
    # manager's queue, where tenants and apps take turns (`fair_ranks`); in the engine's, tenants take turns
    # too (each fill and generate carries its session's tenant).
    engine_max_steps: int | None = None
    latency_cap_tokens: int = 4096
    aging_rounds: int = 8
    # Whether the scheduler sees shared prefixes and cached contexts (off: an ablation, where steps go by
    # objective and load alone; engines still reuse what they happen to hold).
    prefix_affinity: bool = True
    # How much busier (tokens, and 1.5x) an OpenAI backend running a request's prefix may be and still
    # draw that request when it comes alone (`SchedulerConfig.prefix_slack_tokens`).
    prefix_slack_tokens: int = 4096
    # Whether steps share KV at all (off: an ablation, "Parrot without sharing"): no shared constant-prefix
    # contexts, no forking from cached contexts, and a finished step's context is freed at once (nothing
    # could fork it), so every step fills its whole prompt, as a request-centric service does.
    prefix_sharing: bool = True
    # "eager": a step runs as soon as its inputs are ready (throughput-preferred until a get reaches it);
    # "lazy": only once a get (or a call's criteria) activates it — the paper's behaviour, for ablations.
    dispatch: Literal["eager", "lazy"] = "eager"
    # Remote engines send a heartbeat this often; one silent for `engine_timeout` is out of service.
    heartbeat_interval: float = 2.0
    engine_timeout: float = 10.0
    # The most characters a step's rendered prompt may have: checked from its texts' and values' lengths
    # before rendering (an input repeated in a template multiplies its value), far above any model's window.
    max_prompt_chars: int = 1 << 20
    # How many times a step (or an OpenAI request that has streamed nothing) whose engine failed runs again
    # on another engine before it fails naming the engines.
    max_step_retries: int = 2
    # SSJF: predict each step's and OpenAI request's output length (`server.serve.output_lengths`) and send it
    # as the engine priority (used by engines running scheduling="sjf"); off: no priorities are sent. The
    # predictor's state is loaded from and saved (at shutdown) to `length_predictor_path` when given.
    length_prediction: bool = True
    length_predictor_path: str | None = None
    # Admission by predicted length (SSJF §6): a step counts against an engine's capacity with its predicted
    # output times this margin (at most max_tokens) instead of max_tokens; None: max_tokens, as before.
    admit_by_predicted_length: float | None = None
    # Mutel's early rejection (`server.cluster.mutel.admit`): an OpenAI request whose engine's predicted time
    # to first token or time per output token misses these P90 objectives is refused at once with a 503
    # (`slo_rejected`, saying which and by how much) instead of queueing; None: every request is admitted.
    # On prefill + decode pairs it also sizes the prefill engine's chunks to the TPOT objective.
    slo: Slo | None = None

    def __post_init__(self) -> None:
        margin = self.admit_by_predicted_length
        if margin is not None and not (math.isfinite(margin) and margin >= 1.0):
            raise ValueError(
                f"admit_by_predicted_length is the margin over the predicted output length (a number >= 1, "
                f"e.g. 1.5), or None to count max_tokens; got {margin!r}"
            )
        if self.prefix_slack_tokens < 0:
            raise ValueError(
                f"prefix_slack_tokens is how many tokens busier a backend may be and still draw a request of "
                f"a prefix it runs (a number >= 0, e.g. 4096); got {self.prefix_slack_tokens!r}"
            )
