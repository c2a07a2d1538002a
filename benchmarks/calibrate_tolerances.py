"""Measure the calibrated criterion per precision class: correct kernels against the floors,
and injected bugs.

Writes the standard suite in float32, bfloat16, float16 and float64 into a temporary folder.
For every case it judges, in each precision class:

* correct kernels: the reference (its float32 chunked form and the step-by-step form), and
  the field's forms written in PyTorch with autograd (``tests/panel.py``: the chunked WY/UT
  form with products on float32, TF32 or bfloat16 operands, and the step-by-step form),
  transformers' ``torch_chunk_gated_delta_rule`` where installed; in float64 the step-by-step
  form and the tests' extended-precision oracle;
* injected bugs: one wrong element, two heads swapped, the state dropped halfway and at steps
  48, 128 and 256, and every kind of ``bench_findings.py`` but ``rounding`` (which stands for
  rounding, not a bug); in float64 also a flipped ``dg``, a transposed ``dstate`` and a gate
  read one step late.

Prints per class the largest error/floor of each correct kernel, and of each bug how many
cases it fails and its smallest error/floor (where it is caught, and over all cases): the
margin between the worst correct kernel and the least caught bug is the criterion's quality.

    python benchmarks/calibrate_tolerances.py [--quick] [--write [PATH]]

``--quick`` runs the first 48 cases of each suite. Without PyTorch the panel's kernels are
left out (said once). ``--write`` writes each class's margin (the worst correct kernel, the
least caught bug, the dropped states caught) to docs/tables/margins.json (or ``PATH``), which
docs/criterion.md and benchmarks/README.md show (see ``measured_tables.py``).
"""

from __future__ import annotations

import argparse
import datetime
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
import measured_tables as tables
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


def _torch_kernels() -> dict[str, Kernel]:
    try:
        import torch  # noqa: F401
    except ImportError:
        print("PyTorch is not installed: the panel's torch kernels are left out")
        return {}
    import panel

    kernels: dict[str, Kernel] = {
        "torch chunked (float32 products)": lambda fx: panel.chunked(fx),
        "torch step-by-step": lambda fx: panel.step_by_step(fx),
    }
    try:
        import transformers  # noqa: F401

        kernels["transformers chunked"] = lambda fx: (
            None if fx.layout.gate_per_channel else panel.transformers_chunked(fx)
        )
    except ImportError:
        print("transformers is not installed: its chunked function is left out")
    return kernels


def panel_kernel(operands: str) -> Kernel:
    """The panel's chunked kernel with its products on ``operands``."""
    import panel

    return lambda fx: panel.chunked(fx, operands)


def _classes() -> dict[str, tuple[str, dict[str, Kernel]]]:
    """Each class judged: the suite's dtype and its correct kernels."""
    torch_kernels = _torch_kernels()
    float32 = {"reference chunked": f32, "reference step-by-step": f32_recurrent, **torch_kernels}
    tf32 = dict(float32)
    bf16 = {"reference, output rounded": cast(ml_dtypes.bfloat16)}
    f16 = {"reference, output rounded": cast(np.float16)}
    if torch_kernels:
        tf32["torch chunked (TF32 products)"] = panel_kernel("tf32")
        bf16["torch chunked (bfloat16 products)"] = panel_kernel("bfloat16")
        bf16.update({k: v for k, v in torch_kernels.items() if "chunked" in k})
    return {
        "float32": ("float32", float32),
        "tf32": ("float32", tf32),
        "bfloat16": ("bfloat16", bf16),
        "float16": ("float16", f16),
        "float64": ("float64", dict(CORRECT_64)),
    }


CORRECT_64 = {
    "float64 (step by step)": f64_recurrent,
    "extended-precision oracle": extended_oracle,
}


def _bugs(precision: str) -> dict[str, Kernel]:
    import bench_findings

    def injected(kind: str) -> Kernel:
        def kernel(fx: Fixture) -> NDArray[Any] | None:
            from gdn_layout.suites import Case

            out = f32(fx)
            base = out.copy()
            if bench_findings.BUGS[kind](Case(fx.path.name if fx.path else "", fx), out) is None:
                return None
            return None if np.array_equal(out, base, equal_nan=True) else out

        return kernel

    bugs: dict[str, Kernel] = {
        "one wrong element (dk += rms)": wrong_element,
        "heads 0 and 1 of dv swapped": swapped_heads,
        "state dropped at S//2": dropped_state(None),
        **{f"state dropped at t={t}": dropped_state(t) for t in (48, 128, 256)},
    }
    if precision == "float64":
        bugs = {
            "dg flipped (cases with dg != 0)": flipped_dg,
            "dstate transposed": transposed_dstate,
            "gate read one step late": gate_one_step_late,
            **{f"state dropped at t={t}": dropped_state(t) for t in (48, 128, 256)},
        }
    else:
        bugs.update({f"findings: {k}": injected(k) for k in bench_findings.BUGS if k != "rounding"})
    return bugs


def _judge(fx: Fixture, out: NDArray[Any], precision: str) -> Comparison:
    return compare(out.astype(fx.dtype) if precision != "tf32" else out, fx, precision=precision)


def _worst(result: Comparison) -> float:
    return max((g.error_floor_ratio or 0.0) for g in result.grads)


