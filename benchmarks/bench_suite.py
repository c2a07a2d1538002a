"""The standard suite's size and generation time, against the first suite's shapes.

Writes the float32 standard suite in one process and in two (``workers=2``, runs alternating),
then the first suite's cases (its seven shapes before the chunk-boundary ones were added)
in one, and prints each one's file count, bytes and best time, and the ratios. Targets: the
whole suite under 128 MiB and 60 s, and two processes at least 1.6x faster than one.

    python benchmarks/bench_suite.py [--repeat N] [--write [PATH]]

``--write`` writes what it prints to benchmarks/results/suite_size.json (or ``PATH``), which
benchmarks/README.md shows (see ``measured_tables.py``).
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # one core, before NumPy starts its thread pool

import argparse  # noqa: E402
import datetime  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import gdn_layout.generate as generate  # noqa: E402
import measured_tables as tables  # noqa: E402
from gdn_layout.generate import write_suite  # noqa: E402


def _measure(
    shapes: tuple[object, ...], repeat: int, workers: tuple[int, ...] = (1,)
) -> list[tuple[int, int, float]]:
    """Files, bytes and the best time of writing the suite with ``shapes``, for each of
    ``workers``, their runs alternating."""
    full = generate._SUITE_SHAPES
    setattr(generate, "_SUITE_SHAPES", shapes)  # noqa: B010
    try:
        best = dict.fromkeys(workers, float("inf"))
        for _ in range(repeat):
            for count in workers:
                with tempfile.TemporaryDirectory() as folder:
                    start = time.perf_counter()
                    paths = write_suite(Path(folder) / "suite", workers=count)
                    best[count] = min(best[count], time.perf_counter() - start)
                    size = sum(p.stat().st_size for p in paths)
                    size += (Path(folder) / "suite" / "manifest.json").stat().st_size
        return [(len(paths), size, best[count]) for count in workers]
    finally:
        setattr(generate, "_SUITE_SHAPES", full)  # noqa: B010


def suite_size_data(rows: dict[str, tuple[int, int, float]], repeat: int) -> dict[str, Any]:
    """The data file of the measurement: each row's files, MiB and seconds as printed, and the
    ratios of the figures before rounding."""
    (f1, s1, t1), (_, _, t2), (f0, s0, t0) = rows.values()
    return {
        "date": datetime.date.today().isoformat(),
        "repeat": repeat,
        "rows": {
            label: {"files": files, "mib": round(size / 2**20, 1), "seconds": round(seconds, 2)}
            for label, (files, size, seconds) in rows.items()
        },
        "ratios": {
            "files": round(f1 / f0, 2),
            "bytes": round(s1 / s0, 2),
            "time": round(t1 / t0, 2),
            "processes": round(t1 / t2, 2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="best of this many runs (2)")
    tables.add_write_option(parser, "the figures")
    args = parser.parse_args()
    repeat = args.repeat
    first = tuple(c for c in generate._SUITE_SHAPES if c.since == 0)
    one, two = _measure(generate._SUITE_SHAPES, repeat, workers=(1, 2))
    rows = {
        "standard suite": one,
        "standard, workers=2": two,
        "first suite's shapes": _measure(first, repeat)[0],
    }
    data = suite_size_data(rows, repeat)
    print("\n".join(tables.suite_size_lines(data)))
    if args.write is not None:
        tables.record("suite_size", data, args.write)


if __name__ == "__main__":
    main()
