"""The public surface: what each public module exports exists, and each public function and
class points to its neighbours in a numpydoc ``See Also`` section whose names resolve."""

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
    if match is None:
        return []
    names: list[str] = []
    for line in match.group(1).splitlines():
        if line and not line.startswith(" "):
            names += [n.strip() for n in line.split(" : ")[0].split(",")]
    return names


def _resolve(ref: str) -> object:
    """A See Also name as a reader resolves it: from ``gdn_layout``, or a dotted path in it."""
    target: object = gdn_layout
    for part in ref.split("."):
        if (
            isinstance(target, ModuleType)
            and hasattr(target, "__path__")
            and not hasattr(target, part)
        ):
            importlib.import_module(f"{target.__name__}.{part}")
        target = getattr(target, part)
    return target


def test_the_public_modules_are_found() -> None:
    assert {"gdn_layout", "gdn_layout.check", "gdn_layout.files", "gdn_layout.reference"} <= set(
        PUBLIC_MODULES
    )
    assert not any("._" in module for module in PUBLIC_MODULES)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_name_a_public_module_exports_exists(module: str) -> None:
    missing = [name for name, obj in _exports(module) if obj is None]
    assert missing == []
    namespace: dict[str, object] = {}
    exec(f"from {module} import *", namespace)  # the star import a user writes
    assert set(getattr(importlib.import_module(module), "__all__", [])) <= set(namespace)


@pytest.mark.parametrize("name", gdn_layout.__all__)
def test_a_top_level_name_is_its_home_module_s(name: str) -> None:
    obj = getattr(gdn_layout, name)
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return
    homes = [
        module
        for module in PUBLIC_MODULES
        if module != "gdn_layout"
        and getattr(importlib.import_module(module), name, None) is obj
        and name in importlib.import_module(module).__all__
    ]
    assert len(homes) == 1, homes


def test_every_public_function_and_class_is_reached() -> None:
    assert len(DOCUMENTED) >= 40
    assert "gdn_layout.packing.pack" in DOCUMENTED
    assert "gdn_layout.check.Finding" in DOCUMENTED


@pytest.mark.parametrize("qualname", sorted(DOCUMENTED))
def test_a_public_docstring_has_a_see_also_whose_names_resolve(qualname: str) -> None:
    obj = DOCUMENTED[qualname]
    doc = inspect.getdoc(obj) or ""
    names = _see_also(doc)
    assert names, f"{qualname} has no See Also section"
    for ref in names:
        assert not any(part.startswith("_") for part in ref.split(".")), ref
        assert _resolve(ref) is not obj, f"{qualname} sees itself as {ref}"


@pytest.mark.parametrize("qualname", sorted(DOCUMENTED))
def test_see_also_comes_before_notes_and_examples(qualname: str) -> None:
    """numpydoc's order, so that renderers put each section where a reader expects it."""
    doc = inspect.getdoc(DOCUMENTED[qualname]) or ""
    heads = re.findall(r"^(\w[\w ]*)\n-{3,}$", doc, re.M)
    later = [
        h
        for h in heads[heads.index("See Also") + 1 :]
        if h not in ("Notes", "References", "Examples")
    ]
    assert later == [], heads
    if ">>>" in doc:
        assert doc.index(">>>") > doc.index("See Also"), "an example before See Also"


def test_see_also_parsing() -> None:
    doc = "Summary.\n\nSee Also\n--------\nempty, zeros : A buffer.\n    more text\nunpack : x\n"
    assert _see_also(doc) == ["empty", "zeros", "unpack"]
    assert _see_also("Summary.") == []
    with pytest.raises(AttributeError):
        _resolve("layout.no_such_name")
