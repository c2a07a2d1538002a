"""Misreadings: the op computed with its inputs read another way, verified by re-running it.

docs/findings.md (*Misreadings*) says when a reading is named and what a re-run costs. Each
reading of :data:`READINGS` re-runs the op's step-by-step form in float64 on a slice of the
case (the first two batch rows, as many heads as keep ``rows * heads * S * N**2`` within
:data:`BUDGET`), and is named only when the kernel's every judged gradient passes the same
criterion against that re-run. Where a reading's op grows, or the kernel nearly holds it, it
runs again in float32, step by step and in the fused kernels' chunked form: their worst
rounding raises the floors, as the fixture's two forms set the op's.

>>> import numpy as np
>>> from gdn_layout import GdnBackwardLayout, make_fixture, compare
>>> from gdn_layout.reference import backward
>>> fx = make_fixture(GdnBackwardLayout(1, 12, 2, 4, carry_state=True), regime="mild")
>>> q, k, v, g, beta, dy, state = fx.inputs
>>> kernel = backward(q, k, v, g, beta, dy, state.swapaxes(-1, -2), dtype=np.float32)
>>> print(compare(kernel, fx).findings[0].text)  # doctest: +NORMALIZE_WHITESPACE
every gradient matches the op with the initial state read transposed (state[b, h, j, i]):
the kernel reads the state as [V, K]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from .._dtypes import finfo
from .._floors import term_scales
from ..layout import GdnBackwardLayout
from ..packing import unpack
from ..reference._fused import FUSED_CHUNK, fused_backward
from ..reference._recurrent import step_ends, step_gradients
from ._criterion import Scores
from ._findings import ROUNDING_MAX, Finding

_Array = NDArray[Any]  # float64, or float32 for the re-run that rounds as a kernel does
#: The gradients of one re-run, by name; None where the reading says nothing of one.
_Grads = dict[str, _Array | None]

# -- the tuned constants, each with its reason -----------------------------------------------

#: The most state elements a re-run steps through (``rows * heads * S * N**2``): a failing
#: compare of the standard suite re-runs in about 0.2 s, one of B=2 S=1024 H=8 N=128 in a few.
BUDGET: Final = 1 << 24
#: The least values a reading is verified on, and shown on (those of the gradients where it
#: differs from the op): on a handful a shift or a rounding matches as well.
_VERIFIED: Final = 16
_PADDED: Final = (16, 32, 64, 128, 256)  # head sizes a library pads N to
#: About the most bytes a run of the fused chunked form takes at once: it runs a group of
#: heads at a time, one head at least.
_FUSED_BYTES: Final = 32 << 20
#: Values within 16 binades of float32's largest may overflow in another order of the sums
#: that form them: a kernel's value there is free.
_NEAR_OVERFLOW: Final = float(np.finfo(np.float32).max) * 2.0**-16
#: The gradients a screen judges (dq on the first steps, dv on the last; dk where a variant
#: takes dq for it), whose floors a reading's own float32 rounding raises by at most _cap.
_SCREENED: Final = ("dq", "dk", "dv")
#: The words of a variant whose gradients are taken back, by the chain rule, to the tensors
#: the user passed: a port that wraps the op in autograd gets them so, where a hand-written
#: kernel writes the gradients of what it read into its own slots.
_CHAINED: Final = "its gradients taken back to the tensors passed (autograd)"
#: The steps at each end a screen runs (misreading_findings' ruled_out): a long case's full
#: re-runs are made only for the readings its two ends leave possible.
_ENDS: Final = 16
#: The chunk length of the fused kernels whose masked decay differences may overflow.
_KERNEL_CHUNK: Final = 64


class _Slice(NamedTuple):
    """The slice of a case a re-run reads, in the op's ``[B, S, H, N]`` shapes: float64, or
    float32 for a re-run that rounds as a kernel does, step by step or, when ``chunked``, in
    the fused kernels' chunked form."""

    q: _Array
    k: _Array
    v: _Array
    g: _Array
    beta: _Array
    dy: _Array
    state: _Array | None
    per_channel: bool
    chunked: bool = False
    skip: frozenset[str] = frozenset()  # variants a screen ruled out: their runs not made
    ends: bool = False  # dq on the first _ENDS steps and dv on the last alone (a screen's)


class _NoForm(Exception):
    """The chunked form cannot compute this reading: it takes a log-gate on key rows."""


