"""Sampling parameters checked where they are written, not where they are used.

The engine refuses a bad parameter too, but only when a call runs — for a semantic function that is the
``get`` of its output, far from the line that said ``temperature=-1``. `check_sampling` applies the
engine's rules (`parrot.protocol.sampling_problem`, which the engine's `SamplingParams.validate` applies too)
on the client, so a semantic function, a LangChain model or a LlamaIndex LLM refuses them when it is
defined. `parrot.protocol.SamplingConfig` itself stays unconstrained: it is the wire schema, and the
server answers a bad value on the wire with its own typed error.
"""

from __future__ import annotations

from typing import Any

from parrot.protocol import SEED_RANGE, sampling_problem

__all__ = ["PENALTIES", "SEED_RANGE", "check_sampling", "openai_sampling"]

# OpenAI's presence and frequency penalties and vLLM's repetition penalty: what an adapter takes beside the
# sampling every model has.
PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def check_sampling(params: object, *, where: str = "") -> None:
    """Raise `ValueError` naming the first sampling parameter of ``params`` the engine would refuse.

    ``params`` is a `parrot.protocol.SamplingConfig` or anything with its attributes (a LangChain model's
    fields, a call's resolved parameters); an attribute that is missing or None is not given, and not
    checked. ``where`` prefixes the message (e.g. ``"ChatParrot: "``) so the error names what was being
    defined.
    """
    problem = sampling_problem(params)
    if problem is not None:
        raise ValueError(f"{where}{problem}")


def openai_sampling(params: Any) -> dict[str, Any]:
    """The sampling part of an OpenAI-style request body from ``params`` (a `SamplingConfig` or anything
    with its attributes; ``max_tokens`` None: up to the window): ``max_tokens``, ``temperature`` and
    ``top_p`` always, the rest only where it differs from the default, the server's extensions (``top_k``,
    ``ignore_eos``, ``repetition_penalty``) named as vLLM names them."""
    body: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.top_k:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop:
        body["stop"] = list(params.stop)
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if params.repetition_penalty != 1.0:
        body["repetition_penalty"] = params.repetition_penalty
    logit_bias = getattr(params, "logit_bias", None)
    if logit_bias:
        body["logit_bias"] = {str(t): v for t, v in logit_bias.items()}
    return body
