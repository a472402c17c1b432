"""An in-memory fake of the Parrot server's session API, for client tests (an httpx.MockTransport handler).

It speaks the wire schema of `parrot.protocol`: it validates every body with the same models (and submitted
calls with `check_call`), checks the bearer token, records every request, and "generates" an output as
``<name:input values>`` once the call's inputs have values. ``script`` overrides what a named output
becomes (a `GetVariableResponse` minus the id).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from parrot.protocol import (
    CallError,
    CreateSessionResponse,
    CreateVariableRequest,
    GetVariableQuery,
    GetVariableResponse,
    SetVariableRequest,
    SubmitCallRequest,
    SubmitCallResponse,
    TemplateError,
    VariableCreated,
    check_call,
)
from pydantic import ValidationError

URL = "http://parrot.test"


class HTTPError(Exception):
    def __init__(self, status: int, type: str, message: str) -> None:
        self.status, self.type, self.message = status, type, message


@dataclass
class FakeVar:
    var_id: str
    name: str | None
    value: str | None = None
    producer: str | None = None  # call id
    answer: GetVariableResponse | None = None


@dataclass
class FakeServer:
    script: dict[str, dict[str, Any]] = field(default_factory=dict)  # output name -> response fields
    requests: list[httpx.Request] = field(default_factory=list)
    sessions: dict[str, str] = field(default_factory=dict)  # sid -> token
    deleted: list[str] = field(default_factory=list)
    variables: dict[str, FakeVar] = field(default_factory=dict)
    calls: dict[str, SubmitCallRequest] = field(default_factory=dict)
    call_inputs: dict[str, dict[str, str]] = field(default_factory=dict)  # call id -> input name -> var_id
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    # ------------------------------------------------------------------------------------- helpers
    def bodies(self, method: str, suffix: str) -> list[Any]:
        return [
            json.loads(r.content) for r in self.requests if r.method == method and r.url.path.endswith(suffix)
        ]

    def sync_client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handle))

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    # ------------------------------------------------------------------------------------- handler
    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        try:
            status, body = self._route(request)
        except HTTPError as e:
            return httpx.Response(e.status, json={"error": {"type": e.type, "message": e.message}})
        except ValidationError as e:
            return httpx.Response(422, json={"error": {"type": "validation", "message": str(e)}})
        except (TemplateError, CallError) as e:
            return httpx.Response(400, json={"error": {"type": "bad_call", "message": str(e)}})
        return httpx.Response(status, json=body) if body is not None else httpx.Response(status)

    def _route(self, request: httpx.Request) -> tuple[int, Any]:
        parts = request.url.path.strip("/").split("/")
        if request.method == "POST" and parts == ["v1", "sessions"]:
            assert not request.content, "POST /v1/sessions has no body"
            sid, token = f"s{next(self._ids)}", f"tok{next(self._ids)}"
            self.sessions[sid] = token
            return 200, CreateSessionResponse(session_id=sid, token=token).model_dump()
        if parts[:2] != ["v1", "sessions"] or len(parts) < 3:
            raise HTTPError(404, "not_found", f"no route {request.url.path}")
        sid = parts[2]
        if sid not in self.sessions:
            raise HTTPError(404, "unknown_session", f"unknown session {sid!r}")
        if request.headers.get("authorization") != f"Bearer {self.sessions[sid]}":
            raise HTTPError(401, "auth", "missing or wrong session token")
        rest, method = parts[3:], request.method
        if method == "DELETE" and not rest:
            assert not request.content
            self.deleted.append(sid)
            del self.sessions[sid]
            return 204, None
        if method == "POST" and rest == ["variables"]:
            create = CreateVariableRequest.model_validate_json(request.content)
            var = FakeVar(f"v{next(self._ids)}", create.name, create.value)
            self.variables[var.var_id] = var
            return 201, VariableCreated(var_id=var.var_id).model_dump()
        if method == "PUT" and len(rest) == 2 and rest[0] == "variables":
            var = self._var(rest[1])
            value = SetVariableRequest.model_validate_json(request.content).value
            if var.value is not None or var.producer is not None:
                raise HTTPError(409, "conflict", f"variable {var.var_id!r} is already set")
            var.value = value
            return 200, GetVariableResponse(var_id=var.var_id, status="ready", value=value).model_dump()
        if method == "GET" and len(rest) == 2 and rest[0] == "variables":
            assert not request.content
            query = GetVariableQuery.model_validate(dict(request.url.params))
            answer = self._resolve(self._var(rest[1]))
            if answer is None:
                raise HTTPError(504, "get_timeout", f"still pending after {query.timeout}s")
            return 200, answer.model_dump()
        if method == "POST" and rest == ["calls"]:
            call = SubmitCallRequest.model_validate_json(request.content)
            check_call(call.template, call.placeholders)
            call_id = f"c{next(self._ids)}"
            self.calls[call_id] = call
            self.call_inputs[call_id] = {}
            outputs = {}
            for spec in call.placeholders:
                if spec.role == "output":
                    var = FakeVar(f"v{next(self._ids)}", spec.name, producer=call_id)
                    self.variables[var.var_id] = var
                    outputs[spec.name] = var.var_id
                elif spec.var_id is not None:
                    self._var(spec.var_id)
                    self.call_inputs[call_id][spec.name] = spec.var_id
            return 200, SubmitCallResponse(call_id=call_id, outputs=outputs).model_dump()
        raise HTTPError(404, "not_found", f"no route {method} {request.url.path}")

    def _var(self, var_id: str) -> FakeVar:
        if var_id not in self.variables:
            raise HTTPError(404, "unknown_variable", f"unknown variable {var_id!r}")
        return self.variables[var_id]

    def _resolve(self, var: FakeVar) -> GetVariableResponse | None:
        """The variable's final answer, "running" its producer when its inputs are there; None if pending."""
        if var.answer is not None:
            return var.answer
        if var.producer is None:
            if var.value is None:
                return None
            var.answer = GetVariableResponse(var_id=var.var_id, status="ready", value=var.value)
            return var.answer
        call = self.calls[var.producer]
        values = []
        for spec in call.placeholders:
            if spec.role == "input" and spec.value is not None:
                values.append(spec.value)
            elif spec.role == "input":
                upstream = self._resolve(self._var(spec.var_id or ""))
                if upstream is None:
                    return None
                if upstream.status == "failed":
                    var.answer = GetVariableResponse(
                        var_id=var.var_id, status="failed", error=f"upstream failed: {upstream.error}"
                    )
                    return var.answer
                values.append(upstream.value or "")
        fields = self.script.get(
            var.name or "", {"status": "ready", "value": f"<{var.name}:{','.join(values)}>"}
        )
        var.answer = GetVariableResponse(var_id=var.var_id, **fields)
        return var.answer
