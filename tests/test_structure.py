"""The package's modules: their imports form no cycle, and no module reaches into another's
private names."""

from __future__ import annotations

import ast
import functools
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gdn_layout"


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


FILES = {_name(path): path for path in PACKAGE.rglob("*.py")}
MODULES = sorted(FILES)

#: Notebook conveniences (``GdnBackwardLayout.plot``, ``Comparison.plot``) import the plot
#: module, which builds on their classes, when called: the one kind of upward edge.
ON_DEMAND = {("layout", "plot"), ("check._records", "plot")}


@functools.cache
def _imports(module: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(module, names)`` for every package import of ``module``, deferred ones included."""
    path = FILES[module]
    parts = module.split(".")
    package = parts if path.name == "__init__.py" and module != "__init__" else parts[:-1]
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names = tuple(alias.name for alias in node.names)
            if node.level:
                base = package[: len(package) - node.level + 1]
                if node.module is None:
                    found.extend((".".join([*base, name]), ()) for name in names)
                else:
                    found.append((".".join([*base, node.module]), names))
            elif node.module and node.module.startswith("gdn_layout."):
                found.append((node.module.removeprefix("gdn_layout."), names))
    return tuple((target or "__init__", names) for target, names in found if target in FILES)


def test_the_imports_form_no_cycle() -> None:
    graph = {
        module: {t for t, _ in _imports(module) if (module, t) not in ON_DEMAND and t != module}
        for module in MODULES
    }
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as err:
        pytest.fail(f"an import cycle: {' -> '.join(err.args[1])}")


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_is_imported_from_another_module(module: str) -> None:
    private = [
        f"{source}.{name}"
        for source, names in _imports(module)
        for name in names
        if name.startswith("_") and name != "__version__" and f"{source}.{name}" not in FILES
    ]
    assert not private
