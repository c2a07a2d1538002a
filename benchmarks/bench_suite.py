"""The standard suite's size and generation time, against the first suite's shapes.

Writes the float32 standard suite on one thread, then the first suite's 168 cases (its seven
shapes before the chunk-boundary ones were added) in the same run, and prints each one's file
count, bytes and best time, and the ratios. Targets: the whole suite under 128 MiB and 60 s.

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


def _measure(shapes: tuple[object, ...], repeat: int) -> tuple[int, int, float]:
    """Files, bytes and the best time of writing the suite with ``shapes``."""
    full = generate._SUITE_SHAPES
    setattr(generate, "_SUITE_SHAPES", shapes)  # noqa: B010
    try:
        best = float("inf")
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as folder:
                start = time.perf_counter()
                paths = write_suite(Path(folder) / "suite")
                best = min(best, time.perf_counter() - start)
                size = sum(p.stat().st_size for p in paths)
                size += (Path(folder) / "suite" / "manifest.json").stat().st_size
        return len(paths), size, best
    finally:
        setattr(generate, "_SUITE_SHAPES", full)  # noqa: B010


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="best of this many runs (2)")
    repeat = parser.parse_args().repeat
    first = tuple(c for c in generate._SUITE_SHAPES if c.since == 0)
    rows = {
        "standard suite": _measure(generate._SUITE_SHAPES, repeat),
        "first suite's shapes": _measure(first, repeat),
    }
    for label, (files, size, seconds) in rows.items():
        print(f"{label:22s} {files:4d} files  {size / 2**20:6.1f} MiB  {seconds:6.2f} s")
    (f1, s1, t1), (f0, s0, t0) = rows.values()
    print(
        f"ratio (standard / first)  {f1 / f0:5.2f} files  {s1 / s0:6.2f} x bytes  "
        f"{t1 / t0:6.2f} x time"
    )
    print(f"targets: {s1 / 2**20:.1f} MiB <= 128 MiB, {t1:.1f} s <= 60 s")


if __name__ == "__main__":
    main()
