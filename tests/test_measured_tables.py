"""The measured tables the pages show (benchmarks/measured_tables.py): each page shows its
data files rendered, stamped with the version and settings they were measured at. The figures
are what a benchmark measured, so nothing here compares them with the code's constants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import measured_tables
from gdn_layout import __version__

ROOT = measured_tables.ROOT
TABLES = measured_tables.TABLES
SHOWN = [(name, page) for name, table in TABLES.items() for page in table.pages]
PAGES = sorted({page for _, page in SHOWN})
RENDER = "python benchmarks/measured_tables.py"


@pytest.mark.parametrize(("name", "page"), SHOWN)
def test_each_page_shows_its_table_as_its_data_file_renders_it(name: str, page: str) -> None:
    table = TABLES[name]
    shown = measured_tables.blocks((ROOT / page).read_text())
    assert name in shown, f"{page} does not show table {name}: run {RENDER}"
    assert shown[name] == measured_tables.rendered(name), (
        f"{page}: table {name} is not {table.data} rendered: run {RENDER} "
        f"(or {table.script} to measure it again)"
    )


@pytest.mark.parametrize("page", PAGES)
def test_every_table_a_page_marks_is_one_it_should_show(page: str) -> None:
    marked = set(measured_tables.blocks((ROOT / page).read_text()))
    assert marked == {name for name, shown_in in SHOWN if shown_in == page}


@pytest.mark.parametrize("page", PAGES)
def test_each_figure_in_the_text_is_its_data_file_s(page: str) -> None:
    figures = measured_tables.values((ROOT / page).read_text())
    assert figures
    for name, key, text in figures:
        value = measured_tables.lookup(measured_tables.load(name), key)
        assert text == measured_tables.shown(value), f"{page}: {name}.{key}: run {RENDER}"
    assert measured_tables.rendered_page(ROOT / page) == (ROOT / page).read_text()


@pytest.mark.parametrize("name", list(TABLES))
def test_each_table_is_shown_with_its_stamp(name: str) -> None:
    data = measured_tables.load(name)
    stamp = measured_tables.stamp(data)
    assert stamp.startswith(f"Measured with gdn-layout {data['version']} over a suite of ")
    for page in TABLES[name].pages:
        assert measured_tables.blocks((ROOT / page).read_text())[name].endswith(f"\n\n{stamp}")


def test_the_pages_render_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """render_pages rewrites a page whose table or figure is not its data file's, and only
    that page."""
    for page in PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text((ROOT / page).read_text())
    for table in TABLES.values():
        (tmp_path / table.data).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / table.data).write_text((ROOT / table.data).read_text())
    monkeypatch.setattr(measured_tables, "ROOT", tmp_path)
    assert measured_tables.render_pages() == []
    changed = tmp_path / TABLES["margins"].pages[0]
    changed.write_text(changed.read_text().replace("| 7.69 |", "| 7.7 |").replace(">264<", ">265<"))
    assert measured_tables.render_pages() == [changed]
    assert changed.read_text() == (ROOT / TABLES["margins"].pages[0]).read_text()


def test_write_stamps_the_version_and_settings_and_replaces_whole(tmp_path: Path) -> None:
    path = tmp_path / "margins.json"
    path.write_text("{}")
    data = {"classes": {"float32": {"worst_correct": 1.5}}}
    assert measured_tables.write("margins", data, path) == path
    assert json.loads(path.read_text()) == {
        "version": __version__,
        "measured_against": measured_tables.suite_facts(),
        **data,
    }
    with pytest.raises(TypeError):  # not JSON: nothing written
        measured_tables.write("margins", {"classes": object()}, path)
    assert json.loads(path.read_text())["classes"] == data["classes"]
    assert [p.name for p in tmp_path.iterdir()] == ["margins.json"]


@pytest.mark.parametrize(
    ("value", "text"),
    [(7.69, "7.69"), (16.5, "16.5"), (8.0, "8"), (8.123, "8.12"), (2134.0, "2,130")],
)
def test_figure(value: float, text: str) -> None:
    assert measured_tables.figure(value) == text