def _worst_gradient(result: Comparison) -> str:
    return max(result.grads, key=lambda g: g.error_floor_ratio or 0.0).name


#: How the pages name each correct kernel.
_PHRASES = {
    "reference chunked": "the reference's chunked form",
    "reference step-by-step": "the reference's step-by-step form",
    "torch chunked (float32 products)": "the panel's chunked form",
    "torch step-by-step": "the panel's step-by-step form",
    "transformers chunked": "transformers' function",
    "torch chunked (TF32 products)": "the panel's chunked form on TF32 operands",
    "torch chunked (bfloat16 products)": "the panel's chunked form on bfloat16 operands",
    "reference, output rounded": "the reference, its output rounded",
    "float64 (step by step)": "the step-by-step form in float64",
    "extended-precision oracle": "the extended-precision oracle",
}


class Margin:
    """One class's measurement: each correct kernel's worst figure (and where), each bug's
    least figure where caught and its count of cases failed and counted."""

    def __init__(self, suite: str) -> None:
        self.suite = suite
        self.correct: dict[str, tuple[float, str, str]] = {}
        self.caught: dict[str, tuple[float, int, int]] = {}

    def row(self) -> dict[str, Any]:
        """The class's row of docs/tables/margins.json, its figures as the pages print them."""
        worst = tables.figure(max(figure for figure, _, _ in self.correct.values()))
        reaching = [
            (label, gradient, case)
            for label, (figure, gradient, case) in self.correct.items()
            if tables.figure(figure) == worst
        ]
        kernels = ", and ".join(_PHRASES.get(label, label) for label, _, _ in reaching)
        _, gradient, case = reaching[0]
        least = tables.figure(min(figure for figure, _, _ in self.caught.values()))
        dropped = {
            when: list(self.caught[f"state dropped at {when}"][1:])
            for when in tables.DROPPED_AT
            if f"state dropped at {when}" in self.caught
        }
        return {
            "suite": self.suite,
            "worst_correct": float(worst.replace(",", "")),
            "worst_kernel": f"{kernels}, `{gradient}`, {case}",
            "least_caught": float(least.replace(",", "")),
            "state_dropped": dropped,
        }


def margins_data(margins: dict[str, Margin], cases: int) -> dict[str, Any]:
    """docs/tables/margins.json's figures, by class, of a run over ``cases`` of each suite."""
    return {
        "date": datetime.date.today().isoformat(),
        "cases": cases,
        "classes": {name: margin.row() for name, margin in margins.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first 48 cases of each suite")
    tables.add_write_option(parser, "each class's margin")
    args = parser.parse_args()
    print(f"K = {K}")
    suites: dict[str, list[Fixture]] = {}
    margins: dict[str, Margin] = {}
    with tempfile.TemporaryDirectory() as folder:
        for precision, (dtype, correct) in _classes().items():
            if dtype not in suites:
                paths = write_suite(
                    Path(folder) / dtype,
                    dtype=ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype,
                )
                suites[dtype] = [load_fixture(p) for p in paths][: 48 if args.quick else None]
            fixtures = suites[dtype]
            print(
                f"\n== {precision}: the {dtype} suite, {len(fixtures)} cases, K = {K[precision]:g}"
            )
            worst_correct = 0.0
            margin = margins[precision] = Margin(dtype)
            for label, kernel in correct.items():
                ratios: list[float] = []
                failed = counted = 0
                where = ("", "")
                for fx in fixtures:
                    out = kernel(fx)
                    if out is None:
                        continue
                    counted += 1
                    result = _judge(fx, out, precision)
                    failed += not result.passed
                    if not ratios or _worst(result) > max(ratios):
                        where = (_worst_gradient(result), fx.path.name if fx.path else "")
                    ratios.append(_worst(result))
                worst_correct = max(worst_correct, max(ratios))
                margin.correct[label] = (max(ratios), *where)
                print(
                    f"correct {label:36s} failed {failed:3d}/{counted}; error/floor "
                    f"median {np.median(ratios):.3g}, max {max(ratios):.3g}"
                )
            least_caught = float("inf")
            for label, kernel in _bugs(precision).items():
                counted = failed = 0
                least, least_all = float("inf"), float("inf")
                for fx in fixtures:
                    if label.startswith("dg flipped") and not np.any(fx.grads.dg):
                        continue
                    out = kernel(fx)
                    if out is None:
                        continue
                    counted += 1
                    result = _judge(fx, out, precision)
                    ratio = _worst(result)
                    least_all = min(least_all, ratio)
                    if not result.passed:
                        failed += 1
                        least = min(least, ratio)
                least_caught = min(least_caught, least)
                margin.caught[label] = (least, failed, counted)
                print(
                    f"bug {label:40s} failed {failed:3d}/{counted}; smallest error/floor "
                    f"where caught {least:.3g}, over all {least_all:.3g}"
                )
            print(
                f"-> {precision}: worst correct kernel {worst_correct:.3g}, least caught bug "
                f"{least_caught:.3g} (K = {K[precision]:g})"
            )
    if args.write is not None:
        tables.record("margins", margins_data(margins, len(fixtures)), args.write)


if __name__ == "__main__":
    main()
