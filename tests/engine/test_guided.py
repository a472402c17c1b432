"""Constrained decoding in the engine (xgrammar masks) and per-token log-probabilities.

Validity is checked by libraries we did not write (`jsonschema`, `re`), log-probabilities against Hugging
Face's own forward pass on the same weights.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import queue
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch

from server.cluster.remote_engine import result_of
from server.engine import EngineConfig, LLMEngine, SamplingParams, guided as guided_module
from server.engine.api import create_engine_app
from server.engine.errors import GuidedDecodingTooCostlyError, InvalidSamplingParamsError, RequestAbortedError
from server.engine.guide_cost import repetition_product
from server.engine.guided import (
    MAX_JSON_WHITESPACE,
    GrammarCompiler,
    Guide,
    choice_grammar,
    guided_from_structured_outputs,
    structured_outputs,
)
from server.engine.sampling import MAX_GUIDE_CHARS, MIN_LOGPROB, GuidedDecoding
from server.engine.wire import EngineGenerateResponse
from tests.engine.conftest import _hf_model, prompts

_ids = itertools.count(10_000)

# Bounded everywhere (string lengths, array sizes, number ranges): a random model must still finish it.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny() -> Iterator[LLMEngine]:
    eng = LLMEngine.from_pretrained("tiny", EngineConfig(num_kv_blocks=512))
    yield eng
    eng.shutdown()


async def _generate(engine: LLMEngine, prompt: str, sampling: SamplingParams) -> tuple[str, str, list[int]]:
    cid = next(_ids)
    await engine.fill(cid, engine.tokenizer.encode(prompt))
    try:
        r = await engine.generate(cid, sampling)
    finally:
        await engine.free_context(cid)
    return r.text, r.finish_reason, r.token_ids


async def test_json_schema_output_validates_on_every_sample(tiny: LLMEngine) -> None:
    guided = GuidedDecoding("json_schema", json.dumps(PERSON))
    samples = await asyncio.gather(
        *[
            _generate(
                tiny, f"Person {i}:", SamplingParams(max_tokens=300, temperature=1.0, seed=i, guided=guided)
            )
            for i in range(20)
        ]
    )
    for text, reason, _ in samples:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)  # control characters in strings would fail here
    assert len({text for text, _, _ in samples}) > 10  # sampled, not one fixed answer


@pytest.mark.parametrize(
    ("guided", "check"),
    [
        (
            GuidedDecoding("regex", r"[A-Z][a-z]{2,6}-\d{3}"),
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,6}-\d{3}", t),
        ),
        (GuidedDecoding("choice", ("yes", "no", "maybe so")), lambda t: t in ("yes", "no", "maybe so")),
        (
            GuidedDecoding("grammar", 'root ::= [a-c]{1,4} "=" [0-9]{1,2}'),
            lambda t: re.fullmatch(r"[a-c]{1,4}=\d{1,2}", t),
        ),
    ],
    ids=["regex", "choice", "grammar"],
)
async def test_each_kind_of_constraint_holds(tiny: LLMEngine, guided: GuidedDecoding, check: object) -> None:
    for seed in range(3):
        text, reason, _ = await _generate(
            tiny, "Answer:", SamplingParams(max_tokens=40, temperature=1.0, seed=seed, guided=guided)
        )
        assert reason == "stop" and check(text), text  # type: ignore[operator]


async def test_json_object_starts_an_object_and_closes_valid_when_it_stops(tiny: LLMEngine) -> None:
    text, reason, _ = await _generate(
        tiny, "JSON:", SamplingParams(max_tokens=60, guided=GuidedDecoding("json_object"))
    )
    assert text.startswith("{")
    if reason == "stop":  # a random model may write one key until max_tokens; what it closes is valid
        assert isinstance(json.loads(text), dict)


async def test_unconstrained_requests_batched_with_guided_ones_are_unchanged(tiny: LLMEngine) -> None:
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = await _generate(tiny, "The weather today", plain)
    guided = SamplingParams(max_tokens=30, guided=GuidedDecoding("regex", r"\d{1,20}"))
    together = await asyncio.gather(
        _generate(tiny, "The weather today", plain), *[_generate(tiny, f"n{i}", guided) for i in range(3)]
    )
    assert together[0] == alone
    assert all(re.fullmatch(r"\d{1,20}", t) for t, _, _ in together[1:])


@pytest.mark.parametrize(
    ("guided", "message"),
    [
        (GuidedDecoding("regex", "((("), "cannot be compiled"),
        (GuidedDecoding("json_schema", "{not json"), "not valid JSON"),
        (GuidedDecoding("json_schema", "[1, 2]"), "must be a JSON object"),
        (GuidedDecoding("choice", ()), "non-empty list"),
        (GuidedDecoding("choice", ("a", "")), "non-empty strings"),
        (GuidedDecoding("regex", "a" * (MAX_GUIDE_CHARS + 1)), f"at most {MAX_GUIDE_CHARS}"),
        (GuidedDecoding("json_object", "x"), "takes no value"),
        (GuidedDecoding("grammar", "root ::= undefined_rule"), "cannot be compiled"),
        (GuidedDecoding("yaml", "a"), "kind must be one of"),  # type: ignore[arg-type]
        # 33 characters, 50,000 expanded repetitions: its masks took over a second a token within 30.
        (GuidedDecoding("regex", "(([a-z0-9]{1,50}){1,50}){1,20}"), "repeats up to 50000 times"),
        (GuidedDecoding("regex", "a{1,100000}"), "use \\* or \\+ for long runs"),
    ],
)
async def test_a_bad_constraint_fails_its_request_only(
    tiny: LLMEngine, guided: GuidedDecoding, message: str
) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message):
        await _generate(tiny, "x", SamplingParams(max_tokens=4, guided=guided))
    assert tiny.stats().running == 0
    text, _, _ = await _generate(tiny, "still serving", SamplingParams(max_tokens=3, ignore_eos=True))
    assert text


async def test_a_guided_request_cancelled_while_its_grammar_compiles_frees_everything(
    tiny: LLMEngine,
) -> None:
    cid = next(_ids)
    await tiny.fill(cid, tiny.tokenizer.encode("Cancel me"))
    schema = json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}})
    stream = tiny.submit_generate(
        cid, SamplingParams(max_tokens=50, guided=GuidedDecoding("json_schema", schema))
    )
    stream.cancel()
    with pytest.raises(RequestAbortedError):
        await stream.result()
    await tiny.free_context(cid)
    for _ in range(100):
        if tiny.stats().running == 0 and tiny.stats().contexts == 0:
            break
        await asyncio.sleep(0.02)
    assert tiny.stats().running == 0 and tiny.stats().contexts == 0


def test_choice_grammar_escapes_quotes_and_backslashes() -> None:
    assert choice_grammar(['say "hi"', "a\\b"]) == r'root ::= "say \"hi\"" | "a\\b"'


def test_structured_outputs_round_trip_and_refusals() -> None:
    for guided in (
        GuidedDecoding("json_schema", json.dumps(PERSON)),
        GuidedDecoding("json_object"),
        GuidedDecoding("regex", "a+"),
        GuidedDecoding("choice", ("x", "y")),
        GuidedDecoding("grammar", 'root ::= "a"'),
    ):
        back = guided_from_structured_outputs(structured_outputs(guided))
        assert back.kind == guided.kind
        assert (json.loads(back.value) if guided.kind == "json_schema" else back.value) == (  # type: ignore[arg-type]
            PERSON if guided.kind == "json_schema" else guided.value
        )
    compact = guided_from_structured_outputs({"json": PERSON, "disable_any_whitespace": True})
    assert compact.compact and structured_outputs(compact)["disable_any_whitespace"] is True
    assert "disable_any_whitespace" not in structured_outputs(GuidedDecoding("json_object"))
    with pytest.raises(InvalidSamplingParamsError, match="exactly one of"):
        guided_from_structured_outputs({"regex": "a", "choice": ["a"]})
    with pytest.raises(InvalidSamplingParamsError, match="not supported"):
        guided_from_structured_outputs({"structural_tag": "x"})


async def test_logprobs_equal_hugging_face_log_softmax(engine: LLMEngine, gqa_model: Path) -> None:
    prompt = prompts(1, seed=41)[0]
    cid = next(_ids)
    await engine.fill(cid, prompt)
    result = await engine.generate(cid, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3))
    await engine.free_context(cid)
    assert result.logprobs is not None and len(result.logprobs) == 5
    model = _hf_model(gqa_model)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    for step, lp in enumerate(result.logprobs):
        assert lp.token_id == result.token_ids[step]
        assert lp.logprob == pytest.approx(reference[step, lp.token_id].item(), abs=1e-4)
        values, ids = reference[step].topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()  # greedy: the token is the top one
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


async def test_logprobs_under_a_constraint_are_over_what_it_allows(tiny: LLMEngine) -> None:
    """As vLLM reports them: the grammar's mask applies before the log-probabilities, so a token the
    constraint forces is certain (0), and no alternative the constraint refuses is listed."""
    cid = next(_ids)
    await tiny.fill(cid, tiny.tokenizer.encode("Pick:"))
    guided = GuidedDecoding("choice", ("zebra",))
    r = await tiny.generate(cid, SamplingParams(max_tokens=10, guided=guided, logprobs=20))
    await tiny.free_context(cid)
    assert r.text == "zebra" and r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
    rest = "zebra"
    for lp in r.logprobs[:-1]:  # the last is the end of sequence
        allowed = [(t, v) for t, v in lp.top if v > MIN_LOGPROB]
        assert all(rest.startswith(tiny.tokenizer.decode([t])) for t, _ in allowed)  # only what it allows
        assert sum(math.exp(v) for _, v in allowed) == pytest.approx(1.0, abs=1e-5)  # all of the mass
        assert all(v == MIN_LOGPROB for _, v in lp.top[len(allowed) :])  # refused: vLLM's floor, not -inf
        rest = rest[len(tiny.tokenizer.decode([lp.token_id])) :]


async def test_guided_decoding_and_logprobs_over_the_engine_api(tiny: LLMEngine) -> None:
    transport = httpx.ASGITransport(app=create_engine_app(tiny, cluster_token="t"))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://engine", headers={"Authorization": "Bearer t"}
    ) as client:
        cid = next(_ids)
        await client.post("/fill", json={"context_id": cid, "text": "Number:"})
        sampling = {"max_tokens": 20, "guided": {"kind": "regex", "value": r"\d{2,4}"}, "logprobs": 2}
        for stream in (False, True):
            r = await client.post(
                "/generate",
                json={
                    "context_id": next(_ids),
                    "parent_context_id": cid,
                    "sampling": sampling,
                    "stream": stream,
                },
            )
            assert r.status_code == 200
            body = (
                r.json()
                if not stream
                else json.loads(r.text.strip().split("\n\n")[-2].removeprefix("data: "))
            )
            result = result_of(EngineGenerateResponse.model_validate(body))
            assert re.fullmatch(r"\d{2,4}", result.text)
            assert result.logprobs is not None and all(len(lp.top) == 2 for lp in result.logprobs)
        bad = {"max_tokens": 5, "guided": {"kind": "regex", "value": "((("}}
        r = await client.post(
            "/generate", json={"context_id": next(_ids), "parent_context_id": cid, "sampling": bad}
        )
        assert r.status_code == 400 and "cannot be compiled" in r.json()["error"]["message"]


@pytest.mark.parametrize("bounded", [True, False], ids=["maxLength", "unbounded"])
def test_json_strings_refuse_control_characters_and_surrogates(tiny: LLMEngine, bounded: bool) -> None:
    """Byte by byte through the tiny model's byte-level tokens: what xgrammar's own JSON grammar lets into a
    string (a raw control character in a bounded one, a UTF-16 surrogate encoded as UTF-8 in any) is
    refused, while real multi-byte characters pass."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = tiny.tokenizer.get_vocab()
    byte_token = {b: vocab[ch] for b, ch in bytes_to_unicode().items()}
    text = {"type": "string", "maxLength": 8} if bounded else {"type": "string"}
    schema = json.dumps({"type": "object", "properties": {"s": text}, "required": ["s"]})
    grammar = tiny.core.grammars.compile(GuidedDecoding("json_schema", schema))

    def accepts(inner: bytes) -> bool:
        guide = Guide(grammar)
        try:
            for b in b'{"s": "' + inner + b'"}':
                guide.accept(byte_token[b])
        except InvalidSamplingParamsError:
            return False
        return True

    assert accepts("é€😀".encode())
    assert not accepts(b"\xed\xa2\xb2")  # U+D8B2, a surrogate
    assert not accepts(b"\x0e")


