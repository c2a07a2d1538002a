"""Random inputs, fixtures computed by the reference, and the standard suite of fixtures.

>>> import gdn_layout as gl
>>> x = draw_inputs(gl.GdnBackwardLayout(1, 4, 2, 8), regime="mild", seed=1)
>>> x.g.shape, bool((x.g < 0).all())
((1, 4, 2), True)
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import IO, Any, Final, NamedTuple, SupportsIndex

import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import reference
from ._checks import integer, not_a_layout
from ._dtypes import precision_of
from ._floors import CHUNKED_RUNS, FEW_ELEMENTS, PANEL, Sample, panel_floors
from ._version import __version__
from .files._atomic import atomic_write, write_folder
from .files._fixture import (
    FORMAT_VERSION,
    Fixture,
    GdnInputs,
    check_seed,
    resolve_dtype,
    save_fixture,
)
from .files._manifest import MANIFEST, NotASuite, manifest_entry, manifest_text, read_manifest
from .files._safetensors import dtype_code
from .layout import GdnBackwardLayout
from .reference._chunked import chunk_length
from .reference._fused import FUSED_CHUNK, KEEP_BYTES, fused_backward
from .reference._recurrent import default_checkpoint_every
from .reference._states import step_by_step
from .reference._threads import mapped
from .regimes import REGIME_SINCE, REGIMES, draw_gate

__all__ = ["REGIMES", "draw_inputs", "make_fixture", "write_suite"]

#: The child of ``SeedSequence(seed).spawn(7)`` each tensor is drawn from, by name: a
#: tensor's stream never depends on the order of any tuple of names.
_STREAMS: Final = {"q": 0, "k": 1, "v": 2, "g": 3, "beta": 4, "state": 5, "dy": 6}


def draw_inputs(
    layout: GdnBackwardLayout,
    *,
    regime: str = "mixed",
    seed: int = 0,
    dtype: DTypeLike = np.float32,
) -> GdnInputs:
    """Random inputs for ``layout`` as the op expects them, in ``dtype``.

    ``q`` and ``k`` are L2-normalised over ``N``; ``v``, ``dy`` and ``state`` are standard
    normal; ``beta`` is uniform in ``[0.05, 0.95]``. The log-gate ``g`` is drawn as
    ``regime`` says, one of :data:`gdn_layout.regimes.REGIMES`.

    Each tensor has its own random stream, so ``q`` is the same for every regime and gate
    mode of a seed, and a layout with ``carry_state`` shares all other inputs with the one
    without it. Values are drawn in float64 and normalised before the cast to ``dtype``.

    Parameters
    ----------
    layout : GdnBackwardLayout
        Gives every shape, the gate mode and whether a state is drawn.
    regime : str
        The gate regime, one of :data:`REGIMES`.
    seed : int
        A non-negative integer; NumPy integers work.
    dtype : dtype_like
        float64, float32, float16 or bfloat16.

    Returns
    -------
    GdnInputs
        ``q, k, v, g, beta, dy`` and ``state`` (None unless carried).

    Raises
    ------
    TypeError
        ``layout``, ``seed`` or ``dtype`` has the wrong type.
    ValueError
        ``regime`` is unknown or ``seed`` negative.

    See Also
    --------
    make_fixture : Inputs with their outputs and gradients.
    regimes.draw_gate : The gates alone.

    Examples
    --------
    >>> import gdn_layout as gl
    >>> x = draw_inputs(gl.GdnBackwardLayout(2, 5, 3, 8), regime="strong", seed=3)
    >>> x.q.shape, x.g.shape, x.state is None, x.q.dtype
    ((2, 5, 3, 8), (2, 5, 3), True, dtype('float32'))
    >>> bool(np.allclose(np.linalg.norm(x.k, axis=-1), 1.0)), float(x.g.max()) <= -3.0
    (True, True)
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "draw_inputs")
    if regime not in REGIMES:
        raise ValueError(f"draw_inputs: regime must be one of {REGIMES}, got {regime!r}")
    seed = check_seed(seed, "draw_inputs")
    target = resolve_dtype(dtype, "draw_inputs")
    children = np.random.SeedSequence(seed).spawn(len(_STREAMS))
    streams = {name: np.random.default_rng(children[i]) for name, i in _STREAMS.items()}
    qkv = layout.input_shape("q")

    def unit(rng: np.random.Generator) -> NDArray[np.float64]:
        x = rng.standard_normal(qkv)
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        return x / np.where(norm > 0, norm, 1.0)

    drawn: dict[str, NDArray[Any] | None] = {
        "q": unit(streams["q"]),
        "k": unit(streams["k"]),
        "v": streams["v"].standard_normal(qkv),
        "g": draw_gate(streams["g"], layout.input_shape("g"), regime),
        "beta": streams["beta"].uniform(0.05, 0.95, layout.input_shape("beta")),
        "dy": streams["dy"].standard_normal(layout.input_shape("dy")),
        "state": (
            streams["state"].standard_normal(layout.input_shape("state"))
            if layout.carry_state
            else None
        ),
    }
    cast = {n: None if a is None else a.astype(target) for n, a in drawn.items()}
    return GdnInputs(**cast)  # type: ignore[arg-type]


