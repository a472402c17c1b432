"""The engine's HTTP API (FastAPI): fill / generate (+ streaming) / free_context / stats / info / tokenizer.

Bodies are the pydantic models of `parrot.protocol`. Engine errors become
`{"error": {"type", "message"}}` with the status code of their class; other requests are unaffected.
Every route but ``/health`` requires the cluster token (the manager's; ``Authorization: Bearer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from parrot.protocol import ErrorBody, ErrorResponse, TokenLogprobConfig

from server.common.auth_first import AuthFirstMiddleware, GuardedRoute, guarded_routes
from server.common.body_limit import BodyLimitMiddleware
from server.common.security import AuthError, auth_error_response, cluster_token_guard, install_auth_handler
from server.engine.detokenize import IncrementalDetokenizer
from server.engine.engine import LLMEngine
from server.engine.engine_front import GenerationStream
from server.engine.errors import EngineError, InvalidRequestError
from server.engine.manager_link import ManagerLink
from server.engine.request import GenerateResult
from server.engine.sampling import SamplingParams, TokenLogprob
from server.engine.wire import (
    EngineFillRequest,
    EngineFillResponse,
    EngineFreeContextRequest,
    EngineFreeContextResponse,
    EngineGenerateRequest,
    EngineGenerateResponse,
    EngineInfo,
    EngineStats,
    EngineStreamChunk,
    EngineTokenizerFiles,
)

# A fill carries token ids as JSON (~6-8 bytes each): 64 MiB holds a few million, beyond any context window.
MAX_ENGINE_BODY_BYTES = 64 * 1024 * 1024


def error_response(
    status: int,
    error_type: str,
    message: str,
    op_index: int | None = None,
    *,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorBody(type=error_type, message=message, op_index=op_index, param=param, code=code)
    )
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status)


def _refusal(exc: Exception) -> JSONResponse | None:
    return auth_error_response(exc) if isinstance(exc, AuthError) else None


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def create_engine_app(
    engine: LLMEngine, link: ManagerLink | None = None, *, cluster_token: str | None
) -> FastAPI:
    """The HTTP app serving one engine (the caller owns the engine's lifetime). With ``link``, the app
    registers the engine with that manager while it serves, and unregisters when it stops.

    Every route but ``/health`` answers only requests carrying ``cluster_token`` (401 without it, 403 with
    another); None leaves them open — only for an app that no network reaches (in-process tests).
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if link is None:
            yield
            return
        task = asyncio.create_task(link.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await link.leave()

    app = FastAPI(title="Parrot engine", version="1", lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_ENGINE_BODY_BYTES)
    # Outermost: without the cluster token a request is refused before any of its body is read.
    guarded: list[GuardedRoute] = []  # the API's routes with their guards, filled once they exist
    app.add_middleware(AuthFirstMiddleware, routes=guarded, refusal=_refusal)
    install_auth_handler(app)
    guard = [] if cluster_token is None else [Depends(cluster_token_guard(cluster_token))]
    api = APIRouter(dependencies=guard)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_response(exc.http_status, exc.error_type, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _schema_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(422, "invalid_schema", details)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/health/ready", responses={503: {"description": "the engine is draining"}})
    async def ready() -> JSONResponse:
        """Readiness: 503 once the engine drains (it announced a graceful shutdown to its manager: it
        finishes what runs and takes no new work); else 200."""
        if link is not None and link.draining:
            body = {"type": "engine_draining", "message": "the engine is draining: it takes no new work"}
            return JSONResponse({"status": "draining", "error": body}, status_code=503)
        return JSONResponse({"status": "ok"})

    @api.get("/info")
    async def info() -> EngineInfo:
        stats = engine.stats()
        return EngineInfo(
            model=engine.model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            block_size=engine.block_size,
            blocks_total=stats.blocks_total,
            eos_token_ids=sorted(engine.eos_token_ids),
        )

    @api.get("/tokenizer")
    async def tokenizer() -> EngineTokenizerFiles:
        """The tokenizer's files, for a manager that tokenizes prompts for this engine."""
        return EngineTokenizerFiles(files=await asyncio.to_thread(tokenizer_files, engine.tokenizer))

    @api.get("/stats")
    async def stats() -> EngineStats:
        return engine.stats()

    @api.post("/fill", response_model_exclude_none=True)  # prompt_logprobs only when asked
    async def fill(req: EngineFillRequest) -> EngineFillResponse:
        ids = req.token_ids
        if ids is None:
            ids = engine.tokenizer.encode(req.text, add_special_tokens=False)
        if req.prompt_logprobs is not None:
            if req.parent_context_id is not None:
                raise InvalidRequestError(
                    "fill: prompt_logprobs scores a whole prompt, so it starts a new context without a "
                    "parent; leave out parent_context_id"
                )
            scored = await engine.score(
                req.context_id, ids, req.prompt_logprobs, priority=req.priority, tenant=req.tenant
            )
            return EngineFillResponse(
                context_id=req.context_id, num_tokens=len(ids), prompt_logprobs=logprob_configs(scored)
            )
        n = await engine.fill(
            req.context_id,
            ids,
            req.parent_context_id,
            parent_len=req.parent_len,
            priority=req.priority,
            tenant=req.tenant,
        )
        return EngineFillResponse(context_id=req.context_id, num_tokens=n)

    @api.post("/generate", response_model=None)
    async def generate(req: EngineGenerateRequest) -> EngineGenerateResponse | StreamingResponse:
        sampling = SamplingParams(**req.sampling.model_dump())
        handle = engine.submit_generate(
            req.context_id,
            sampling,
            req.parent_context_id,
            stream=req.stream,
            latency_cap=req.latency_cap,
            parent_len=req.parent_len,
            priority=req.priority,
            tenant=req.tenant,
        )
        if not req.stream:
            return _response(req.context_id, await handle.result())
        first = await _first_event(handle)  # validation errors answer with a status code, not a stream
        return StreamingResponse(
            _stream_events(engine, req, sampling, handle, first), media_type="text/event-stream"
        )

    @api.post("/free_context")
    async def free_context(req: EngineFreeContextRequest) -> EngineFreeContextResponse:
        await engine.free_context(req.context_id)
        return EngineFreeContextResponse(context_id=req.context_id)

    app.include_router(api)
    guarded += guarded_routes(api)
    return app


def tokenizer_files(tokenizer: Any) -> dict[str, str]:
    """A Hugging Face tokenizer as the text files ``save_pretrained`` writes (binary files are skipped:
    fast tokenizers need none)."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        files = {}
        for path in sorted(Path(tmp).iterdir()):
            with contextlib.suppress(UnicodeDecodeError):
                files[path.name] = path.read_text(encoding="utf-8")
        return files


def _response(context_id: int, result: GenerateResult) -> EngineGenerateResponse:
    return EngineGenerateResponse(
        context_id=context_id,
        token_ids=result.token_ids,
        text=result.text,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=len(result.token_ids),
        logprobs=None if result.logprobs is None else logprob_configs(result.logprobs),
    )


def logprob_configs(logprobs: list[TokenLogprob]) -> list[TokenLogprobConfig]:
    """The engine's per-token log-probabilities in the engine API's shape."""
    return [TokenLogprobConfig.model_validate(asdict(lp)) for lp in logprobs]


async def _first_event(handle: GenerationStream) -> int | None:
    """The first token, or None when the generate ended without one; raises the request's error."""
    try:
        return await anext(handle)
    except StopAsyncIteration:
        await handle.result()  # re-raises a validation error as EngineError
        return None


async def _stream_events(
    engine: LLMEngine,
    req: EngineGenerateRequest,
    sampling: SamplingParams,
    handle: GenerationStream,
    first: int | None,
) -> AsyncIterator[str]:
    detok = IncrementalDetokenizer(engine.tokenizer, sampling.stop)

    sent = 0

    def chunk(token_id: int) -> str:
        nonlocal sent
        logprob = next(iter(logprob_configs(handle.logprobs[sent : sent + 1])), None)
        sent += 1
        event = EngineStreamChunk(token_id=token_id, text=detok.push(token_id), logprob=logprob)
        return _sse(event.model_dump_json(exclude_none=True))

    try:
        if first is not None:
            yield chunk(first)
            async for token_id in handle:
                yield chunk(token_id)
        result = await handle.result()
    except EngineError as e:
        yield _sse(ErrorResponse(error=ErrorBody(type=e.error_type, message=str(e))).model_dump_json())
        return
    final = _response(req.context_id, result).model_dump()
    final["text_delta"] = detok.finish(result.text)
    yield _sse(json.dumps(final))
    yield _sse("[DONE]")
