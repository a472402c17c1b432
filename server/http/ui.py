"""The live view: ``/ui`` (one static page, no build step) and the read-only routes it polls.

The page holds no data: it asks for a credential and reads the routes below with it. The cluster token's
holder sees every engine and session (``GET /v1/view``) and any session's DAG; a session's own token sees
that session's DAG and nothing else. Looking changes nothing: no step is activated, no session kept alive.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse
from parrot.protocol import GetVariableResponse, SessionDag

from server.common.auth_first import header_guard
from server.common.security import bearer_token, cluster_token_guard, matches_any
from server.serve.dag_view import ClusterView
from server.serve.manager import Manager
from server.serve.sessions import Session
from server.serve.streams import STREAM_ANSWER, server_sent_events

__all__ = ["UI_FILES", "ViewedSession", "create_ui_router"]

# The page's files (package data, `server/http/static`) and their media types.
UI_FILES = {
    "ui.html": "text/html; charset=utf-8",
    "ui.js": "text/javascript; charset=utf-8",
    "ui.css": "text/css; charset=utf-8",
}
# The page runs only its own script and reads only this origin: model text it shows can never run.
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@header_guard
async def _viewer(request: Request) -> Session:
    """The session of a view route, for its own token or the cluster token (401/403/404 otherwise, as on
    every session route). ``async``: a dictionary lookup needs no thread hop."""
    manager: Manager = request.app.state.manager
    session_id = request.path_params["session_id"]
    token = bearer_token(request.headers.get("authorization"))
    if token is not None and matches_any(token, (request.app.state.security.cluster_token,)):
        return manager.sessions.find(session_id)
    return manager.session(session_id, token)


ViewedSession = Annotated[Session, Depends(_viewer)]


def create_ui_router(manager: Manager, cluster_token: str) -> APIRouter:
    """The page and its routes over ``manager``; ``cluster_token`` opens the whole view."""
    router = APIRouter()
    static = files("server.http") / "static"

    def page_file(name: str) -> Response:
        return Response(static.joinpath(name).read_bytes(), media_type=UI_FILES[name], headers=_PAGE_HEADERS)

    @router.get("/ui", include_in_schema=False)
    async def ui_page() -> Response:
        return page_file("ui.html")

    @router.get("/ui/{name}", include_in_schema=False)
    async def ui_asset(name: str) -> Response:
        if name not in UI_FILES or name == "ui.html":
            return Response("not found", status_code=404, media_type="text/plain")
        return page_file(name)

    @router.get("/v1/view", dependencies=[Depends(cluster_token_guard(cluster_token))])
    async def cluster_view() -> ClusterView:
        """Every engine (KV blocks, requests, prefix hits) and every live session (for the cluster token)."""
        return manager.cluster_view()

    @router.get("/v1/sessions/{session_id}/dag")
    async def session_dag(s: ViewedSession) -> SessionDag:
        """The session's calls, steps and variables: state, engine, objective, task group, prefill tokens
        computed and saved, queue and run time (the session's token or the cluster token)."""
        return manager.session_dag(s)

    @router.get("/v1/sessions/{session_id}/dag/variables/{var_id}")
    async def watched_variable(s: ViewedSession, var_id: str) -> GetVariableResponse:
        """The variable now, whole; activates nothing (a get would run the steps it needs)."""
        return manager.variable_snapshot(s, var_id)

    @router.get(
        "/v1/sessions/{session_id}/dag/variables/{var_id}/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}, "description": STREAM_ANSWER}},
    )
    async def watched_stream(
        s: ViewedSession, var_id: str, timeout: Annotated[float | None, Query(ge=0)] = None
    ) -> StreamingResponse:
        """The variable's text as it is written, as ``.../variables/{var_id}/stream`` answers it, but
        watching only: it runs nothing, and a variable nobody asked for stays pending until the timeout."""
        items = await manager.variable_text(s, var_id, None, timeout, watch=True)
        return StreamingResponse(server_sent_events(items), media_type="text/event-stream")

    return router