def make_fixture(
    layout: GdnBackwardLayout,
    *,
    dtype: DTypeLike = np.float32,
    regime: str = "mixed",
    seed: int = 0,
    progress: Callable[[float], object] | None = None,
    calibrate: bool = True,
    states: SupportsIndex | None = None,
    workers: int | None = 1,
    precisions: tuple[str, ...] | str | None = None,
) -> Fixture:
    """Draw inputs with :func:`draw_inputs` and compute ``y`` and ``packed`` for them.

    The reference runs in float64 on the inputs as stored (already cast to ``dtype``), and its
    results are cast to ``dtype``: the fixture is exactly the reference's answer for its own
    inputs, up to that final rounding. ``progress`` is passed to the reference backward.

    With ``calibrate=True`` (the default) the correct forms a kernel of each precision class
    computes run on the stored inputs: the spec's step-by-step form in float32, and the
    chunked WY/UT form as fused kernels compute it, in float32 and with its matrix products on
    TF32 or bfloat16 operands. The precision floors of every gradient, the worst rounding of
    a class's forms against the float64 result, are kept in :attr:`Fixture.floors`;
    :func:`~gdn_layout.compare` judges against them (see docs/criterion.md). On a large
    fixture the step-by-step form runs on two batch rows and heads (:func:`sampled_pairs`).

    Parameters
    ----------
    layout : GdnBackwardLayout
        The case.
    dtype : dtype_like
        The dtype of every stored tensor.
    regime, seed
        As for :func:`draw_inputs`.
    progress : callable, optional
        Called with the fraction of the backward done.
    calibrate : bool
        Whether to measure the precision floors (below) and keep them in
        :attr:`Fixture.floors`.
    states : int, optional
        A chunk length: keep the state entering each chunk of that many steps and its
        cotangent (:attr:`Fixture.h`, :attr:`Fixture.dh`, from
        :func:`~gdn_layout.reference.chunk_states`). The state after the last step
        (:attr:`Fixture.final_state`) is kept whenever the state is carried, and with
        ``states``. Calibrated, their floors and ``y``'s are measured as the gradients' are,
        from the step-by-step form in float32, and kept in :attr:`Fixture.state_floors`.
    workers : int or None
        Threads for the reference (see :func:`gdn_layout.reference.backward`) and for the
        floors' forms, which run side by side: 1, the default, computes in the calling
        thread, None on every core this process may use. The fixture is the same, bit for
        bit, for every value.
    precisions : tuple of str, optional
        The precision classes whose floors are measured. By default the class of ``dtype``'s
        buffers alone (float64's floors are float32's, scaled); each other class costs its
        own runs (see docs/criterion.md). ``"all"`` asks for every class ``dtype``'s buffers
        can be judged in: for float32 and float64 ``float32``, ``tf32`` and ``float16``, as
        the standard suite records. A class left out is judged against its default floors.

    Returns
    -------
    Fixture
        With ``regime``, ``seed``, ``compute_dtype="float64"`` and, when calibrated, the
        floors recorded.

    Raises
    ------
    TypeError, ValueError
        As :func:`draw_inputs`.

    See Also
    --------
    draw_inputs : The inputs alone.
    save_fixture : Write it.
    write_suite : The standard set of them.
    reference.backward : The gradients alone.

    Examples
    --------
    >>> import gdn_layout as gl
    >>> fx = make_fixture(gl.GdnBackwardLayout(1, 4, 2, 8, carry_state=True), regime="zero")
    >>> fx.packed.shape, fx.grads.dstate.shape, fx.compute_dtype
    ((336,), (1, 2, 8, 8), 'float64')
    >>> fast = make_fixture(fx.layout, regime="zero", workers=2)
    >>> bool(np.array_equal(fast.packed, fx.packed)), fast.floors == fx.floors
    (True, True)
    """
    threads = reference.resolve_workers(workers, "make_fixture")
    x = draw_inputs(layout, regime=regime, seed=seed, dtype=dtype)
    if states is not None:
        states = integer(states, "make_fixture: states", least=1, most=_MAX_CHUNK, or_none=True)
    classes = precisions_of(x.q.dtype, precisions)
    return _fixture_of(layout, x, regime, int(seed), progress, calibrate, states, threads, classes)


#: The longest chunk a fixture records (``states_chunk`` is read back as at most 18 digits).
_MAX_CHUNK: Final = 10**18 - 1


def _fixture_of(
    layout: GdnBackwardLayout,
    x: GdnInputs,
    regime: str,
    seed: int,
    progress: Callable[[float], object] | None = None,
    calibrate: bool = True,
    states: int | None = None,
    workers: int = 1,
    precisions: tuple[str, ...] = ("float32",),
) -> Fixture:
    """The fixture of ``layout`` for the inputs ``x``: :func:`make_fixture` after the draw."""
    # The reference converts the stored inputs to float64 (exactly) as it lays them out.
    truth = reference_outputs(x, states, workers)
    packed = reference.backward(*x, dtype=np.float64, progress=progress, workers=workers)
    floors = state_floors = None
    if calibrate:
        classes = precisions_of(x.q.dtype, precisions)
        measured = correct_forms_floors(x, _named(packed, truth, layout), states, classes, workers)
        floors = {
            c: {n: f for n, f in per.items() if n in layout.names} for c, per in measured.items()
        }
        if len(truth) > 1:  # the states are kept, and so are their floors and y's
            state_floors = {
                c: {n: f for n, f in per.items() if n in truth} for c, per in measured.items()
            }
    target = x.q.dtype

    def kept(name: str) -> NDArray[Any] | None:
        return None if name not in truth else np.asarray(truth[name]).astype(target)

    return Fixture(
        *x,
        y=np.asarray(truth["y"]).astype(target),
        packed=np.asarray(packed).astype(target),
        regime=regime,
        seed=seed,
        compute_dtype="float64",
        floors=floors,
        final_state=kept("final_state"),
        h=kept("h"),
        dh=kept("dh"),
        states_chunk=states,
        state_floors=state_floors,
    )


