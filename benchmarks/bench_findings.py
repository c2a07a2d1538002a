"""How often compare names an injected bug, and how often it names a bug that is not there.

Writes the float32 standard suite (or reads ``--suite``), and for every case takes a correct
kernel's output, the reference's float32 chunked backward, and injects one bug at a time:

    scale      dq times 2                     transpose  dstate's last two axes exchanged
    heads      dv's heads 0 and 1 exchanged   batch      dk's batch elements 0 and 1 exchanged
    shift      dg written one step late       boundary   no state carried across step S // 2
    axes       dv written as [B, H, S, N]     unwritten  dk all zeros
    nonfinite  one NaN in dq                  layout     dk and dv exchanged in the buffer
    rounding   float32 noise 2**-18 relative on every gradient (about 30 ulp)

Then the misreading panel (with torch installed): every reading of
``gdn_layout.check._misreadings.READINGS`` applied by tests/panel.py's ``misread``, a
step-by-step PyTorch kernel under autograd glued to the op with that reading (not the
reference on transformed inputs), over the same cases: per reading, how many cases it
changed (failed), how often it was named, how often it was offered only as the other cause
of a finding no output can tell from it (``details["or_reading"]``: a ``dg`` a step off under
equal gates, ``dstate``'s rows of zeros under a folded run), and how often another reading
was named instead.

A bug is applied only where it can exist (two heads for a head swap, a state for a transpose,
...) and where it changes the output. Per kind it prints how many cases it was applied to,
how many failed, how often the finding of that kind was named for the bugged gradient (or the
buffer) and how often some other structural kind was named instead. Then, on correct
kernels (the float32 chunked and step-by-step forms, and the float64 truth rounded to float16
and to bfloat16), how many cases fail and how many get a structural finding (anything but
``rounding``), and the time of a comparison with findings over one without, in the same run.

    python benchmarks/bench_findings.py [--suite DIR] [--quick] [--dtype bfloat16] [--write [PATH]]

``--write`` writes the misreading panel to benchmarks/results/misreadings_DTYPE.json (or
``PATH``), which benchmarks/README.md shows (see ``measured_tables.py``).
"""

from __future__ import annotations

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"  # one core, before NumPy starts its thread pool

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from numpy.typing import NDArray  # noqa: E402

import measured_tables as tables  # noqa: E402
from gdn_layout import Case, GdnBackwardLayout, load_suite, unpack, write_suite  # noqa: E402
from gdn_layout.reference import backward  # noqa: E402

#: Relative noise of the rounding injection: about 30 float32 ulp, past the floors' 16.
_NOISE = 2.0**-18

#: Injects a bug into a correct output, in place; returns where a finding should name it (a
#: gradient, "buffer", or "" for any gradient), or None where the bug cannot exist.
Bug = Callable[[Case, NDArray[np.float32]], str | None]


def _scale(case: Case, out: NDArray[np.float32]) -> str | None:
    unpack(out, case.layout).dq[...] *= 2
    return "dq"


def _transpose(case: Case, out: NDArray[np.float32]) -> str | None:
    state = unpack(out, case.layout).dstate
    if state is None or case.layout.state_size < 2:
        return None
    state[...] = np.swapaxes(state, -1, -2).copy()
    return "dstate"


def _heads(case: Case, out: NDArray[np.float32]) -> str | None:
    if case.layout.heads < 2:
        return None
    dv = unpack(out, case.layout).dv
    dv[:, :, [0, 1]] = dv[:, :, [1, 0]]
    return "dv"


def _batch(case: Case, out: NDArray[np.float32]) -> str | None:
    if case.layout.batch < 2:
        return None
    dk = unpack(out, case.layout).dk
    dk[[0, 1]] = dk[[1, 0]]
    return "dk"


def _shift(case: Case, out: NDArray[np.float32]) -> str | None:
    if case.layout.seq < 3:
        return None
    dg = unpack(out, case.layout).dg
    dg[:, 1:] = dg[:, :-1].copy()
    dg[:, 0] = 0
    return "dg"


def _boundary(case: Case, out: NDArray[np.float32]) -> str | None:
    seq = case.layout.seq
    if seq < 8:
        return None
    t0 = seq // 2
    x = case.inputs
    grads = unpack(out, case.layout)
    parts = ((0, t0, x.state), (t0, seq, None))  # the second part starts from a zero state
    for lo, hi, state in parts:
        q, k, v, g, beta, dy = (np.asarray(a)[:, lo:hi] for a in x[:6])
        piece = backward(q, k, v, g, beta, dy, state, dtype=np.float32)
        layout = GdnBackwardLayout.from_inputs(q, g, state)
        pieces = unpack(piece, layout)
        for name in ("dq", "dk", "dv", "dg", "dbeta"):
            getattr(grads, name)[:, lo:hi] = getattr(pieces, name)
        if state is not None and grads.dstate is not None:
            grads.dstate[...] = pieces.dstate
    return ""  # every gradient may name it


