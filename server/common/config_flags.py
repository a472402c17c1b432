"""Command-line flags declared on a config dataclass's fields, as vLLM's ``EngineArgs`` does.

A field made with `flagged` carries its flag: the name (``--`` and the field's name with dashes, unless
given), the help, and how its text is read. `add_config_flags` adds a field's flag to a parser with the
field's own default, and `config_values` reads the parsed values back as keyword arguments for the config:
a command line built this way cannot drift from the config it fills. Only the standard library is imported
here: the command lines parse before anything heavy loads.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Flag", "add_config_flags", "config_values", "flagged", "fraction"]

_FLAG = "flag"  # the key of a field's metadata that holds its `Flag`


@dataclass(frozen=True)
class Flag:
    """How a config field is set from the command line."""

    help: str
    # Reads the flag's text (argparse's ``type``): default ``int``/``float``/``str`` as the field's default
    # is, ``str`` for a field whose default is None.
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    # The flag's name, where it is not the field's (``--enforce-eager`` for ``cuda_graphs``).
    name: str | None = None
    # A bool field that defaults to True and that the flag turns off (vLLM's ``--enforce-eager``).
    negates: bool = False

    def option(self, field: str) -> str:
        """The flag for ``field``."""
        return self.name or "--" + field.replace("_", "-")

    def dest(self, field: str) -> str:
        """Where argparse puts the flag's value (``enforce_eager`` for ``--enforce-eager``)."""
        return self.option(field).removeprefix("--").replace("-", "_")


def flagged(default: Any, flag: Flag) -> Any:
    """A dataclass field with ``default`` and the command-line ``flag`` that sets it."""
    return dataclasses.field(default=default, metadata={_FLAG: flag})


def _flag_fields(config: type, names: Iterable[str]) -> list[tuple[dataclasses.Field[Any], Flag]]:
    by_name = {f.name: f for f in dataclasses.fields(config)}
    out = []
    for name in names:
        field = by_name.get(name)
        flag = None if field is None else field.metadata.get(_FLAG)
        if field is None or not isinstance(flag, Flag):
            raise TypeError(f"{config.__name__}.{name} has no command-line flag (see `flagged`)")
        out.append((field, flag))
    return out


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, config: type, names: Iterable[str]
) -> None:
    """Add the flags of ``config``'s fields ``names`` to ``parser``, each with its field's default."""
    for field, flag in _flag_fields(config, names):
        option, dest, default = flag.option(field.name), flag.dest(field.name), field.default
        if isinstance(default, bool):
            if default is not flag.negates:
                raise TypeError(f"{config.__name__}.{field.name}: a bool flag turns its default off")
            parser.add_argument(option, dest=dest, action="store_true", help=flag.help)
            continue
        parse = flag.parse or (str if default is None else type(default))
        parser.add_argument(
            option,
            dest=dest,
            type=parse,
            default=default,
            metavar=flag.metavar,
            choices=flag.choices,
            help=flag.help,
        )


def config_values(config: type, args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The values of ``config``'s fields ``names`` as parsed into ``args`` by `add_config_flags`."""
    values = {}
    for field, flag in _flag_fields(config, names):
        value = getattr(args, flag.dest(field.name))
        values[field.name] = (not value) if flag.negates else value
    return values


def fraction(text: str) -> float:
    """A flag's number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value
