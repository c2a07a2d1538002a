"""unpack and pack against the NumPy code they replace, timed in one run.

    python benchmarks/bench_packing.py [--quick]

For packed float32 buffers from 1 KiB to 256 MiB it prints, per size, the ratio of each
baseline's time to gdn-layout's (above 1: gdn-layout is faster):

- unpack            vs hand-written slicing + reshape of the same six views;
- pack(out=)        vs the memory-copy floor, two ways: one ``np.copyto`` of a contiguous
                    buffer of the same size into a preallocated one ("vs floor"), and
                    ``np.copyto`` of each gradient into its preallocated slice ("vs copyto
                    each": the same bytes from the same six arrays, with no checks at all);
- pack()            vs ``np.concatenate`` of the raveled gradients.

Targets: unpack >= 0.67 (within 1.5x of hand slicing) at every size, with a time that does not
grow with size; pack(out=) >= 0.9 of the floor's throughput; pack() >= 1.0.

First, the fixed costs on a small (1.3 KiB) buffer, as time ratios (below 1: gdn-layout is
faster): ``pack(out=)`` against the hand-written ``np.concatenate(grads, axis=None, out=out)``
of the same arrays (target: at most 2), and ``unpack`` against hand slicing (at most 1.3).
Each figure is the best of several repeats, interleaved, since the machine is shared.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, pack, unpack

KIB = 1024


def layout_of_size(nbytes: int) -> GdnBackwardLayout:
    """A carried-state, per-head-gate float32 layout of about ``nbytes``, with H=4 and the
    largest power-of-two N (up to 128) whose state takes at most an eighth of the buffer."""
    heads, n = 4, 128
    while n > 1 and heads * n * n * 4 > nbytes // 8:
        n //= 2
    per_step = heads * (3 * n + 2)
    seq = max(1, (nbytes // 4 - heads * n * n) // per_step)
    return GdnBackwardLayout(1, seq, heads, n, carry_state=True)


def best_time(fn: Callable[[], object], number: int, repeat: int) -> float:
    """Best mean seconds per call over ``repeat`` batches of ``number`` calls."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def hand_unpack(flat: NDArray[Any], layout: GdnBackwardLayout) -> list[NDArray[Any]]:
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    q = b * s * h * n
    bsh = b * s * h
    o = 3 * q
    return [
        flat[0:q].reshape(b, s, h, n),
        flat[q : 2 * q].reshape(b, s, h, n),
        flat[2 * q : o].reshape(b, s, h, n),
        flat[o : o + bsh].reshape(b, s, h),
        flat[o + bsh : o + 2 * bsh].reshape(b, s, h),
        flat[o + 2 * bsh :].reshape(b, h, n, n),
    ]


def copy_each(destinations: list[NDArray[Any]], sources: list[NDArray[Any]]) -> None:
    for dst, src in zip(destinations, sources, strict=True):
        np.copyto(dst, src)


def measure(nbytes: int, quick: bool) -> dict[str, float]:
    layout = layout_of_size(nbytes)
    rng = np.random.default_rng(0)
    flat = rng.standard_normal(layout.total_elems, dtype=np.float32)
    grads = [g.copy() for g in unpack(flat, layout) if g is not None]
    out = np.empty_like(flat)
    floor_dst = np.empty_like(flat)
    each_dst = [g for g in unpack(np.empty_like(flat), layout) if g is not None]
    assert np.array_equal(pack(*grads, out=out), flat)

    copies = max(1, min(2000, (64 * 2**20) // nbytes))
    number = copies if not quick else max(1, copies // 10)
    repeat = 5 if not quick else 3
    views = 20000 if not quick else 2000

    timings: dict[str, list[float]] = {}
    candidates: dict[str, tuple[Callable[[], object], int]] = {
        "unpack": (lambda: unpack(flat, layout), views),
        "hand_unpack": (lambda: hand_unpack(flat, layout), views),
        "pack_out": (lambda: pack(*grads, out=out), number),
        "copyto_floor": (lambda: np.copyto(floor_dst, flat), number),
        "copyto_each": (lambda: copy_each(each_dst, grads), number),
        "pack_new": (lambda: pack(*grads), number),
        "concatenate": (lambda: np.concatenate([g.ravel() for g in grads]), number),
    }
    for _ in range(repeat):  # interleave, so that noise hits every candidate alike
        for name, (fn, count) in candidates.items():
            gc.collect()
            timings.setdefault(name, []).append(best_time(fn, count, 1))
    best = {name: min(values) for name, values in timings.items()}
    best["nbytes"] = layout.nbytes(np.float32)
    return best


def fixed_costs(quick: bool) -> tuple[float, float, float, float]:
    """Best microseconds of pack(out=), np.concatenate(out=), unpack and hand slicing on the
    1344-byte buffer of B=1 S=4 H=2 N=8 with a carried state, interleaved."""
    layout = GdnBackwardLayout(1, 4, 2, 8, carry_state=True)
    flat = np.random.default_rng(0).standard_normal(layout.total_elems, dtype=np.float32)
    grads = [g.copy() for g in unpack(flat, layout) if g is not None]
    out = np.empty_like(flat)
    candidates: list[Callable[[], object]] = [
        lambda: pack(*grads, out=out),
        lambda: np.concatenate(grads, axis=None, out=out),
        lambda: unpack(flat, layout),
        lambda: hand_unpack(flat, layout),
    ]
    best = [float("inf")] * len(candidates)
    for _ in range(10 if quick else 60):
        for i, fn in enumerate(candidates):
            best[i] = min(best[i], best_time(fn, 500, 1))
    pack_out, concatenate, unpacked, hand = (t * 1e6 for t in best)
    return pack_out, concatenate, unpacked, hand


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, sizes to 16 MiB")
    args = parser.parse_args()
    top = 16 * 2**20 if args.quick else 256 * 2**20
    sizes = [KIB]
    while sizes[-1] < top:
        sizes.append(sizes[-1] * 4)

    pack_out, concatenate, unpacked, hand = fixed_costs(args.quick)
    print(f"NumPy {np.__version__}; fixed costs on a 1.3 KiB float32 buffer:")
    print(
        f"  pack(out=) {pack_out:.2f} us / np.concatenate(out=) {concatenate:.2f} us = "
        f"{pack_out / concatenate:.2f} (target <= 2)"
    )
    print(
        f"  unpack {unpacked:.2f} us / hand slicing {hand:.2f} us = "
        f"{unpacked / hand:.2f} (target <= 1.3)"
    )
    print()
    print(f"NumPy {np.__version__}; float32; ratio = baseline time / gdn-layout time")
    header = (
        f"{'size':>9} {'unpack us':>9} {'vs hand':>8} {'pack(out=) GB/s':>15} "
        f"{'vs floor':>8} {'vs copyto each':>14} {'pack() us':>10} {'vs concat':>9}"
    )
    print(header)
    for size in sizes:
        r = measure(size, args.quick)
        gbps = r["nbytes"] / r["pack_out"] / 1e9
        print(
            f"{_human(int(r['nbytes'])):>9} {r['unpack'] * 1e6:9.2f} "
            f"{r['hand_unpack'] / r['unpack']:8.2f} {gbps:15.2f} "
            f"{r['copyto_floor'] / r['pack_out']:8.2f} {r['copyto_each'] / r['pack_out']:14.2f} "
            f"{r['pack_new'] * 1e6:10.1f} "
            f"{r['concatenate'] / r['pack_new']:9.2f}"
        )


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}"
        nbytes //= 1024
    return f"{nbytes} TiB"


if __name__ == "__main__":
    main()
