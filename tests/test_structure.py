"""The package's modules: small, layered without cycles, private names kept private, each
module's tests found by its name."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gdn_layout"


def _name(path: Path) -> str:
    """A module's dotted name inside the package: a subpackage is named by its folder."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


FILES = {_name(path): path for path in PACKAGE.rglob("*.py")}
MODULES = sorted(FILES)


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(FILES[module].read_text())


def _package_of(module: str) -> list[str]:
    """The dotted package a module's relative imports start from, as parts."""
    parts = module.split(".")
    return parts if FILES[module].name == "__init__.py" and module != "__init__" else parts[:-1]


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` for every import of a package module, deferred ones included."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if node.level:
                base = _package_of(module)[: len(_package_of(module)) - node.level + 1]
                if node.module is None:  # from . import x
                    found.extend((".".join([*base, name]), []) for name in names)
                else:
                    found.append((".".join([*base, node.module]), names))
            elif node.module and node.module.startswith("gdn_layout."):
                found.append((node.module.removeprefix("gdn_layout."), names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("gdn_layout."):
                    found.append((alias.name.removeprefix("gdn_layout."), []))
    return found


def test_the_modules_are_known() -> None:
    # A new module must be placed in the layering below.
    assert set(MODULES) == set(LAYERS)


#: Every module, lowest first: each may import only modules before it.
LAYERS = [
    "_version",
    "_checks",
    "_dtypes",
    "_arrays",
    "_tables",
    "_progress",
    "_process",
    "_norms",
    "_stats",
    "_picture",
    "regimes",
    "layout",
    "_cli_values",
    "_limits",
    "packing",
    "_floors",
    "files._atomic",
    "files._safetensors",
    "files._mapping",
    "files._fixture",
    "files._outputs",
    "files._manifest",
    "files",
    "reference._threads",
    "reference._inputs",
    "reference._recurrent",
    "reference._chunked",
    "reference._states",
    "reference._fused",
    "reference",
    "check._criterion",
    "check._findings",
    "check._misreadings",
    "check._records",
    "check._scan",
    "check._explain",
    "check._compare",
    "check",
    "generate",
    "suites",
    "summary",
    "pytest_plugin",
    "plot",
    "cli",
    "__init__",
    "__main__",
]


#: The one kind of upward edge: a notebook convenience method (``GdnBackwardLayout.plot``,
#: ``Comparison.plot``) that imports the plot module, which builds on its class, when called.
ON_DEMAND = {("layout", "plot"), ("check._records", "plot")}


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_a_module_imports_only_modules_below_it(module: str) -> None:
    # A strict order of the modules means no import cycle, deferred imports included.
    above = LAYERS[LAYERS.index(module) :]
    wrong = [n for n, _ in _imports(module) if n in above and (module, n) not in ON_DEMAND]
    assert not wrong, f"{module} imports {wrong}, which are not below it"


@pytest.mark.parametrize(("module", "target"), sorted(ON_DEMAND))
def test_on_demand_imports_happen_only_inside_a_method(module: str, target: str) -> None:
    top_level = [
        node
        for node in _tree(module).body
        if isinstance(node, ast.ImportFrom)
        and node.level
        and node.module is not None
        and ".".join(
            [*_package_of(module)[: len(_package_of(module)) - node.level + 1], node.module]
        )
        == target
    ]
    assert not top_level, f"{module} imports {target} at load time"
    assert target in {name for name, _ in _imports(module)}, f"{module} no longer needs {target}"


@pytest.mark.parametrize("module", MODULES)
def test_no_private_name_is_imported_from_another_module(module: str) -> None:
    private = [
        f"{source}.{name}"
        for source, names in _imports(module)
        for name in names
        if name.startswith("_") and name != "__version__" and name not in MODULES
    ]
    assert not private


@pytest.mark.parametrize("module", MODULES)
def test_no_private_attribute_of_another_module_or_object(module: str) -> None:
    # `x._name` is allowed on self and cls only (and on namedtuples' own API, `_asdict`).
    tree = _tree(module)
    private = sorted(
        {
            f"{node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.value.id not in ("self", "cls")
            and node.attr not in ("_asdict", "_fields", "_replace", "_make")
        }
    )
    assert not private


TESTS = Path(__file__).resolve().parent

#: The test modules that guard a concern across modules rather than one module's contract.
CONCERNS = {
    "bounded_memory": "compare and inspect's peak memory, in a fresh process",
    "golden": "every layout quantity against the Rust seed's",
    "notebook": "the example notebook in a Jupyter kernel",
    "oracle": "the tests' own long-double oracle",
    "pinned_bytes": "fixture files byte for byte as 0.1.0 wrote them",
    "public_api": "what the public modules export and document",
    "readme": "the examples of README.md and docs/",
    "reference_exact": "the reference against the oracle in every regime",
    "state_checks": "a kernel's parts, from fixture to verdict to command line",
    "structure": "the modules' layering",
    "measured_tables": "the measured tables of docs/ and benchmarks/ against the code",
    "views": "the notebook and terminal views of every record",
}


def test_each_test_module_is_named_after_its_module_or_a_concern() -> None:
    # A newcomer finds the tests of files/_atomic.py in test_atomic.py.
    homes = {module.rsplit(".", 1)[-1].lstrip("_") for module in MODULES}
    tested = {path.stem.removeprefix("test_") for path in TESTS.glob("test_*.py")}
    assert tested - homes <= set(CONCERNS), sorted(tested - homes - set(CONCERNS))
    assert set(CONCERNS) <= tested, sorted(set(CONCERNS) - tested)
    assert not set(CONCERNS) & homes
