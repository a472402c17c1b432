"""Semantic Variable outputs that declare a JSON schema (``P.transforms.json(schema=...)``): generated under
the schema by constrained decoding, so the value parsed is valid by construction — checked by `jsonschema`
for every kind of input (literal, session variable, future, failed future), sync and async, on one engine
and two, and with a pydantic model as the schema."""

from __future__ import annotations

import asyncio

import jsonschema
import parrot as P
import pytest
from pydantic import BaseModel, Field

from server.launcher import LaunchedServer
from tests.server.conftest import BROKEN

# Bounded, so that the random tiny model finishes every value.
TICKET = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 20},
        "priority": {"enum": ["low", "high"]},
        "points": {"type": "integer", "minimum": 1, "maximum": 13},
    },
    "required": ["title", "priority", "points"],
    "additionalProperties": False,
}


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0, le=10)


SAMPLING = P.SamplingConfig(max_tokens=120, temperature=0.0)
TICKET_OF = P.SemanticFunction.from_template(
    "Bug report: {{input:report}}\nTicket as JSON: {{output:ticket}}",
    name="ticket_of",
    sampling=SAMPLING,
    transforms={"ticket": [P.transforms.strip(), P.transforms.json(schema=TICKET)]},
)
JUDGE = P.SemanticFunction.from_template(
    "Ticket: {{input:ticket}}\nVerdict: {{output:verdict}}\nReason: {{output:reason}}",
    name="judge",
    sampling=P.SamplingConfig(max_tokens=60, temperature=0.0),
    transforms={"verdict": [P.transforms.json(schema=Verdict)], "ticket": [P.transforms.render()]},
)
WRITE = P.SemanticFunction.from_template("Describe a crash: {{output:text}}", name="write", sampling=SAMPLING)


def test_a_schema_output_is_valid_for_every_input_kind(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url) as s:
        tickets = {
            "literal": TICKET_OF(report="the app crashes on start"),
            "variable": TICKET_OF(report=s.variable("the app crashes on start")),
            "future": TICKET_OF(report=WRITE()),
        }
        values = {k: v.get() for k, v in tickets.items()}
    for value in values.values():
        jsonschema.validate(value, TICKET)
    assert values["variable"] == values["literal"]


def test_a_schema_output_feeds_the_next_call_and_a_pydantic_schema_holds(
    one_or_two: LaunchedServer,
) -> None:
    with P.Session(one_or_two.url):
        ticket = TICKET_OF(report="login button does nothing")
        verdict, reason = JUDGE(ticket=ticket)
        checked = Verdict.model_validate(verdict.get())
        assert isinstance(reason.get(), str) and 0 <= checked.score <= 10


async def test_async_gets_of_schema_outputs(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url):
        outs = [TICKET_OF(report=f"bug number {i}") for i in range(4)]
        values = await asyncio.gather(*[o.aget() for o in outs])
    for value in values:
        jsonschema.validate(value, TICKET)


def test_a_failed_future_fails_the_schema_output_with_its_cause(one_or_two: LaunchedServer) -> None:
    with P.Session(one_or_two.url):
        out = TICKET_OF(report=BROKEN())
        with pytest.raises(P.VariableFailedError, match="json transform failed"):
            out.get()
        assert TICKET_OF(report="still served").get()["priority"] in ("low", "high")


def test_a_schema_transform_must_constrain_the_text_itself(one_or_two: LaunchedServer) -> None:
    late = P.SemanticFunction.from_template(
        "X: {{output:x}}",
        name="late",
        transforms={"x": [P.transforms.regex("(.*)"), P.transforms.json(schema=TICKET)]},
    )
    both = P.SemanticFunction.from_template(
        "X: {{output:x}}",
        name="both",
        sampling=P.SamplingConfig(guided={"kind": "regex", "value": "a+"}),
        transforms={"x": [P.transforms.json(schema=TICKET)]},
    )
    with P.Session(one_or_two.url):
        # refused at submit (HTTP 400), whichever comes first: the call or its get
        with pytest.raises(P.BadRequestError, match="first transform"):
            late().get()
        with pytest.raises(P.BadRequestError, match="keep one"):
            both().get()
        assert TICKET_OF(report="still served").get()["points"] >= 1