def _step_form(
    x: _Slice,
    *,
    q: _Array | None = None,
    k: _Array | None = None,
    gate: _Array | None = None,
    decay: _Array | None = None,
    beta: _Array | None = None,
    state: _Array | None = None,
    columns: bool = False,
    cotangent: _Array | None = None,
    fold: bool = False,
) -> dict[str, _Array]:
    """The op's step-by-step form, or its fused chunked form when ``x.chunked``, with the
    inputs given read in place of ``x``'s: the log-gate ``gate`` or a decay ``decay`` given
    directly, a per-channel decay on value columns when ``columns``, a cotangent on the final
    state, the batch rows as one sequence when ``fold``. ``dg`` is the gradient of the gate
    read. Raises :class:`_NoForm` for a chunked form given ``decay`` or ``columns``."""
    q = x.q if q is None else q
    k = x.k if k is None else k
    g = x.g if gate is None else gate
    b = x.beta if beta is None else beta
    s0 = x.state if state is None else state
    v, dy = x.v, x.dy
    rows, seq, heads, n = q.shape
    if fold:  # [B, S, ...] as [1, B*S, ...]: row r's first step follows row r-1's last
        q, k, v, dy = (t.reshape(1, rows * seq, heads, n) for t in (q, k, v, dy))
        g = g.reshape(1, rows * seq, *g.shape[2:])
        decay = None if decay is None else decay.reshape(g.shape)
        b = b.reshape(1, rows * seq, heads)
        s0 = None if s0 is None else s0[:1]
    if x.chunked:
        if decay is not None or columns:
            raise _NoForm
        grads = _fused_form(q, k, v, g, b, dy, s0, cotangent)
    else:
        gate_read = g if decay is None else None
        run = functools.partial(step_ends, steps=_ENDS) if x.ends else step_gradients
        grads = run(
            q, k, v, gate_read, b, dy, s0, decay=decay, columns=columns, cotangent=cotangent,
            dtype=q.dtype,
        )._asdict()  # fmt: skip
    if fold:
        for name in grads.keys() - {"dstate"}:
            grads[name] = grads[name].reshape(rows, seq, *grads[name].shape[2:])
        grads["dstate"] = np.concatenate([grads["dstate"], np.zeros_like(grads["dstate"])])[:rows]
    return grads


