"""Pure checks of what remote engines send the manager: whether one more may register, and whether a
heartbeat's stats make sense. No I/O: the routes in `server.http.app` call them and answer the refusals."""

from __future__ import annotations

from collections.abc import Sequence

from server.engine.wire import EngineStats, EngineStatus

__all__ = ["EngineLimitError", "HeartbeatError", "heartbeat_problem", "registration_refusal"]

# Fields a running engine never changes: a heartbeat must repeat what the engine registered with.
_FIXED_FIELDS = ("model", "block_size", "blocks_total", "max_model_len")


class EngineLimitError(Exception):
    """The manager already has as many remote engines in service as it takes."""

    http_status = 429
    error_type = "too_many_engines"


class HeartbeatError(Exception):
    """A heartbeat whose stats cannot be right; the engine's state is left as it was."""

    http_status = 400
    error_type = "bad_heartbeat"


def registration_refusal(engines: Sequence[EngineStatus], name: str, pending: int, limit: int) -> str | None:
    """Why an engine named ``name`` may not register now (None: it may). ``engines`` is the manager's
    engine list, ``pending`` the registrations already under way. An engine registering again under the
    name of one in service replaces it, so it does not count against ``limit``."""
    in_service = [e for e in engines if e.url is not None and e.alive]
    if any(e.name == name for e in in_service):
        return None
    if len(in_service) + pending >= limit:
        return (
            f"the manager already has {len(in_service)} remote engines in service (and {pending} joining), "
            f"its limit is {limit}: stop one first, or raise the limit (python -m server --max-engines)"
        )
    return None


def heartbeat_problem(stats: EngineStats, registered: EngineStats) -> str | None:
    """What is wrong with heartbeat ``stats`` of an engine that registered with ``registered`` (None: it
    is sane): negative counts, blocks in use or free over the total, or a fixed field that changed."""
    negative = sorted(k for k, v in stats.model_dump().items() if isinstance(v, int) and v < 0)
    if negative:
        return f"counts must not be negative: {', '.join(negative)}"
    if stats.blocks_total <= 0:
        return "blocks_total must be > 0"
    if stats.blocks_used + stats.blocks_free > stats.blocks_total:
        return (
            f"blocks_used ({stats.blocks_used}) + blocks_free ({stats.blocks_free}) is over blocks_total "
            f"({stats.blocks_total})"
        )
    changed = [k for k in _FIXED_FIELDS if getattr(stats, k) != getattr(registered, k)]
    if changed:
        return (
            f"{', '.join(changed)} differ from what the engine registered with: an engine that changed "
            "must register again"
        )
    return None
