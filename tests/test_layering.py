"""The package's layering, read from its source: no import circle among its modules, and the framework-neutral
layers (measure/, the techniques module, the record) import no Lightning."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from modelwright import REPO_ROOT

SOURCE = REPO_ROOT / "src"
#: What must not import Lightning at its top level (a function may, where it runs under Lightning anyway).
NEUTRAL = ("modelwright.measure", "modelwright.techniques", "modelwright.record")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in SOURCE.rglob("*.py")}


def top_level_imports(name: str, path: Path) -> Iterator[str]:
    """The modules ``name`` imports as it loads (statements at its top level, in ``if`` and ``try`` included):
    ``from package import module`` names the module, ``from module import name`` the module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for statement in tree.body:
        nodes = ast.walk(statement) if isinstance(statement, (ast.If, ast.Try)) else [statement]
        for node in nodes:
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package[:len(package) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                for alias in node.names:
                    yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def import_graph() -> dict[str, set[str]]:
    return {name: {found for found in top_level_imports(name, path) if found in MODULES and found != name}
            for name, path in MODULES.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the path that closes it (a depth-first search's back edges)."""
    found = []
    state = dict.fromkeys(graph, "new")

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph[name]):
            if state[imported] == "open":
                found.append([*path[path.index(imported):], imported])
            elif state[imported] == "new":
                visit(imported, [*path, imported])
        state[name] = "done"

    for name in sorted(graph):
        if state[name] == "new":
            visit(name, [name])
    return found


def test_no_import_circle_among_the_packages_modules():
    assert len(MODULES) > 40  # the package was read
    assert circles(import_graph()) == []


def test_a_circle_is_found():
    """The search itself finds a → b → c → a, and nothing where the imports run one way."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert circles({"a": set(), "b": {"a"}}) == []


def test_the_neutral_layers_import_no_lightning():
    for name, path in MODULES.items():
        if name.startswith(NEUTRAL):
            imported = set(top_level_imports(name, path))
            assert not {module for module in imported
                        if module.split(".")[0] in ("lightning", "pytorch_lightning")}, name
