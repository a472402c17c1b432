"""The client's conventions, against the real in-process server on the tiny model: a base URL
given with or without ``/v1``, sampling values refused at definition, a ``get`` timeout that says how long
it waited, and `parrot.ConnectionError` as the builtin `ConnectionError`."""

from __future__ import annotations

import builtins
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import parrot as P
import pytest
from parrot.urls import server_root

from server.launcher import LaunchedServer, launch


@pytest.fixture(scope="module")
def served() -> Iterator[LaunchedServer]:
    with launch("tiny") as s:
        yield s


@P.semantic_function(max_tokens=4)
def echo(x):  # type: ignore[no-untyped-def]
    """Say {{input:x}}: {{output:y}}"""


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_a_session_takes_the_server_root_or_its_v1(served: LaunchedServer, suffix: str) -> None:
    with P.Session(served.url + suffix) as s:
        assert s.url == served.url
        assert isinstance(echo("a parrot").get(), str)


@pytest.mark.parametrize(
    ("given", "root"),
    [
        ("http://host:9000", "http://host:9000"),
        ("http://host:9000/", "http://host:9000"),
        ("http://host:9000/v1", "http://host:9000"),
        ("https://host:9000/v1/", "https://host:9000"),
        ("http://host/proxy/parrot/v1", "http://host/proxy/parrot"),  # a proxy's prefix stays
        ("http://v1:9000", "http://v1:9000"),  # a host named v1 is not the API prefix
        ("http://host/apiv1", "http://host/apiv1"),
    ],
)
def test_server_root_forms(given: str, root: str) -> None:
    assert server_root(given) == root


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("host:9000", "must start with http:// or https://"),
        ("http://", "has no host"),
        ("http://host:9000/v1?key=1", "must not have a query"),
    ],
)
def test_bad_urls_are_refused_at_once(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        P.Session(url)


def test_a_get_timeout_says_how_long_it_waited(served: LaunchedServer) -> None:
    with P.Session(served.url) as s:
        out = echo(s.variable(name="x"))  # its input is never set: it stays pending
        started = time.monotonic()
        with pytest.raises(P.GetTimeoutError) as info:
            out.get(timeout=1)
        took = time.monotonic() - started
    message = str(info.value)
    assert info.value.status == 504
    assert "after 0s" not in message and "get's timeout: 1s" in message
    waited = float(re.search(r"still pending after (\d+\.\d+)s", message)[1])  # type: ignore[index]
    assert 1.0 <= waited <= took + 0.01  # the message rounds to 10 ms


async def test_an_async_get_timeout_says_how_long_it_waited(served: LaunchedServer) -> None:
    async with P.Session(served.url) as s:
        out = echo(s.variable(name="x"))
        with pytest.raises(
            P.GetTimeoutError, match=r"still pending after 0\.[5-9]\d*s \(get's timeout: 0\.5s\)"
        ):
            await out.aget(timeout=0.5)


def test_connection_error_is_the_builtin_one() -> None:
    assert issubclass(P.ConnectionError, builtins.ConnectionError)
    assert issubclass(P.ConnectionError, P.ParrotError)
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # The builtin name catches it.
    with pytest.raises(ConnectionError, match=re.escape(url)) as info, P.Session(url, timeout=2) as s:
        s.variable("x").get()  # the first request (the session opens with it)
    assert isinstance(info.value, P.ConnectionError) and isinstance(info.value, OSError)
    assert info.value.type == "connection"


BAD_SAMPLING = [
    ({"temperature": -1}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"seed": 1 << 64}, "seed must be a 64-bit integer"),
    ({"stop": [""]}, "stop strings must be non-empty"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_SAMPLING)
def test_bad_sampling_fails_at_decoration(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:

        @P.semantic_function(**kwargs)
        def summarize(text):  # type: ignore[no-untyped-def]
            """Summarize {{input:text}}: {{output:summary}}"""

    assert "summarize()" in str(info.value)  # it names the function being defined


def test_bad_sampling_of_one_output_or_a_template_fails_at_definition() -> None:
    with pytest.raises(ValueError, match=r"output 'b'.*temperature"):

        @P.semantic_function(max_tokens=4, sampling={"b": {"temperature": -0.5}})
        def two(x):  # type: ignore[no-untyped-def]
            """{{input:x}} {{output:a}} then {{output:b}}"""

    with pytest.raises(ValueError, match="top_p"):
        P.SemanticFunction.from_template("{{input:x}} {{output:y}}", sampling=P.SamplingConfig(top_p=0))
