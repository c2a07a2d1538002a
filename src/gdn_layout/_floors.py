"""Precision floors: what rounding alone makes of each tensor of a fixture, measured by the
correct forms a kernel of each precision class computes (docs/criterion.md)."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._dtypes import PRECISIONS, precision_of, round_mantissa
from ._norms import CHUNK_ELEMENTS, Norm
from .layout import GRADIENT_NAMES, GdnBackwardLayout
from .reference._fused import FUSED_CHUNK, fused_backward
from .reference._states import step_by_step
from .reference._threads import mapped

#: A fixture's floors by precision class, then tensor: ``(rms, max)`` or ``(rms, max, reach)``.
Floors = Mapping[str, Mapping[str, tuple[float, ...]]]
#: The classes a fixture measures floors for: all but float64, whose are float32's, scaled.
FLOOR_CLASSES: Final = tuple(name for name in PRECISIONS if name != "float64")
#: Each class's correct forms and the dtype their results are rounded to. float16 takes the
#: TF32 run (its 10 mantissa bits, not its range: a float16 kernel's underflow is its own).
PANEL: Final = {
    "float32": (("step-by-step", "float32"), ("chunked", "float32")),
    "tf32": (("step-by-step", "float32"), ("chunked", "float32"), ("chunked-tf32", "float32")),
    "bfloat16": (("step-by-step", "bfloat16"), ("chunked-bfloat16", "bfloat16")),
    "float16": (("step-by-step", "float16"), ("chunked-tf32", "float16")),
}
#: The chunked runs' product operands' mantissa bits (None: float32's).
CHUNKED_RUNS: Final = {"chunked": None, "chunked-tf32": 10, "chunked-bfloat16": 7}
_FORMS: Final = ("step-by-step", *CHUNKED_RUNS)
#: Most elements of a tensor whose floors take the rounding analysis's least (so few are a few
#: samples of one rounding order, which another order may exceed).
FEW_ELEMENTS: Final = 32
#: How many times over a sampled step-by-step form's estimated figures are taken (the estimate
#: was as low as 0.48 of the whole run's: benchmarks/bench_reference.py --sampled).
SAMPLE_MARGIN: Final = 2.5
#: Past this much work (``B H S N^2``, far above any suite case) the step-by-step form, one
#: step at a time, runs on ``_SAMPLED_PAIRS`` (batch row, head) pairs alone.
_SAMPLED_WORK: Final = 1 << 24
_SAMPLED_PAIRS: Final = 2
_RECORDED: Final = {
    "float64": ("float32", "tf32", "float16"),
    "float32": ("float32", "tf32", "float16"),
    "bfloat16": ("bfloat16",),
    "float16": ("float16",),
}


def checked_floors(
    value: object, where: str, names: tuple[str, ...] = GRADIENT_NAMES
) -> dict[str, dict[str, tuple[float, ...]]]:
    """``value`` as floors of tensors among ``names``, each figure finite and >= 0."""
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where} must be a mapping {{precision: {{gradient: (rms, max)}}}}, "
            f"got {type(value).__name__}"
        )
    floors: dict[str, dict[str, tuple[float, ...]]] = {}
    for precision, per in value.items():
        if precision not in FLOOR_CLASSES:
            raise ValueError(
                f"{where}: unknown precision class {precision!r}; expected among {FLOOR_CLASSES}"
            )
        if not isinstance(per, Mapping):
            raise TypeError(f"{where}[{precision!r}] must be a mapping, got {type(per).__name__}")
        for grad, figures in per.items():
            if grad not in names or not _is_floor(figures):
                raise ValueError(
                    f"{where}[{precision!r}][{grad!r}] must be (rms, max) or (rms, max, reach) "
                    f"for a tensor among {', '.join(names)}, finite numbers >= 0; got {figures!r}"
                )
        floors[precision] = {g: tuple(float(x) for x in f) for g, f in per.items()}
    return floors


def _is_floor(figures: object) -> bool:
    if not isinstance(figures, (list, tuple)) or len(figures) not in (2, 3):
        return False
    return all(
        isinstance(x, numbers.Real)
        and not isinstance(x, (bool, np.bool_))
        and math.isfinite(float(x))
        and float(x) >= 0
        for x in figures
    )


def encode_floors(floors: Floors) -> str:
    """The floors as the JSON text of the fixture's ``floors`` metadata key."""
    document = {d: {g: list(f) for g, f in per.items()} for d, per in floors.items()}
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def decode_floors(
    text: str, names: tuple[str, ...] = GRADIENT_NAMES, key: str = "floors"
) -> dict[str, dict[str, tuple[float, ...]]]:
    """Parse :func:`encode_floors`' text kept under metadata ``key``; ValueError if damaged."""
    try:
        document: Any = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"{key} is not JSON: {err}") from None
    try:
        return checked_floors(document, key, names)
    except TypeError as err:  # the file's to fix, like every other damage
        raise ValueError(str(err)) from None


