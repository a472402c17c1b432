"""Mutel's load balancer as pure decisions over frozen snapshots.

Prefill/decode disaggregation for multi-turn chat: prefill instances keep the prompt KV they computed (it is
the next turn's prefix), decode instances hold only the tokens they generate, and each decode step's
attention over the prompt part runs on the prefill instance holding it. The decisions:

* `admit` — early rejection: a turn whose predicted TTFT or TPOT misses its SLO is refused at once with a
  typed `Rejection` (the manager answers it as a 503), never dropped silently;
* `choose_prefill` — by KV locality and load: the least predicted TTFT, where a locality hit saves moving
  or recomputing the history;
* `choose_decode` — the least loaded decode instance with room for the KV the turn will hold on it;
  `balance_kv` — or one that takes the prompt's KV too, when prefill memory is what holds turns back;
* `chunk_size` — the largest prefill chunk that keeps the decode work waiting on the instance in its TPOT;
  `chunk_within` — or that ends within the gap between decode instances' attention requests (never blocks);
* `move_or_recompute` — move KV over the link or recompute it, whichever takes less time.

The snapshots they decide on are `server.cluster.mutel_types`. Nothing here does I/O, reads a clock or keeps
state: the manager and the cluster simulator (`server.sim.disagg`) call the same functions, and the
baselines are the same code with features off (colocated: every instance has role ``BOTH``; Splitwise-like:
no locality, whole contexts moved).
"""

from __future__ import annotations

from collections.abc import Sequence

from server.cluster.mutel_types import (
    CostModel,
    Fetch,
    InstanceView,
    PrefillChoice,
    Rejection,
    RejectReason,
    Role,
    Slo,
    TurnRequest,
)

__all__ = [  # the snapshots' types too: callers import every name of Mutel from here
    "CostModel", "Fetch", "InstanceView", "PrefillChoice", "RejectReason", "Rejection", "Role", "Slo",
    "TurnRequest", "admit", "balance_kv", "choose_decode", "choose_prefill", "chunk_size", "chunk_within",
    "move_or_recompute", "predict_prefill", "predict_tpot",
]  # fmt: skip


def move_or_recompute(
    tokens: int,
    bytes_per_token: int,
    link_bytes_per_s: float,
    prefill_s_per_token: float,
    latency_s: float = 0,
) -> Fetch:
    """Move ``tokens`` of KV once over the link, or recompute them: whichever takes less time. Moving uses
    the link, recomputing the GPU; ties recompute (nothing crosses the link)."""
    move = latency_s + tokens * bytes_per_token / link_bytes_per_s
    return "move" if tokens > 0 and move < tokens * prefill_s_per_token else "recompute"


def predict_prefill(
    inst: InstanceView, req: TurnRequest, cost: CostModel, locality: bool = True
) -> PrefillChoice:
    """The prefill of ``req`` on ``inst``: history it holds is reused, the rest moved or recomputed; TTFT =
    the move, then the queue ahead and this prompt at the instance's recent speed."""
    reused = min(inst.held.get(req.conversation, 0), req.history_tokens) if locality else 0
    missing = req.history_tokens - reused
    per_token = inst.prefill_s_per_token or cost.prefill_token_s
    fetch = move_or_recompute(
        missing, cost.kv_bytes_per_token, cost.link_bytes_per_s, per_token, cost.link_latency_s
    )
    compute = req.prompt_tokens + (missing if fetch == "recompute" else 0)
    attention = cost.prefill_s(compute, req.context_tokens - compute) - compute * cost.prefill_token_s
    moving = cost.move_s(missing) if fetch == "move" else 0.0
    ttft = moving + (inst.queued_prefill_tokens + compute) * per_token + attention
    return PrefillChoice(inst.index, reused, fetch, compute, ttft)