def _fused_form(
    q: _Array,
    k: _Array,
    v: _Array,
    g: _Array,
    beta: _Array,
    dy: _Array,
    state: _Array | None,
    cotangent: _Array | None,
) -> dict[str, _Array]:
    """The fused kernels' chunked form in ``q``'s dtype: the fixture's ``chunked`` floors run,
    on a reading's inputs. A group of heads where it overflows is NaN."""
    rows, seq, heads, n = q.shape
    out = {
        "dq": np.empty_like(q),
        "dk": np.empty_like(k),
        "dv": np.empty_like(v),
        "dg": np.empty_like(g),
        "dbeta": np.empty_like(beta),
        "dstate": np.zeros((rows, heads, n, n), q.dtype),
    }
    # A group of heads at a time (one at least): a per-channel chunk's temporaries are 64
    # times its inputs (reference._fused).
    each = q.dtype.itemsize * rows * (8 * FUSED_CHUNK**2 * (n if g.ndim == 4 else 1) + 32 * seq * n)
    step = max(1, _FUSED_BYTES // max(each, 1))
    for h0 in range(0, heads, step):
        part = slice(h0, min(h0 + step, heads))
        qp, kp, vp, gp, bp, dyp = (t[:, :, part] for t in (q, k, v, g, beta, dy))
        s0 = None if state is None else state[:, part]
        c0 = None if cotangent is None else cotangent[:, part]
        layout = GdnBackwardLayout.from_inputs(qp, gp, s0)
        try:
            flat, _, _ = fused_backward(
                qp, kp, vp, gp, bp, dyp, s0, dtype=q.dtype, cotangent=c0, keep=0
            )
        except FloatingPointError:  # the recurrence overflowed
            flat = np.full(layout.total_elems, np.nan, q.dtype)
        grads = unpack(flat, layout)
        for name in ("dq", "dk", "dv", "dg", "dbeta"):
            out[name][:, :, part] = getattr(grads, name)
        if grads.dstate is not None:
            out["dstate"][:, part] = grads.dstate
    return out


# -- the readings ------------------------------------------------------------------------


class Reading(NamedTuple):
    """One misreading of the op's inputs or conventions.

    ``name`` is ``details["reading"]``; ``computes`` completes "every gradient matches the op
    with ..."; ``applies`` says whether it can change a case of a layout; ``truths`` yields,
    for a slice of the case, each variant's words (``""`` for one variant alone) and its
    gradients (None for a gradient the reading leaves unjudged).
    """

    name: str
    computes: str
    applies: Callable[[GdnBackwardLayout], bool]
    truths: Callable[[_Slice], Iterator[tuple[str, _Grads]]]


def _state_transposed(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    assert x.state is not None
    grads: _Grads = dict(_step_form(x, state=x.state.swapaxes(-1, -2)))
    yield "", grads
    dstate = grads["dstate"]
    assert dstate is not None
    yield (
        "dstate written with the same stride (one transposed stride for both)",
        {**grads, "dstate": dstate.swapaxes(-1, -2)},
    )


def _gate_as_decay(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    yield "", dict(_step_form(x, decay=x.g))  # its dg: that of the decay read, g itself


def _gate_exp_twice(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    grads: _Grads = dict(_step_form(x, gate=np.exp(x.g)))
    yield "", grads
    dg = grads["dg"]
    assert dg is not None
    yield _CHAINED, {**grads, "dg": dg * np.exp(x.g)}  # through the exp the glue took


def _gate_shift(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    for late in (True, False):
        g = np.zeros_like(x.g)  # the step without a gate reads g = 0: no decay
        if late:
            g[:, 1:] = x.g[:, :-1]
        else:
            g[:, :-1] = x.g[:, 1:]
        if np.array_equal(g, x.g):  # a constant gate reads the same either way: only a
            continue  # dg stored a step off would differ, which is a shift, not a reading
        words = "g[t - 1] at step t (the gate read one step late)"
        if not late:
            words = "g[t + 1] at step t (the gate read one step early)"
        used, own = (
            f"{words}, dg[t] the gradient of {w}" for w in ("the gate step t used", "g[t]")
        )
        if {used, own} <= x.skip:
            continue
        grads: _Grads = dict(_step_form(x, gate=g))
        dg = grads["dg"]
        assert dg is not None
        moved = np.zeros_like(dg)  # the gradient of g[t] stored where g[t] is, not at step t
        if late:
            moved[:, :-1] = dg[:, 1:]
        else:
            moved[:, 1:] = dg[:, :-1]
        yield used, grads
        yield own, {**grads, "dg": moved}


def _gate_axis(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    yield "", dict(_step_form(x, columns=True))


def _g_beta_swapped(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    grads: _Grads = dict(_step_form(x, gate=x.beta, beta=x.g))
    yield "", grads
    yield _CHAINED, {**grads, "dg": grads["dbeta"], "dbeta": grads["dg"]}


_WITHOUT: Final = "dv formed without beta (dv = du, not beta * du)"


def _beta_missing(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    ones = "beta = 1 in the update (dbeta not judged)"
    if ones not in x.skip:
        yield ones, {**_step_form(x, beta=np.ones_like(x.beta)), "dbeta": None}
    if _WITHOUT in x.skip:
        return
    truth = _step_form(x)
    dv = truth["dv"]
    assert dv is not None
    with np.errstate(divide="ignore", invalid="ignore"):
        without = np.where(x.beta[..., None] != 0, dv / x.beta[..., None], 0.0)
    yield _WITHOUT, {**truth, "dv": without}


def _normalized(t: _Array) -> tuple[_Array, _Array]:
    norm = np.sqrt(np.sum(t * t, axis=-1, keepdims=True))
    return t / np.where(norm > 0, norm, 1.0), norm


def _qk_normalized(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    (q, nq), (k, nk) = _normalized(x.q), _normalized(x.k)
    grads: _Grads = dict(_step_form(x, q=q, k=k))
    chained = dict(grads)
    for name, unit, norm in (("dq", q, nq), ("dk", k, nk)):
        d = grads[name]
        assert d is not None
        along = np.sum(unit * d, axis=-1, keepdims=True)
        chained[name] = (d - unit * along) / np.where(norm > 0, norm, 1.0)
    yield "", chained
    yield "its dq and dk those of the normalized q and k", grads


def _qk_swapped(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    grads: _Grads = dict(_step_form(x, q=x.k, k=x.q))
    yield "", grads
    yield _CHAINED, {**grads, "dq": grads["dk"], "dk": grads["dq"]}


def _final_state_cotangent(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    rows, _, heads, n = x.q.shape
    ones = np.ones((rows, heads, n, n), x.q.dtype)
    yield "", dict(_step_form(x, cotangent=ones))


def _batch_folded(x: _Slice) -> Iterator[tuple[str, _Grads]]:
    yield "", {**_step_form(x, fold=True), "dstate": None}  # a folded run has one initial state


READINGS: Final[tuple[Reading, ...]] = (
    Reading(
        "state_transposed",
        "the initial state read transposed (state[b, h, j, i]): the kernel reads the state "
        "as [V, K]",
        lambda layout: layout.carry_state,
        _state_transposed,
    ),
    Reading(
        "gate_as_decay",
        "the decay g itself instead of exp(g): the kernel takes a decay and was passed the "
        "log-gate",
        lambda layout: True,
        _gate_as_decay,
    ),
    Reading(
        "gate_exp_twice",
        "the decay exp(exp(g)): the kernel takes a log-gate and was passed the decay exp(g)",
        lambda layout: True,
        _gate_exp_twice,
    ),
    Reading("gate_shift", "", lambda layout: layout.seq > 1, _gate_shift),
    Reading(
        "gate_axis",
        "the per-channel decay on value columns instead of key rows",
        lambda layout: layout.gate_per_channel,
        _gate_axis,
    ),
    Reading(
        "g_beta_swapped",
        "g and beta exchanged (argument order?)",
        lambda layout: not layout.gate_per_channel,
        _g_beta_swapped,
    ),
    Reading("beta_missing", "", lambda layout: True, _beta_missing),
    Reading(
        "qk_normalized",
        "q and k L2-normalized again inside (an l2norm flag left on?)",
        lambda layout: True,
        _qk_normalized,
    ),
    Reading("qk_swapped", "q and k exchanged", lambda layout: True, _qk_swapped),
    Reading(
        "final_state_cotangent",
        "a cotangent of ones on the final state added (the op has none)",
        lambda layout: True,
        _final_state_cotangent,
    ),
    Reading("scale", "", lambda layout: True, lambda x: iter(())),  # a factor: _scales
    Reading(
        "batch_folded",
        "the batch rows run as one sequence: the state carried from row b into row b + 1",
        lambda layout: layout.batch > 1,
        _batch_folded,
    ),
)


def _scales(n: int) -> Iterator[tuple[str, float]]:
    """The scales a kernel may use instead of ``1/sqrt(N)``, in words, over the op's."""
    c = 1.0 / math.sqrt(n)
    yield "the scale 1 instead of 1/sqrt(N)", 1.0 / c
    yield "the scale 1/N instead of 1/sqrt(N)", (1.0 / n) / c
    for padded in _PADDED:
        if padded > n:
            yield (
                f"the scale 1/sqrt({padded}) (N padded to {padded}) instead of 1/sqrt({n})",
                (1.0 / math.sqrt(padded)) / c,
            )


# -- verification ------------------------------------------------------------------------


def misreading_findings(
    actual: Mapping[str, NDArray[Any]],
    expected: Mapping[str, NDArray[Any]],
    inputs: tuple[NDArray[Any] | None, ...],
    layout: GdnBackwardLayout,
    scores: Scores,
) -> tuple[Finding, ...]:
    """The misreadings of :data:`READINGS` the kernel's gradients ``actual`` (by name, in
    their shapes) pass against, on a slice of the case; () when the slice passes against
    ``expected`` (the fixture's gradients). ``inputs`` are the case's ``q, k, v, g, beta, dy,
    state``; ``scores`` the criteria the case was judged by, made again against a reading
    (:meth:`Scores.against`). The first reading verified ends the search; else one every
    gradient but one matches (docs/findings.md) is named so."""
    if layout.seq == 0 or layout.state_size == 0 or layout.batch == 0 or layout.heads == 0:
        return ()
    rows = slice(0, min(layout.batch, 2))
    steps = layout.seq * layout.state_size**2 * (rows.stop - rows.start)
    names = layout.names
    heads = _worst_heads(actual, expected, names, rows, max(1, min(layout.heads, BUDGET // steps)))
    actual_of = {n: _sliced(actual[n], n, rows, heads, keep=True) for n in names}
    op = {n: _sliced(expected[n], n, rows, heads) for n in names}
    theirs: _Grads = dict(op)
    x = _case_slice(inputs, layout, rows, heads)
    # The reading's op rounds as the kernel's would: its floors are at least that rounding,
    # and where it leaves the kernel's range the kernel's values are free.
    low = None
    if any(np.asarray(actual[n]).dtype != np.float64 for n in names):
        state = None if x.state is None else x.state.astype(np.float32)
        q, k, v, g, beta, dy = (t.astype(np.float32) for t in x[:6])
        low = _Slice(q, k, v, g, beta, dy, state, x.per_channel)
    op_term = term_scales(x.q, x.k, op["dq"], op["dk"], per_channel=x.per_channel)["dg"]

    @functools.cache
    def limit(name: str) -> float:
        """``K`` of the class gradient ``name`` is judged in; NaN for explicit tolerances."""
        return scores.against(name, np.ones(1), None, None).limit

    def dg_term(grads: _Grads) -> float:
        """The scale of the terms ``grads``' ``dg`` is formed from: its own ``dq`` and
        ``dk``'s, or, for a gradient judged alone, the op's."""
        dq, dk = grads.get("dq"), grads.get("dk")
        if dq is None or dk is None or grads is theirs:
            return op_term
        return term_scales(x.q, x.k, dq, dk, per_channel=x.per_channel)["dg"]

    def passes(
        grads: _Grads,
        rounded: tuple[_Grads, ...] | None,
        kernel: Mapping[str, Any],
        stored: bool = False,
    ) -> int | None:
        """How many values ``kernel``'s judged gradients were compared on, when all pass
        against ``grads``; None when one fails. ``rounded``: the reading's float32 runs, the
        step-by-step form's first, whose overflow frees values; the floors are at least the
        worst of their rounding. ``stored``: the floors are at least the rounding of
        ``grads``' own values to the kernel's dtype (the fixture's are its op's)."""
        term = dg_term(grads)
        verified = 0
        for name in (n for n in names if grads.get(n) is not None):
            e = np.asarray(grads[name], np.float64)
            a = np.asarray(kernel[name], np.float64)
            figures = []  # the (rms, max) of each rounding the floors are at least
            if rounded is not None and rounded[0].get(name) is not None:
                r = np.asarray(rounded[0][name], np.float64)
                big = np.abs(e) > min(_NEAR_OVERFLOW, float(finfo(actual_of[name].dtype).max))
                free = ~np.isfinite(r) | big | ~np.isfinite(e)  # past any float: unverifiable
                if (~np.isfinite(a) & ~free).any():
                    return None
                e, a = e[~free], a[~free]
                cap = _cap(limit(name)) if name in _SCREENED else (math.inf, math.inf)
                forms = (np.asarray(form[name], np.float64)[~free] for form in rounded)
                figures += [
                    (min(rms, cap[0]), min(peak, cap[1]))
                    for rms, peak in (_figures(o, e) for o in forms if np.isfinite(o).all())
                ]
            if stored:
                figures.append(_stored_figures(e, actual_of[name].dtype))
            if not np.isfinite(e).all():
                return None
            floor = (max(f[0] for f in figures), max(f[1] for f in figures)) if figures else None
            if scores.against(name, e, term if name == "dg" else None, floor).score(a, e) > 1:
                return None
            verified += e.size
        return verified

    failing = {n for n in names if passes({n: theirs[n]}, None, actual_of) is None}
    if not failing:
        return ()

    def holds(grads: _Grads, rounded: tuple[_Grads, ...] | None) -> bool:
        """The reading judges a gradient the kernel fails, changes the op's values in one it
        judges (else a bug of its own, a moved ``dg``, would pass for it), and the kernel
        passes against it."""
        judged = {n for n in names if grads.get(n) is not None}
        if not failing & judged:
            return False
        shown = [n for n in judged if passes({n: grads[n]}, None, theirs) is None]
        if sum(np.asarray(grads[n]).size for n in shown) < _VERIFIED:
            return False
        verified = passes(grads, rounded, actual_of, stored=True)
        return verified is not None and verified >= _VERIFIED

    def but_one(grads: _Grads) -> str | None:
        """The one judged gradient the kernel misses ``grads`` in, past rounding's reach,
        when it matches them in every other, and those show the reading in two gradients the
        kernel fails against the op: a reading in the update, one gradient formed otherwise."""
        judged = [n for n in names if grads.get(n) is not None]
        missed = [n for n in judged if passes({n: grads[n]}, None, actual_of) is None]
        if len(missed) != 1 or len(judged) < 3:
            return None
        name = missed[0]
        e, a = (np.asarray(t[name], np.float64) for t in (grads, actual_of))
        near = dg_term(grads) if name == "dg" else None
        if scores.against(name, e, near, None).score(a, e) <= ROUNDING_MAX:
            return None
        shown = [
            n
            for n in judged
            if n != name and n in failing and passes({n: grads[n]}, None, theirs) is None
        ]
        return name if len(shown) >= 2 and holds({**grads, name: None}, None) else None

    kernel64 = {n: np.asarray(actual_of[n], np.float64) for n in _SCREENED if n in names}
    peaks = {n: float(np.abs(a[np.isfinite(a)]).max(initial=0.0)) for n, a in kernel64.items()}

    def ruled_out(reading: Reading) -> frozenset[str] | None:
        """The variants of ``reading`` a screen rules out; None when it rules out all. On a
        long sequence each reading runs first on its two ends alone (``dq`` on the first
        :data:`_ENDS` steps, ``dv`` on the last: their values are the full run's), and a
        variant the kernel misses there under any floors the full check may use
        (:func:`_misses`), in as many gradients as leave it neither named nor named but one,
        is not run in full."""
        if layout.seq <= 8 * _ENDS:
            return frozenset()  # a full run of a short sequence costs as little
        ends = reading.truths(x._replace(ends=True))
        lows = {} if low is None else dict(reading.truths(low._replace(ends=True)))
        out, every = set(), True
        for words, grads in ends:
            judged = [n for n in names if grads.get(n) is not None]
            missed = {
                n
                for n in kernel64
                if _misses(n, grads.get(n), lows.get(words, {}).get(n), kernel64[n], peaks[n],
                           actual_of[n].dtype, scores)
            }  # fmt: skip
            rest = failing - missed  # but_one names one gradient missed, two failing shown
            if missed and (len(missed) >= 2 or len(judged) < 3 or len(rest) < 2):
                out.add(words)
            else:
                every = False
        return None if every else frozenset(out)

    partial: Finding | None = None
    with np.errstate(all="ignore"):
        for reading in READINGS:
            if not reading.applies(layout):
                continue
            scaled = reading.name == "scale"  # a scale is the truth times a factor: no re-run
            if scaled:
                variants: Iterator[tuple[str, _Grads]] = (
                    (words, {n: factor * t for n, t in theirs.items() if t is not None})
                    for words, factor in _scales(layout.state_size)
                )
            else:
                skip = ruled_out(reading)
                if skip is None:
                    continue  # every variant ruled out: no full run
                variants = (
                    (w, g) for w, g in reading.truths(x._replace(skip=skip)) if w not in skip
                )
            rounded: dict[str, tuple[_Grads, ...]] | None = None
            for words, grads in variants:
                named = holds(grads, None)
                if (not named and not scaled and low is not None) and (
                    _grows(grads, theirs, actual_of) or _nearer(grads, theirs, actual_of, failing)
                ):
                    # its op's own float32 rounding may be what the kernel misses by: a
                    # second run of each variant, only for a reading that grows or nearly holds
                    if rounded is None:
                        rounded = _rounded(reading, low)
                    named = words in rounded and holds(grads, rounded[words])
                if named:
                    return (_finding(reading, words),)
                if partial is None and not scaled and (missed := but_one(grads)) is not None:
                    op_s = passes({missed: theirs[missed]}, None, actual_of) is not None
                    partial = _finding(reading, words, but=missed, op_s=op_s)
    return () if partial is None else (partial,)


def _misses(
    name: str,
    e: _Array | None,
    low: _Array | None,
    a: _Array,
    largest: float,
    dtype: np.dtype[Any],
    scores: Scores,
) -> bool:
    """Whether the kernel's gradient ``name`` ``a`` (float64; ``largest`` its largest finite
    magnitude, stored in ``dtype``) fails against a screen's values ``e`` (NaN where not
    run; ``low`` the same in float32, whose overflow frees values) under any floors the full
    check may judge it by.

    Why it holds: the full check's floors are at most ``f = max(fixture's, cap, eps)``
    (:func:`_cap`; ``eps`` the stored rounding), so a variant passing has ``rms(e) <= max|a| /
    (1 - K f_rms)``, and every error at most ``K f_max rms(e)``, or ``K eps max|e|``. An error
    past the larger bound fails it."""
    if e is None:
        return False
    e = np.asarray(e, np.float64)
    reach = min(_NEAR_OVERFLOW, float(finfo(dtype).max))
    judged = np.isfinite(e) & np.isfinite(a) & (np.abs(e) <= reach)
    if low is not None:
        judged &= np.isfinite(low)
    if not judged.any():
        return False
    error = np.abs(a - e)[judged]
    eps = float(finfo(dtype).eps)  # a value stored in dtype is within eps/2 of it
    cap = _cap(scores.against(name, np.ones(1), None, None).limit)
    judge = scores.against(name, np.ones(1), None, (max(cap[0], eps), cap[1]))
    if judge.mode != "calibrated":  # explicit tolerances: elementwise, judged alike
        return bool(judge.counts_elements and (error > judge.allowances(np.abs(e[judged]))).any())
    assert judge.precision is not None
    assert judge.floor is not None
    half = judge.precision.unit_roundoff / 2  # the least floor, by rms(expected)
    k, rms_floor, max_floor = judge.limit, max(judge.floor[0], half), max(judge.floor[1], half)
    if k * rms_floor >= 1 or k * eps >= 1:
        return False
    bound = max(k * max_floor * largest / (1 - k * rms_floor), k * eps * largest / (1 - k * eps))
    return float(error.max()) > bound * (1 + 1e-9)


def _cap(limit: float) -> tuple[float, float]:
    """The most a reading's own float32 rounding raises the ``(rms, max)`` floors of
    :data:`_SCREENED`: ``1/(32K)`` and ``1/(8K)`` for the class's ``K``. Past that a kernel
    could miss the reading by an eighth of its values and pass."""
    if not limit > 0:
        return (math.inf, math.inf)
    return (1.0 / (32 * limit), 1.0 / (8 * limit))


def _rounded(reading: Reading, low: _Slice) -> dict[str, tuple[_Grads, ...]]:
    """Each variant of ``reading`` run in float32, by its words: step by step, and in the
    fused kernels' chunked form where that form can compute it (a kernel of either form
    rounds as that form does; the fixture's floors are the worst of the same two). By words:
    gates equal only in float32 make a variant of ``gate_shift`` that float64 has not."""
    steps = dict(reading.truths(low))
    try:
        chunked = dict(reading.truths(low._replace(chunked=True)))
    except _NoForm:
        return {words: (grads,) for words, grads in steps.items()}
    return {words: (grads, chunked[words]) for words, grads in steps.items()}


def _grows(grads: _Grads, truth: _Grads, kernel: Mapping[str, Any]) -> bool:
    """Whether a reading's float32 rounding may matter: its gradients reach a thousand times
    the op's RMS, or some are not finite, or the kernel's are not."""
    for name, values in grads.items():
        op = truth.get(name)
        if values is None or op is None:
            continue
        with np.errstate(all="ignore"):
            if not np.isfinite(values).all() or not np.isfinite(kernel[name]).all():
                return True
            if _rms(values) > 1e3 * _rms(op):
                return True
    return False


def _nearer(grads: _Grads, truth: _Grads, kernel: Mapping[str, Any], failing: set[str]) -> bool:
    """Whether the kernel is nearer a reading than the op in every gradient it fails that the
    reading judges: a near miss, which the reading's own float32 rounding may account for."""
    pairs = [(kernel[n], grads.get(n), truth.get(n)) for n in sorted(failing)]
    judged = [(np.asarray(a, np.float64), r, op) for a, r, op in pairs if r is not None]
    with np.errstate(all="ignore"):
        return bool(judged) and all(
            _rms(a - r) < _rms(a - op)
            for a, r, op in judged
            if op is not None  # always given
        )


def _rms(t: NDArray[Any]) -> float:
    return math.sqrt(float(np.mean(np.square(t, dtype=np.float64)))) if t.size else 0.0


def _figures(low: _Array, e: _Array) -> tuple[float, float]:
    """The ``(rms, max)`` floor figures of ``low`` against ``e``: RMS and largest error over
    ``rms(e)``."""
    scale = math.sqrt(float(np.mean(e * e))) if e.size else 0.0
    if scale == 0 or not np.isfinite(scale):
        return (0.0, 0.0)
    err = np.abs(low - e)
    return (math.sqrt(float(np.mean(err * err))) / scale, float(err.max()) / scale)


def _stored_figures(e: _Array, dtype: np.dtype[Any]) -> tuple[float, float]:
    """The ``(rms, max)`` floor figures of ``e`` stored in ``dtype``: a kernel returning
    ``dtype`` misses a reading's values by that much however it computes them."""
    with np.errstate(all="ignore"):
        kept = np.asarray(e).astype(dtype).astype(np.float64)
    normal = np.isfinite(kept) & (np.abs(e) >= float(finfo(dtype).tiny))
    return _figures(np.where(normal, kept, e), e)  # what underflows is not excused


def _finding(reading: Reading, variant: str, but: str | None = None, op_s: bool = False) -> Finding:
    what = "; ".join(part for part in (reading.computes, variant) if part)
    if but is None:
        text = f"every gradient matches the op with {what}"
    elif op_s:
        text = (
            f"every gradient but {but} matches the op with {what}; {but} is the op's, "
            "formed as for the inputs as given"
        )
    else:
        text = (
            f"every gradient but {but} matches the op with {what}; {but} matches neither: "
            "formed otherwise"
        )
    details: dict[str, object] = {"reading": reading.name, "variant": variant or None}
    if but is not None:
        details["but"] = but
    return Finding("misreading", None, text, details)


def _worst_heads(
    actual: Mapping[str, NDArray[Any]],
    expected: Mapping[str, NDArray[Any]],
    names: tuple[str, ...],
    rows: slice,
    count: int,
) -> slice:
    """``count`` consecutive heads around the one where the most gradients of the rows
    ``rows`` come nearest their largest error: where a misreading shows in every gradient
    it changes (under fast decay, some heads show it in one gradient alone)."""
    heads = np.asarray(actual[names[0]]).shape[2] if names else 0
    if count >= heads:
        return slice(0, heads)
    worst = np.zeros((len(names), heads))
    for i, name in enumerate(names):
        for h in range(heads):
            a = _sliced(actual[name], name, rows, slice(h, h + 1))
            e = _sliced(expected[name], name, rows, slice(h, h + 1))
            with np.errstate(all="ignore"):
                worst[i, h] = np.nan_to_num(np.max(np.abs(a - e), initial=0.0), nan=np.inf)
    largest = worst.max(axis=1, keepdims=True)
    with np.errstate(all="ignore"):
        share = np.nan_to_num(np.where(largest > 0, worst / largest, 0.0), nan=1.0)
    # The most gradients within half their largest error; then the nearest to it overall.
    best = int(np.argmax((share >= 0.5).sum(axis=0) + share.mean(axis=0) / 2))
    start = min(best, heads - count)
    return slice(start, start + count)


def _sliced(t: NDArray[Any], name: str, rows: slice, heads: slice, keep: bool = False) -> Any:
    """Gradient ``name``'s slice, in float64 unless ``keep`` (the kernel's dtype)."""
    part = t[rows, heads] if name == "dstate" else t[rows, :, heads]
    return part if keep else np.asarray(part, np.float64)


def _case_slice(
    inputs: tuple[NDArray[Any] | None, ...],
    layout: GdnBackwardLayout,
    rows: slice,
    heads: slice,
) -> _Slice:
    q, k, v, g, beta, dy, state = inputs

    def part(t: NDArray[Any] | None) -> _Array:
        assert t is not None
        return np.asarray(t[rows, :, heads], np.float64)

    return _Slice(
        part(q),
        part(k),
        part(v),
        part(g),
        part(beta),
        part(dy),
        None if state is None else np.asarray(state[rows, heads], np.float64),
        layout.gate_per_channel,
    )


def overflow_finding(
    nonfinite: Mapping[str, NDArray[Any]], g: NDArray[Any], buffers: np.dtype[Any]
) -> Finding | None:
    """``overflow`` when the gradients ``nonfinite`` (by name: the kernel's, non-finite where
    the truth is finite) are non-finite in a chunk of 64 steps whose log-decay ``-sum(g)``
    spans more than ``exp`` takes in the kernel's computation dtype (float64 for float64
    buffers, else float32): a chunked kernel that takes ``exp(G_i - G_j)`` of every pair
    before masking the anti-causal half overflows there, and ``inf * 0`` is NaN."""
    steps = g.shape[1] if g.ndim >= 3 else 0
    if not nonfinite or steps == 0:
        return None
    compute = np.float64 if buffers == np.float64 else np.float32
    reach = math.log(float(np.finfo(compute).max))
    pad = -steps % _KERNEL_CHUNK
    with np.errstate(all="ignore"):
        spans = np.pad(np.asarray(g, np.float64), [(0, 0), (0, pad)] + [(0, 0)] * (g.ndim - 2))
        spans = -spans.reshape(g.shape[0], -1, _KERNEL_CHUNK, *g.shape[2:]).sum(axis=2)
        if spans.ndim == 4:  # a per-channel gate: its largest channel
            spans = spans.max(axis=-1)
    over = spans > reach  # [B, chunks, H]
    hit = []
    for name, grad in nonfinite.items():
        if name == "dstate":
            continue
        bad: NDArray[np.bool_] = ~np.isfinite(np.asarray(grad, np.float64))
        steps_bad = np.pad(bad.reshape(*bad.shape[:3], -1).any(axis=-1), [(0, 0), (0, pad), (0, 0)])
        chunks_bad = steps_bad.reshape(bad.shape[0], -1, _KERNEL_CHUNK, bad.shape[2]).any(axis=2)
        if (chunks_bad & over).any():
            hit.append(name)
    if not hit:
        return None
    span = float(spans[over].max())
    return Finding(
        "overflow",
        None,
        f"{', '.join(hit)} {'is' if len(hit) == 1 else 'are'} non-finite in chunks of "
        f"{_KERNEL_CHUNK} steps whose log-decay spans up to {span:.4g}, more than "
        f"{np.dtype(compute).name}'s exp takes ({reach:.4g}): an exp of a masked (anti-causal) "
        "decay difference overflowing? mask before exp",
        {"gradients": tuple(hit), "span": span, "reach": reach, "chunk": _KERNEL_CHUNK},
    )
