"""Quotas: how much one client may hold at once, so no tenant can exhaust the server for the others.

Pure checks over counts the caller keeps (`SessionTable` counts sessions per client; the manager counts a
session's variables, unfinished steps and the tokens those steps may still generate). Each refusal is a
`QuotaExceededError` (HTTP 429 with ``Retry-After``) naming the quota and the setting that raises it.
The defaults are generous for one machine: far above what an application needs, far below what exhausts
the process.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.serve.sessions import SessionError

__all__ = [
    "QuotaExceededError",
    "Quotas",
    "SessionUsage",
    "check_call",
    "check_session",
    "check_stored",
    "check_variables",
    "tenant_tokens_refusal",
]


class QuotaExceededError(SessionError):
    """A client or session is at one of its quotas; retry after ``retry_after`` seconds (or free some)."""

    http_status = 429
    error_type = "quota_exceeded"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Quotas:
    """Per tenant (an API key's, else a client address) and per session bounds (`ManagerConfig.quotas`)."""

    sessions_per_client: int = 4096  # a load test of thousands of users from one host still fits
    variables_per_session: int = 20_000
    queued_steps_per_session: int = 2_000  # steps of calls submitted and not finished
    queued_tokens_per_session: int = 4_000_000  # max_tokens summed over those steps
    # Characters of the variable values a tenant's open sessions were given (kept until a session ends).
    stored_chars_per_tenant: int = 256 * 2**20
    # Tokens a tenant has in flight: its sessions' unfinished steps' max_tokens, and the prompt and
    # max_tokens of each generation of its running OpenAI requests.
    queued_tokens_per_tenant: int = 16_000_000


@dataclass
class SessionUsage:
    """What a session holds now: its variables, its unfinished steps and their max_tokens in all."""

    variables: int = 0
    queued_steps: int = 0
    queued_tokens: int = 0


def check_session(quotas: Quotas, client: str, open_sessions: int) -> None:
    """Refuse a new session when ``client`` already has ``quotas.sessions_per_client`` open."""
    if open_sessions >= quotas.sessions_per_client:
        raise QuotaExceededError(
            f"client {client} has {open_sessions} sessions open, the most allowed "
            "(Quotas.sessions_per_client): delete finished sessions (DELETE /v1/sessions/{id}) or wait for "
            "idle ones to expire",
            retry_after=5.0,
        )


def check_variables(quotas: Quotas, usage: SessionUsage, new: int) -> None:
    """Refuse ``new`` variables beyond ``quotas.variables_per_session``."""
    if usage.variables + new > quotas.variables_per_session:
        raise QuotaExceededError(
            f"the session holds {usage.variables} variables and asks for {new} more, over "
            f"{quotas.variables_per_session} (Quotas.variables_per_session): use a new session for new work"
        )


def check_call(quotas: Quotas, usage: SessionUsage, steps: int, tokens: int) -> None:
    """Refuse a call of ``steps`` steps that may generate ``tokens`` tokens beyond the session's quotas of
    unfinished work; retrying once earlier calls finish succeeds."""
    if usage.queued_steps + steps > quotas.queued_steps_per_session:
        raise QuotaExceededError(
            f"the session has {usage.queued_steps} steps unfinished and submits {steps} more, over "
            f"{quotas.queued_steps_per_session} (Quotas.queued_steps_per_session): wait for results first"
        )
    if usage.queued_tokens + tokens > quotas.queued_tokens_per_session:
        raise QuotaExceededError(
            f"the session's unfinished steps may generate {usage.queued_tokens} tokens and this call "
            f"{tokens} more, over {quotas.queued_tokens_per_session} (Quotas.queued_tokens_per_session): "
            "wait for results first or lower max_tokens"
        )


def check_stored(quotas: Quotas, client: str, stored: int, new: int) -> None:
    """Refuse a value of ``new`` characters when ``client``'s sessions already hold ``stored``, beyond
    ``quotas.stored_chars_per_tenant``."""
    if stored + new > quotas.stored_chars_per_tenant:
        raise QuotaExceededError(
            f"{client}'s sessions hold {stored} characters of values and this one has {new}, over "
            f"{quotas.stored_chars_per_tenant} (Quotas.stored_chars_per_tenant): delete finished sessions "
            "(DELETE /v1/sessions/{id}) first",
            retry_after=5.0,
        )


def tenant_tokens_refusal(quotas: Quotas, client: str, queued: int, tokens: int) -> str | None:
    """Why ``tokens`` more in flight are refused for ``client``, which has ``queued`` in flight (None:
    within ``quotas.queued_tokens_per_tenant``)."""
    if queued + tokens <= quotas.queued_tokens_per_tenant:
        return None
    return (
        f"{client} has {queued} tokens in flight (unfinished steps' max_tokens, running requests' prompts "
        f"and max_tokens) and asks for {tokens} more, over {quotas.queued_tokens_per_tenant} "
        "(Quotas.queued_tokens_per_tenant): wait for results first or lower max_tokens"
    )
