"""Time the reference backward and a fixture at the sizes users wait on.

* **backward**: :func:`gdn_layout.reference.backward` at B=1, S=4096, H=16, N=128 in float64
  and float32, per-head and per-channel gate, carried state, ``workers=1`` and ``workers=2``:
  the best of several runs, interleaved so that a load from elsewhere on a shared machine
  falls on every configuration alike.
* **fixture**: :func:`gdn_layout.make_fixture` (float32, carried state, its default class) at
  the same size, over the float64 backward alone (the fixture's truth).
* ``--sampled`` only: how far the floors' step-by-step figures on a sample of rows and heads
  fall below those of the whole run (docs/criterion.md).

Every process runs with one BLAS thread (``OPENBLAS_NUM_THREADS`` and the like set to 1).
Run: ``python benchmarks/bench_reference.py`` (``--quick``: S=512, H=4, N=64).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"

import numpy as np  # noqa: E402

from gdn_layout import GdnBackwardLayout, draw_inputs, make_fixture  # noqa: E402
from gdn_layout.reference import backward  # noqa: E402


def _best(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """The best wall time of each run, the runs interleaved round after round."""
    best = dict.fromkeys(runs, math.inf)
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def backward_times(shape: tuple[int, int, int, int], repeats: int) -> None:
    runs: dict[str, Callable[[], Any]] = {}
    for per_channel in (False, True):
        layout = GdnBackwardLayout(*shape, gate_per_channel=per_channel, carry_state=True)
        x = draw_inputs(layout, regime="mixed", seed=0, dtype=np.float64)
        for dtype in ("float64", "float32"):
            for workers in (1, 2):
                name = f"{'per channel' if per_channel else 'per head':11s} {dtype} w={workers}"
                runs[name] = functools.partial(backward, *x, dtype=dtype, workers=workers)
    backward(*draw_inputs(GdnBackwardLayout(1, 8, 2, 4), seed=0))  # warm-up
    print(f"backward, B={shape[0]} S={shape[1]} H={shape[2]} N={shape[3]}, best of {repeats}:")
    for name, seconds in _best(runs, repeats).items():
        print(f"  {name}: {seconds:.3f} s")


def fixture_time(shape: tuple[int, int, int, int], repeats: int) -> None:
    layout = GdnBackwardLayout(*shape, carry_state=True)
    wide: Any = [None if a is None else a.astype(np.float64) for a in draw_inputs(layout)]
    make_fixture(GdnBackwardLayout(1, 8, 2, 4, carry_state=True))  # warm-up
    runs = {"fixture": lambda: make_fixture(layout), "truth": lambda: backward(*wide)}
    best = _best(runs, repeats)
    print(
        f"fixture (float32), B={shape[0]} S={shape[1]} H={shape[2]} N={shape[3]}: "
        f"{best['fixture']:.2f} s, truth {best['truth']:.2f} s, "
        f"ratio {best['fixture'] / best['truth']:.2f}"
    )


def sampled_margin(shapes: list[tuple[int, int, int, int]], seed: int = 3) -> tuple[float, float]:
    """What the floors' step-by-step form on a sample of rows and heads
    (``_floors.sampled_pairs``, ``_floors.Sample``) does to the floors of every class: for
    every shape, gate regime and mode, tensor and figure, the floors with the sample against
    those of the whole run, from the same runs. The lowest ratio is to be at least 1 (no floor
    lowered); the highest says how far ``_floors.SAMPLE_MARGIN`` raises a floor."""
    from gdn_layout import reference
    from gdn_layout._floors import (
        CHUNKED_RUNS,
        PANEL,
        SAMPLE_MARGIN,
        Sample,
        _picked,
        panel_floors,
        sampled_pairs,
        tensors_by_name,
    )
    from gdn_layout.files import GdnInputs
    from gdn_layout.generate import draw_inputs, reference_outputs
    from gdn_layout.reference._fused import fused_backward
    from gdn_layout.reference._states import step_by_step
    from gdn_layout.regimes import REGIMES

    classes = tuple(PANEL)
    lowest, highest = math.inf, 0.0
    for batch, seq, heads, size in shapes:
        for per_channel in (False, True):
            layout = GdnBackwardLayout(
                batch, seq, heads, size, gate_per_channel=per_channel, carry_state=True
            )
            pairs = sampled_pairs(layout)
            assert pairs is not None, layout
            for regime in REGIMES:
                x = draw_inputs(layout, regime=regime, seed=seed)
                wide = GdnInputs._make(None if a is None else a.astype(np.float64) for a in x)
                truth = tensors_by_name(
                    reference.backward(*wide), reference_outputs(wide, None), layout
                )
                runs = {"step-by-step": tensors_by_name(*step_by_step(*x), layout)}
                for form, bits in CHUNKED_RUNS.items():
                    runs[form] = tensors_by_name(*fused_backward(*x, bits=bits)[:2], layout)
                whole = panel_floors(runs, truth, None, classes)
                # a run on the sample alone gives the whole run's values there, bit for bit
                step = {n: np.asarray(a) for n, a in runs.pop("step-by-step").items()}
                on = {
                    form: {n: _picked(n, np.asarray(run[n]), layout, pairs) for n in truth}
                    for form, run in {**runs, "step-by-step": step}.items()
                }
                there = {n: _picked(n, a, layout, pairs) for n, a in truth.items()}
                sample = Sample("step-by-step", there, on)
                sampled = panel_floors(runs, truth, None, classes, sample)
                ratios = [
                    sampled[c][n][i] / whole[c][n][i]
                    for c in classes
                    for n in truth
                    for i in (0, 1)
                    if whole[c][n][i] > 0
                ]
                lowest, highest = min(lowest, *ratios), max(highest, *ratios)
                print(
                    f"{batch}x{seq}x{heads}x{size} {'channel' if per_channel else 'scalar':7s} "
                    f"{regime:8s}: sampled floors {min(ratios):.2f} to {max(ratios):.2f}x the "
                    "whole run's",
                    flush=True,
                )
    print(
        f"sampled floors (the estimate {SAMPLE_MARGIN:g}x over) {lowest:.2f} to "
        f"{highest:.2f}x the whole run's"
    )
    return lowest, highest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small configuration")
    parser.add_argument(
        "--sampled",
        action="store_true",
        help="only how far the floors' sampled step-by-step figures fall below the whole run's",
    )
    args = parser.parse_args()
    if args.sampled:
        shapes = [(1, 512, 16, 64)] if args.quick else [(1, 512, 16, 64), (1, 4096, 16, 128)]
        sampled_margin(shapes)
        return 0
    shape = (1, 512, 4, 64) if args.quick else (1, 4096, 16, 128)
    print(f"numpy {np.__version__}; one BLAS thread")
    backward_times(shape, 2 if args.quick else 3)
    fixture_time(shape, 1 if args.quick else 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
