"""Dependencies flow one way (docs/architecture.md): the adapters -> `parrot`; `server` -> `parrot.protocol`
and `kernels`; `kernels` -> torch/triton only; `parrot` never imports `server`, torch or transformers (a
client install is httpx + pydantic). Inside the service the wings stack: the HTTP edge (`server.http`, the
launcher, the CLI) on the manager (`server.serve`), on the cluster's engine kinds (`server.cluster`), on the
engine (`server.engine`); `server.common` (settings, security, bounds) under all of them. The benchmarks
and the recipes share their workload text through `workload_text`, not through each other; experiments
(``benchmarks/<name>.py``) share through `benchmarks.harness` and `benchmarks.workloads`, not through each
other.

Checked on every import statement of every module — lazy (function-level) ones and ``if TYPE_CHECKING:``
ones included: a type-only import still makes one module's meaning depend on the other's, and a type a
module needs from a module above it is declared where it is needed instead (`parrot.variable.VariableOwner`).
"""

from __future__ import annotations

import ast
import graphlib
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The repository's import roots (tests excluded): top-level name -> its package directory or module file.
ROOTS: dict[str, Path] = {
    "server": ROOT / "server",
    "kernels": ROOT / "kernels",
    "benchmarks": ROOT / "benchmarks",
    "recipes": ROOT / "recipes",
    "parrot": ROOT / "integrations" / "parrot",
    "langchain_parrot": ROOT / "integrations" / "langchain_parrot",
    "llamaindex_parrot": ROOT / "integrations" / "llamaindex_parrot",
    "workload_text": ROOT / "workload_text.py",
}

_HTTP_EDGE = {"server.http", "server.launcher", "server.__main__"}

# importer -> what it must never import. A dotted name stands for that module and everything under it.
FORBIDDEN: dict[str, set[str]] = {
    # The client: httpx + pydantic only.
    "parrot": {
        "server",
        "kernels",
        "benchmarks",
        "recipes",
        "langchain_parrot",
        "llamaindex_parrot",
        "torch",
        "transformers",
    },
    # The adapters -> `parrot`, never the service or each other (each is an extra of its own).
    "langchain_parrot": {"server", "kernels", "benchmarks", "recipes", "llamaindex_parrot", "torch"},
    "llamaindex_parrot": {"server", "kernels", "benchmarks", "recipes", "langchain_parrot", "torch"},
    "kernels": {"server", "parrot", "langchain_parrot", "llamaindex_parrot", "benchmarks", "recipes"},
    "server": {"langchain_parrot", "llamaindex_parrot", "benchmarks", "recipes"},
    # Shared by every wing, so it imports none of them.
    "server.common": {"server.engine", "server.cluster", "server.serve", "server.sim", *_HTTP_EDGE},
    # The engine knows nothing of the other engine kinds, the manager, the simulator built on it, or the HTTP
    # edge above them.
    "server.engine": {"server.cluster", "server.serve", "server.sim", *_HTTP_EDGE},
    # The other engine kinds are engines: they know nothing of the manager that holds them.
    "server.cluster": {"server.serve", "server.sim", *_HTTP_EDGE},
    # The manager decides; the HTTP edge answers for it and the simulator drives it.
    "server.serve": {"server.sim", *_HTTP_EDGE},
    # The kernels benchmark times the kernels alone: loading the engine would skew the machine it measures.
    "benchmarks.kernels": {"server.engine", "server.serve", *_HTTP_EDGE},
    "benchmarks.harness.kernel_cases": {"server.engine", "server.serve", *_HTTP_EDGE},
    "recipes": {"benchmarks"},
    "workload_text": set(ROOTS) - {"workload_text"},
}

# The top-level modules of `benchmarks` that are not experiments: the package, what runs the experiments
# (`__main__`, `runner`) and lists them (`experiments`), what they share (`plotting`), the GPU run's
# report (`gpu_report`) and vLLM's side of a worker process (`vllm_worker`). Every other
# ``benchmarks/<name>.py`` is an experiment.
NOT_EXPERIMENTS = {
    "__init__",
    "__main__",
    "plotting",
    "experiments",
    "runner",
    "gpu_report",
    "vllm_worker",
}


