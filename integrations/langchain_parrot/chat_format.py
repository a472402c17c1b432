"""`ChatFormat`: the engine's chat template, so that a compiled chat prompt is rendered as the server would.

`ChatParrot` used directly sends messages to ``/v1/chat/completions``, where the server renders them with
the tokenizer's chat template (``add_generation_prompt=True``) and encodes the text without adding special
tokens. A compiled chain instead sends one unrendered template, which the manager encodes *with* special
tokens (it prepends BOS itself). `ChatFormat.template_text` renders the messages with the same chat
template and drops the leading BOS text when the tokenizer adds BOS on its own — so both paths reach the
engine with the same token ids.

The server publishes each model's chat template in its ``GET /v1/models`` card, so `ChatFormat.from_card`
(what `ChatParrot` uses when given no ``chat_format``) renders with it — sandboxed Jinja, set up as
`transformers` sets up its own — and needs no local copy of the tokenizer. A tokenizer you have works too:
`ChatFormat.from_pretrained` (a local Hugging Face folder; `TINY_MODEL_DIR` is the embedded "tiny" model of
the installed service) or `ChatFormat.from_tokenizer` (a tokenizer object).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from langchain_parrot.errors import UnsupportedInputError

__all__ = ["TINY_MODEL_DIR", "ChatFormat"]


def _tiny_model_dir() -> Path:
    # Located in the installed `server` package (a wheel's site-packages or a checkout) by find_spec, which
    # runs no code: importing `server.engine.tiny` would import torch; this adapter never loads the service.
    spec = find_spec("server")
    if spec is None or not spec.submodule_search_locations:  # no service installed: a checkout's layout
        return Path(__file__).resolve().parents[2] / "server" / "engine" / "tiny"
    return Path(next(iter(spec.submodule_search_locations))) / "engine" / "tiny"


TINY_MODEL_DIR = _tiny_model_dir()
"""The folder of the embedded "tiny" model's tokenizer (in the installed Parrot serve)."""

# Contents a transparent chat template inserts verbatim; a template that strips or rewrites message
# contents changes them (then a value produced server-side cannot be dropped into the rendered text as is).
_PROBE = " \n\t{x} <p>&amp; \n "


class ChatFormat:
    """Renders chat messages (``[{"role", "content"}]``) into the text the engine sees.

    ``render(messages)`` is the chat template with the generation prompt; ``bos_token`` the BOS text and
    ``adds_bos`` whether the tokenizer prepends BOS when encoding (then the rendered BOS text is dropped
    from compiled templates, because the manager's encode adds it back).
    """

    def __init__(
        self, render: Callable[[list[dict[str, Any]]], str], *, bos_token: str | None, adds_bos: bool
    ) -> None:
        self._render = render
        self.bos_token = bos_token
        self.adds_bos = adds_bos
        self.transparent = self._probe_transparent()

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        """From a Hugging Face tokenizer object (it must have a chat template)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no chat template")

        def render(messages: list[dict[str, Any]]) -> str:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return str(text)

        bos_id = getattr(tokenizer, "bos_token_id", None)
        ids = tokenizer.encode("a")
        adds_bos = bos_id is not None and bool(ids) and ids[0] == bos_id
        return cls(render, bos_token=getattr(tokenizer, "bos_token", None), adds_bos=adds_bos)

    @classmethod
    def from_card(cls, card: Mapping[str, Any]) -> ChatFormat | None:
        """From a model card of the server's ``GET /v1/models`` (None when it publishes no chat template).

        The template runs in Jinja's immutable sandbox with the settings `transformers` renders chat
        templates with (trim_blocks, lstrip_blocks, loop controls, ``raise_exception``, ``strftime_now``,
        a ``tojson`` that keeps non-ASCII), so the text equals what the server's tokenizer renders.
        """
        template = card.get("chat_template")
        if not isinstance(template, str) or not template:
            return None
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as e:  # pragma: no cover - jinja2 ships with the langchain extra
            raise ImportError(
                "rendering the server's chat template needs `jinja2`: pip install jinja2"
            ) from e

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        compiled = env.from_string(template)
        bos = card.get("bos_token")
        eos = list(card.get("eos_tokens") or [])
        specials = {"bos_token": bos or "", "eos_token": eos[0] if eos else ""}

        def render(messages: list[dict[str, Any]]) -> str:
            return compiled.render(messages=messages, add_generation_prompt=True, **specials)

        return cls(render, bos_token=bos, adds_bos=bool(card.get("adds_bos_token")))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ChatFormat:
        """From a local Hugging Face model or tokenizer folder (needs ``transformers``; no download)."""
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(
                f"no tokenizer folder at {folder}: give a local Hugging Face model folder"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers ships with the server extra
            raise ImportError(
                "ChatFormat.from_pretrained needs `transformers`: pip install transformers"
            ) from e
        return cls.from_tokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        """The chat template applied to ``messages``, with the generation prompt."""
        try:
            return self._render(list(messages))
        except Exception as e:  # jinja errors: a template that refuses these messages (e.g. role order)
            raise UnsupportedInputError(f"the chat template cannot render these messages: {e}") from e

    def template_text(self, messages: Sequence[dict[str, Any]]) -> str:
        """The rendered text a compiled call sends: `render` without the BOS text the manager adds back."""
        text = self.render(messages)
        if not self.adds_bos:
            return text
        if not self.bos_token or not text.startswith(self.bos_token):
            raise UnsupportedInputError(
                "the tokenizer adds BOS when encoding but its chat template does not start with it: a "
                "compiled prompt would not match the chat endpoint's tokens"
            )
        return text[len(self.bos_token) :]

    def _probe_transparent(self) -> bool:
        """Whether message contents reach the rendered text unchanged (checked once, on a probe)."""
        try:
            return _PROBE in self._render([{"role": "user", "content": _PROBE}])
        except Exception:
            return False

    def __repr__(self) -> str:
        return f"<ChatFormat bos={self.bos_token!r} adds_bos={self.adds_bos} transparent={self.transparent}>"
