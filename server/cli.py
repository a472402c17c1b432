"""What the command-line entry points share: one-line errors, ``--help`` with defaults, the listening socket.

Both `python -m server` (``parrot-serve``) and `python -m server.engine` (``parrot-engine``) use these. The
module imports only the standard library at the top, so that a core-only install (httpx + pydantic, no
``server`` extra) can still say in one line what to install (`exit_if_extra_missing`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from server.common.connection_limits import ConnectionLimits, guarded_h11

if TYPE_CHECKING:
    from starlette.types import ASGIApp

__all__ = [
    "USAGE_ERROR",
    "DefaultsHelpFormatter",
    "add_listen_args",
    "bind_listener",
    "exit_if_extra_missing",
    "exit_with_error",
    "listener_url",
    "program_name",
    "ready_lines",
    "serve",
]

USAGE_ERROR = 2  # argparse's own exit status for a command line it refuses

# This distribution's own top-level packages: one of them missing is a broken install or a bug, not an extra.
_OWN_PACKAGES = frozenset(
    {"server", "kernels", "parrot", "langchain_parrot", "llamaindex_parrot", "benchmarks", "workload_text"}
)


def program_name(module: str, script: str) -> str:
    """How the user started us, for messages: the console script ``script`` when that is what runs, else
    ``python -m module``."""
    return script if Path(sys.argv[0]).name == script else f"python -m {module}"


def exit_with_error(prog: str, message: str, code: int = USAGE_ERROR) -> NoReturn:
    """Print ``prog: error: message`` on stderr as one line and exit with ``code``: a mistake in the
    command line (a model that is not there, a port in use) is no traceback."""
    print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
    raise SystemExit(code)


def exit_if_extra_missing(error: ModuleNotFoundError, prog: str, extra: str = "server") -> None:
    """Exit with one line naming the ``pip install`` that fixes ``error`` when it is a third-party package
    missing altogether (the ``extra`` is not installed). Return otherwise — a missing submodule (a version
    mismatch) or one of our own modules (a bug) — for the caller to re-raise with its traceback."""
    name = error.name or ""
    if not name or "." in name or name in _OWN_PACKAGES:
        return
    raise SystemExit(
        f"{prog}: needs the {extra!r} extra ({name!r} is not installed): pip install 'parrot-serve[{extra}]'"
    )


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` that shows every option's default, as "(default: X)" after its help — unless the help
    already says what the default is, or there is nothing to show (None, an unset flag, an empty list) —
    and keeps the description's and epilog's lines as written (the environment variables' table)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default == [] or default == argparse.SUPPRESS
        if not action.option_strings or nothing or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def add_listen_args(parser: argparse.ArgumentParser, port: int) -> None:
    """``--host`` and ``--port`` (default ``port``), which `bind_listener` binds."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=port, help="port to listen on (0: a free one, logged)")
    defaults = ConnectionLimits()
    parser.add_argument(
        "--head-timeout",
        type=float,
        default=defaults.head_timeout_s,
        help="seconds a client may take to send a request's line and headers (then the connection closes)",
    )
    parser.add_argument(
        "--max-connections-per-client",
        type=int,
        default=defaults.max_per_client,
        help="connections one client address may hold open at once (more are answered 503 and closed)",
    )


def connection_limits(prog: str, args: argparse.Namespace) -> ConnectionLimits:
    """The `ConnectionLimits` of the flags `add_listen_args` added (a bad value: a one-line error)."""
    try:
        return ConnectionLimits(args.head_timeout, args.max_connections_per_client)
    except ValueError:
        exit_with_error(prog, "--head-timeout and --max-connections-per-client must be positive")


def bind_listener(prog: str, host: str, port: int) -> socket.socket:
    """The socket the server will listen on, bound now — before any model loads — so that a port in use is
    a one-line error at once (exit 2), not after the load. Port 0 binds a free port (`listener_url` says
    which). Hand the socket to `serve`: nothing can take the port in between."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose protocol says TCP, and
    # accepted connections inherit it. Without it every response on a kept-alive connection waits out the
    # peer's delayed ACK (~40 ms a request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # As uvicorn does: a restart is not refused over the last run's connections in TIME_WAIT; a port
        # another server listens on still is.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            reason += " (a server runs there: stop it, or pick another --port; --port 0 takes a free one)"
        exit_with_error(prog, f"cannot listen on {host}:{port}: {reason}")
    return sock


def listener_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket: the port actually bound, also when 0 was asked for."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def ready_lines(url: str, models: Sequence[str], api_keys: bool, token_source: str) -> list[str]:
    """What a user needs once the server at ``url`` is up: the OpenAI base URL with the model ids and the
    key a client sends, the Parrot client's URL, and the live view's address with where its credential
    is (``token_source``: the cluster token's file or variable; the token itself never goes to a log)."""
    local = url.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")
    key = "the key given with --api-key" if api_keys else "any (no --api-key given)"
    return [
        f"OpenAI API: base_url={local}/v1, models: {', '.join(models) or 'none yet'}, api_key: {key}",
        f"Parrot client: parrot.Session({local!r})",
        f"live view: {local}/ui (sign in with the cluster token: {token_source})",
    ]


def serve(
    app: ASGIApp,
    sock: socket.socket,
    drain_timeout: float,
    drain: Callable[[], Awaitable[object]] | None,
    log: logging.Logger,
    limits: ConnectionLimits | None = None,
    ready: Callable[[str], Sequence[str]] | None = None,
) -> None:
    """Serve ``app`` on ``sock`` (from `bind_listener`) until a signal; the first one drains (``drain``,
    then up to ``drain_timeout`` seconds for in-flight requests: `server.engine.draining`). Logs the URL
    it serves on, with the port actually bound, and once the app has started the lines ``ready(url)``
    answers (what a user points a client at). ``limits`` bound each connection (`ConnectionLimits`)."""
    import uvicorn  # the server extra: imported only to serve

    from server.engine.draining import DrainingServer

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_graceful_shutdown=drain_timeout,  # type: ignore[arg-type]  # any number of seconds works
        http=guarded_h11(limits or ConnectionLimits()),
    )
    url = listener_url(sock)
    log.info("serving on %s", url)

    def started() -> None:
        for line in ready(url) if ready is not None else ():
            log.info("%s", line)

    DrainingServer(config, drain, started).run(sockets=[sock])
