"""Draw the pictures README.md shows, into this folder: ``python docs/make_figures.py``.

``heatmap.png`` is ``plot_errors`` of a float32 fixture against a kernel with three bugs: one
wrong element of ``dk``, heads 1 and 2 of ``dv`` swapped from the second chunk of 16 steps on,
and a NaN in ``dbeta``. ``causes.png`` is the signed error of a kernel whose ``dq`` is
``-1/2`` times the truth and whose ``dstate`` is transposed: the ratio one flat colour, the
state's tiles mirrored about their diagonals. Needs ``gdn-layout[plot]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from gdn_layout import GdnBackwardLayout, compare, unpack
from gdn_layout.generate import make_fixture
from gdn_layout.plot import plot_errors

HERE = Path(__file__).resolve().parent


def main(folder: Path = HERE) -> list[Path]:
    """Write the pictures into ``folder``; returns their paths."""
    layout = GdnBackwardLayout(batch=2, seq=48, heads=4, state_size=8)
    fixture = make_fixture(layout, dtype=np.float32, seed=0)
    expected = fixture.packed
    actual = expected.copy()
    grads = unpack(actual, layout)
    grads.dk[1, 37, 2, 5] += 1e-3
    grads.dv[:, 16:, [1, 2]] = grads.dv[:, 16:, [2, 1]]
    grads.dbeta[1, 30, 3] = np.nan
    heatmap = folder / "heatmap.png"
    plot_errors(compare(actual, expected, layout, floors=fixture.floors), chunk=16, path=heatmap)
    return [heatmap, *_causes(folder)]


def _causes(folder: Path) -> list[Path]:
    """``ratio.png``: ``dq`` scaled by -1/2 and heads 1 and 2 of ``dv`` swapped, as ratios;
    ``transpose.png``: a transposed ``dstate``, as its signed error."""
    layout = GdnBackwardLayout(batch=1, seq=48, heads=4, state_size=8, carry_state=True)
    fixture = make_fixture(layout, dtype=np.float32, seed=0)
    actual = fixture.packed.copy()
    grads = unpack(actual, layout)
    grads.dq[...] *= -0.5
    grads.dv[:, :, [1, 2]] = grads.dv[:, :, [2, 1]]
    assert grads.dstate is not None
    grads.dstate[...] = np.swapaxes(grads.dstate, -1, -2).copy()
    report = compare(actual, fixture.packed, layout, floors=fixture.floors)
    ratio, transpose = folder / "ratio.png", folder / "transpose.png"
    plot_errors(report, names=["dq", "dv"], kind="ratio", path=ratio)
    plot_errors(report, names=["dstate"], kind="signed", path=transpose)
    return [ratio, transpose]


if __name__ == "__main__":
    for path in main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"wrote {path}")