def correct_forms_floors(
    x: GdnInputs,
    truth: dict[str, NDArray[Any]],
    states: int | None,
    precisions: tuple[str, ...],
    workers: int = 1,
) -> dict[str, dict[str, tuple[float, float, float]]]:
    """The floors of each tensor of ``truth`` (gradients and states, by name, float64) for
    each class of ``precisions``: the worst rounding of its correct forms
    (:data:`~gdn_layout._floors.PANEL`), run on the stored inputs ``x``, and the least
    that rounding analysis allows. Forms run side by side on ``workers`` threads."""
    layout = GdnBackwardLayout.from_inputs(x.q, x.g, x.state)
    forms = sorted({form for c in precisions for form, _ in PANEL[c]}, key=_FORMS.index)
    # The rounding analysis's least floor guards tensors of few elements, whose measured
    # figures are a few samples of one rounding order.
    sized = next((f for f in forms if f in CHUNKED_RUNS), None)
    if min((a.size for a in truth.values()), default=0) > FEW_ELEMENTS:
        sized = None
    # The kernels' chunks are of 64 steps: a fixture's states at other boundaries come from a
    # run cut there too, whose shorter chunks would understate the gradients' rounding.
    cut = states is not None and states % FUSED_CHUNK != 0
    pairs = sampled_pairs(layout)

    def run(form: str) -> tuple[dict[str, NDArray[Any]], dict[str, NDArray[Any]] | None]:
        if not _has_state(layout):  # every form gives the truth's zeros
            return dict(truth), None
        if form == "step-by-step":
            if pairs is None:
                return _named(*step_by_step(*x, chunk=states), layout), None
            few = GdnInputs._make(
                None if a is None else _pick(a, pairs, 1 if name == "state" else 2)
                for name, a in zip(GdnInputs._fields, x, strict=True)
            )
            part = GdnBackwardLayout.from_inputs(few.q, few.g, few.state)
            return _named(*step_by_step(*few, chunk=states), part), None
        bits = CHUNKED_RUNS[form]
        low, outputs, magnitudes = fused_backward(
            *x, chunk=None if cut else states, bits=bits, sizes=form == sized
        )
        named = _named(low, outputs, layout)
        sizes = None if magnitudes is None else _named(*magnitudes, layout)
        if cut:
            at_states = fused_backward(*x, chunk=states, bits=bits)[1]
            for name in ("h", "dh", "final_state"):
                named[name] = at_states[name]
                if sizes is not None:  # the uncut run's sums are not the states' here
                    sizes.pop(name, None)
        return named, sizes

    done = dict(zip(forms, mapped(run, forms, workers), strict=True))
    runs = {form: result[0] for form, result in done.items()}
    sizes = None if sized is None else done[sized][1]
    sample = None
    if pairs is not None and "step-by-step" in runs:
        # The step-by-step form ran on the sample alone: the truth and the forms whole there.
        alone = runs.pop("step-by-step")
        picked = {
            form: {name: _picked(name, run[name], layout, pairs) for name in truth}
            for form, run in runs.items()
        }
        there = {name: _picked(name, array, layout, pairs) for name, array in truth.items()}
        sample = Sample("step-by-step", there, {**picked, "step-by-step": alone})
    return panel_floors(runs, truth, sizes, precisions, sample)


#: Every form of the panel, in the order they run.
_FORMS: Final = ("step-by-step", *CHUNKED_RUNS)
#: The batch rows and heads the step-by-step form runs on where a fixture has more of them and
#: the whole run would be long (``_SAMPLED_WORK``): its steps one at a time cost several times
#: the truth's chunks. The chunked forms run whole: on two heads of sixteen, their floors
#: could fall as much as 95 times below the whole run's. See ``_floors.Sample``.
SAMPLED_PAIRS: Final = 2
#: State elements times steps (``B H S N^2``) from which the step-by-step form runs on a sample:
#: far above every case of the standard suite, whose floors stay those of the whole run.
_SAMPLED_WORK: Final = 1 << 24


def sampled_pairs(layout: GdnBackwardLayout) -> list[tuple[int, int]] | None:
    """The ``(batch row, head)`` pairs the step-by-step form of the floors runs on: spread
    evenly, the first and the last among them; None for all of them.

    >>> sampled_pairs(GdnBackwardLayout(2, 4096, 8, 128))
    [(0, 0), (1, 7)]
    >>> sampled_pairs(GdnBackwardLayout(2, 32, 8, 128)) is None
    True
    """
    count = layout.batch * layout.heads
    work = count * layout.seq * layout.state_size**2
    if count <= SAMPLED_PAIRS or work < _SAMPLED_WORK:
        return None
    picked = [round(i * (count - 1) / (SAMPLED_PAIRS - 1)) for i in range(SAMPLED_PAIRS)]
    return [divmod(index, layout.heads) for index in picked]


def _shape_of(name: str, layout: GdnBackwardLayout) -> tuple[tuple[int, ...], int]:
    """The shape of tensor ``name`` of a fixture of ``layout`` (its states, if any,
    ``[B, K, H, N, N]``) and its head axis."""
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    if name in ("dstate", "final_state"):
        return (b, h, n, n), 1
    if name in ("h", "dh"):
        return (b, -1, h, n, n), 2
    return (b, s, h, -1), 2  # dq, dk, dv, dg, dbeta and y


def _picked(
    name: str, array: NDArray[Any], layout: GdnBackwardLayout, pairs: list[tuple[int, int]]
) -> NDArray[Any]:
    """The ``pairs`` of tensor ``name`` of a fixture of ``layout``, flattened as a run on
    them alone gives it."""
    shape, axis = _shape_of(name, layout)
    shaped = array if array.ndim == len(shape) else array.reshape(shape)
    return _pick(shaped, pairs, axis).reshape(-1)


def _pick(array: NDArray[Any], pairs: list[tuple[int, int]], axis: int) -> NDArray[Any]:
    """The ``(row, head)`` ``pairs`` of ``array``, whose heads are on ``axis``: one batch row
    of ``len(pairs)`` heads."""
    parts = [np.take(array[row], head, axis=axis - 1) for row, head in pairs]
    return np.stack(parts, axis=axis - 1)[None]


def precisions_of(dtype: np.dtype[Any], asked: object = None) -> tuple[str, ...]:
    """The precision classes a fixture of ``dtype`` records floors for: ``asked`` (names of
    classes, or ``"all"``), by default the class of its buffers (float64's is float32's, as
    float64's floors are derived from them). ``"all"`` is every class the buffers can be
    judged in (float32 and float64: float32, tf32 and float16, whose floors share the TF32
    run)."""
    if asked is None:
        return _RECORDED.get(dtype.name, _RECORDED["float32"])[:1]
    if asked == "all":
        return _RECORDED.get(dtype.name, _RECORDED["float32"])
    if isinstance(asked, str) or not isinstance(asked, Iterable):
        raise TypeError(
            "make_fixture: precisions must be 'all' or a sequence of precision class names, "
            f"got {asked!r}"
        )
    names: list[str] = []
    for value in asked:
        name = precision_of(value, "make_fixture: precisions").name
        if name == "float64":
            name = "float32"  # float64's floors are float32's, scaled
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError("make_fixture: precisions names no class; give at least one")
    return tuple(names)


