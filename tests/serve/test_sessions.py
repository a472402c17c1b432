"""Session bookkeeping: constant work per token check, the waiting guard against the reaper, quotas."""

from __future__ import annotations

import pytest

from server.serve import sessions as sessions_module
from server.serve.quotas import (
    QuotaExceededError,
    Quotas,
    SessionUsage,
    check_call,
    check_session,
    check_variables,
)
from server.serve.sessions import ForbiddenError, SessionTable, UnauthorizedError, UnknownSessionError


def test_each_refusal_names_its_cause() -> None:
    table = SessionTable(ttl=10)
    a, b = table.create(0.0), table.create(0.0)
    assert table.authenticate(a.session_id, a.token, 1.0) is a
    with pytest.raises(UnauthorizedError, match="missing"):
        table.authenticate(a.session_id, None, 1.0)
    with pytest.raises(ForbiddenError):  # another session's token
        table.authenticate(a.session_id, b.token, 1.0)
    with pytest.raises(ForbiddenError):  # a live token and an id that does not exist: not told apart
        table.authenticate("nope", b.token, 1.0)
    with pytest.raises(UnauthorizedError, match="wrong token"):
        table.authenticate(a.session_id, "guess", 1.0)
    with pytest.raises(UnknownSessionError):
        table.authenticate("nope", "guess", 1.0)
    table.remove(b.session_id)
    with pytest.raises(UnauthorizedError):  # a deleted session's token is nobody's now
        table.authenticate(a.session_id, b.token, 1.0)


def test_a_wrong_token_costs_one_comparison_whatever_the_number_of_sessions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = SessionTable(ttl=10)
    first = table.create(0.0)
    for _ in range(2000):
        table.create(0.0)
    calls = 0
    real = sessions_module.secrets.compare_digest

    def counting(a: str, b: str) -> bool:
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(sessions_module.secrets, "compare_digest", counting)
    with pytest.raises(UnauthorizedError):
        table.authenticate(first.session_id, "guess", 1.0)
    with pytest.raises(UnknownSessionError):
        table.authenticate("nope", "guess", 1.0)
    assert calls == 1


def test_a_session_waited_on_never_expires_and_is_idle_from_when_the_wait_ends() -> None:
    table = SessionTable(ttl=10)
    s = table.create(0.0)
    clock = [0.0]
    with table.waiting(s, lambda: clock[0]):
        assert table.expired(100.0) == []
        clock[0] = 100.0
    assert table.expired(105.0) == []
    assert table.expired(111.0) == [s]


def test_sessions_are_counted_per_client_and_the_quota_refuses_with_429() -> None:
    table = SessionTable(ttl=10)
    quotas = Quotas(sessions_per_client=2)
    made = []
    for _ in range(2):
        check_session(quotas, "10.0.0.1", table.open_by("10.0.0.1"))
        made.append(table.create(0.0, client="10.0.0.1"))
    with pytest.raises(QuotaExceededError, match="sessions_per_client") as refused:
        check_session(quotas, "10.0.0.1", table.open_by("10.0.0.1"))
    assert refused.value.http_status == 429 and refused.value.retry_after > 0
    check_session(quotas, "10.0.0.2", table.open_by("10.0.0.2"))  # another client is not affected
    table.remove(made[0].session_id)
    check_session(quotas, "10.0.0.1", table.open_by("10.0.0.1"))


def test_variable_and_call_quotas_count_what_is_unfinished() -> None:
    quotas = Quotas(variables_per_session=3, queued_steps_per_session=2, queued_tokens_per_session=100)
    usage = SessionUsage(variables=2, queued_steps=1, queued_tokens=60)
    check_variables(quotas, usage, 1)
    with pytest.raises(QuotaExceededError, match="variables_per_session"):
        check_variables(quotas, usage, 2)
    check_call(quotas, usage, 1, 40)
    with pytest.raises(QuotaExceededError, match="queued_steps_per_session"):
        check_call(quotas, usage, 2, 10)
    with pytest.raises(QuotaExceededError, match="queued_tokens_per_session"):
        check_call(quotas, usage, 1, 41)
