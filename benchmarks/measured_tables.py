"""Measured tables: each a data file written by the script that measures it, shown in the
pages rendered from that file.

A page keeps a rendered table between ``<!-- table: NAME -->`` and ``<!-- /table -->`` (and
a single figure between ``<!-- value: NAME.key -->`` and ``<!-- /value -->``), Markdown
having no include; ``python benchmarks/measured_tables.py`` renders them into the pages again,
as a script's ``--write`` does, and tests/test_measured_tables.py checks that they are. Each
data file is stamped with the version and the settings it was measured at (the standard
suite's case count, `K` per class, the classes, the regimes), and each rendered table says
them: a figure is what was measured then, not a claim about the code now.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Literal, NamedTuple

from gdn_layout import __version__, generate
from gdn_layout._dtypes import PRECISIONS
from gdn_layout.check import K
from gdn_layout.files._atomic import atomic_write
from gdn_layout.regimes import REGIMES

ROOT = Path(__file__).resolve().parents[1]


class Table(NamedTuple):
    """One measured table: where its figures are kept, what writes them, where it is shown."""

    #: The data file, relative to the repository.
    data: str
    #: The command that measures it and writes the data file.
    script: str
    #: The pages that show it, relative to the repository.
    pages: tuple[str, ...]
    #: The rendered table, from the data file's contents.
    render: Callable[[Mapping[str, Any]], str]


def suite_facts() -> dict[str, Any]:
    """What a measurement over the standard suite is measured against, read from the code now:
    its case count (the files ``write_suite`` writes), of which with a per-head gate, of
    which of the first suite's shapes, and `K` per class, the classes, the regimes."""
    cases = list(generate._suite_cases())
    first = {shape.tag for shape in generate._SUITE_SHAPES if shape.since == 0}
    return {
        "cases": len(cases),
        "cases_per_head_gate": sum(not case.layout.gate_per_channel for case in cases),
        "cases_of_the_first_shapes": sum(case.name.split("-")[0] in first for case in cases),
        "K": dict(K),
        "classes": list(PRECISIONS),
        "regimes": list(REGIMES),
    }


def write(name: str, data: Mapping[str, Any], path: Path | None = None) -> Path:
    """Write table ``name``'s data file (or ``path``) whole or not at all, stamped with the
    version and the settings of :func:`suite_facts`; returns the path written."""
    target = ROOT / TABLES[name].data if path is None else path
    content = {"version": __version__, "measured_against": suite_facts(), **data}
    text = json.dumps(content, indent=2, ensure_ascii=False) + "\n"

    def dump(out: IO[bytes]) -> None:
        out.write(text.encode())

    return atomic_write(target, dump, overwrite=True)


def add_write_option(parser: argparse.ArgumentParser, what: str) -> None:
    """A script's ``--write [PATH]``: record ``what`` in its data file (or ``PATH``)."""
    parser.add_argument(
        "--write",
        nargs="?",
        type=Path,
        const=True,
        metavar="PATH",
        help=f"write {what} to its data file (or PATH) and render the pages that show it",
    )


def record(name: str, data: Mapping[str, Any], path: Path | Literal[True]) -> None:
    """``--write``: write table ``name``'s data file (``path``, or its own for True) and
    render every page from the data files, saying what was written."""
    print(f"wrote {write(name, data, None if path is True else path)}")
    for page in render_pages():
        print(f"rendered {page}")


def load(name: str) -> dict[str, Any]:
    """Table ``name``'s data file, as written."""
    data: dict[str, Any] = json.loads((ROOT / TABLES[name].data).read_text())
    return data


def figure(value: float) -> str:
    """Three significant figures, thousands written out: 7.69, 16.5, 8, 2,130."""
    if value >= 1000:
        return f"{float(f'{value:.3g}'):,.0f}"
    return f"{value:.3g}"


def _caught(counts: Mapping[str, list[int]], when: str) -> str:
    return "-" if when not in counts else "{}/{}".format(*counts[when])


#: The bugs of the margins table's last column, in its order.
DROPPED_AT = ("S//2", "t=48", "t=128", "t=256")


