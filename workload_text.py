"""Deterministic workload text: the standard library's own docstrings, with nothing downloaded.

The benchmarks cut their prompts and documents from it, and so do the recipes and tests that want a long
document of any size. It is a top-level module of its own because neither side may import the other
(benchmarks never import recipes, recipes never import benchmarks) and the service (`server`) does not carry
workload text; it imports nothing but the standard library.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

__all__ = ["TEXT_MODULES", "stdlib_text"]

# Modules whose docstrings make the workload text. A fixed list in a fixed order: the text is the same on
# every run of one Python version, with nothing downloaded.
TEXT_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "dataclasses",
    "decimal",
    "email.message",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "re",
    "shutil",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)


def stdlib_text(min_chars: int) -> str:
    """Deterministic English-ish text: docstrings of standard-library modules and their public members.

    Repeated as needed to reach ``min_chars``. Identical on every run of one Python version.
    """
    parts: list[str] = []
    for name in TEXT_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a stripped-down Python: skip, the text just comes from fewer modules
            continue
        docs = [inspect.getdoc(module)]
        with warnings.catch_warnings():  # deprecated members (typing.io, ...) warn when touched
            warnings.simplefilter("ignore", DeprecationWarning)
            members = sorted(inspect.getmembers(module), key=lambda kv: kv[0])
            docs += [
                inspect.getdoc(member) for member_name, member in members if not member_name.startswith("_")
            ]
        # A member's docstring may be inherited (int, object, ...): keep each text once.
        seen: set[str] = set()
        for doc in docs:
            if doc and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    text = "\n\n".join(parts)
    if not text:
        raise RuntimeError("no docstrings found in the standard library (python -OO?)")
    while len(text) < min_chars:
        text = text + "\n\n" + text
    return text