def _axes(case: Case, out: NDArray[np.float32]) -> str | None:
    layout = case.layout
    if sum(n > 1 for n in (layout.seq, layout.heads)) < 2:
        return None
    dv = unpack(out, layout).dv
    dv.reshape(-1)[...] = dv.transpose(0, 2, 1, 3).copy().reshape(-1)
    return "dv"


def _unwritten(case: Case, out: NDArray[np.float32]) -> str | None:
    unpack(out, case.layout).dk[...] = 0
    return "dk"


def _nonfinite(case: Case, out: NDArray[np.float32]) -> str | None:
    unpack(out, case.layout).dq[0, case.layout.seq // 2, 0, 0] = np.nan
    return "dq"


def _layout(case: Case, out: NDArray[np.float32]) -> str | None:
    grads = unpack(out, case.layout)
    grads.dk[...], grads.dv[...] = grads.dv.copy(), grads.dk.copy()
    return None if np.array_equal(grads.dk, grads.dv) else "buffer"


def _rounding(case: Case, out: NDArray[np.float32]) -> str | None:
    rng = np.random.default_rng(0)
    out *= (1 + _NOISE * rng.standard_normal(out.size)).astype(np.float32)
    return ""


BUGS: dict[str, Bug] = {
    "scale": _scale,
    "transpose": _transpose,
    "heads": _heads,
    "batch": _batch,
    "shift": _shift,
    "boundary": _boundary,
    "axes": _axes,
    "unwritten": _unwritten,
    "nonfinite": _nonfinite,
    "layout": _layout,
    "rounding": _rounding,
}


def _named(kind: str, where: str, findings: Any) -> tuple[bool, bool]:
    """Whether the finding of ``kind`` was named where the bug is, and whether another
    structural kind was named instead of it."""
    if where == "buffer":
        mine = [f for f in findings if f.gradient is None]
    elif where:
        mine = [f for f in findings if f.gradient == where]
    else:
        mine = list(findings)
    kinds = {f.kind for f in mine}
    other = kinds - {kind, "rounding"}
    return kind in kinds, bool(other) and kind not in kinds


def _correct_outputs(case: Case) -> dict[str, NDArray[Any]]:
    x = case.inputs
    outputs: dict[str, NDArray[Any]] = {
        "float32 chunked": backward(*x, dtype=np.float32),
        "float32 step-by-step": backward(*x, dtype=np.float32, method="recurrent"),
    }
    truth = backward(*x)
    outputs["float16"] = truth.astype(np.float16)
    try:
        import ml_dtypes
    except ImportError:  # the bfloat16 row needs gdn-layout[bfloat16]
        return outputs
    outputs["bfloat16"] = truth.astype(ml_dtypes.bfloat16)
    return outputs


#: Each reading and the variants a port has of it, as ``panel.misread`` takes them.
MISREADINGS = (
    ("state_transposed", ""),
    ("gate_as_decay", ""),
    ("gate_exp_twice", ""),
    ("gate_shift", ""),
    ("gate_shift", "early"),
    ("gate_axis", ""),
    ("g_beta_swapped", ""),
    ("beta_missing", ""),
    ("beta_missing", "dv"),
    ("qk_normalized", ""),
    ("qk_swapped", ""),
    ("final_state_cotangent", ""),
    ("scale", "1"),
    ("scale", "1/N"),
    ("scale", "128"),
    ("batch_folded", ""),
)


def misreading_panel(cases: list[Case]) -> dict[str, Any] | None:
    """Per reading: cases it failed, how often named, how often another reading instead.
    Prints the table and returns its data (None without torch)."""
    import sys

    try:
        import torch  # noqa: F401
    except ImportError:
        print("\nmisreading panel: needs torch (pip install torch)")
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import panel
    from gdn_layout.check._misreadings import READINGS

    applies = {r.name: r.applies for r in READINGS}
    rows: dict[str, dict[str, int]] = {}
    misses: list[str] = []
    for reading, variant in MISREADINGS:
        counts = dict.fromkeys(("cases", "failed", "named", "or", "other"), 0)
        for case in cases:
            layout = case.layout
            if not applies[reading](layout) or layout.seq < 2 or layout.state_size < 2:
                continue
            counts["cases"] += 1
            result = case.compare(panel.misread(case.fixture, reading, variant))
            if result.passed:
                continue
            counts["failed"] += 1
            named = [f.details["reading"] for f in result.findings if f.kind == "misreading"]
            offered = {f.details.get("or_reading") for f in result.findings}
            counts["named"] += reading in named
            counts["or"] += reading not in named and reading in offered
            counts["other"] += bool(set(named) - {reading})
            if reading not in named and reading not in offered:
                misses.append(f"{reading}/{variant or '-'} {case.name}: {result.causes()[:2]}")
        rows[f"{reading}{'/' + variant if variant else ''}"] = counts
    regimes = collections.Counter(line.split(":")[0].rsplit("-", 1)[1] for line in misses)
    data = {
        "date": datetime.date.today().isoformat(),
        "cases": len(cases),
        "rows": rows,
        "misses_by_regime": dict(regimes),
    }
    print()
    print("\n".join(tables.misreading_lines(data)) + ", the first:")
    for line in misses[:8]:
        print(f"  {line}")
    return data


def _dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", type=Path, help="a standard suite to read (else written)")
    parser.add_argument("--quick", action="store_true", help="every 8th case only")
    parser.add_argument(
        "--dtype", default="float32", help="the suite's dtype when it is written (bfloat16: ...)"
    )
    tables.add_write_option(parser, "the misreading panel")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = args.suite
        if root is None:
            root = Path(folder) / "suite"
            write_suite(root, dtype=_dtype(args.dtype), workers=None)
        cases = load_suite(root)
    if args.quick:
        cases = cases[::8]
    applied: collections.Counter[str] = collections.Counter()
    failed: collections.Counter[str] = collections.Counter()
    named: collections.Counter[str] = collections.Counter()
    wrong: collections.Counter[str] = collections.Counter()
    misses: dict[str, list[str]] = collections.defaultdict(list)
    correct_fail: collections.Counter[str] = collections.Counter()
    correct_structural: collections.Counter[str] = collections.Counter()
    correct_total: collections.Counter[str] = collections.Counter()
    structural_texts: list[str] = []
    timed_pass = timed_find = 0.0
    for case in cases:
        good = backward(*case.inputs, dtype=np.float32)
        start = time.perf_counter()
        case.compare(good)
        timed_pass += time.perf_counter() - start
        for kind, bug in BUGS.items():
            out = good.copy()
            where = bug(case, out)
            if where is None or np.array_equal(out, good, equal_nan=True):
                continue
            applied[kind] += 1
            start = time.perf_counter()
            result = case.compare(out)
            if kind == "scale":
                timed_find += time.perf_counter() - start
            if result.passed:
                continue
            failed[kind] += 1
            hit, other = _named(kind, where, result.findings)
            named[kind] += hit
            wrong[kind] += other
            if not hit:
                misses[kind].append(f"{case.name}: {[f.text for f in result.findings]}")
        for label, out in _correct_outputs(case).items():
            # the truth rounded to a coarser dtype is judged in that dtype's class, as a kernel
            # computing in it says (a fixture's own class refuses a coarser output)
            coarser = out.dtype.itemsize < case.fixture.packed.dtype.itemsize
            result = case.compare(out, precision=label if coarser else None)
            correct_total[label] += 1
            correct_fail[label] += not result.passed
            structural = [f for f in result.findings if f.kind != "rounding"]
            correct_structural[label] += bool(structural)
            structural_texts += [f"{case.name} ({label}): {f.text}" for f in structural]

    print(f"{len(cases)} cases of the standard suite")
    print(f"{'kind':10s} {'applied':>7s} {'failed':>6s} {'named':>6s} {'rate':>6s} {'other':>6s}")
    for kind in BUGS:
        n, f = applied[kind], failed[kind]
        rate = named[kind] / f if f else float("nan")
        print(f"{kind:10s} {n:7d} {f:6d} {named[kind]:6d} {rate:6.1%} {wrong[kind]:6d}")
    print()
    print(f"{'correct kernel':22s} {'cases':>5s} {'failed':>6s} {'structural':>10s}")
    for label in correct_total:
        print(
            f"{label:22s} {correct_total[label]:5d} {correct_fail[label]:6d} "
            f"{correct_structural[label]:10d}"
        )
    print()
    print(
        f"compare of dq x 2 (findings) / compare of the correct output: "
        f"{timed_find / timed_pass:.2f} ({timed_find:.2f} s / {timed_pass:.2f} s over the cases)"
    )
    for kind, lines in misses.items():
        regimes = collections.Counter(line.split(":")[0].rsplit("-", 1)[1] for line in lines)
        print(f"\nnot named, {kind} ({len(lines)}; by regime: {dict(regimes)}), the first:")
        for line in lines[:3]:
            print(f"  {line}")
    if structural_texts:
        print(f"\nstructural findings on correct kernels ({len(structural_texts)}):")
        for line in structural_texts[:10]:
            print(f"  {line}")
    panel = misreading_panel(cases)
    if args.write is not None and panel is not None:
        tables.record(f"misreadings_{args.dtype}", panel, args.write)


if __name__ == "__main__":
    main()
