"""An in-memory fake of the Parrot server's session API, for client tests (an httpx.MockTransport handler).

It answers the single-operation routes and the batch route the client uses (operations applied in order,
an error naming its ``op_index``, then the get: NDJSON, all at once since nothing here runs concurrently).

It speaks the wire schema of `parrot.protocol`: it validates every body with the same models (and
submitted calls with the server's `validate_call`), checks the bearer token, records every request, and
"generates" an output as ``<name:input values>`` once the call's inputs have values. ``script``
overrides what a named output becomes (a `GetVariableResponse` minus the id).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from parrot.protocol import (
    BatchApplied,
    BatchCreateVariable,
    BatchGetAnswer,
    BatchRequest,
    BatchSetVariable,
    CallError,
    CreateSessionResponse,
    CreateVariableRequest,
    GetVariableQuery,
    GetVariableResponse,
    SetVariableRequest,
    SubmitCallRequest,
    SubmitCallResponse,
    VariableCreated,
)
from parrot.template import TemplateError
from pydantic import ValidationError

from server.serve.call_checks import validate_call

URL = "http://parrot.test"


class HTTPError(Exception):
    def __init__(self, status: int, type: str, message: str, op_index: int | None = None) -> None:
        self.status, self.type, self.message, self.op_index = status, type, message, op_index


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
    reject: dict[str, HTTPError] = field(default_factory=dict)  # func_name -> the error its calls get
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

    def ops(self, op: str) -> list[dict[str, Any]]:
        """The bodies of the batched operations of type ``op`` (without their ``op`` tag), in order."""
        return [
            {k: v for k, v in body.items() if k != "op"}
            for batch in self.bodies("POST", "/batch")
            for body in batch["ops"]
            if body["op"] == op
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
            error = {"type": e.type, "message": e.message, "op_index": e.op_index}
            return httpx.Response(e.status, json={"error": {k: v for k, v in error.items() if v is not None}})
        except ValidationError as e:
            return httpx.Response(422, json={"error": {"type": "validation", "message": str(e)}})
        except (TemplateError, CallError) as e:
            return httpx.Response(400, json={"error": {"type": "bad_call", "message": str(e)}})
        if isinstance(body, str):
            return httpx.Response(status, text=body, headers={"content-type": "application/x-ndjson"})
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
        opens = parts[3:] == ["batch"] and request.method == "POST" and sid not in self.sessions
        if opens and json.loads(request.content).get("create") is not None:  # created by its first batch
            self.sessions[sid] = request.headers.get("authorization", "").removeprefix("Bearer ")
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
            return 201, self._create(CreateVariableRequest.model_validate_json(request.content)).model_dump()
        if method == "PUT" and len(rest) == 2 and rest[0] == "variables":
            value = SetVariableRequest.model_validate_json(request.content).value
            return 200, self._set(rest[1], value).model_dump()
        if method == "GET" and len(rest) == 2 and rest[0] == "variables":
            assert not request.content
            query = GetVariableQuery.model_validate(dict(request.url.params))
            answer = self._resolve(self._var(rest[1]))
            if answer is None:
                raise HTTPError(504, "get_timeout", f"still pending after {query.timeout}s")
            return 200, answer.model_dump()
        if method == "POST" and rest == ["calls"]:
            return 200, self._submit(SubmitCallRequest.model_validate_json(request.content)).model_dump()
        if method == "POST" and rest == ["batch"]:
            return 200, self._batch(BatchRequest.model_validate_json(request.content))
        raise HTTPError(404, "not_found", f"no route {method} {request.url.path}")

    def _create(self, create: CreateVariableRequest) -> VariableCreated:
        var = FakeVar(create.var_id or f"v{next(self._ids)}", create.name, create.value)
        if var.var_id in self.variables:
            raise HTTPError(409, "conflict", f"variable {var.var_id!r} already exists")
        self.variables[var.var_id] = var
        return VariableCreated(var_id=var.var_id)

    def _set(self, var_id: str, value: str) -> GetVariableResponse:
        var = self._var(var_id)
        if var.value is not None or var.producer is not None:
            raise HTTPError(409, "conflict", f"variable {var.var_id!r} is already set")
        var.value = value
        return GetVariableResponse(var_id=var.var_id, status="ready", value=value)

    def _submit(self, call: SubmitCallRequest) -> SubmitCallResponse:
        validate_call(call.template, call.placeholders)
        if call.func_name in self.reject:
            raise self.reject[call.func_name]
        call_id = f"c{next(self._ids)}"
        for spec in call.placeholders:  # validate before changing anything
            if spec.role == "input" and spec.var_id is not None:
                self._var(spec.var_id)
        self.calls[call_id] = call
        self.call_inputs[call_id] = {}
        outputs = {}
        for spec in call.placeholders:
            if spec.role == "output":
                var = FakeVar(spec.var_id or f"v{next(self._ids)}", spec.name, producer=call_id)
                self.variables[var.var_id] = var
                outputs[spec.name] = var.var_id
            elif spec.var_id is not None:
                self.call_inputs[call_id][spec.name] = spec.var_id
        return SubmitCallResponse(call_id=call_id, outputs=outputs)

    def _batch(self, batch: BatchRequest) -> str:
        """Apply the operations in order (an error names its index), then answer the get: NDJSON text."""
        results: list[Any] = []
        for index, op in enumerate(batch.ops):
            try:
                if isinstance(op, BatchCreateVariable):
                    results.append(self._create(op))
                elif isinstance(op, BatchSetVariable):
                    results.append(self._set(op.var_id, op.value))
                else:
                    results.append(self._submit(op))
            except (TemplateError, CallError) as e:
                raise HTTPError(400, "bad_call", str(e), op_index=index) from e
            except HTTPError as e:
                raise HTTPError(e.status, e.type, e.message, op_index=index) from e
        lines = [BatchApplied(results=results).model_dump_json()]
        if batch.get is not None:
            var = self._var(batch.get.var_id)
            answer = self._resolve(var) or GetVariableResponse(var_id=var.var_id, status="pending")
            lines.append(BatchGetAnswer(get=answer).model_dump_json())
        return "\n".join(lines) + "\n"

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
                if upstream.status == "failed":  # as the server does: the cause's type and text carry over
                    var.answer = GetVariableResponse(
                        var_id=var.var_id,
                        status="failed",
                        error=f"upstream failed: {upstream.error}",
                        error_type=upstream.error_type,
                        llm_output=upstream.llm_output,
                    )
                    return var.answer
                values.append(upstream.value or "")
        fields = self.script.get(
            var.name or "", {"status": "ready", "value": f"<{var.name}:{','.join(values)}>"}
        )
        var.answer = GetVariableResponse(var_id=var.var_id, **fields)
        return var.answer
