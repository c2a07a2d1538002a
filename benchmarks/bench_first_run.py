"""What a user waits for on a first run, each figure beside the float64 truth of the same run.

* **suite**: the standard suite with every class's floors, written in one process and in two
  (as pytest's first run writes it on two cores: a process per core), beside the truth
  alone: the same fixtures without floors (``make_fixture(calibrate=False)``: the inputs, the
  float64 forward and backward, the casts), nothing written.
* **fixture**: ``make_fixture`` at B=1, S=4096, H=16, N=128 (carried state, float32), its
  default class and every class, over the float64 backward of its inputs (the truth): three
  runs of each, alternating, the best of each.
* **explain**: a failing ``compare`` that nothing explains (noise of 1e-3 of each gradient's
  RMS added to ``dk`` and ``dg``) at B=2, S=1024, H=8, N=128 against a fixture, over a passing
  one at the same shape (the reference in float32), with the truth of that shape beside.
* **memory**: the peak RSS of ``gdn-layout compare`` in a fresh process, one wrong ``dstate``
  element at N=4096 (two 64 MiB raw files), and the same files equal, beside docs/memory.md's
  bound (the files plus 256 MiB).

Targets (issue "The first run in seconds"): suite <= 8 s; fixture <= 3x its truth, every class
<= 4x; failing compare <= 3x a passing one; every compare within the memory bound. One BLAS
thread throughout.

    python benchmarks/bench_first_run.py [--quick] [--write [PATH]]

``--write`` writes what it prints to benchmarks/results/first_run.json (or ``PATH``), which
README.md and benchmarks/README.md show (see ``measured_tables.py``).
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # one core, before NumPy starts its thread pool

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

import gdn_layout.generate as generate  # noqa: E402
import measured_tables as tables  # noqa: E402
from gdn_layout import GdnBackwardLayout, compare, make_fixture, unpack  # noqa: E402
from gdn_layout.reference import backward  # noqa: E402

MiB = 1 << 20


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def suite(quick: bool) -> dict[str, Any]:
    """Seconds: the suite written in one process and in two, and its truth alone."""
    cases = list(generate._suite_cases())
    if quick:
        cases = cases[::8]
    start = time.perf_counter()
    for index, case in enumerate(cases):
        make_fixture(case.layout, regime=case.regime, seed=index, calibrate=False)
    truth = time.perf_counter() - start
    full = generate._suite_cases
    times = {}
    setattr(generate, "_suite_cases", lambda regimes=None: iter(cases))  # noqa: B010
    try:
        for workers in (1, 2):
            with tempfile.TemporaryDirectory() as folder:
                times[("one_process", "two_processes")[workers - 1]] = _timed(
                    lambda: generate.write_suite(Path(folder) / "s", workers=workers)  # noqa: B023
                )
    finally:
        setattr(generate, "_suite_cases", full)  # noqa: B010
    return {"cases": len(cases), "truth": truth, **times}


def _truth(layout: GdnBackwardLayout, x: Any) -> float:
    wide: list[Any] = [None if a is None else a.astype(np.float64) for a in x]
    return _timed(lambda: backward(*wide, dtype=np.float64))


def fixture(quick: bool) -> dict[str, Any]:
    """Seconds: the truth, the fixture in its default class and in every class (best of 3)."""
    shape = (1, 512, 4, 32) if quick else (1, 4096, 16, 128)
    layout = GdnBackwardLayout(*shape, carry_state=True)
    make_fixture(GdnBackwardLayout(1, 8, 2, 4, carry_state=True))  # warm-up
    x = generate.draw_inputs(layout, dtype=np.float32)
    best = dict.fromkeys(("truth", "default class", "every class"), float("inf"))
    for _ in range(3):  # alternating, the best of each: the machine may be shared
        best["truth"] = min(best["truth"], _truth(layout, x))
        best["default class"] = min(best["default class"], _timed(lambda: make_fixture(layout)))
        every = _timed(lambda: make_fixture(layout, precisions="all"))
        best["every class"] = min(best["every class"], every)
    return {"shape": list(shape), **best}


def explain(quick: bool) -> dict[str, Any]:
    """Seconds: a passing and a failing compare against a fixture (best of two each), and the
    truth of the shape."""
    shape = (1, 128, 2, 32) if quick else (2, 1024, 8, 128)
    layout = GdnBackwardLayout(*shape, carry_state=True)
    fx = make_fixture(layout)
    passing = backward(*fx.inputs, dtype=np.float32)
    failing = passing.copy()
    rng = np.random.default_rng(1)
    for name in ("dk", "dg"):
        grad = getattr(unpack(failing, layout), name)
        rms = float(np.sqrt(np.mean(np.square(grad, dtype=np.float64))))
        grad += (1e-3 * rms * rng.standard_normal(grad.shape)).astype(grad.dtype)
    assert compare(passing, fx).passed
    assert not compare(failing, fx).passed
    times = {
        "passing": min(_timed(lambda: compare(passing, fx)) for _ in range(2)),
        "failing": min(_timed(lambda: compare(failing, fx)) for _ in range(2)),
    }
    return {"shape": list(shape), "truth": _truth(layout, fx.inputs), **times}


_PEAK = """
import json, sys
from gdn_layout.cli import main
code = main(json.loads(sys.argv[1]))
status = open("/proc/self/status").read()
peak = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
print("PEAK", int(peak.split()[1]) * 1024, "EXIT", code, file=sys.stderr)
"""


def memory(quick: bool) -> dict[str, float] | None:
    """MiB: the peak RSS of a passing and a failing ``gdn-layout compare`` of two raw files,
    each in a fresh process, and the bound; None where /proc/self/status is not read."""
    if not sys.platform.startswith("linux"):
        return None
    n = 1024 if quick else 4096
    layout = GdnBackwardLayout(1, 1, 1, n, carry_state=True)
    nbytes = layout.nbytes(np.float32)
    flags = ["--dtype", "float32", "-B", "1", "-S", "1", "-H", "1", "-N", str(n), "--carry-state"]
    peaks = {}
    with tempfile.TemporaryDirectory() as folder:
        actual, expected = Path(folder) / "actual.bin", Path(folder) / "expected.bin"
        for path in (actual, expected):
            with open(path, "wb") as file:
                file.truncate(nbytes)  # zeros, sparse
        for label in ("passing", "failing"):
            if label == "failing":  # dstate[0, 0, 5, 7] = 1
                with open(actual, "r+b") as file:
                    file.seek(4 * (layout.segment("dstate").offset + 5 * n + 7))
                    file.write(np.float32(1.0).tobytes())
            argv = ["compare", str(actual), str(expected), *flags]
            done = subprocess.run(
                [sys.executable, "-c", _PEAK, json.dumps(argv)],
                capture_output=True,
                text=True,
                check=False,
            )
            words = done.stderr.split()
            peaks[label] = int(words[words.index("PEAK") + 1]) / MiB
    return {"N": n, "files": 2 * nbytes / MiB, "bound": (2 * nbytes + 256 * MiB) / MiB, **peaks}


def first_run_data(figures: dict[str, Any]) -> dict[str, Any]:
    """The data file: each section's figures, seconds and MiB to four decimals."""

    def rounded(section: dict[str, Any]) -> dict[str, Any]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in section.items()}

    return {
        "date": datetime.date.today().isoformat(),
        "cases": figures["suite"]["cases"],
        **{
            name: None if section is None else rounded(section) for name, section in figures.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, every 8th case")
    tables.add_write_option(parser, "the figures")
    args = parser.parse_args()
    figures = {
        "suite": suite(args.quick),
        "fixture": fixture(args.quick),
        "explain": explain(args.quick),
        "memory": memory(args.quick),
    }
    data = first_run_data(figures)
    print("\n".join(tables.first_run_lines(data)))
    if args.write is not None:
        if args.quick:
            sys.exit("--write records the full run only: drop --quick")
        tables.record("first_run", data, args.write)


if __name__ == "__main__":
    main()
