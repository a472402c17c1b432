"""The session's variable table: settled once, typed errors that say what to fix."""

from __future__ import annotations

from typing import get_args

import pytest

from server.serve import transforms
from server.serve.variables import (
    VALUE_KINDS,
    StepId,
    UnknownVariableError,
    Variable,
    VariableConflictError,
    VariableTable,
)


def test_create_with_and_without_a_value() -> None:
    table = VariableTable()
    ready = table.create("task", "a snake game")
    pending = table.create(var_id="v1")
    assert ready == Variable(ready.var_id, "task", "ready", "a snake game", "text", None, None)
    assert len(ready.var_id) == 32 and ready.settled
    assert (pending.var_id, pending.status, pending.value, pending.settled) == ("v1", "pending", None, False)
    assert len(table) == 2 and "v1" in table and "nope" not in table
    assert [v.var_id for v in table] == [ready.var_id, "v1"]
    with pytest.raises(VariableConflictError, match="'v1' already exists"):
        table.create(var_id="v1")


def test_set_once() -> None:
    table = VariableTable()
    table.create("x", var_id="x")
    snapshot = table.get("x")
    assert table.set("x", '{"a": 1}', "json") == Variable("x", "x", "ready", '{"a": 1}', "json")
    assert snapshot.status == "pending"  # snapshots never change under their holder
    with pytest.raises(VariableConflictError, match="already has a value and cannot set") as info:
        table.set("x", "again")
    assert info.value.http_status == 409 and info.value.var_id == "x"
    assert table.get("x").value == '{"a": 1}'  # the first value stands


def test_fail_with_a_message() -> None:
    table = VariableTable()
    table.create(var_id="x")
    failed = table.fail("x", "engine crashed")
    assert (failed.status, failed.error, failed.value) == ("failed", "engine crashed", None)
    assert (failed.error_type, failed.llm_output) == ("step_failed", None)
    with pytest.raises(VariableConflictError, match=r"has failed \(engine crashed\) and cannot set"):
        table.set("x", "late")
    with pytest.raises(VariableConflictError, match="cannot fail"):
        table.fail("x", "twice")
    table.create("y", "v", var_id="y")
    with pytest.raises(VariableConflictError, match="already has a value and cannot fail"):
        table.fail("y", "no")


def test_fail_with_the_cause_and_the_refused_text() -> None:
    table = VariableTable()
    assert table.create(var_id="x").error_type is None  # only a failed variable has an error type
    failed = table.fail("x", "json transform failed: ...", error_type="transform_failed", llm_output="{oops")
    assert (failed.status, failed.error_type, failed.llm_output) == ("failed", "transform_failed", "{oops")
    assert table.get("x") == failed


def test_unknown_variable() -> None:
    table = VariableTable()
    for op in (lambda: table.get("ghost"), lambda: table.set("ghost", "v"), lambda: table.fail("ghost", "m")):
        with pytest.raises(UnknownVariableError, match="'ghost' does not exist in this session") as info:
            op()
        assert info.value.http_status == 404 and isinstance(info.value, LookupError)


def test_producer() -> None:
    table = VariableTable()
    table.create(var_id="x")
    assert table.set_producer("x", StepId("c", 0)).producer == StepId("c", 0)
    with pytest.raises(VariableConflictError, match="already the output of step 0 of call 'c'"):
        table.set_producer("x", StepId("d", 1))
    with pytest.raises(ValueError, match="starts pending"):
        table.create(value="v", producer=StepId("c", 1))


def test_kinds_match_the_transforms() -> None:
    assert get_args(transforms.ValueKind) == VALUE_KINDS
    with pytest.raises(ValueError, match="value kind"):
        VariableTable().create(value="1", kind="yaml")  # type: ignore[arg-type]
