"""Dependencies flow one way (DESIGN.md): the adapters -> `parrot`; `server` -> `parrot.protocol` and
`kernels`; `kernels` -> torch/triton only; `parrot` never imports `server`, torch or transformers (a client
install is httpx + pydantic). Checked on every import statement of every module, lazy ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package directory -> top-level modules it must never import
FORBIDDEN: dict[Path, set[str]] = {
    ROOT / "integrations" / "parrot": {"server", "kernels", "torch", "transformers", "benchmarks"},
    ROOT / "kernels": {"server", "parrot", "langchain_parrot", "llamaindex_parrot", "benchmarks"},
    ROOT / "server": {"langchain_parrot", "llamaindex_parrot", "benchmarks", "recipes"},
    ROOT / "integrations" / "langchain_parrot": {"server", "kernels", "torch", "benchmarks"},
    ROOT / "integrations" / "llamaindex_parrot": {"server", "kernels", "torch", "benchmarks"},
}


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (absolute imports only; relative stay inside)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN), ids=lambda p: str(p.relative_to(ROOT)))
def test_dependencies_point_one_way(package: Path) -> None:
    assert package.is_dir(), package
    wrong = {
        f"{path.relative_to(ROOT)} imports {name}"
        for path in package.rglob("*.py")
        for name in _imports(path) & FORBIDDEN[package]
    }
    assert not wrong, sorted(wrong)


def test_the_server_reads_the_client_package_only_through_its_wire_schema() -> None:
    wrong = set()
    for path in (ROOT / "server").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] == "parrot" and node.module != "parrot.protocol":
                    wrong.add(f"{path.relative_to(ROOT)} imports {node.module}")
            elif isinstance(node, ast.Import):
                wrong.update(
                    f"{path.relative_to(ROOT)} imports {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "parrot" and a.name != "parrot.protocol"
                )
    assert not wrong, sorted(wrong)
