"""`AuthFirstMiddleware`: a route's credential checks run before anything reads its body.

FastAPI reads and parses a request's body before it solves the route's dependencies, so a guard declared as
a dependency alone would let an anonymous client make the server read, buffer and validate up to the body
limit (and run every validator on it) before answering 401. This middleware finds the route a request will
reach, in a table of the app's routes (`guarded_routes`), and runs that route's guards — those marked with
`header_guard`: they read only headers and path parameters — first; a refusal is answered at once, its
connection closed, the body never read. The route still runs its guards as dependencies (a few
microseconds), so an app without this middleware stays exactly as strict.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.routing import APIRoute, APIRouter
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = [
    "AuthFirstMiddleware",
    "GuardedRoute",
    "HeaderGuard",
    "guarded_routes",
    "header_guard",
    "header_guards",
]

_MARK = "_parrot_header_guard"
HeaderGuard = Callable[[Request], Awaitable[Any]]
Guard = TypeVar("Guard", bound=Callable[..., Awaitable[Any]])


def header_guard(guard: Guard) -> Guard:
    """Mark ``guard`` (an ``async`` FastAPI dependency taking only ``request: Request``, reading only its
    headers and path parameters) as one `AuthFirstMiddleware` runs before the body is read."""
    setattr(guard, _MARK, True)
    return guard


def header_guards(route: object) -> list[HeaderGuard]:
    """The header guards ``route`` declares (its own dependencies and its router's), in order."""
    if not isinstance(route, APIRoute):
        return []
    return [d.call for d in route.dependant.dependencies if getattr(d.call, _MARK, False)]  # type: ignore[misc]


@dataclass(frozen=True)
class GuardedRoute:
    """A route and the header guards a request to it passes first."""

    route: APIRoute
    guards: tuple[HeaderGuard, ...]


def guarded_routes(router: APIRouter, *extra: HeaderGuard) -> list[GuardedRoute]:
    """Each FastAPI route of ``router`` itself (not of the routers it includes: list those separately) with
    ``extra`` (the guards it is included with) and its own header guards."""
    return [
        GuardedRoute(route, (*extra, *header_guards(route)))
        for route in router.routes
        if isinstance(route, APIRoute)
    ]


async def _no_body() -> dict[str, Any]:
    raise RuntimeError("a header guard must not read the request body")


class AuthFirstMiddleware:
    """Pure ASGI middleware running the header guards of the route a request matches in ``routes`` before
    the app (a list the app may fill after adding this middleware: it is read per request).

    ``refusal`` turns what a guard raised into the response to send (None: not a refusal, re-raised).
    """

    def __init__(
        self, app: ASGIApp, routes: Sequence[GuardedRoute], refusal: Callable[[Exception], Response | None]
    ) -> None:
        self.app = app
        self.routes = routes
        self.refusal = refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            response = await self._check(scope)
            if response is not None:
                response.headers["Connection"] = "close"  # the body, if one was sent, is never read
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _check(self, scope: Scope) -> Response | None:
        for guarded in self.routes:
            match, child = guarded.route.matches(scope)
            if match is not Match.FULL:  # PARTIAL: the path but not the method (the router may answer 405)
                continue
            request = Request({**scope, **child}, receive=_no_body)
            for guard in guarded.guards:
                try:
                    await guard(request)
                except Exception as e:  # each refusal has its response; anything else is re-raised
                    response = self.refusal(e)
                    if response is None:
                        raise
                    return response
            return None
        return None