async def test_a_grammar_refusing_a_token_fails_its_request_not_its_batch(
    tiny: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    accept = Guide.accept
    refused: list[int] = []

    def refuse_once(self: Guide, token_id: int) -> None:
        if not refused:
            refused.append(token_id)
            raise InvalidSamplingParamsError(f"token {token_id} breaks the request's grammar")
        accept(self, token_id)

    monkeypatch.setattr(Guide, "accept", refuse_once)
    guided = SamplingParams(max_tokens=20, guided=GuidedDecoding("regex", r"\d{1,8}"))
    outcomes = await asyncio.gather(
        *[_generate(tiny, f"n{i}", guided) for i in range(2)],
        _generate(tiny, "plain", SamplingParams(max_tokens=4, ignore_eos=True)),
        return_exceptions=True,
    )
    failed = [o for o in outcomes if isinstance(o, InvalidSamplingParamsError)]
    assert len(failed) == 1 and "breaks the request's grammar" in str(failed[0])
    assert sum(isinstance(o, tuple) for o in outcomes) == 2 and tiny.stats().running == 0


@pytest.mark.parametrize(
    ("pattern", "product"),
    [
        (r"(([a-z0-9]{1,50}){1,50}){1,20}", 50_000),
        (r"\d{1,3}(\.\d{1,3}){3}", 9),
        (r"(\w{1,20}\s){1,10}", 200),
        (r"(a|b)*c+x{3,}", 1),  # unbounded loops are not expanded
        (r"[{]{2}\{(\d{1,5})\}", 5),  # braces in a class or escaped are text
        (r"((a){3})(b{4}){2}", 8),
    ],
)
def test_a_regex_costs_the_product_of_its_nested_repetitions(pattern: str, product: int) -> None:
    assert repetition_product(pattern) == product


async def test_a_guide_over_its_mask_budget_fails_its_request_not_its_batch(
    tiny: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(guided_module, "MASK_STEP_BUDGET_S", 0.0)  # every mask overruns
    guided = SamplingParams(max_tokens=20, guided=GuidedDecoding("regex", r"\d{1,8}"))
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    outcomes = await asyncio.gather(
        _generate(tiny, "n", guided), _generate(tiny, "plain", plain), return_exceptions=True
    )
    assert isinstance(outcomes[0], GuidedDecodingTooCostlyError), outcomes[0]
    assert "token mask took" in str(outcomes[0]) and outcomes[0].error_type == "guided_decoding_too_costly"
    assert isinstance(outcomes[1], tuple) and tiny.stats().running == 0


def test_a_compile_over_its_time_limit_fails_its_request(tiny: LLMEngine) -> None:
    compiler = GrammarCompiler(tiny.tokenizer, tiny.vocab_size, tiny.eos_token_ids)  # nothing cached yet
    answers: queue.Queue[tuple[object, BaseException | None]] = queue.Queue()
    try:
        compiler.submit(GuidedDecoding("json_object"), lambda g, e: answers.put((g, e)), timeout_s=0.001)
        grammar, error = answers.get(timeout=60)
        assert grammar is None and isinstance(error, GuidedDecodingTooCostlyError)
        assert "did not compile within 0.001 s" in str(error)
        time.sleep(0.5)
        assert answers.empty()  # the compile that finished later answers nobody a second time
        compiler.submit(GuidedDecoding("json_object"), lambda g, e: answers.put((g, e)))
        grammar, error = answers.get(timeout=60)
        assert error is None and grammar is not None
    finally:
        compiler.shutdown()


@pytest.mark.parametrize("compact", [False, True], ids=["bounded-whitespace", "compact"])
def test_json_whitespace_is_bounded_or_off(tiny: LLMEngine, compact: bool) -> None:
    """Between JSON tokens a model may lay out up to MAX_JSON_WHITESPACE characters in a row (as it learned
    to), never more (it cannot loop on whitespace); compact JSON takes none beyond ", " and ": "."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = tiny.tokenizer.get_vocab()
    byte_token = {b: vocab[ch] for b, ch in bytes_to_unicode().items()}
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    grammar = tiny.core.grammars.compile(GuidedDecoding("json_schema", schema, compact))

    def accepts(text: bytes) -> bool:
        guide = Guide(grammar)
        try:
            for b in text:
                guide.accept(byte_token[b])
            guide.accept(min(tiny.eos_token_ids))  # complete only if the grammar may stop here
        except InvalidSamplingParamsError:
            return False
        return guide.finished

    assert accepts(b'{"s": "a"}')
    assert accepts(b'{\n  "s": "a"\n}') is not compact
    run = b" " * MAX_JSON_WHITESPACE
    assert accepts(b"{" + run + b'"s": "a"}') is not compact
    assert not accepts(b"{" + run + b' "s": "a"}')