_RECORDED: Final = {
    "float64": ("float32", "tf32", "float16"),
    "float32": ("float32", "tf32", "float16"),
    "bfloat16": ("bfloat16",),
    "float16": ("float16",),
}


def _named(
    packed: NDArray[Any], outputs: dict[str, NDArray[Any]], layout: GdnBackwardLayout
) -> dict[str, NDArray[Any]]:
    """Each gradient of ``packed`` and each tensor of ``outputs``, by name."""
    grads = {seg.name: packed[seg.offset : seg.offset + seg.length] for seg in layout.segments()}
    return {**grads, **outputs}


def reference_outputs(
    x: GdnInputs, states: int | None, workers: int = 1
) -> dict[str, NDArray[Any]]:
    """The float64 truth of inputs ``x``, computed in float64: ``y``, and the states a fixture
    keeps (``final_state`` when the state is carried or ``states`` given, ``h`` and ``dh`` with
    ``states``)."""
    result = reference.forward(*x[:5], state=x.state, dtype=np.float64, workers=workers)
    y, final = result if isinstance(result, tuple) else (result, None)
    outputs = {"y": y}
    if states is not None:
        h, dh, final = reference.chunk_states(*x, chunk=states, dtype=np.float64, workers=workers)
        outputs.update(h=h, dh=dh)
    if final is not None:
        outputs["final_state"] = final
    return outputs


def _has_state(layout: GdnBackwardLayout) -> bool:
    """Whether the state has an element: with B, H or N zero, ``y``, the states and every
    gradient are zero (or empty) whatever S, and the reference's per-step loops would run S
    steps of nothing."""
    return layout.batch * layout.heads * layout.state_size > 0


#: Bytes of the Python objects (array headers, tuples, lists) of one chunk the fused form keeps
#: for its backward, and of one stack of the chunked reference's plan, besides their arrays'
#: data: most of the memory where chunks are a step long (``states=1``).
_CHUNK_OBJECTS: Final = 4 << 10
_STACK_OBJECTS: Final = 1 << 10
#: What a fixture of a few elements costs: the code its first run imports and sets up.
_FIRST_RUN: Final = 4 << 20


def fixture_memory(
    layout: GdnBackwardLayout,
    *,
    dtype: DTypeLike = np.float32,
    states: int | None = None,
    precisions: tuple[str, ...] | str | None = None,
    workers: int | None = 1,
) -> int:
    """The peak memory, in bytes, of :func:`~gdn_layout.make_fixture` of ``layout`` with these
    arguments and :func:`~gdn_layout.save_fixture` of the result, beyond the interpreter's.

    Counted from the shapes as the arrays alive at the peak of each phase; the estimate is the
    largest phase:

    * the draw: the inputs in float64 and in ``dtype``, and the gate's temporaries;
    * the float64 reference, beside the inputs in ``dtype``: its forward, with
      ``states`` its chunk states ``h`` and ``dh`` (``[B, K, H, N, N]``, ``K = ceil(S /
      states)``), its backward; each with the copies its entry makes, its results, the plan's
      pair decays, the state it keeps per stack of steps, one stack's working set and each
      stack's Python objects;
    * the precision floors' runs (:func:`correct_forms_floors`), in float32 on the stored
      inputs, one after another (side by side with ``workers`` above 1) beside the float64
      results: each run's copies, results and states (the step-by-step form's checkpoints,
      the fused form's state at every chunk and the chunks it keeps) and what the runs before
      it keep; then the comparison's buffers;
    * the results cast to ``dtype`` beside their float64 originals.

    Besides, what a first run imports. A per-channel gate's chunks are counted one step long,
    as the extreme gate regime cuts them. With no state element (B, H or N zero) nothing runs
    but the draw, the reference's copies of its inputs and its zero results. Measured within
    25% above the peak RSS over shapes whose estimate is 100 to 600 MiB, N = 0 among them,
    with glibc's mmap threshold fixed: the arrays' peak, not what the heap keeps of freed ones
    (up to a fifth more; tests/test_limits.py).

    >>> layout = GdnBackwardLayout(1, 4096, 4, 64)
    >>> fixture_memory(layout, states=1) > fixture_memory(layout) > layout.nbytes(np.float64)
    True
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "fixture_memory")
    if states is not None:
        states = integer(states, "fixture_memory: states", least=1, or_none=True)
    stored = resolve_dtype(dtype, "fixture_memory")
    classes = precisions_of(stored, precisions)
    threads = reference.resolve_workers(workers, "fixture_memory")
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    inputs = 4 * layout.qkv_elems + layout.gate_elems + layout.beta_elems + layout.state_elems
    chunk_states = (-(-s // states) if states else 0) * b * h * n * n  # h, and as much dh
    final = b * h * n * n if layout.carry_state or states else 0
    truth = layout.qkv_elems + 2 * chunk_states + final  # y and the states, in float64
    results = truth + layout.total_elems
    # While the gate is drawn: q, k, v and a mixed gate's mild, strong, pick and result.
    draw = (3 * layout.qkv_elems + 4 * layout.gate_elems) * 8 + 2 * layout.gate_elems
    held = inputs * stored.itemsize  # the inputs as stored (the reference converts its own)
    phases = [
        max(draw, inputs * 8) + inputs * stored.itemsize,
        held + results * (8 + stored.itemsize),  # the results cast beside the float64 ones
    ]
    if b * h * n:
        truth_peak = held + _reference_peak(layout, inputs, truth, states)
        runs, comparison = _floors_peak(layout, inputs, states, classes, threads)
        phases += [truth_peak, held + results * 8 + runs + comparison]
    else:  # every result is zero: the reference copies and checks its inputs (a mask each,
        # whose freed pages the heap keeps), then fills and checks its output
        phases.append(held + (inputs + layout.total_elems) * 9)
    return _FIRST_RUN + max(phases)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _padded(steps: int, every: int, length: int) -> int:
    """The elements per batch element and head of the chunked plan's pair decays, ``[B,
    H * count, L, L]`` for each stack of ``every`` of ``steps`` steps cut in ``count``
    chunks of ``length``, padded to ``L``, the stack's longest."""

    def one(m: int) -> int:
        longest = min(length, m)
        return _ceil(m, longest) * longest * longest if m else 0

    return steps // every * one(every) + one(steps % every)