def _margins(data: Mapping[str, Any]) -> str:
    rows = [
        "| class (suite) | worst correct kernel | its kernel | least caught bug "
        "| state dropped at S//2, t=48, 128, 256: caught |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in data["classes"].items():
        dropped = ", ".join(_caught(row["state_dropped"], when) for when in DROPPED_AT)
        rows.append(
            f"| {name} ({row['suite']}) | {figure(row['worst_correct'])} | {row['worst_kernel']} "
            f"| {figure(row['least_caught'])} | {dropped} |"
        )
    return "\n".join(rows)


def _margins_brief(data: Mapping[str, Any]) -> str:
    k = data["measured_against"]["K"]
    rows = [
        "| class | worst correct kernel | least caught bug | `K` |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in data["classes"].items():
        rows.append(
            f"| {name} | {figure(row['worst_correct'])} ({row['worst_kernel']}) "
            f"| {figure(row['least_caught'])} | {k[name]:g} |"
        )
    return "\n".join(rows)


def suite_size_lines(data: Mapping[str, Any]) -> list[str]:
    """What ``bench_suite.py`` prints: each suite's files, MiB and seconds, then the ratios
    (of the figures before rounding)."""
    rows = data["rows"]
    lines = [
        f"{label:22s} {r['files']:4d} files  {r['mib']:6.1f} MiB  {r['seconds']:6.2f} s"
        for label, r in rows.items()
    ]
    one = rows["standard suite"]
    ratio = data["ratios"]
    lines.append(
        f"ratio (standard / first)  {ratio['files']:5.2f} files  {ratio['bytes']:6.2f} x bytes  "
        f"{ratio['time']:6.2f} x time"
    )
    lines.append(
        f"targets: {one['mib']:.1f} MiB <= 128 MiB, {one['seconds']:.1f} s <= 60 s, "
        f"one / two processes {ratio['processes']:.2f} >= 1.6"
    )
    return lines


def misreading_lines(data: Mapping[str, Any]) -> list[str]:
    """What ``bench_findings.py``'s misreading panel prints: per reading the cases it applies
    to, those failed, named, offered as the other cause (``or``), and named as another."""
    lines = [
        f"{'reading':28s} {'cases':>5s} {'failed':>6s} {'named':>6s} {'rate':>6s} "
        f"{'or':>6s} {'other':>6s}"
    ]
    for label, c in data["rows"].items():
        rate = c["named"] / c["failed"] if c["failed"] else float("nan")
        lines.append(
            f"{label:28s} {c['cases']:5d} {c['failed']:6d} {c['named']:6d} {rate:6.1%} "
            f"{c['or']:6d} {c['other']:6d}"
        )
    misses = data["misses_by_regime"]
    lines += [
        "",
        f"misreadings neither named nor offered: {sum(misses.values())} (by regime: {misses})",
    ]
    return lines


def _first_run_rows(data: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """Each figure of ``bench_first_run.py``: what it is, the figure, what is beside it, and
    the target with its ratio."""
    suite, fixture, explain, memory = (data[k] for k in ("suite", "fixture", "explain", "memory"))
    one, two, truth = suite["one_process"], suite["two_processes"], suite["truth"]
    shape = "B={} S={} H={} N={}".format(*fixture["shape"])
    rows = [
        (
            f"the standard suite, every class's floors ({suite['cases']} fixtures), one process",
            f"{one:.1f} s",
            f"its truth alone {truth:.1f} s",
            f"<= 8 s ({one / truth:.1f}x its truth)",
        ),
        (
            "the same, two processes (pytest's first run on two cores)",
            f"{two:.1f} s",
            "",
            f"<= 8 s ({two / truth:.1f}x its truth)",
        ),
    ]
    for label, target in (("default class", 3), ("every class", 4)):
        ratio = fixture[label] / fixture["truth"]
        rows.append(
            (
                f"one fixture at {shape}, {label}",
                f"{fixture[label]:.1f} s",
                f"its truth {fixture['truth']:.1f} s",
                f"<= {target}x its truth ({ratio:.1f}x)",
            )
        )
    shape = "B={} S={} H={} N={}".format(*explain["shape"])
    rows.append(
        (
            f"a failing compare nothing explains at {shape}",
            f"{explain['failing']:.2f} s",
            f"a passing one {explain['passing']:.2f} s, the truth {explain['truth']:.2f} s",
            f"<= 3x a passing one ({explain['failing'] / explain['passing']:.1f}x)",
        )
    )
    if memory is not None:
        rows.append(
            (
                f"peak memory of a failing compare, one wrong dstate element at N={memory['N']}",
                f"{memory['failing']:.0f} MiB",
                f"a passing one {memory['passing']:.0f} MiB",
                f"<= the files + 256 MiB = {memory['bound']:.0f} MiB",
            )
        )
    return rows


def first_run_lines(data: Mapping[str, Any]) -> list[str]:
    """What ``bench_first_run.py`` prints: each figure, what is beside it, its target."""
    return [
        f"{what}: {figure} ({beside}); target {target}"
        for what, figure, beside, target in (
            (w, f, b or "-", t) for w, f, b, t in _first_run_rows(data)
        )
    ]


def _first_run(data: Mapping[str, Any]) -> str:
    rows = ["| what a user waits for | now | beside it | target |", "| --- | ---: | --- | --- |"]
    rows += [f"| {w} | {f} | {b} | {t} |" for w, f, b, t in _first_run_rows(data)]
    return "\n".join(rows)


def _misreadings(data: Mapping[str, Any]) -> str:
    return "\n".join(["```", *misreading_lines(data), "```"])


def _suite_size(data: Mapping[str, Any]) -> str:
    return "\n".join(["```", *suite_size_lines(data), "```"])


_CALIBRATE = "python benchmarks/calibrate_tolerances.py --write"
TABLES: dict[str, Table] = {
    "margins": Table("docs/tables/margins.json", _CALIBRATE, ("docs/criterion.md",), _margins),
    "margins_brief": Table(
        "docs/tables/margins.json",
        _CALIBRATE,
        ("benchmarks/README.md",),
        _margins_brief,
    ),
    **{
        f"misreadings_{dtype}": Table(
            f"benchmarks/results/misreadings_{dtype}.json",
            f"python benchmarks/bench_findings.py --dtype {dtype} --write",
            ("benchmarks/README.md",),
            _misreadings,
        )
        for dtype in ("float32", "bfloat16")
    },
    "first_run": Table(
        "benchmarks/results/first_run.json",
        "python benchmarks/bench_first_run.py --write",
        ("README.md", "benchmarks/README.md"),
        _first_run,
    ),
    "suite_size": Table(
        "benchmarks/results/suite_size.json",
        "python benchmarks/bench_suite.py --write",
        ("benchmarks/README.md",),
        _suite_size,
    ),
}

#: A table's block: its body never runs into the next block's marker.
_BLOCK = re.compile(r"<!-- table: (\w+) -->\n((?:(?!<!-- table: ).)*?)\n<!-- /table -->", re.DOTALL)
_VALUE = re.compile(r"<!-- value: (\w+)\.([\w.]+) -->(.*?)<!-- /value -->")


def blocks(text: str) -> dict[str, str]:
    """A page's rendered tables by name."""
    return dict(_BLOCK.findall(text))


def values(text: str) -> list[tuple[str, str, str]]:
    """A page's single figures: (table, key path, the text shown)."""
    return _VALUE.findall(text)


def lookup(data: Mapping[str, Any], path: str) -> Any:
    """``data``'s value at a dotted key path (``measured_against.cases``)."""
    value: Any = data
    for key in path.split("."):
        value = value[key]
    return value


def shown(value: object) -> str:
    """A single figure as a page shows it."""
    return figure(value) if isinstance(value, float) else str(value)


def stamp(data: Mapping[str, Any]) -> str:
    """The line under a rendered table: the version and settings it was measured at."""
    facts = data["measured_against"]
    k = ", ".join(f"{name} {value:g}" for name, value in facts["K"].items())
    return (
        f"Measured with gdn-layout {data['version']} over a suite of {facts['cases']} cases "
        f"(`K`: {k})."
    )


def rendered(name: str) -> str:
    """Table ``name`` rendered from its data file, with its stamp."""
    data = load(name)
    return f"{TABLES[name].render(data)}\n\n{stamp(data)}"


def rendered_page(path: Path) -> str:
    """The page at ``path`` with every table and figure it shows rendered from its data file."""
    text = path.read_text()
    text = _BLOCK.sub(
        lambda m: f"<!-- table: {m[1]} -->\n{rendered(m[1])}\n<!-- /table -->",
        text,
    )
    return _VALUE.sub(
        lambda m: f"<!-- value: {m[1]}.{m[2]} -->{shown(lookup(load(m[1]), m[2]))}<!-- /value -->",
        text,
    )


def render_pages() -> list[Path]:
    """Render every page's tables and figures from the data files; returns the pages changed."""
    changed = []
    for page in sorted({page for table in TABLES.values() for page in table.pages}):
        path = ROOT / page
        text = rendered_page(path)
        if text != path.read_text():
            path.write_text(text)
            changed.append(path)
    return changed


if __name__ == "__main__":
    for page in render_pages():
        print(f"rendered {page}")
