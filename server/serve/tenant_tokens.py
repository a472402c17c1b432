"""What a tenant has in flight, in tokens, and the quotas that bound it.

A session's unfinished steps count their ``max_tokens`` (`Quotas.queued_tokens_per_session`); a tenant's
sessions and running OpenAI requests (each generation's prompt and ``max_tokens``) count together against
`Quotas.queued_tokens_per_tenant`. Sums are kept as they change (O(1) a call) and recounted exactly only
where they would refuse.
"""

from __future__ import annotations

from collections import Counter

from server.serve.ir import CallIR
from server.serve.quotas import (
    QuotaExceededError,
    Quotas,
    SessionUsage,
    check_call,
    check_variables,
    tenant_tokens_refusal,
)
from server.serve.sessions import Session, SessionTable


class TenantTokens:
    """The token quotas of ``sessions``' tenants and of their OpenAI requests."""

    def __init__(self, sessions: SessionTable, quotas: Quotas) -> None:
        self.sessions = sessions
        self.quotas = quotas
        self._openai: Counter[str] = Counter()  # tenant -> tokens of its running OpenAI requests

    def check_call(self, session: Session, call: CallIR) -> None:
        """Refuse ``call`` beyond the session's quotas (variables, unfinished steps, their max_tokens) or
        its tenant's (`QuotaExceededError`); else count its tokens as queued."""
        quotas, graph = self.quotas, session.graph
        tokens = sum(step.gen.sampling.max_tokens for step in call.steps)
        check_variables(quotas, SessionUsage(variables=len(graph.variables)), len(call.outputs))
        usage = SessionUsage(queued_steps=len(graph), queued_tokens=session.queued_tokens)
        if usage.queued_tokens + tokens > quotas.queued_tokens_per_session:
            usage.queued_tokens = queued_tokens(session)
            self.sessions.set_queued(session, usage.queued_tokens)
        check_call(quotas, usage, len(call.steps), tokens)
        refusal = self._refusal(session.client, tokens)
        if refusal is not None:
            raise QuotaExceededError(refusal)
        self.sessions.set_queued(session, usage.queued_tokens + tokens)

    def hold(self, tenant: str, tokens: int) -> str | None:
        """Count an OpenAI request's ``tokens`` (each generation's prompt and max_tokens) as ``tenant``'s
        in flight until `release`; or refuse them, with the reason (`Quotas.queued_tokens_per_tenant`)."""
        refusal = self._refusal(tenant, tokens)
        if refusal is None:
            self._openai[tenant] += tokens
        return refusal

    def release(self, tenant: str, tokens: int) -> None:
        """An OpenAI request `hold` counted is over."""
        self._openai[tenant] -= tokens
        if self._openai[tenant] <= 0:
            del self._openai[tenant]

    def _refusal(self, client: str, tokens: int) -> str | None:
        """Why ``client`` may not have ``tokens`` more in flight, or None."""
        queued = self._openai[client] + self.sessions.queued_by(client)
        refusal = tenant_tokens_refusal(self.quotas, client, queued, tokens)
        if refusal is not None:
            for s in self.sessions.of(client):
                self.sessions.set_queued(s, queued_tokens(s))
            queued = self._openai[client] + self.sessions.queued_by(client)
            refusal = tenant_tokens_refusal(self.quotas, client, queued, tokens)
        return refusal


def queued_tokens(session: Session) -> int:
    """The max_tokens of ``session``'s unfinished steps, counted exactly."""
    return sum(node.step.gen.sampling.max_tokens for node in session.graph.steps())
