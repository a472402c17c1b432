"""The server's base URL, in whichever form a user gives it.

OpenAI-style clients are configured with the API's base, ``http://host:9000/v1``; Parrot's own routes hang
off the server root (``/v1/sessions``, ``/v1/chat/completions``, but also ``/tokenize`` and ``/health``,
which are not under ``/v1``). `server_root` accepts both spellings, with or without a trailing slash, and
returns the root every client here appends its paths to. It is the one place the `parrot` client and the
LangChain and LlamaIndex adapters check and normalise a URL (`ServerURL` for their pydantic fields).
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator

__all__ = ["BASE_URL_ENV", "DEFAULT_BASE_URL", "ServerURL", "server_root"]

DEFAULT_BASE_URL = "http://127.0.0.1:9000"
"""Where the adapters look for a server when given no URL (``python -m server``'s default port)."""

BASE_URL_ENV = "PARROT_BASE_URL"
"""The environment variable the adapters read the server's URL from when given none."""

_API_PREFIX = "/v1"


def server_root(url: str, *, what: str = "the server URL") -> str:
    """The server root of ``url``: ``http://host:9000``, ``http://host:9000/``, ``http://host:9000/v1`` and
    ``http://host:9000/v1/`` all give ``http://host:9000`` (a path before ``/v1``, such as a proxy's
    prefix, is kept).

    Raises `ValueError` naming ``what`` for a URL that is not ``http(s)://host...`` or that has a query or
    fragment (paths are appended to it, so those would end up in the wrong place).
    """
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{what} must start with http:// or https://, got {url!r}")
    parts = urlsplit(url)
    if not parts.netloc:
        raise ValueError(f"{what} has no host: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"{what} must not have a query or a fragment, got {url!r}")
    path = parts.path.rstrip("/")
    # The path's last segment only: a host named "v1" or a segment such as "/apiv1" is not the API prefix.
    if path.endswith(_API_PREFIX):
        path = path[: -len(_API_PREFIX)].rstrip("/")
    return f"{parts.scheme}://{parts.netloc}{path}"


ServerURL = Annotated[str, AfterValidator(server_root)]
"""A pydantic field type for a server URL: checked and kept as its root (`server_root`), so that requests,
comparisons and serialization all see one spelling of the server."""
