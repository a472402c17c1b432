"""Every ``PARROT_*`` variable is declared once (`server.common.settings.SETTINGS`), typed, and read only
through
its declaration; a value that does not parse is an error naming the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels.settings import EnvSetting, choice, switch
from server.common.settings import SETTINGS, epilog

ROOT = Path(__file__).resolve().parents[1]
# What the service's own code may read of the environment besides its settings: the servers' environment
# (CPython's allocator and OpenMP's wait policy, set before a restart), a child process's copy of the
# environment, a build script's tokenizer flag.
OTHER_ENV_READS = {
    "server/common/server_env.py",
    "server/cluster/ray_vllm.py",
    "server/engine/tiny/build_tokenizer.py",
}


def _sources() -> list[Path]:
    return [p for d in ("server", "kernels") for p in (ROOT / d).rglob("*.py")]


def test_every_parrot_variable_the_service_names_is_declared() -> None:
    declared = {s.name for s in SETTINGS}
    named = {m for p in _sources() for m in re.findall(r"\bPARROT_[A-Z0-9_]+\b", p.read_text())}
    assert named <= declared, sorted(named - declared)
    assert len(declared) == len(SETTINGS)  # each once


def test_only_the_settings_read_the_environment() -> None:
    readers = {
        p.relative_to(ROOT).as_posix()
        for p in _sources()
        if re.search(r"os\.environ|os\.getenv", p.read_text())
    }
    assert readers - OTHER_ENV_READS == {"kernels/settings.py"}


def test_the_help_lists_every_setting_with_its_default() -> None:
    text = epilog()
    for s in SETTINGS:
        assert s.name in text
    assert "PARROT_BF16_GEMM" in text and "(default: auto)" in text and "(default: 1)" in text
    assert "(default: None)" not in text  # an unset variable's doc says what happens instead


def test_a_setting_parses_its_value_or_names_itself_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    flag = EnvSetting("PARROT_TEST_FLAG", True, "a test switch", switch)
    mode = EnvSetting("PARROT_TEST_MODE", "auto", "a test choice", choice("auto", "ours"))
    assert flag.get() is True and mode.get() == "auto"  # unset: the default
    for raw, value in (("0", False), ("off", False), ("TRUE", True), (" 1 ", True), ("", True)):
        monkeypatch.setenv(flag.name, raw)
        assert flag.get() is value, raw
    monkeypatch.setenv(flag.name, "maybe")
    with pytest.raises(ValueError, match=r"\$PARROT_TEST_FLAG takes 1 or 0"):
        flag.get()
    monkeypatch.setenv(mode.name, "Ours")
    assert mode.get() == "ours"
    monkeypatch.setenv(mode.name, "theirs")
    with pytest.raises(ValueError, match=r"\$PARROT_TEST_MODE takes one of auto, ours, not 'theirs'"):
        mode.get()
