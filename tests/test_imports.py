"""The library's import structure: no cycle among specjax's modules, nothing from train/,
and an install that holds specjax alone.

The graph is read from the source with ast, not by importing, and counts every import
statement, those inside functions too: a function-level import is still a dependency (it
runs on the first call instead of at import), and moving an import into a function is the
usual way a cycle is hidden rather than removed. The lazy imports that keep
`import specjax` cheap (transformers, the server's packages, specjax.engine from the
CLI) do not form cycles, so counting them costs nothing.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specjax"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, name: str) -> set[str]:
    """Every module `path` (module `name`) imports, absolute: for `from a import b`, a.b
    where that is a module of the package, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.update(f"{base}.{alias.name}" for alias in node.names)
            out.add(base)
    return out


def graph() -> dict[str, set[str]]:
    """specjax module -> the specjax modules it imports (itself and its package left out)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in files.items():
        targets = imported(path, name)
        # `from . import x` names the package and its module x: keep the module alone
        edges[name] = {t for t in targets if t in files and t != name
                       and not any(u.startswith(t + ".") and u in files for u in targets)}
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_relative_and_function_level_imports():
    edges = graph()
    assert "specjax.proposers" in edges["specjax.adaptive"]      # from .proposers import ...
    assert "specjax.steps" in edges["specjax.proposers"]         # from . import steps
    assert "specjax.server" in edges["specjax.cli"]              # inside _serve()
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_specjax_has_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_specjax_imports_nothing_from_train():
    for path in sorted(PACKAGE.rglob("*.py")):
        bad = sorted(t for t in imported(path, module_name(path)) if t == "train" or t.startswith("train."))
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}: the library must not import train/"


def test_the_install_holds_specjax_alone():
    """pyproject's package list claims no top-level `train` (train/ runs from the repository)."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    assert "specjax" in packages
    assert all(p == "specjax" or p.startswith("specjax.") for p in packages), packages