def _module_files() -> dict[str, Path]:
    """Every module of the repository's packages by dotted name (a package by its ``__init__.py``)."""
    modules: dict[str, Path] = {}
    for name, root in ROOTS.items():
        if root.is_file():
            modules[name] = root
            continue
        for path in root.rglob("*.py"):
            parts = (name, *path.relative_to(root).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _module_files()


def imported_names(module: str, path: Path) -> Iterator[str]:
    """The dotted names every import statement of ``module`` (at ``path``) names, wherever it stands
    (module level, a function, ``if TYPE_CHECKING:``): ``import a.b`` gives ``a.b``; ``from a.b import c``
    gives ``a.b.c`` (a module or a name in ``a.b``); relative imports are resolved against the package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                yield base if alias.name == "*" else f"{base}.{alias.name}"


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _repo_module(name: str) -> str | None:
    """The repository module an imported name loads: itself, or the nearest enclosing module."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the repository modules it imports. A package's ``__init__`` that Python runs before one
    of its submodules is not an edge: a package re-exporting its submodules would otherwise be a cycle."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_repo_module(name) for name in imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def test_the_rules_name_real_modules() -> None:
    """A misspelt rule would check nothing: every importer and every repository name it forbids is a module
    or a package of modules."""

    def exists(name: str) -> bool:
        return any(_under(module, name) for module in MODULES)

    unknown = {name for name in FORBIDDEN if not exists(name)}
    unknown |= {
        name
        for forbidden in FORBIDDEN.values()
        for name in forbidden
        if name.split(".")[0] in ROOTS and not exists(name)
    }
    assert not unknown, sorted(unknown)


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_dependencies_point_one_way(importer: str) -> None:
    wrong = {
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if _under(module, importer)
        for name in imported_names(module, path)
        if any(_under(name, forbidden) for forbidden in FORBIDDEN[importer])
    }
    assert not wrong, sorted(wrong)


def experiment_modules() -> set[str]:
    """Every experiment module, from the files: ``benchmarks.<name>`` for each ``benchmarks/<name>.py``
    not in `NOT_EXPERIMENTS`."""
    return {f"benchmarks.{p.stem}" for p in ROOTS["benchmarks"].glob("*.py") if p.stem not in NOT_EXPERIMENTS}


def test_no_experiment_imports_another() -> None:
    """What experiments share lives in `benchmarks.harness` (or `benchmarks.workloads`), never in another
    experiment: an experiment is free to change its own sizes, clients and names without breaking another
    (the report and the runner read experiments; they are not experiments)."""
    experiments = experiment_modules()
    assert {"benchmarks.map_reduce", "benchmarks.kernels"} <= experiments  # the files were found
    assert all((ROOTS["benchmarks"] / f"{name}.py").is_file() for name in NOT_EXPERIMENTS)  # none stale
    wrong = {
        f"{module} imports {name}"
        for module in experiments
        for name in imported_names(module, MODULES[module])
        if any(_under(name, other) for other in experiments - {module})
    }
    assert not wrong, sorted(wrong)


# What of the client package the server may read: its wire schema, split by API (the session API, the
# template grammar, OpenAI's format); never the client's own code (sessions, futures, the HTTP client).
CLIENT_WIRE = ("parrot.protocol", "parrot.template", "parrot.openai_types")


def test_the_server_reads_the_client_package_only_through_its_wire_schema() -> None:
    wrong = {
        f"{module} imports {name}"
        for module, path in MODULES.items()
        if _under(module, "server")
        for name in imported_names(module, path)
        if _under(name, "parrot") and not any(_under(name, wire) for wire in CLIENT_WIRE)
    }
    assert not wrong, sorted(wrong)


def test_no_import_cycles() -> None:
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as e:
        cycle = e.args[1]  # each node is imported by the one after it
        pytest.fail("import cycle (A -> B: A imports B): " + " -> ".join(reversed(cycle)))


def test_the_import_reader_sees_lazy_type_only_and_relative_imports(tmp_path: Path) -> None:
    """The checks above are only as good as `imported_names`: it must see the imports easy to miss."""
    path = tmp_path / "__init__.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from server.http.app import create_app\n"
        "def f():\n"
        "    import torch.nn\n"
        "from .sibling import thing\n"
        "from .. import other\n"
    )
    names = set(imported_names("server.serve", path))
    assert names == {
        "typing.TYPE_CHECKING",
        "server.http.app.create_app",
        "torch.nn",
        "server.serve.sibling.thing",
        "server.other",
    }


def test_the_session_implements_what_a_variable_needs_of_it() -> None:
    """`VariableOwner` stands in for `parrot.Session` so that `parrot.variable` need not import it; no type
    checker runs here, so the two are compared: every member it declares, Session has with that signature."""
    from parrot.session import Session
    from parrot.variable import VariableOwner

    declared = {
        name: member
        for name, member in vars(VariableOwner).items()
        if inspect.isfunction(member) and name not in vars(object)
    }
    assert declared
    for name, member in declared.items():
        implemented = getattr(Session, name, None)
        assert implemented is not None, f"Session has no {name}"
        assert inspect.signature(implemented) == inspect.signature(member), name
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(member), name


def test_code_says_what_and_why_never_when() -> None:
    # History lives in commits and closing notes: no issue numbers or run counts in code and comments.
    import re

    when = re.compile(r"\b[Ii]ssue \d+|\bseed 0\d\d\b|\b(?:first|second|third|fourth|fifth|sixth) GPU run\b")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for top in ("server", "kernels", "benchmarks", "integrations", "recipes", "tests")
        for path in sorted((ROOT / top).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if when.search(line)
    ]
    assert not found, found
