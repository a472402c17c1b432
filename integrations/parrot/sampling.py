"""Sampling parameters checked where they are written, not where they are used.

The engine refuses a bad parameter too, but only when a call runs — for a semantic function that is the
``get`` of its output, far from the line that said ``temperature=-1``. `check_sampling` applies the
engine's rules (`parrot.protocol.sampling_problem`, which the engine's `SamplingParams.validate` applies too)
on the client, so a semantic function, a LangChain model or a LlamaIndex LLM refuses them when it is
defined. `parrot.protocol.SamplingConfig` itself stays unconstrained: it is the wire schema, and the
server answers a bad value on the wire with its own typed error.
"""

from __future__ import annotations

from parrot.openai_types import openai_sampling
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