def _stack_work(layout: GdnBackwardLayout, steps: int, length: int) -> int:
    """The bytes of one stack of ``steps`` steps in chunks of ``length`` that the chunked
    reference forms: a dozen float64 arrays of ``[B, H, steps, N]``, ten of ``[B, H, steps,
    length]``, and five states and three for each chunk (with a per-channel gate, chunks of
    a step)."""
    bh, n = layout.batch * layout.heads, layout.state_size
    chunks = steps if layout.gate_per_channel else _ceil(steps, length)
    return 8 * bh * (13 * steps * n + 10 * steps * min(steps, length) + (5 + 3 * chunks) * n * n)


def _reference_peak(layout: GdnBackwardLayout, inputs: int, truth: int, states: int | None) -> int:
    """The bytes of the float64 reference's peak beyond the inputs: its forward, with
    ``states`` :func:`~gdn_layout.reference.chunk_states` beside ``y``, its backward beside
    their results. Each copies its inputs and ends with a mask of its largest result."""
    b, h, n = layout.batch, layout.heads, layout.state_size
    s = max(layout.seq, 1)  # S = 0 takes one step's bookkeeping
    bh, state, qkv, packed = b * h, b * h * n * n, layout.qkv_elems, layout.total_elems
    length = chunk_length(n)
    per_head = not layout.gate_per_channel
    if n > 1:  # the chunked form, a stack of steps at a time
        every = min(s, length)
        pairs = per_head * bh * _padded(s, every, length)
        work = _stack_work(layout, every, length) + _ceil(s, every) * _STACK_OBJECTS + qkv
        forward = (inputs + state + pairs) * 8 + work  # inputs: the copies, y for dy
        backward = (inputs + packed + pairs + _ceil(s, every) * state) * 8 + work
    else:  # the step-by-step form: checkpoints every C steps, C steps recomputed
        c = default_checkpoint_every(s)
        forward = (inputs + state + 4 * bh * 256 * n) * 8 + qkv
        backward = (inputs + packed + (_ceil(s, c) + c + 6) * state + 12 * c * bh * n) * 8 + qkv
    peak = max(forward, truth * 8 + backward)
    if states:
        chunk, count = min(states, s), _ceil(layout.seq, states)
        at = (inputs + (2 * count + 1) * state) * 8 + count * state  # h, dh, final, mask
        if n > 1:
            pairs = per_head * bh * _padded(s, chunk, min(chunk, length))
            at += pairs * 8 + _stack_work(layout, chunk, min(chunk, length))
            at += _ceil(s, chunk) * _STACK_OBJECTS
        else:  # the step-by-step form, its gradients into a scratch buffer
            at += (packed + (chunk + 6) * state + 12 * chunk * bh * n) * 8
        peak = max(peak, qkv * 8 + at)
    return peak


