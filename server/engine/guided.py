"""Constrained decoding: a grammar compiled once per constraint, a matcher per request, and the token mask
it puts on the logits before sampling (xgrammar, the grammar library vLLM and SGLang use).

Compiling walks the whole vocabulary, so it runs on worker threads, never on the engine loop, with a time
limit; its cost is bounded by the constraint's size and a regex's expanded repetitions
(`GuidedDecoding.validate`). Matching is incremental: filling one request's mask costs microseconds per
token (`benchmarks/guided_decoding.py` measures it), and a request whose masks overrun their CPU-time
budget fails alone.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from server.engine.errors import GuidedDecodingTooCostlyError, InvalidSamplingParamsError
from server.engine.sampling import GuidedDecoding

try:
    import xgrammar as xgr
except ImportError:  # the `server` extra installs it; a clear error when a guided request arrives
    xgr = None  # type: ignore[assignment]  # checked before every use

# JSON may hold whitespace between its tokens, at most this many characters in a row: a model then writes
# the layout it learned (SmolLM2 under a schema: 1 valid object in 4 forced compact, 7 in 8 with this; vLLM's
# default lays out freely too), and one that would loop on whitespace cannot (unbounded, a small model can
# loop until max_tokens and cut the JSON short).
MAX_JSON_WHITESPACE = 16

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[17:28:00] file.cc:83: " before xgrammar's reason
CompiledGrammar = Any  # xgrammar.CompiledGrammar (xgrammar is optional at import time)
Compiled = Callable[[CompiledGrammar | None, BaseException | None], None]


# xgrammar's character classes for one character of a bounded and of an unbounded string, and ours.
_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"

# vLLM's `structured_outputs` keys (its OpenAI extension) for each kind of constraint.
_VLLM_KEYS: dict[str, str] = {
    "json_schema": "json",
    "json_object": "json_object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


_COMPACT = "disable_any_whitespace"


def structured_outputs(guided: GuidedDecoding) -> dict[str, Any]:
    """``guided`` as vLLM's ``structured_outputs`` request field (which Parrot's own `/v1` reads too)."""
    value: Any = True if guided.kind == "json_object" else guided.value
    if guided.kind == "json_schema":
        value = json.loads(guided.value)  # type: ignore[arg-type]
    elif guided.kind == "choice":
        value = list(guided.value)  # type: ignore[arg-type]
    fields: dict[str, Any] = {_VLLM_KEYS[guided.kind]: value}
    if guided.compact:
        fields[_COMPACT] = True
    return fields


def guided_from_structured_outputs(fields: dict[str, Any]) -> GuidedDecoding:
    """The constraint a vLLM ``structured_outputs`` field asks for; exactly one of its keys must be set."""
    given = {k: v for k, v in fields.items() if v not in (None, False) and k != _COMPACT}
    kinds = {vllm: ours for ours, vllm in _VLLM_KEYS.items()}
    unknown = sorted(set(given) - set(kinds))
    if unknown or len(given) != 1:
        raise InvalidSamplingParamsError(
            f"structured_outputs takes exactly one of {sorted(kinds)}"
            + (f"; {unknown} are not supported" if unknown else f", got {sorted(given) or 'none'}")
        )
    key, value = next(iter(given.items()))
    kind = kinds[key]
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    compact = bool(fields.get(_COMPACT)) and kind in ("json_schema", "json_object")
    guided = GuidedDecoding(kind, None if kind == "json_object" else value, compact)  # type: ignore[arg-type]
    guided.validate()
    return guided


def json_grammar(schema: str, compact: bool = False) -> str:
    """The EBNF grammar of JSON text valid under ``schema``, its strings held to what JSON and UTF-8 allow;
    whitespace between tokens up to `MAX_JSON_WHITESPACE` characters in a row (``compact``: none).

    xgrammar's own grammar lets a string's character be a raw control character (in a length-bounded
    string) or a UTF-16 surrogate encoded as UTF-8 (in any string): neither is valid JSON text, and a small
    model does pick such byte tokens.
    """
    layout: dict[str, Any] = {"any_whitespace": False}
    if not compact:
        layout = {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
    grammar = str(xgr.Grammar.from_json_schema(schema, **layout))
    for lenient in _STRING_CHARS:
        grammar = grammar.replace(lenient, _JSON_STRING_CHAR)
    return grammar


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Compiles run on this many threads (xgrammar's compiler is thread-safe), so one slow compile does not hold
# the others; a request whose grammar is not compiled within COMPILE_TIMEOUT_S fails (the compile goes on,
# and a later request of the same constraint finds it cached).
COMPILE_THREADS = 2
COMPILE_TIMEOUT_S = 30.0
# The token mask of one request is filled on the engine's thread, between the forward pass and sampling: a
# constraint whose matcher state explodes (an ambiguous pattern) would hold every request of the batch, so
# a request whose one mask takes over MASK_STEP_BUDGET_S, or whose masks take over MASK_TOTAL_BUDGET_S in
# all, fails alone.
MASK_STEP_BUDGET_S = 0.25
MASK_TOTAL_BUDGET_S = 10.0


class GrammarCompiler:
    """Compiles `GuidedDecoding` constraints for one tokenizer on worker threads; xgrammar caches each
    compiled grammar, so a constraint sent again (every request of one schema) compiles once."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")

    def submit(self, guided: GuidedDecoding, done: Compiled, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """Compile ``guided`` off the caller's thread; ``done(grammar, error)`` runs once, on a worker: with
        the grammar, the compile's error, or `GuidedDecodingTooCostlyError` after ``timeout_s``."""
        settled = threading.Lock()

        def settle(grammar: CompiledGrammar | None, error: BaseException | None) -> None:
            if settled.acquire(blocking=False):
                done(grammar, error)

        def late() -> None:
            settle(
                None,
                GuidedDecodingTooCostlyError(
                    f"guided {guided.kind} did not compile within {timeout_s:g} s: send a smaller constraint"
                ),
            )

        timer = threading.Timer(timeout_s, late)
        timer.daemon = True
        timer.start()

        def run() -> None:
            try:
                grammar = self.compile(guided)
            except BaseException as e:  # a library failure fails this request, not the worker
                settle(None, e)
            else:
                settle(grammar, None)
            finally:
                timer.cancel()

        self._executor.submit(run)

    def compile(self, guided: GuidedDecoding) -> CompiledGrammar:
        """The compiled grammar of ``guided``; a constraint the library refuses is
        `InvalidSamplingParamsError`."""
        guided.validate()
        compiler = self._get_compiler()
        try:
            if guided.kind in ("json_schema", "json_object"):
                schema = guided.value if guided.kind == "json_schema" else '{"type": "object"}'
                return compiler.compile_grammar(json_grammar(schema, guided.compact))  # type: ignore[arg-type]
            if guided.kind == "regex":
                return compiler.compile_regex(guided.value)
            if guided.kind == "choice":
                return compiler.compile_grammar(choice_grammar(guided.value))  # type: ignore[arg-type]
            return compiler.compile_grammar(guided.value)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors for a bad constraint
            reason = _LOG_PREFIX.sub("", str(e)).strip()
            raise InvalidSamplingParamsError(f"guided {guided.kind} cannot be compiled: {reason}") from None

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                if xgr is None:
                    raise InvalidSamplingParamsError(
                        "guided decoding needs the xgrammar package: pip install 'parrot-serve[server]'"
                    )
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler


class Guide:
    """One request's place in its grammar: which tokens may come next, and whether it is complete."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(grammar)
        self.mask_s = 0.0  # CPU time spent filling this request's masks
        self._over_budget: str | None = None

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        # CPU time of this thread (the matcher fills the mask on it): what the constraint costs, not what a
        # busy machine adds while the thread waits for a core (a 0.25 s token budget broke under load).
        started = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        spent = time.thread_time() - started
        self.mask_s += spent
        if spent > MASK_STEP_BUDGET_S or self.mask_s > MASK_TOTAL_BUDGET_S:
            self._over_budget = (
                f"the constraint's token mask took {spent:.2f} s for one token ({self.mask_s:.2f} s in all), "
                f"over its budget ({MASK_STEP_BUDGET_S:g} s a token, {MASK_TOTAL_BUDGET_S:g} s a request): "
                "its pattern is too ambiguous to enforce; make it more specific"
            )

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (sampled under this guide's mask, so the grammar allows it); a
        guide over its mask budget raises `GuidedDecodingTooCostlyError` instead."""
        if self._over_budget is not None:
            raise GuidedDecodingTooCostlyError(self._over_budget)
        if not self._matcher.accept_token(token_id):
            raise InvalidSamplingParamsError(f"token {token_id} breaks the request's grammar")

    @property
    def finished(self) -> bool:
        """The grammar is complete and its stop token was taken: nothing may follow."""
        return bool(self._matcher.is_terminated())


def mask_logits(logits: torch.Tensor, guides: list[Guide | None]) -> torch.Tensor:
    """``logits`` ([N, vocab], float32) with every token a row's guide forbids set to -inf, in place."""
    rows = [i for i, g in enumerate(guides) if g is not None]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(guides), logits.shape[-1])
    for i in rows:
        guides[i].fill_mask(bitmask, i)  # type: ignore[union-attr]
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits
