"""The package's shape: no import cycle between its modules, ``TYPE_CHECKING`` and lazy imports
included, and the public names pinned.

The walk reads every module's source (it imports nothing), so an import that only a type
checker or a rarely taken branch follows counts as much as one at the top of a module: a cycle
there is still two modules that cannot be understood apart. The layers between subpackages are
checked by import-linter (``lint-imports``, the contract in ``pyproject.toml``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import fastapi_singletonjob
import fastapi_singletonjob.testing

PACKAGE_DIR = Path(fastapi_singletonjob.__file__).parent


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module below ``root`` (a package directory), by dotted name; a package is named
    by its ``__init__.py``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join((package, *parts))] = path
    return names


def imported(module: str, path: Path, modules: Mapping[str, Path]) -> Iterator[str]:
    """The modules of ``modules`` that ``module`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    here = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _known(alias.name, modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # ``from package import module`` imports the module; ``from module import
                # name`` the module that defines the name.
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in modules else base


def _known(name: str, modules: Mapping[str, Path]) -> Iterator[str]:
    if name in modules:
        yield name


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself excluded)."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {target for target in imported(module, path, modules) if target in modules}
        targets.discard(module)
        graph[module] = targets
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE_DIR, "fastapi_singletonjob")
    assert len(graph) > 40  # the walk found the package
    assert "fastapi_singletonjob._store.base" in graph["fastapi_singletonjob._store.memory"]
    assert cycles(graph) == []


def test_the_walk_finds_a_cycle_through_type_checking_and_lazy_imports(tmp_path: Path) -> None:
    """The check can fail: a cycle made only of a ``TYPE_CHECKING`` import one way and a
    function-level import the other way is found, as is one through ``from . import x``."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.b import B\n"
    )
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import A\n")
    (package / "c.py").write_text("from . import d\n")
    (package / "d.py").write_text("from .c import C\n")
    (package / "e.py").write_text("from .a import A\n")
    graph = import_graph(package, "pkg")
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"], ["pkg.c", "pkg.d"]]


def test_the_public_names_are_those_of_the_brief() -> None:
    """``testing`` exports the fake clock alone (the package's ``__all__`` is pinned in
    test_config.py)."""
    assert fastapi_singletonjob.testing.__all__ == ["FakeClock"]
