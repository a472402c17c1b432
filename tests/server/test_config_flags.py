"""Command-line flags declared on config fields (`server.common.config_flags`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from server.common.config_flags import Flag, add_config_flags, config_values, flagged, fraction


@dataclass(frozen=True)
class _Config:
    rows: int = flagged(4, Flag("rows"))
    share: float = flagged(0.5, Flag("a share", parse=fraction))
    name: str | None = flagged(None, Flag("a name", choices=("a", "b")))
    fast: bool = flagged(True, Flag("slow down", name="--slow", negates=True))
    verbose: bool = flagged(False, Flag("say more"))
    plain: int = 3


_NAMES = ("rows", "share", "name", "fast", "verbose")


def _parse(argv: list[str]) -> _Config:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, _Config, _NAMES)
    return _Config(**config_values(_Config, parser.parse_args(argv), _NAMES))


def test_no_flags_give_the_fields_defaults() -> None:
    assert _parse([]) == _Config()


def test_each_flag_sets_its_field() -> None:
    got = _parse(["--rows", "7", "--share", "1", "--name", "b", "--slow", "--verbose"])
    assert got == _Config(rows=7, share=1.0, name="b", fast=False, verbose=True)


@pytest.mark.parametrize("argv", [["--rows", "x"], ["--share", "0"], ["--share", "1.5"], ["--name", "c"]])
def test_a_bad_value_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _parse(argv)
    assert exit_info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_a_field_without_a_flag_is_refused() -> None:
    with pytest.raises(TypeError, match=r"_Config\.plain has no command-line flag"):
        add_config_flags(argparse.ArgumentParser(), _Config, ["plain"])


def test_a_bool_flag_must_turn_its_default_off() -> None:
    @dataclass(frozen=True)
    class Wrong:
        on: bool = flagged(True, Flag("turn on"))

    with pytest.raises(TypeError, match="turns its default off"):
        add_config_flags(argparse.ArgumentParser(), Wrong, ["on"])