def precisions_of(dtype: np.dtype[Any], asked: object = None) -> tuple[str, ...]:
    """The precision classes a fixture of ``dtype`` records floors for: ``asked`` (names, or
    ``"all"``), by default its buffers' class (float64's is float32's)."""
    recorded = _RECORDED.get(dtype.name, _RECORDED["float32"])
    if asked is None or asked == "all":
        return recorded[:1] if asked is None else recorded
    if isinstance(asked, str) or not isinstance(asked, Iterable):
        raise TypeError(
            "make_fixture: precisions must be 'all' or a sequence of precision class names, "
            f"got {asked!r}"
        )
    names: list[str] = []
    for value in asked:
        name = precision_of(value, "make_fixture: precisions").name
        name = "float32" if name == "float64" else name  # float64's floors are float32's
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("make_fixture: precisions names no class; give at least one")
    return tuple(names)


def _rounded(values: NDArray[Any], name: str) -> NDArray[np.float32]:
    """float32 ``values`` rounded to ``name``'s dtype, as float32."""
    values = np.ascontiguousarray(values, np.float32).reshape(-1)
    if name == "bfloat16":
        return round_mantissa(values, 7)
    if name == "float16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).astype(np.float32)
    return values


def _figures(low: NDArray[Any], truth: NDArray[Any], rms: float) -> tuple[float, float]:
    """``(rms, max)`` of ``low`` against ``truth`` (1-D), relative to rms(truth) ``rms``."""
    if truth.size == 0:
        return (0.0, 0.0)
    err = np.abs(low - truth)
    peak = float(err.max())
    if rms == 0:
        return (0.0, 0.0) if peak == 0 else (math.inf, math.inf)
    return (_short(math.sqrt(float(np.mean(np.square(err)))) / rms), _short(peak / rms))


def _rms(x: NDArray[Any]) -> float:
    return math.sqrt(float(np.mean(np.square(x)))) if x.size else 0.0


