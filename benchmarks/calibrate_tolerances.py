"""Measure the calibrated criterion: floors, correct kernels against them, injected bugs.

Writes the standard suite in float32, float16, bfloat16 and float64 into a temporary folder,
then for every case compares correct kernels (the reference in float32, by the default method
and step by step, its output rounded to float16 and bfloat16; in float64, the step-by-step
form and the tests' extended-precision oracle rounded to float64) and injected bugs (one wrong
element, two heads swapped, the state dropped halfway and at steps 48, 128 and 256; in float64
also a flipped dg, a transposed dstate and a gate read one step late) with the default,
calibrated criterion.
Prints the largest error/floor ratio of each correct kernel, the smallest of each bug on the
gradients it touches, and how many cases each passes or fails.

    python benchmarks/calibrate_tolerances.py
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import NDArray

from gdn_layout import Comparison, GdnBackwardLayout, compare, unpack
from gdn_layout.check._criterion import K
from gdn_layout.files import Fixture, load_fixture
from gdn_layout.generate import write_suite
from gdn_layout.reference import backward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from oracle import oracle  # the tests' extended-precision truth

Kernel = Callable[[Fixture], NDArray[Any] | None]


def _work(fx: Fixture) -> type[np.floating[Any]]:
    """The dtype a kernel under test computes in: float64 for a float64 case, else float32."""
    return np.float64 if fx.dtype == np.float64 else np.float32


def f32(fx: Fixture) -> NDArray[Any]:
    return backward(*fx.inputs, dtype=np.float32)


def f32_recurrent(fx: Fixture) -> NDArray[Any]:
    return backward(*fx.inputs, dtype=np.float32, method="recurrent")


def f64_recurrent(fx: Fixture) -> NDArray[Any]:
    return backward(*fx.inputs, dtype=np.float64, method="recurrent")


def extended_oracle(fx: Fixture) -> NDArray[Any] | None:
    if fx.layout.seq > 100 or fx.layout.state_size > 16:
        return None  # the oracle keeps every state: test-sized cases only
    o = oracle(*fx.inputs)
    grads = (o.dq, o.dk, o.dv, o.dg, o.dbeta) + (() if o.dstate is None else (o.dstate,))
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in grads])


def flipped_dg(fx: Fixture) -> NDArray[Any]:
    out = fx.packed.copy()
    unpack(out, fx.layout).dg[...] *= -1
    return out


def transposed_dstate(fx: Fixture) -> NDArray[Any] | None:
    out = fx.packed.copy()
    dstate = unpack(out, fx.layout).dstate
    if dstate is None:
        return None
    dstate[...] = dstate.swapaxes(-1, -2).copy()
    return out


def gate_one_step_late(fx: Fixture) -> NDArray[Any]:
    x = fx.inputs
    late = np.zeros_like(x.g)
    late[:, 1:] = x.g[:, :-1]
    return backward(x.q, x.k, x.v, late, x.beta, x.dy, x.state, dtype=_work(fx))


def cast(dtype: Any) -> Kernel:
    return lambda fx: f32(fx).astype(dtype)


def wrong_element(fx: Fixture) -> NDArray[Any]:
    out = f32(fx)
    dk = unpack(out, fx.layout).dk
    if dk.size == 0:
        return out
    flat = dk.reshape(-1)
    flat[flat.size // 2] += float(np.sqrt(np.mean(np.square(flat, dtype=np.float64))))
    return out


def swapped_heads(fx: Fixture) -> NDArray[Any] | None:
    if fx.layout.heads < 2:
        return None
    out = f32(fx)
    dv = unpack(out, fx.layout).dv
    dv[:, :, [0, 1]] = dv[:, :, [1, 0]]
    return out


def dropped_state(t: int | None) -> Kernel:
    """A chunked kernel that forgets the state at step ``t`` (``None``: at ``S // 2``); cases
    of ``t`` steps or fewer have no such step and are not counted."""

    def kernel(fx: Fixture) -> NDArray[Any] | None:
        layout, x = fx.layout, fx.inputs
        cut = layout.seq // 2 if t is None else t
        if not 0 < cut < layout.seq:
            return None
        q, k, v, g, beta, dy = (np.asarray(a) for a in x[:6])
        head = backward(
            q[:, :cut],
            k[:, :cut],
            v[:, :cut],
            g[:, :cut],
            beta[:, :cut],
            dy[:, :cut],
            x.state,
            dtype=_work(fx),
        )
        tail = backward(
            q[:, cut:],
            k[:, cut:],
            v[:, cut:],
            g[:, cut:],
            beta[:, cut:],
            dy[:, cut:],
            dtype=_work(fx),
        )
        first = unpack(head, GdnBackwardLayout.from_inputs(x.q[:, :cut], x.g[:, :cut], x.state))
        second = unpack(tail, GdnBackwardLayout.from_inputs(x.q[:, cut:], x.g[:, cut:]))
        out = np.empty(layout.total_elems, _work(fx))
        grads = unpack(out, layout)
        for name in ("dq", "dk", "dv", "dg", "dbeta"):
            target = getattr(grads, name)
            target[:, :cut] = getattr(first, name)
            target[:, cut:] = getattr(second, name)
        if grads.dstate is not None:
            grads.dstate[...] = first.dstate
        return out

    return kernel


CORRECT = {
    "float32 (default)": f32,
    "float32 (step by step)": f32_recurrent,
    "float16 output": cast(np.float16),
    "bfloat16 output": cast(ml_dtypes.bfloat16),
}
CORRECT_64 = {
    "float64 (step by step)": f64_recurrent,
    "extended-precision oracle": extended_oracle,
}
BUGS = {
    "one wrong element (dk += rms)": (wrong_element, ("dk",)),
    "heads 0 and 1 of dv swapped": (swapped_heads, ("dv",)),
    "state dropped at S//2": (dropped_state(None), None),
    **{f"state dropped at t={t}": (dropped_state(t), None) for t in (48, 128, 256)},
}
BUGS_64 = {
    "dg flipped (cases with dg != 0)": (flipped_dg, ("dg",)),
    "dstate transposed": (transposed_dstate, ("dstate",)),
    "gate read one step late": (gate_one_step_late, None),
    **{f"state dropped at t={t}": (dropped_state(t), None) for t in (48, 128, 256)},
}


def _judge(fx: Fixture, out: NDArray[Any]) -> Comparison:
    return compare(out, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales)


def _ratio(result: Comparison, name: str) -> float:
    ratio = result[name].error_floor_ratio
    return float("nan") if ratio is None else ratio


def main() -> None:
    print(f"K = {K}")
    for dtype in ("float32", "float16", "bfloat16", "float64"):
        wide = dtype == "float64"
        with tempfile.TemporaryDirectory() as folder:
            paths = write_suite(folder, dtype=dtype if dtype != "bfloat16" else ml_dtypes.bfloat16)
            fixtures = [load_fixture(p) for p in paths]
            print(f"\n== {dtype} suite: {len(fixtures)} cases")
            worst_floor: dict[str, dict[str, float]] = {}
            for fx in fixtures:
                assert fx.floors is not None
                for d, per in fx.floors.items():
                    for rms, peak in per.values():
                        w = worst_floor.setdefault(d, {"rms": 0.0, "max": 0.0})
                        w["rms"], w["max"] = max(w["rms"], rms), max(w["max"], peak)
            for d, w in worst_floor.items():
                print(f"largest floor for {d}: rms {w['rms']:.3g}, max {w['max']:.3g}")
            for label, kernel in (CORRECT_64 if wide else CORRECT).items():
                ratios, failed, counted = [], 0, 0
                for fx in fixtures:
                    out = kernel(fx)
                    if out is None:
                        continue
                    counted += 1
                    result = _judge(fx, out)
                    failed += not result.passed
                    ratios += [_ratio(result, g.name) for g in result.grads if g.size]
                print(
                    f"correct {label:26s} failed {failed:3d}/{counted}; error/floor "
                    f"median {np.median(ratios):.3g}, max {max(ratios):.3g}"
                )
            for label, (kernel, touched) in (BUGS_64 if wide else BUGS).items():
                for out_dtype in ("float64",) if wide else ("float32", "bfloat16"):
                    counted = failed = 0
                    least = float(np.inf)
                    by_regime: dict[str, list[int]] = {}
                    for fx in fixtures:
                        out = kernel(fx)
                        if out is None or (touched == ("dg",) and not np.any(fx.grads.dg)):
                            continue
                        if out_dtype == "bfloat16":
                            out = out.astype(ml_dtypes.bfloat16)
                        counted += 1
                        result = _judge(fx, out)
                        failed += not result.passed
                        tally = by_regime.setdefault(str(fx.regime), [0, 0])
                        tally[0] += not result.passed
                        tally[1] += 1
                        names = touched or result.names
                        least = min(least, max(_ratio(result, n) for n in names))
                    print(
                        f"bug {label:30s} {out_dtype:8s} failed {failed:3d}/{counted}; "
                        f"smallest error/floor {least:.3g}"
                    )
                    if label.startswith("state dropped at t="):
                        print(
                            "    by regime: "
                            + ", ".join(f"{r} {f}/{n}" for r, (f, n) in by_regime.items())
                        )


if __name__ == "__main__":
    main()
