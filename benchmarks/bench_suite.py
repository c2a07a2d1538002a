"""The standard suite's size and generation time, against the first suite's shapes.

Writes the float32 standard suite in one process and in two (``workers=2``, runs alternating),
then the first suite's 168 cases (its seven shapes before the chunk-boundary ones were added)
in one, and prints each one's file count, bytes and best time, and the ratios. Targets: the
whole suite under 128 MiB and 60 s, and two processes at least 1.6x faster than one.

    python benchmarks/bench_suite.py [--repeat N]
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # one core, before NumPy starts its thread pool

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import gdn_layout.generate as generate  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="best of this many runs (2)")
    repeat = parser.parse_args().repeat
    first = tuple(c for c in generate._SUITE_SHAPES if c.since == 0)
    one, two = _measure(generate._SUITE_SHAPES, repeat, workers=(1, 2))
    rows = {
        "standard suite": one,
        "standard, workers=2": two,
        "first suite's shapes": _measure(first, repeat)[0],
    }
    for label, (files, size, seconds) in rows.items():
        print(f"{label:22s} {files:4d} files  {size / 2**20:6.1f} MiB  {seconds:6.2f} s")
    (f1, s1, t1), (_, _, t2), (f0, s0, t0) = rows.values()
    print(
        f"ratio (standard / first)  {f1 / f0:5.2f} files  {s1 / s0:6.2f} x bytes  "
        f"{t1 / t0:6.2f} x time"
    )
    print(
        f"targets: {s1 / 2**20:.1f} MiB <= 128 MiB, {t1:.1f} s <= 60 s, "
        f"one / two processes {t1 / t2:.2f} >= 1.6"
    )


if __name__ == "__main__":
    main()