def _short(x: float) -> float:
    # Three significant digits, rounded up: a floor is never understated.
    if x == 0 or not math.isfinite(x):
        return x
    scale = 10.0 ** (2 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def _measure(
    runs: Mapping[str, Mapping[str, NDArray[Any]]],
    truth: Mapping[str, NDArray[Any]],
    wanted: Mapping[str, set[str]],
) -> dict[str, dict[str, dict[str, tuple[float, float]]]]:
    """The figures of each form of ``runs``, by form, rounding (``wanted``), tensor."""
    flat = {name: np.asarray(t, np.float64).reshape(-1) for name, t in truth.items()}
    scale = {name: _rms(t) for name, t in flat.items()}
    return {
        form: {
            r: {n: _figures(_rounded(runs[form][n], r), flat[n], scale[n]) for n in truth}
            for r in sorted(wanted[form])
        }
        for form in runs
        if form in wanted
    }


class Sample(NamedTuple):
    """A ``form`` that ran on a sample of (batch row, head) pairs, with the truth and every
    form's results there."""

    form: str
    truth: Mapping[str, NDArray[Any]]
    runs: Mapping[str, Mapping[str, NDArray[Any]]]


def panel_floors(
    runs: Mapping[str, Mapping[str, NDArray[Any]]],
    truth: Mapping[str, NDArray[Any]],
    sizes: Mapping[str, NDArray[Any]] | None,
    precisions: tuple[str, ...] = tuple(PANEL),
    sample: Sample | None = None,
) -> dict[str, dict[str, tuple[float, float, float]]]:
    """The floors of each class of ``precisions`` for every tensor of ``truth``: the worst
    figures of its forms' ``runs``, and the reach over the step-by-step form's.

    ``sample.form`` ran on the sample alone: its figures are the next form's times the two
    forms' ratio on the sample, :data:`SAMPLE_MARGIN` times over. A tensor of at most
    :data:`FEW_ELEMENTS` elements is no lower than ``u * M`` (``u`` the product roundoff,
    ``M`` the sums of absolute terms, ``sizes``): another summation order may move that far."""
    wanted: dict[str, set[str]] = {}
    for precision in precisions:
        for form, rounding in PANEL[precision]:
            wanted.setdefault(form, set()).add(rounding)
    measured = _measure(runs, truth, wanted)
    if sample is not None and sample.form in wanted:
        on = _measure(sample.runs, sample.truth, wanted)
        estimate = measured.setdefault(sample.form, {})
        for precision in precisions:
            (_, rounding), (other, other_rounding) = PANEL[precision][:2]
            own, next_form = on[sample.form][rounding], on[other][other_rounding]
            whole = measured[other][other_rounding]
            per = estimate.setdefault(rounding, {})
            for name in truth:
                figures = []
                for i in (0, 1):
                    ratio = own[name][i] / next_form[name][i] if next_form[name][i] else math.inf
                    figure = whole[name][i] * ratio
                    if not math.isfinite(figure):  # nothing to scale by: the sample's own
                        figure = own[name][i] if math.isfinite(own[name][i]) else whole[name][i]
                    figures.append(
                        max(per.get(name, (0.0, 0.0))[i], _short(SAMPLE_MARGIN * figure))
                    )
                per[name] = (figures[0], figures[1])
    floors: dict[str, dict[str, tuple[float, float, float]]] = {}
    for precision in precisions:
        forms, u = PANEL[precision], PRECISIONS[precision].product_roundoff
        floors[precision] = {}
        for name, expected in truth.items():
            worst = [measured[form][rounding][name] for form, rounding in forms]
            if sizes is not None and name in sizes and expected.size <= FEW_ELEMENTS:
                m, scale = np.asarray(sizes[name], np.float64).reshape(-1), _rms(expected)
                if scale and m.size:
                    worst.append((u * _rms(m) / scale, u * float(m.max()) / scale))
            rms = _short(max(f[0] for f in worst))
            peak = _short(max(f[1] for f in worst))
            # Over the step-by-step form's figure, no lower than the least floor: a form that
            # happened to round exactly reaches nothing.
            step = measured["step-by-step"][forms[0][1]][name]
            base = max(*step, PRECISIONS[precision].unit_roundoff / 2)
            floors[precision][name] = (rms, peak, _short(max(rms, peak) / base))
    return floors


def sampled_pairs(layout: GdnBackwardLayout) -> list[tuple[int, int]] | None:
    """The (batch row, head) pairs the step-by-step form runs on; None for all of them."""
    count = layout.batch * layout.heads
    if count <= _SAMPLED_PAIRS or count * layout.seq * layout.state_size**2 < _SAMPLED_WORK:
        return None
    picked = [round(i * (count - 1) / (_SAMPLED_PAIRS - 1)) for i in range(_SAMPLED_PAIRS)]
    return [divmod(index, layout.heads) for index in picked]


def _picked(
    name: str, array: NDArray[Any], layout: GdnBackwardLayout, pairs: list[tuple[int, int]]
) -> NDArray[Any]:
    """The ``pairs`` of tensor ``name`` of ``layout``, flattened as a run on them gives it."""
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    shape, axis = {
        "dstate": ((b, h, n, n), 1),
        "final_state": ((b, h, n, n), 1),
        "state": ((b, h, n, n), 1),
        "h": ((b, -1, h, n, n), 2),
        "dh": ((b, -1, h, n, n), 2),
    }.get(name, ((b, s, h, -1), 2))
    return _pick(np.asarray(array).reshape(shape), pairs, axis).reshape(-1)


def tensors_by_name(
    packed: NDArray[Any], outputs: Mapping[str, NDArray[Any]], layout: GdnBackwardLayout
) -> dict[str, NDArray[Any]]:
    """Each gradient of ``packed`` and each tensor of ``outputs``, by name."""
    grads = {seg.name: packed[seg.offset : seg.offset + seg.length] for seg in layout.segments()}
    return {**grads, **outputs}


def correct_forms_floors(
    x: Sequence[Any],
    truth: dict[str, NDArray[Any]],
    states: int | None,
    precisions: tuple[str, ...],
    workers: int = 1,
) -> dict[str, dict[str, tuple[float, float, float]]]:
    """The floors of each tensor of ``truth`` for each class of ``precisions``: its correct
    forms run on the stored inputs ``x``, side by side on ``workers`` threads."""
    layout = GdnBackwardLayout.from_inputs(x[0], x[3], x[6])
    forms = sorted({form for c in precisions for form, _ in PANEL[c]}, key=_FORMS.index)
    # The least floor of few elements needs a run's sums of absolute terms.
    sized = next((f for f in forms if f in CHUNKED_RUNS), None)
    if min((a.size for a in truth.values()), default=0) > FEW_ELEMENTS:
        sized = None
    # The kernels' chunks are of 64 steps: states kept at other boundaries come from a run
    # cut there too, whose shorter chunks would understate the gradients' rounding.
    cut = states is not None and states % FUSED_CHUNK != 0
    pairs = sampled_pairs(layout)
    empty = layout.batch * layout.heads * layout.state_size == 0  # every form gives zeros

    def run(form: str) -> tuple[dict[str, NDArray[Any]], dict[str, NDArray[Any]] | None]:
        if empty:
            return dict(truth), None
        if form == "step-by-step":
            if pairs is None:
                return tensors_by_name(*step_by_step(*x, chunk=states), layout), None
            few: list[Any] = [
                None if a is None else _pick(a, pairs, 2 - (i == 6)) for i, a in enumerate(x)
            ]
            part = GdnBackwardLayout.from_inputs(few[0], few[3], few[6])
            return tensors_by_name(*step_by_step(*few, chunk=states), part), None
        bits = CHUNKED_RUNS[form]
        low, outputs, magnitudes = fused_backward(
            *x, chunk=None if cut else states, bits=bits, sizes=form == sized
        )
        named = tensors_by_name(low, outputs, layout)
        sums = None if magnitudes is None else tensors_by_name(*magnitudes, layout)
        if cut:
            at_states = fused_backward(*x, chunk=states, bits=bits)[1]
            for name in ("h", "dh", "final_state"):
                named[name] = at_states[name]
                if sums is not None:  # the uncut run's sums are not the states' here
                    sums.pop(name, None)
        return named, sums

    done = dict(zip(forms, mapped(run, forms, workers), strict=True))
    runs = {form: result[0] for form, result in done.items()}
    sample = None
    if pairs is not None and not empty and "step-by-step" in runs:
        alone = runs.pop("step-by-step")
        there = {
            form: {n: _picked(n, a[n], layout, pairs) for n in truth} for form, a in runs.items()
        }
        truth_there = {n: _picked(n, a, layout, pairs) for n, a in truth.items()}
        sample = Sample("step-by-step", truth_there, {**there, "step-by-step": alone})
    return panel_floors(runs, truth, None if sized is None else done[sized][1], precisions, sample)


def _pick(array: NDArray[Any], pairs: list[tuple[int, int]], axis: int) -> NDArray[Any]:
    """The ``(row, head)`` ``pairs`` of ``array`` (heads on ``axis``): one row of them."""
    parts = [np.take(array[row], head, axis=axis - 1) for row, head in pairs]
    return np.stack(parts, axis=axis - 1)[None]


def term_scales(
    q: NDArray[Any], k: NDArray[Any], dq: NDArray[Any], dk: NDArray[Any], *, per_channel: bool
) -> dict[str, float]:
    """``{"dg": s}``: ``s`` the RMS of ``sum_n |q dq| + |k dk|`` (per channel, without the
    sum), the terms chunked kernels form ``dg`` from, which it can be far below.

    >>> import numpy as np
    >>> ones = np.ones((1, 2, 1, 4))
    >>> term_scales(ones, ones, ones, -ones, per_channel=False)
    {'dg': 8.0}
    >>> term_scales(ones, ones, ones, -ones, per_channel=True)
    {'dg': 2.0}
    """
    norm, count = Norm(), 0
    batch, seq = q.shape[:2]
    block = max(1, CHUNK_ELEMENTS // max(1, math.prod(q.shape[2:])))
    for b in range(batch):
        for s in range(0, seq, block):
            steps = slice(s, s + block)
            terms = np.abs(q[b, steps] * dq[b, steps].astype(np.float64))
            terms += np.abs(k[b, steps] * dk[b, steps].astype(np.float64))
            if not per_channel:
                terms = terms.sum(axis=-1)
            terms = terms[np.isfinite(terms)]
            norm.add(terms)
            count += terms.size
    return {"dg": norm.rms(count)}