def _floors_peak(
    layout: GdnBackwardLayout,
    inputs: int,
    states: int | None,
    classes: tuple[str, ...],
    workers: int,
) -> tuple[int, int]:
    """The bytes of the precision floors' runs, beyond the inputs and the float64 results, and
    of the comparison after them. The runs, in float32, of each class's forms: one after
    another, each beside what the runs before it returned, or side by side on ``workers``
    threads. The chunks a fused run keeps are small arrays whose heap stays for the runs
    after it (to hold their chunks, or the states they copy last). The comparison holds a
    float64 buffer of the longest tensor and float32 copies of the fused form's strided y, h
    and dh, two at a time."""
    b, h, n = layout.batch, layout.heads, layout.state_size
    s = max(layout.seq, 1)  # S = 0 takes one step's bookkeeping
    bh, state, qkv, packed = b * h, b * h * n * n, layout.qkv_elems, layout.total_elems
    count = _ceil(layout.seq, states) if states else 0
    final = state if layout.carry_state or states else 0
    tensors = [qkv, layout.gate_elems, layout.beta_elems]  # the gradients, y as dq
    tensors += [state] * layout.carry_state + [count * state] * bool(states) + [final] * bool(final)
    longest, few = max(tensors), min(tensors) <= FEW_ELEMENTS
    uncut = (packed + qkv + final) * 4  # what a run returns, but the states
    returned = uncut + 2 * count * state * 4
    per_channel = layout.gate_per_channel

    pairs = sampled_pairs(layout)
    # The part of the rows and heads the step-by-step form runs on: with a sample, its inputs
    # are copied first. (The comparison's copies of the truth and the chunked runs there are a
    # part as small, within what the comparison is counted above the runs' peak.)
    share = 1.0 if pairs is None else len(pairs) / bh

    def step_by_step() -> int:
        every = min(states, s) if states else default_checkpoint_every(s)
        held = _ceil(s, every) + count + every + 7  # checkpoints, dh, an interval's states
        copies = inputs * (1 + (pairs is not None))
        run = (copies + packed + qkv + held * state + 16 * every * bh * n) * 4
        return int(run * share) + longest

    def fused(chunk: int | None, sized: bool, heap: int) -> tuple[int, int]:
        """The peak of a fused run cut every ``chunk`` steps too, with the chunks it keeps in
        a heap of at least ``heap`` bytes, and the chunks it keeps."""
        starts = _ceil(s, FUSED_CHUNK)
        if chunk:
            starts += _ceil(s, chunk) - _ceil(s, math.lcm(FUSED_CHUNK, chunk))
        c = _ceil(s, starts)  # steps of a chunk, on average
        # A chunk's float32 arrays, and those its budget counts: views of q, k, v too.
        if per_channel:
            each = (c * c * n + 3 * c * c + 8 * c * n + c) * bh * 4
            counted = each + 4 * c * n * bh * 4
        else:
            each = (6 * c * c + 6 * c * n + 2 * c) * bh * 4
            counted = each + 3 * c * n * bh * 4
        keeps = min(starts, KEEP_BYTES // max(counted, 1)) * (each + _CHUNK_OBJECTS)
        # Forming a chunk again and its backward: 18 arrays [B, H, C, C], 12 [B, H, C, N],
        # five [B, H, C, C, N] with a per-channel gate, four states.
        work = ((18 + 5 * per_channel * n) * c * c + 12 * c * n) * bh * 4 + 4 * state * 4
        copies = 2 * count * state * 4 if chunk else 0  # the states at the chunk boundaries
        # the state at every boundary, and its cotangent there with ``chunk`` (else two)
        held = (starts + 1) + (starts + 1 if chunk else 2)
        peak = (inputs + held * state + packed + qkv) * 4
        peak += max(heap, keeps) + max(work, copies + longest)
        if sized:  # the sums of absolute terms of every result, in float64
            peak += (packed + qkv + 2 * (starts + 1) * state) * 8
        return peak, keeps

    forms = sorted(
        {form for c in classes for form, _ in PANEL[c]}, key=("step-by-step", *CHUNKED_RUNS).index
    )
    sizes = next((form for form in forms if form in CHUNKED_RUNS), None)
    peak = done = heap = 0  # the peak so far, what the runs returned, the chunks' heap
    for form in forms:
        start = 0 if workers > 1 else heap  # side by side, each thread has its own heap
        if form not in CHUNKED_RUNS:
            full = step_by_step()
        elif states and states % FUSED_CHUNK:  # a run uncut, then one cut at the states
            one, keeps = fused(None, few and form == sizes, start)
            two, keeps2 = fused(states, False, max(start, keeps))
            full, heap = max(one, uncut + two), max(heap, keeps, keeps2)
        else:
            full, keeps = fused(states, few and form == sizes, start)
            heap = max(heap, keeps)
        peak = peak + full if workers > 1 else max(peak, done + full)
        done += int(returned * share) if form == "step-by-step" else returned
    strided = count * state + max(qkv, count * state) if states else qkv
    return peak, longest * 8 + strided * 4


class _Case(NamedTuple):
    tag: str
    batch: int
    seq: int
    heads: int
    state_size: int
    #: The revision of the standard suite it joined, counted with the regimes'
    #: (:data:`~gdn_layout.regimes.REGIME_SINCE`): 0 the first suite's shapes, 2 those that
    #: reach every chunk boundary (revision 1 added two regimes). A new shape takes the next
    #: revision, so that its files follow every file of the suite so far (see _suite_cases).
    since: int = 0
    #: Every batch row gets the same inputs, so that a row that differs is the kernel's doing.
    identical_rows: bool = False


#: The chunk sizes a kernel is likely to use: the suite crosses at least two boundaries of
#: each, and ends a sequence one step past a boundary and one step before one.
CHUNK_SIZES: Final = (16, 32, 64, 128, 256)

#: Edge shapes of :func:`write_suite`: S=1, N=1, the shape RLX tests with (B, H > 1), S a
#: multiple of 64, S not one, S just past one, and the largest N of RLX's CPU kernels. Then
#: the chunk boundaries: S = 255 (one step short of a boundary of every chunk size), S = 300
#: with N = 128, S = 513 (one step past two boundaries of every chunk size), and two batch rows
#: of identical inputs across two 64-step boundaries.
_SUITE_SHAPES: Final = (
    _Case("s1", 1, 1, 1, 8),
    _Case("n1", 1, 7, 2, 1),
    _Case("rlx", 2, 5, 3, 8),
    _Case("s64", 1, 64, 2, 16),
    _Case("s65", 2, 65, 2, 16),
    _Case("s100", 1, 100, 3, 16),
    _Case("n128", 1, 3, 1, 128),
    _Case("s255", 1, 255, 2, 16, since=2),
    _Case("s300", 1, 300, 1, 128, since=2),
    _Case("s513", 1, 513, 2, 16, since=2),
    _Case("twin", 2, 130, 2, 8, since=2, identical_rows=True),
)


class _SuiteCase(NamedTuple):
    name: str
    layout: GdnBackwardLayout
    regime: str
    identical_rows: bool
    #: The suite's revision that added it: the later of its shape's and its regime's.
    since: int


def _suite_cases(regimes: Mapping[str, int] | None = None) -> Iterator[_SuiteCase]:
    """Every file of the standard suite, in file (and seed) order, for ``regimes`` (each
    regime's revision; by default :data:`~gdn_layout.regimes.REGIME_SINCE`): by the revision that
    added it, then by shape, gate mode, state mode and regime (in their tables' order).

    A regime or a shape added with a new revision adds files after every existing one, so that
    every file keeps its place, and so its seed and its bytes."""
    if regimes is None:
        regimes = REGIME_SINCE
    cases = [
        _suite_case(shape, per_channel, carry, regime, max(shape.since, since))
        for shape in _SUITE_SHAPES
        for per_channel in (False, True)
        for carry in (False, True)
        for regime, since in regimes.items()
    ]
    return iter(sorted(cases, key=lambda case: case.since))  # stable: the rest in table order


def _suite_case(
    shape: _Case, per_channel: bool, carry: bool, regime: str, since: int
) -> _SuiteCase:
    layout = GdnBackwardLayout(
        shape.batch,
        shape.seq,
        shape.heads,
        shape.state_size,
        gate_per_channel=per_channel,
        carry_state=carry,
    )
    name = (
        f"{shape.tag}-b{shape.batch}s{shape.seq}h{shape.heads}n{shape.state_size}"
        f"-{'channel' if per_channel else 'scalar'}"
        f"-{'state' if carry else 'nostate'}-{regime}.safetensors"
    )
    return _SuiteCase(name, layout, regime, shape.identical_rows, since)


def suite_size() -> int:
    """How many fixtures :func:`write_suite` writes: the standard suite's cases."""
    return sum(1 for _ in _suite_cases())


def suite_digest(dtype: np.dtype[Any], seed: int = 0) -> str:
    """The SHA-256, in hex, of the definition of the suite :func:`write_suite` writes in
    ``dtype`` from ``seed``: every file's name, layout, regime, revision and seed, the dtype,
    the precision classes recorded, the chunk sizes of the manifest, the fixture format, and
    the inputs drawn for each regime on a small probe (so that a regime drawn otherwise, or a
    change to any input's draw, is another definition). A suite of one digest holds what the
    code of that digest writes.

    >>> suite_digest(np.dtype(np.float32)) == suite_digest(np.dtype(np.float32))
    True
    >>> suite_digest(np.dtype(np.float32)) == suite_digest(np.dtype(np.float64))
    False
    """
    cases = list(_suite_cases())
    definition = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype_code(dtype, "write_suite"),
        "seed": seed,
        "precisions": precisions_of(dtype, "all"),
        "chunk_sizes": CHUNK_SIZES,
        "cases": [
            [case.name, case.layout.to_dict(), case.regime, case.identical_rows, case.since]
            for case in cases
        ],
    }
    digest = hashlib.sha256(json.dumps(definition, sort_keys=True).encode())
    probe = GdnBackwardLayout(1, 3, 2, 2, gate_per_channel=True, carry_state=True)
    for regime in dict.fromkeys(case.regime for case in cases):
        for array in draw_inputs(probe, regime=regime, seed=seed, dtype=np.float64):
            digest.update(b"" if array is None else array.tobytes())
    return digest.hexdigest()