def choose_prefill(
    instances: Sequence[InstanceView],
    req: TurnRequest,
    cost: CostModel,
    locality: bool = True,
    slo: Slo | None = None,
) -> PrefillChoice | None:
    """The prefill instance for ``req``: first one with room for its KV now (else it waits there), then,
    with ``slo``, one whose decodes stay within the TPOT SLO with this turn's (role ``BOTH`` only: it will
    decode there), then the least predicted TTFT (KV locality first: a hit saves moving or recomputing the
    history; then load), the shorter queue, the lower index. None: no instance could ever hold it."""
    out = req.expected_output_tokens

    def key(i: InstanceView) -> tuple[bool, bool, float, int, int]:
        both = i.role is Role.BOTH  # it will decode the turn too
        fits = i.kv_free >= req.context_tokens + (out if both else 0)  # (idle conversations' KV makes way)
        slow = both and slo is not None and predict_tpot(i, cost, req.context_tokens + out // 2) > slo.tpot_s
        ttft = predict_prefill(i, req, cost, locality).predicted_ttft_s
        return (not fits, slow, ttft, i.queued_prefill_tokens, i.index)

    options = [i for i in instances if i.role.prefills and i.kv_capacity >= req.context_tokens]
    return predict_prefill(min(options, key=key), req, cost, locality) if options else None


def choose_decode(instances: Sequence[InstanceView], kv_tokens: int) -> int | None:
    """The decode instance with the shortest decode step (then fewest decodes, least KV, lowest index)
    among those with ``kv_tokens`` free; None when none has room now (the turn waits)."""
    fits = [i for i in instances if i.role.decodes and i.kv_free >= kv_tokens]
    best = min(fits, key=lambda i: (i.decode_step_s, i.running_decodes, i.kv_used, i.index), default=None)
    return None if best is None else best.index


def balance_kv(prefill: InstanceView, instances: Sequence[InstanceView], req: TurnRequest) -> int | None:
    """Mutel's KV balancing, when a prefilled turn goes to decode: None keeps its prompt KV on the prefill
    instance (attention parallelism); else the decode instance to move it to, with the answer (attention
    there is local). Moved only when turns wait for KV room on the prefill instance and a decode instance
    has room for the whole context: the decode instances' memory is otherwise idle."""
    if prefill.kv_waiting <= 0:
        return None
    return choose_decode(instances, req.context_tokens + req.expected_output_tokens)


def predict_tpot(
    inst: InstanceView,
    cost: CostModel,
    local_tokens: int,
    remote_tokens: int = 0,
    *,
    overlapped: bool = False,
) -> float:
    """The decode step of ``inst`` with one more request reading ``local_tokens`` of KV there and
    ``remote_tokens`` on a prefill instance (whose attention the step waits for). ``overlapped``: the remote
    attention runs while the step attends over its local part (each layer's query goes out first, as on
    GPUs), so the step grows by the longer of the two reads, not their sum."""
    step = inst.decode_step_s or cost.base_s
    reads = max(local_tokens, remote_tokens) if overlapped else local_tokens + remote_tokens
    return step + cost.decode_seq_s + cost.kv_token_s * reads


def admit(
    prefill: PrefillChoice | None,
    decode: InstanceView | None,
    slo: Slo,
    cost: CostModel,
    local_tokens: int,
    remote_tokens: int = 0,
    *,
    overlapped: bool = False,
) -> Rejection | None:
    """Early rejection: None to accept, else why not. ``decode``: where the turn would decode now (None:
    nowhere has room yet); ``local_tokens``/``remote_tokens``/``overlapped`` as for `predict_tpot`."""
    if prefill is None:
        return Rejection(RejectReason.NO_CAPACITY)
    if prefill.predicted_ttft_s > slo.ttft_s:
        return Rejection(RejectReason.TTFT, prefill.predicted_ttft_s, slo.ttft_s)
    if decode is not None:  # (no decode instance with room yet: the turn will queue for one)
        tpot = predict_tpot(decode, cost, local_tokens, remote_tokens, overlapped=overlapped)
        if tpot > slo.tpot_s:
            return Rejection(RejectReason.TPOT, tpot, slo.tpot_s)
    return None


def chunk_size(
    tpot_s: float,
    decode_step_s: float,
    cost: CostModel,
    *,
    cached_tokens: int = 0,
    fixed_s: float = 0.0,
    blocking: float = 1.0,
    min_tokens: int = 64,
    max_tokens: int = 2048,
) -> int:
    """The largest prefill chunk n (within [min_tokens, max_tokens]) with ``decode_step_s + blocking *
    (fixed_s + n tokens' compute) <= tpot_s``: the decode work waiting on this instance still meets its TPOT.

    ``decode_step_s`` is that work's own step time (0: none waits, so the largest chunk). Colocated, the
    chunk rides in the decode step (``fixed_s`` 0, ``blocking`` 1). On a prefill instance whose chunk is a
    step of its own (``fixed_s`` its base) and whose remote attention waits for the layer of the chunk under
    way, on average half of it: ``blocking`` 0.5, summed over the layers."""
    if decode_step_s <= 0:
        return max_tokens
    room = (tpot_s - decode_step_s) / blocking
    return chunk_within(room, cost, cached_tokens=cached_tokens, fixed_s=fixed_s, min_tokens=min_tokens,
                        max_tokens=max_tokens)  # fmt: skip


def chunk_within(
    room_s: float,
    cost: CostModel,
    *,
    cached_tokens: int = 0,
    fixed_s: float = 0.0,
    min_tokens: int = 64,
    max_tokens: int = 2048,
) -> int:
    """The largest prefill chunk (within [min_tokens, max_tokens]) whose step, ``fixed_s`` + its tokens'
    compute after ``cached_tokens``, takes at most ``room_s``. Mutel's coordination sizes a prefill
    instance's chunk to the gap between its decode instances' attention requests (each layer's chunk ends
    before the next query arrives: decode attention is never blocked)."""
    per_token = cost.prefill_token_s + cost.prefill_pair_s * cached_tokens
    room = room_s - fixed_s
    return max(min_tokens, min(max_tokens, int(room / per_token) if room > 0 else 0))
