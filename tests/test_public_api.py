"""The public surface: what each public module exports exists, has one home, and is documented;
the names a numpydoc ``See Also`` section lists resolve."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

import gdn_layout

PACKAGE = Path(gdn_layout.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("gdn_layout", *parts)).removesuffix(".__init__")


PUBLIC_MODULES = sorted(
    name
    for name in map(_module_name, PACKAGE.rglob("*.py"))
    if not any(part.startswith("_") for part in name.split("."))
)


def _exports(module: str) -> list[tuple[str, object]]:
    mod = importlib.import_module(module)
    return [(name, getattr(mod, name, None)) for name in getattr(mod, "__all__", [])]


def _documented() -> dict[str, object]:
    """Every public function and class, once, under the public module it is exported from."""
    found: dict[int, tuple[str, object]] = {}
    for module in sorted(PUBLIC_MODULES, key=lambda m: m == "gdn_layout"):  # homes first
        for name, obj in _exports(module):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and id(obj) not in found:
                found[id(obj)] = (f"{module}.{name}", obj)
    return dict(found.values())


DOCUMENTED = _documented()


def _see_also(doc: str) -> list[str]:
    """The names a numpydoc ``See Also`` section lists (``a, b : text`` lists two)."""
    match = re.search(r"^See Also\n-{8}\n(.*?)(?:\n\n|\Z)", doc, re.M | re.S)
    lines = match.group(1).splitlines() if match else []
    return [n.strip() for line in lines if line[:1] != " " for n in line.split(" : ")[0].split(",")]


def _resolve(ref: str) -> object:
    """A See Also name as a reader resolves it: from ``gdn_layout``, or a dotted path in it."""
    target: object = gdn_layout
    for part in ref.split("."):
        if isinstance(target, ModuleType) and not hasattr(target, part):
            importlib.import_module(f"{target.__name__}.{part}")  # a subpackage's module
        target = getattr(target, part)
    return target


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_name_a_public_module_exports_exists(module: str) -> None:
    assert [name for name, obj in _exports(module) if obj is None] == []
    namespace: dict[str, object] = {}
    exec(f"from {module} import *", namespace)  # the star import a user writes
    assert set(getattr(importlib.import_module(module), "__all__", [])) <= set(namespace)


@pytest.mark.parametrize("name", gdn_layout.__all__)
def test_a_top_level_name_is_its_home_module_s(name: str) -> None:
    obj = getattr(gdn_layout, name)
    if inspect.isfunction(obj) or inspect.isclass(obj):
        homes = [
            module
            for module in PUBLIC_MODULES
            if module != "gdn_layout" and (name, obj) in _exports(module)
        ]
        assert len(homes) == 1, homes


def test_the_public_modules_and_names_are_found() -> None:
    assert {"gdn_layout", "gdn_layout.check", "gdn_layout.plot", "gdn_layout.packing"} <= set(
        PUBLIC_MODULES
    )
    assert not any("._" in module for module in PUBLIC_MODULES)
    assert {"gdn_layout.packing.pack", "gdn_layout.check.Finding"} <= set(DOCUMENTED)
    assert _see_also("S.\n\nSee Also\n--------\nempty, zeros : A.\n    more\nunpack : x\n") == [
        "empty",
        "zeros",
        "unpack",
    ]


@pytest.mark.parametrize("qualname", sorted(DOCUMENTED))
def test_a_public_name_is_documented_and_its_see_also_resolves(qualname: str) -> None:
    obj = DOCUMENTED[qualname]
    doc = inspect.getdoc(obj) or ""
    assert doc.strip(), f"{qualname} has no docstring"
    for ref in _see_also(doc):
        assert not any(part.startswith("_") for part in ref.split(".")), ref
        assert _resolve(ref) is not obj, f"{qualname} sees itself as {ref}"
