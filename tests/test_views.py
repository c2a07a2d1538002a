"""Terminal and notebook views: the layout table, gradient statistics and the comparison report."""

from __future__ import annotations

from typing import Any

import numpy as np

from gdn_layout import GdnBackwardLayout, compare, unpack, zeros


def _pretty(obj: Any) -> str:
    """What IPython's pretty printer shows: the text ``_repr_pretty_`` gives it."""
    shown: list[str] = []
    printer = type("Printer", (), {"text": lambda self, text: shown.append(text)})()
    obj._repr_pretty_(printer, False)
    return "".join(shown)


def test_layout_views_show_the_table() -> None:
    layout = GdnBackwardLayout(2, 5, 3, 8, carry_state=True)
    text = str(layout)
    assert text.splitlines()[0] == "B=2 S=5 H=3 N=8, per-head gate, carried state; float32"
    assert any(line.split()[:1] == ["dstate"] and "780" in line for line in text.splitlines())
    assert _pretty(layout) == text
    html = layout._repr_html_()
    assert html.startswith("<table")
    assert all(f">{name}<" in html for name in layout.names)
    assert ">1164<" in html


def test_grads_views_show_statistics() -> None:
    _, grads = zeros(GdnBackwardLayout(1, 3, 2, 4), dtype=np.float64)
    grads.dv[0, 1, 1, 2] = 4.0
    grads.dbeta[0, 0, 0] = np.nan
    lines = {line.split()[0]: line.split() for line in str(grads).splitlines()[2:]}
    assert lines["dv"][-4:] == ["0.167", "0.816", "0", "0"]  # mean 4/24, rms sqrt(16/24)
    assert lines["dbeta"][-2:] == ["1", "0"]
    assert "dstate" not in lines
    assert _pretty(grads) == str(grads)
    assert "background:#fdd" in grads._repr_html_()  # the row with a NaN stands out


def test_comparison_views_name_the_failure() -> None:
    layout = GdnBackwardLayout(1, 4, 2, 4, gate_per_channel=True)
    expected = np.linspace(-1, 1, layout.total_elems)
    actual = expected.copy()
    unpack(actual, layout).dg[0, 3, 1, 2] += 0.5
    report = compare(actual, expected, layout)
    assert "FAIL" in str(report)
    assert "[0, 3, 1, 2]" in str(report)
    assert _pretty(report) == str(report)
    assert "FAIL" in report._repr_html_()
