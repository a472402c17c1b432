"""Typed engine errors.

Every error a caller can cause has its own class and a message that says what to fix. The HTTP layer maps
them to status codes through `http_status`; the engine keeps serving other requests after any of them.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises to a caller."""

    http_status: int = 500
    error_type: str = "engine_error"


class InvalidRequestError(EngineError):
    """The request is malformed (bad token ids, bad sampling parameters, ...)."""

    http_status = 400
    error_type = "invalid_request"


class UnsupportedByEngineError(InvalidRequestError):
    """An operation this kind of engine does not offer (the message names the kind and what does)."""

    error_type = "unsupported_by_engine"


class TokenOutOfVocabError(InvalidRequestError):
    error_type = "token_out_of_vocab"


class InvalidSamplingParamsError(InvalidRequestError):
    error_type = "invalid_sampling_params"


class GuidedDecodingTooCostlyError(InvalidSamplingParamsError):
    """A constraint too costly to enforce: over a complexity bound before compiling, a compile over its
    time limit, or a token mask over its time budget while generating (the request alone fails)."""

    error_type = "guided_decoding_too_costly"


class PromptTooLongError(InvalidRequestError):
    """The context would exceed the model's context window or the whole KV cache."""

    http_status = 413
    error_type = "prompt_too_long"


class UnknownContextError(EngineError):
    http_status = 404
    error_type = "unknown_context"


class ContextExistsError(EngineError):
    http_status = 409
    error_type = "context_exists"


class ContextBusyError(EngineError):
    """Two requests tried to extend the same context at once."""

    http_status = 409
    error_type = "context_busy"


class RequestAbortedError(EngineError):
    http_status = 499
    error_type = "request_aborted"


class EngineDeadError(EngineError):
    """The engine loop stopped (shut down or crashed); no request can be served."""

    http_status = 503
    error_type = "engine_dead"


class EngineDrainingError(EngineError):
    """The engine is draining (shutting down gracefully): it finishes what runs but takes no new work.
    The manager places the request on another engine."""

    http_status = 503
    error_type = "engine_draining"


class EngineFailedError(EngineError):
    """A request's engine failed (unreachable, stream broken, loop stopped) on every attempt the manager's
    retry limit allows; the message names the engines."""

    http_status = 503
    error_type = "engine_failed"


def engine_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says the engine, not the request, is at fault — it died, cannot be reached, broke
    the stream, or is draining — so that the request may run again on another engine. Remote engines'
    errors keep their type across HTTP, hence the comparison by ``error_type``."""
    return getattr(error, "error_type", None) in (EngineDeadError.error_type, EngineDrainingError.error_type)