def _identical_rows_fixture(
    layout: GdnBackwardLayout, dtype: np.dtype[Any], regime: str, seed: int
) -> Fixture:
    """A fixture of ``layout`` whose batch rows all hold the inputs drawn for the first."""
    one = GdnBackwardLayout(
        1,
        layout.seq,
        layout.heads,
        layout.state_size,
        gate_per_channel=layout.gate_per_channel,
        carry_state=layout.carry_state,
    )
    x = draw_inputs(one, regime=regime, seed=seed, dtype=dtype)
    q, k, v, g, beta, dy = (np.repeat(a, layout.batch, axis=0) for a in x[:6])
    state = None if x.state is None else np.repeat(x.state, layout.batch, axis=0)
    inputs = GdnInputs(q, k, v, g, beta, dy, state)
    return _fixture_of(layout, inputs, regime, seed, precisions=precisions_of(dtype, "all"))


def boundaries_crossed(seq: int) -> dict[int, int]:
    """How many boundaries of each chunk size of :data:`CHUNK_SIZES` a sequence of ``seq``
    steps crosses (a boundary at ``c * C`` for ``0 < c * C < seq``).

    >>> boundaries_crossed(65)
    {16: 4, 32: 2, 64: 1, 128: 0, 256: 0}
    """
    return {size: max(seq - 1, 0) // size for size in CHUNK_SIZES}


def write_suite(
    directory: str | os.PathLike[str],
    *,
    dtype: DTypeLike = np.float32,
    seed: int = 0,
    overwrite: bool = False,
    progress: Callable[[float], object] | None = None,
    workers: int | None = 1,
) -> list[Path]:
    """Write the standard fixture set for a kernel test-suite into ``directory``.

    Every combination of gate mode (scalar, per channel), state mode (carried or not), gate
    regime (:data:`REGIMES`) and edge shape is one file. The shapes: S=1, N=1, B and H above
    1, S = 64, 65, 100 and N=128, then those that reach every chunk boundary of
    :data:`CHUNK_SIZES` (16 to 256): S = 255 (each chunk size's last chunk one step short),
    S = 513 (two boundaries of each crossed, the last chunk one step long), S = 300 with
    N = 128, and two batch rows of identical inputs over S = 130. File ``i`` uses seed
    ``seed + i``, in the order the shapes and regimes joined the suite (each names the
    revision it came with), so that a shape or a regime added later never changes an existing
    file's name, seed or bytes. ``manifest.json`` lists each file with its layout, regime,
    seed, dtype, size, SHA-256, the boundaries of each chunk size it crosses (``crosses``) and
    whether its batch rows are identical (``identical_rows``). The whole set takes tens of MiB
    in float32. Returns the fixture paths. ``progress``, when given, is called with the
    fraction of the files written so far.

    The suite is all or nothing: it is written into a temporary folder next to ``directory``
    and renamed into place when complete. A ``directory`` that exists and is not empty is
    refused unless ``overwrite=True``, which replaces the whole folder, provided it holds a
    suite written here (its manifest says so) and nothing its manifest does not list: a
    folder's own files are never removed. The new folder is exchanged with the old in one step
    where the system can (Linux), so ``directory`` always holds one complete suite, and the old
    one is removed after. Concurrent runs each end with one complete suite in ``directory``,
    the last one's.

    Parameters
    ----------
    directory : str or os.PathLike
        The suite's folder; created, with its parents, when missing.
    dtype : dtype_like
        The dtype of every fixture.
    seed : int
        The first file's seed.
    overwrite : bool
        Replace an existing, non-empty folder that holds only a suite and its listed files.
    progress : callable, optional
        Called with the fraction of the files written.
    workers : int or None
        Processes that make the fixtures, each one file at a time: 1, the default, makes them
        in the calling thread, None one process per core this process may use. The files and
        the manifest are the same, byte for byte, for every value. Above 1 the processes are
        spawned: a script that calls ``write_suite`` at its top level guards the call with
        ``if __name__ == "__main__":``, as :mod:`multiprocessing` asks.

    Returns
    -------
    list of pathlib.Path
        The fixture files, in manifest order, spelled from ``directory`` as given.

    Raises
    ------
    FileExistsError
        ``directory`` exists and is not empty while ``overwrite`` is false, it is not a
        folder, or it holds something its manifest does not list or no manifest written here
        (it is then never replaced).
    TypeError, ValueError
        ``dtype`` or ``seed`` is not usable; ValueError too when ``directory`` is the current
        folder or holds it (the suite would take its place).
    OSError
        A file cannot be written; nothing is left in ``directory`` then.
    RuntimeError
        A worker process ended abruptly; nothing is left in ``directory`` then.

    See Also
    --------
    load_suite : Read it back.
    verify_suite : Check it against its manifest.
    make_fixture : One fixture.
    """
    given = Path(directory)
    target = resolve_dtype(dtype, "write_suite")
    seed = check_seed(seed, "write_suite")
    processes = reference.resolve_workers(workers, "write_suite")
    root = Path(os.path.realpath(given))  # a named folder with a parent, even for "."
    try:
        here = os.path.realpath(os.getcwd())
    except FileNotFoundError:  # the current folder was removed: it cannot be replaced
        here = None
    if here is not None and os.path.commonpath([root, here]) == os.fspath(root):
        raise ValueError(
            f"write_suite: directory {os.fspath(given)!r} is the current folder or holds it: a "
            "suite takes the place of its folder, which would leave the current one deleted; "
            f"give a folder inside it, such as {os.fspath(given / 'suite')!r}"
        )
    if _non_empty_folder(root):  # refused now, not after the work (and again when moved in)
        if not overwrite:
            raise FileExistsError(
                f"{root} exists and is not empty; pass overwrite=True to replace it"
            )
        if (why := _not_a_suite(root)) is not None:
            raise FileExistsError(f"{root} is not replaced: {why}")
    root.parent.mkdir(parents=True, exist_ok=True)
    names = write_folder(
        root,
        lambda built: _write_suite_files(built, target, seed, progress, processes),
        overwrite=overwrite,
        replaceable=_not_a_suite,
        own=_of_a_suite,
    )
    return [given / name for name in names]


def _in_order(
    cases: list[_SuiteCase], target: np.dtype[Any], seed: int, workers: int
) -> Iterator[Fixture]:
    """The fixture of each case, in order, made in ``workers`` processes at most
    ``2 * workers`` ahead of the one handed out, so that few fixtures wait in memory.

    Processes, not threads: a suite's cases are small, and threads making them would queue on
    the GIL between NumPy's short calls. They are started by spawning, the one start method
    every system has, and one that copies no lock held by another thread."""
    workers = min(workers, len(cases), _MOST_PROCESSES if os.name == "nt" else workers)
    if workers <= 1:
        yield from (_suite_fixture(case, target, seed + i) for i, case in enumerate(cases))
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        pending: deque[Future[Fixture]] = deque()
        try:
            for index, case in enumerate(cases):
                pending.append(pool.submit(_suite_fixture, case, target, seed + index))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as err:
            raise RuntimeError(
                "write_suite: a worker process ended abruptly (killed, out of memory, or "
                "started from a script that calls write_suite at its top level: guard the call "
                'with if __name__ == "__main__":); its own error, if any, is on stderr'
            ) from err
        finally:
            for future in pending:
                future.cancel()


#: The most processes a pool may have on Windows (``ProcessPoolExecutor`` refuses more).
_MOST_PROCESSES: Final = 61


def _suite_fixture(case: _SuiteCase, target: np.dtype[Any], seed: int) -> Fixture:
    """The fixture of one file of the standard suite."""
    if case.identical_rows:
        return _identical_rows_fixture(case.layout, target, case.regime, seed)
    return make_fixture(case.layout, dtype=target, regime=case.regime, seed=seed, precisions="all")


def _non_empty_folder(path: Path) -> bool:
    try:
        return any(True for _ in os.scandir(path))
    except NotADirectoryError:
        raise FileExistsError(f"{path} exists and is not a folder") from None
    except FileNotFoundError:
        return False


def _not_a_suite(folder: Path) -> str | None:
    """Why ``folder`` may not be replaced by a suite; None when it holds a suite this library
    wrote (its manifest says so) and nothing but the regular files that manifest lists."""
    try:
        listed = {entry["file"] for entry in read_manifest(folder)}
    except NotASuite as err:
        return f"{err.why}; {_ADVICE}"
    with os.scandir(folder) as entries:
        found = [(entry.name, entry.is_file(follow_symlinks=False)) for entry in entries]
    odd = sorted(name for name, regular in found if name in listed and not regular)
    if odd:
        return (
            f"the files {', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''} it lists are "
            f"not regular files (a symbolic link, a folder, ...); {_ADVICE}"
        )
    foreign = sorted(name for name, _ in found if name != MANIFEST and name not in listed)
    if foreign:
        return (
            f"it holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which its "
            f"manifest does not list; {_ADVICE}"
        )
    return None


_ADVICE: Final = "move it away yourself or choose another folder"


def _of_a_suite(folder: Path) -> list[str] | None:
    """What of a replaced suite in ``folder`` is the suite's own, to be removed: the files its
    manifest lists, then the manifest; None for a folder without one (unfinished work)."""
    try:
        return [*(entry["file"] for entry in read_manifest(folder)), MANIFEST]
    except NotASuite:
        return None


def _write_suite_files(
    root: Path,
    target: np.dtype[Any],
    seed: int,
    progress: Callable[[float], object] | None,
    workers: int = 1,
) -> list[str]:
    """Write every fixture and the manifest into the empty folder ``root``; their names."""
    entries: list[dict[str, Any]] = []
    cases = list(_suite_cases())
    for index, fixture in enumerate(_in_order(cases, target, seed, workers)):
        name, layout, regime, identical_rows, _since = cases[index]
        path = save_fixture(root / name, fixture)
        if progress is not None:
            progress((index + 1) / len(cases))
        entries.append(
            manifest_entry(
                name,
                path.read_bytes(),
                layout=layout.to_dict(),
                regime=regime,
                seed=seed + index,
                crosses={str(c): n for c, n in boundaries_crossed(layout.seq).items()},
                identical_rows=identical_rows,
                dtype=dtype_code(target, "write_suite"),
            )
        )
    text = manifest_text(
        entries,
        gdn_layout_version=__version__,
        dtype=dtype_code(target, "write_suite"),
        seed=seed,
    )

    def write(out: IO[bytes]) -> None:
        out.write(text)

    atomic_write(root / MANIFEST, write, overwrite=False)
    return [entry["file"] for entry in entries]
