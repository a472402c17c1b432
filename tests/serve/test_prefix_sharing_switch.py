"""`ManagerConfig.prefix_sharing`: off, no step shares KV — every step fills its whole prompt and frees its
context when done; on, a shared constant prefix is prefilled once and the calls fork it. Exact prefill
token counts from the engine's stats, on the embedded tiny model."""

from __future__ import annotations

import parrot as P
import pytest

from server.engine import EngineConfig
from server.launcher import launch
from server.serve.manager import ManagerConfig

SYSTEM = " ".join(f"rule {i}: answer in one line about item {i}." for i in range(12))
TEMPLATE = f"{SYSTEM}\nQuestion:\n{{{{input:q}}}}\nAnswer:\n{{{{output:a}}}}"
QUESTIONS = ["what is item three", "what is item seven", "name every item"]


def run(sharing: bool) -> tuple[list[str], int, int, list[int], int]:
    """Answers, prefill tokens computed, contexts held after the session, prompt lengths, prefix length."""
    fn = P.SemanticFunction.from_template(
        TEMPLATE, name="ask", sampling=P.SamplingConfig(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    config = ManagerConfig(prefix_sharing=sharing)
    with launch("tiny", engine_config=EngineConfig(num_kv_blocks=256), manager_config=config) as served:
        engine = served.engines[0]
        before = engine.stats().prefill_tokens_computed
        with P.Session(served.url) as s:
            answers = [fn(q=s.variable(q)) for q in QUESTIONS]
            got = [a.get() for a in answers]
        computed = engine.stats().prefill_tokens_computed - before
        contexts = engine.stats().contexts
        tokenizer = engine.tokenizer
        prompts = [len(tokenizer.encode(f"{SYSTEM}\nQuestion:\n{q}\nAnswer:\n")) for q in QUESTIONS]
        prefix = len(tokenizer.encode(f"{SYSTEM}\nQuestion:\n"))
    return got, computed, contexts, prompts, prefix


@pytest.mark.parametrize("sharing", [False, True])
def test_prefix_sharing_switch_counts_prefill_exactly(sharing: bool) -> None:
    got, computed, contexts, prompts, prefix = run(sharing)
    assert prefix >= 16  # long enough to become a shared context (ManagerConfig.min_shared_prefix_tokens)
    if sharing:
        # The constant prefix once, then each call's own tail (the prompts split cleanly at the newline).
        assert computed == prefix + sum(n - prefix for n in prompts)
        assert contexts >= 1  # the prefix and the finished calls stay cached
    else:
        assert computed == sum(prompts)  # every step fills its whole prompt
        assert contexts == 0  # nothing is kept: no step could fork it
    if sharing:
        assert got == run(False)[0]  # the same greedy answers either way
