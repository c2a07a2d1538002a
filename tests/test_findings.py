"""The findings core: each hypothesis named on its own and in combination, never on correct
kernels or on unrelated data."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, pack, unpack
from gdn_layout.check import K
from gdn_layout.check._findings import (
    _IDENTIFIED,
    KINDS,
    Finding,
    Score,
    buffer_findings,
    grad_findings,
    size_findings,
    tensor_findings,
)
from gdn_layout.generate import draw_inputs
from gdn_layout.reference import backward
from gdn_layout.regimes import REGIMES

Array = NDArray[np.float64]
STRUCTURAL = set(KINDS) - {"rounding"}

#: (rms limit, max limit) of the calibrated-like criterion, by dtype.
LIMITS = {
    name: (K[name] * rms, K[name] * largest)
    for name, (rms, largest) in {
        "float32": (6e-5, 2e-4),
        "float16": (1e-3, 1e-2),
        "bfloat16": (4e-3, 5e-2),
    }.items()
}


def scorer(dtype: str = "float32", tighter: float = 1.0) -> Score:
    rms_limit, max_limit = (limit / tighter for limit in LIMITS[dtype])

    def score(name: str, a: Array, e: Array) -> float:
        ref = float(np.sqrt(np.mean(e * e))) if e.size else 0.0
        ref = ref if ref > 0 else 1e-30
        d = a - e
        if not d.size:
            return 0.0
        rms = float(np.sqrt(np.mean(d * d))) / ref / rms_limit
        worst = float(np.abs(d).max()) / ref / max_limit
        return max(rms, worst)

    return score


SCORE = scorer()

#: Layouts covering both gate modes, both state modes, and H = 1, S = 1, N = 1.
LAYOUTS = {
    "head": GdnBackwardLayout(2, 8, 3, 4),
    "head-state": GdnBackwardLayout(2, 8, 3, 4, carry_state=True),
    "channel": GdnBackwardLayout(2, 8, 3, 4, gate_per_channel=True),
    "channel-state": GdnBackwardLayout(2, 8, 3, 4, gate_per_channel=True, carry_state=True),
    "H1": GdnBackwardLayout(2, 6, 1, 4, carry_state=True),
    "S1": GdnBackwardLayout(2, 1, 3, 4, carry_state=True),
    "N1": GdnBackwardLayout(2, 6, 3, 1, carry_state=True),
}


@functools.cache
def truth(layout: GdnBackwardLayout, regime: str = "mixed", seed: int = 0) -> Array:
    x = draw_inputs(layout, regime=regime, seed=seed, dtype=np.float64)
    return backward(*x)


def views(flat: NDArray[Any], layout: GdnBackwardLayout) -> dict[str, NDArray[Any]]:
    """Each gradient's view of a packed buffer, by name."""
    return {name: view for name, view in unpack(flat, layout)._asdict().items() if view is not None}


def grads(layout: GdnBackwardLayout) -> dict[str, Array]:
    return views(truth(layout), layout)


def kinds(found: tuple[Finding, ...]) -> list[str]:
    return [f.kind for f in found]


def only(found: tuple[Finding, ...], kind: str) -> Finding:
    assert kinds(found) == [kind], [f.text for f in found]
    return found[0]


def cases(
    predicate: Callable[[GdnBackwardLayout, str], bool] = lambda layout, name: True,
) -> list[Any]:
    return [
        pytest.param(layout, name, id=f"{key}-{name}")
        for key, layout in LAYOUTS.items()
        for name in layout.names
        if predicate(layout, name)
    ]


def identified(layout: GdnBackwardLayout, name: str, steps_lost: int = 0) -> bool:
    """Whether a hypothesis on ``name`` sees enough values to be identified: at least
    ``_IDENTIFIED`` of them, once ``steps_lost`` steps are left out (a shift's overlap)."""
    shape = layout.shape(name)
    kept = (
        math.prod(shape)
        if name == "dstate"
        else math.prod(shape) // shape[1] * max(shape[1] - steps_lost, 0)
    )
    return kept >= _IDENTIFIED


# -- each kind on its own --------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "name"), cases(identified))
@pytest.mark.parametrize("factor", [2.0, -1.0, 0.5, 1.37])
def test_scale(layout: GdnBackwardLayout, name: str, factor: float) -> None:
    e = grads(layout)[name]
    found = only(grad_findings(name, factor * e, e, layout, SCORE), "scale")
    assert found.gradient == name
    assert found.details["factor"] == pytest.approx(factor)
    assert f"{factor:#.4g}" in found.text
    if factor != 1.37:
        assert found.details["named"]


@pytest.mark.parametrize(
    ("factor", "named", "words"),
    [
        (4.0, ("sqrt(N)",), "a missing 1/sqrt(N) = 1/4?"),
        (0.25, ("1/sqrt(N)",), "applied twice"),
        (16.0, ("N",), "1/N = 1/16"),
        (-1.0, ("-1",), "sign flip"),
    ],
)
def test_scale_names_the_factors_of_n(factor: float, named: tuple[str], words: str) -> None:
    layout = GdnBackwardLayout(1, 4, 2, 16)
    e = grads(layout)["dq"]
    found = only(grad_findings("dq", factor * e, e, layout, SCORE), "scale")
    assert found.details["named"] == named
    assert words in found.text


@pytest.mark.parametrize(
    ("layout", "name"),
    cases(lambda layout, name: layout.shape(name)[-1] == layout.shape(name)[-2] > 1),
)
def test_transpose(layout: GdnBackwardLayout, name: str) -> None:
    e = grads(layout)[name]
    found = only(grad_findings(name, e.swapaxes(-1, -2), e, layout, SCORE), "transpose")
    assert found.details["factor"] == 1.0
    if name == "dstate":
        assert "dstate[b, h, i, j] is expected[b, h, j, i]" in found.text


def _head_axis(name: str) -> int:
    return 1 if name == "dstate" else 2


@pytest.mark.parametrize(
    ("layout", "name"), cases(lambda layout, name: layout.heads > 1 and identified(layout, name))
)
def test_heads_exchanged(layout: GdnBackwardLayout, name: str) -> None:
    e = grads(layout)[name]
    perm = [1, 0, 2]
    found = only(
        grad_findings(name, np.take(e, perm, axis=_head_axis(name)), e, layout, SCORE), "heads"
    )
    assert found.details["pairs"] == ((0, 1),)
    assert found.details["permutation"] == (1, 0, 2)
    assert "heads 0 and 1 exchanged" in found.text


def test_heads_in_a_cycle() -> None:
    layout = LAYOUTS["head-state"]
    e = grads(layout)["dv"]
    found = only(grad_findings("dv", e[:, :, [2, 0, 1]], e, layout, SCORE), "heads")
    assert found.details["permutation"] == (2, 0, 1)
    assert found.details["pairs"] == ()
    assert "head 0 holds head 2's values" in found.text


@pytest.mark.parametrize(
    ("layout", "name"), cases(lambda layout, name: layout.batch > 1 and identified(layout, name))
)
def test_batch_exchanged(layout: GdnBackwardLayout, name: str) -> None:
    e = grads(layout)[name]
    found = only(grad_findings(name, e[::-1], e, layout, SCORE), "batch")
    assert found.details["pairs"] == ((0, 1),)
    assert "batch elements 0 and 1 exchanged" in found.text


@pytest.mark.parametrize(
    ("layout", "name"),
    cases(
        lambda layout, name: name != "dstate" and layout.seq >= 4 and identified(layout, name, 2)
    ),
)
@pytest.mark.parametrize("step", [1, -1, 2, -2])
def test_shift(layout: GdnBackwardLayout, name: str, step: int) -> None:
    e = grads(layout)[name]
    a = np.zeros_like(e)
    if step > 0:
        a[:, step:] = e[:, :-step]
    else:
        a[:, :step] = e[:, -step:]
    found = only(grad_findings(name, a, e, layout, SCORE), "shift")
    assert found.details["step"] == step
    assert f"by {step:+d} step" in found.text
    gate_read_off = name == "dg" and abs(step) == 1  # the same dg as a gate read a step off
    assert found.details.get("or_reading") == ("gate_shift" if gate_read_off else None)


@pytest.mark.parametrize("name", ["dg", "dbeta"])
def test_no_structure_on_too_few_values(name: str) -> None:
    layout = LAYOUTS["H1"]  # dg and dbeta: 12 values, below _IDENTIFIED
    assert not identified(layout, name)
    e = grads(layout)[name]
    bugged = {
        "shift": np.concatenate([np.zeros_like(e[:, :1]), e[:, :-1]], axis=1),
        "batch": e[::-1],
        "scale": 2 * e,
    }
    for kind, a in bugged.items():
        found = kinds(grad_findings(name, a, e, layout, SCORE))
        assert kind not in found, (kind, found)
    flat = truth(layout)
    g = unpack(flat, layout)
    swapped = pack(g.dq, g.dk, g.dv, g.dbeta, g.dg, g.dstate)  # dg and dbeta exchanged
    assert not buffer_findings(swapped, flat, layout, SCORE)


def _noisy(e: Array, where: Any, seed: int = 1) -> Array:
    a = e.copy()
    rng = np.random.default_rng(seed)
    part = a[where]
    a[where] = part + 0.1 * np.abs(part).mean() * rng.standard_normal(part.shape)
    return a


@pytest.mark.parametrize(
    ("layout", "name"), cases(lambda layout, name: name != "dstate" and layout.seq >= 6)
)
def test_boundary_wrong_from_a_step_on(layout: GdnBackwardLayout, name: str) -> None:
    e = grads(layout)[name]
    found = only(grad_findings(name, _noisy(e, np.s_[:, 4:]), e, layout, SCORE), "boundary")
    assert (found.details["step"], found.details["side"]) == (4, "from")
    assert "wrong from step 4 on" in found.text
    _says_what_it_saw_first(found)


def _says_what_it_saw_first(found: Finding) -> None:
    """A boundary with a side records what it saw (``seen``), its text's first part: the
    backward's words replace the rest (``check._explain``)."""
    seen = found.details["seen"]
    assert isinstance(seen, str)
    assert found.text.startswith(seen)
    assert found.text[len(seen) :][:1] in ("", ":", ";")


@pytest.mark.parametrize("carried", [False, True])
def test_wrong_from_step_1_on_is_a_term_that_reads_the_state_where_none_is_carried(
    carried: bool,
) -> None:
    # Step 0 reads a zero state when none is carried: a wrong term that reads it vanishes
    # there, and no step of the sequence is named. With a carried state, step 1 is one.
    layout = GdnBackwardLayout(1, 12, 2, 8, carry_state=carried)
    e = grads(layout)["dk"]
    found = only(grad_findings("dk", _noisy(e, np.s_[:, 1:]), e, layout, SCORE), "boundary")
    if carried:
        assert (found.details["step"], found.details["side"]) == (1, "from")
    else:
        assert (found.details["step"], found.details["side"]) == (None, "zero state")
        assert "right at step 0 alone, where the state it reads is still zero" in found.text


def test_a_state_not_carried_across_a_step_is_named_where_its_error_starts() -> None:
    # Wrong from step 12 to 17 (a state not carried at 12, its error fading after), right
    # on both sides: the step where it jumps is named.
    layout = GdnBackwardLayout(1, 40, 2, 8)
    e = grads(layout)["dq"]
    a = e.copy()
    a[:, 12:18] *= 1 + 0.3 * 0.5 ** np.arange(6)[None, :, None, None]
    found = only(grad_findings("dq", a, e, layout, SCORE), "boundary")
    assert (found.details["side"], found.details["step"], found.details["first"]) == (
        "window",
        12,
        12,
    )
    assert "a state not carried across step 12?" in found.text


def test_boundary_wrong_before_a_step_and_zeros() -> None:
    layout = LAYOUTS["channel"]
    e = grads(layout)["dk"]
    a = e.copy()
    a[:, :5] = 0.0
    found = only(grad_findings("dk", a, e, layout, SCORE), "boundary")
    assert (found.details["step"], found.details["side"], found.details["zeros"]) == (
        5,
        "before",
        True,
    )
    assert "all zeros there" in found.text
    _says_what_it_saw_first(found)


def test_an_error_from_the_first_step_that_fades_names_no_step() -> None:
    # An initial state's error fades with the decay, by a factor of 3 a step here: where it
    # passes under the limit is no boundary. An abrupt end of the same error is one.
    layout = GdnBackwardLayout(1, 24, 2, 8)
    e = grads(layout)["dq"]
    fade = 0.3 * 3.0 ** -np.arange(layout.seq)
    a = e * (1 + fade[None, :, None, None])
    found = only(grad_findings("dq", a, e, layout, SCORE), "boundary")
    assert (found.details["step"], found.details["side"]) == (None, "fades")
    assert "initial state" not in found.text  # none is carried here
    carried = GdnBackwardLayout(1, 24, 2, 8, carry_state=True)
    e_state = grads(carried)["dq"]
    a_state = e_state * (1 + fade[None, :, None, None])
    with_state = only(grad_findings("dq", a_state, e_state, carried, SCORE), "boundary")
    assert "the initial state, or how it is read, wrong?" in with_state.text
    _says_what_it_saw_first(found)
    _says_what_it_saw_first(with_state)
    cut = found.details["until"]
    assert isinstance(cut, int)
    assert cut > 1
    assert "fades" in found.text
    abrupt = e.copy()
    abrupt[:, :cut] = e[:, :cut] * 1.3  # wrong over the same steps, ending at once
    edge = only(grad_findings("dq", abrupt, e, layout, SCORE), "boundary")
    assert (edge.details["step"], edge.details["side"]) == (cut, "before")
    _says_what_it_saw_first(edge)


@pytest.mark.parametrize(
    ("layout", "name", "order"),
    [
        (LAYOUTS["head"], "dq", (0, 2, 1, 3)),
        (LAYOUTS["head-state"], "dbeta", (0, 2, 1)),
        (LAYOUTS["channel"], "dg", (0, 2, 1, 3)),
        (LAYOUTS["head"], "dv", (1, 0, 2, 3)),
        (LAYOUTS["head-state"], "dstate", (1, 0, 2, 3)),
        (LAYOUTS["S1"], "dk", (0, 1, 3, 2)),
    ],
)
def test_axes(layout: GdnBackwardLayout, name: str, order: tuple[int, ...]) -> None:
    e = grads(layout)[name]
    a = e.transpose(order).reshape(e.shape)  # written in C order as e.transpose(order)
    found = only(grad_findings(name, a, e, layout, SCORE), "axes")
    letters = "BHIJ" if name == "dstate" else "BSHN"
    assert found.details["order"] == tuple(letters[i] for i in order)


@pytest.mark.parametrize(("layout", "name"), cases())
def test_unwritten_zeros_and_constants(layout: GdnBackwardLayout, name: str) -> None:
    e = grads(layout)[name]
    zero = only(grad_findings(name, np.zeros_like(e), e, layout, SCORE), "unwritten")
    assert zero.details["how"] == "zeros"
    if e.size > 1:
        const = only(grad_findings(name, np.full_like(e, 0.5), e, layout, SCORE), "unwritten")
        assert (const.details["how"], const.details["value"]) == ("constant", 0.5)
        # NaN everywhere is non-finite, not a fill: nothing unwritten explains it
        poisoned = grad_findings(name, np.full_like(e, np.nan), e, layout, SCORE)
        assert kinds(poisoned) == ["nonfinite"]


@pytest.mark.parametrize(("layout", "name"), cases())
def test_unwritten_batch_rows(layout: GdnBackwardLayout, name: str) -> None:
    e = grads(layout)[name]
    a = e.copy()
    a[1] = 0  # row 1 never written, or dstate of rows run as one sequence
    found = [f for f in grad_findings(name, a, e, layout, SCORE) if f.details.get("how") == "rows"]
    if np.count_nonzero(e[1]) < _IDENTIFIED:
        assert not found  # a handful of zeros is as likely a rounding
        return
    assert kinds(tuple(found)) == ["unwritten"]
    assert found[0].details["rows"] == (1,)
    assert found[0].text.startswith(f"{name}'s batch row 1 is all zeros where the op's are not")
    assert ("one initial state" in found[0].text) == (name == "dstate")
    assert found[0].details.get("or_reading") == ("batch_folded" if name == "dstate" else None)
    assert not grad_findings(name, e.copy(), e, layout, SCORE)  # nothing where nothing fails


def test_a_row_that_rounds_to_zero_is_not_unwritten() -> None:
    # Row 0's values underflow in float16, as a fast-decaying dstate's do: its zeros are
    # right. Row 1 is wrong (transposed), and only row 1 is named, by its own finding.
    layout = LAYOUTS["head-state"]
    e = grads(layout)["dstate"].copy()
    e[0] *= 1e-12
    a = e.astype(np.float16)
    assert not a[0].any()
    a[1] = a[1].swapaxes(-1, -2)
    found = grad_findings("dstate", a, e, layout, SCORE)
    assert all(f.details.get("how") != "rows" for f in found), [f.text for f in found]


@pytest.mark.parametrize(
    ("layout", "name"), cases(lambda layout, name: name != "dstate" and layout.seq >= 6)
)
def test_nonfinite_spreading_to_earlier_steps(layout: GdnBackwardLayout, name: str) -> None:
    e = grads(layout)[name]
    a = e.copy()
    a[0, :4] = np.nan  # as a backward sweep carries a NaN from step 3 down
    a[1, 2, 0] = np.inf
    found = only(grad_findings(name, a, e, layout, SCORE), "nonfinite")
    assert found.details["count"] == a[0, :4].size + a[1, 2, 0].size
    assert found.details["spread"] == "earlier"
    assert found.details["last_step"] == 3
    assert found.to_dict()["details"]["first"][0] == [0] * e.ndim  # type: ignore[index]
    assert "up to s=3" in found.text


def test_nonfinite_one_element_and_dstate() -> None:
    layout = LAYOUTS["channel-state"]
    e = grads(layout)["dstate"]
    a = e.copy()
    a[1, 2, 0, 3] = np.nan
    found = only(grad_findings("dstate", a, e, layout, SCORE), "nonfinite")
    assert found.details["first"] == ((1, 2, 0, 3),)
    assert found.details["spread"] is None
    dq = grads(layout)["dq"]
    b = dq.copy()
    b[:, 5:] = np.inf
    assert only(grad_findings("dq", b, dq, layout, SCORE), "nonfinite").details["spread"] == (
        "later"
    )


@pytest.mark.parametrize(("layout", "name"), cases())
def test_rounding(layout: GdnBackwardLayout, name: str) -> None:
    e = grads(layout)[name]
    rng = np.random.default_rng(3)
    rms = float(np.sqrt(np.mean(e * e)))
    a = e + 3 * LIMITS["float32"][0] * rms * rng.standard_normal(e.shape)
    found = grad_findings(name, a, e, layout, SCORE)
    if SCORE(name, a, e) <= 1.0:  # a one-element gradient whose noise happened to be small
        assert found == ()
        return
    assert only(found, "rounding").details["score"] == pytest.approx(SCORE(name, a, e))
    assert "x the limit" in found[0].text


# -- the packed buffer -----------------------------------------------------------------------


def _packed(layout: GdnBackwardLayout, order: list[str]) -> Array:
    g = grads(layout)
    return np.concatenate([g[name].reshape(-1) for name in order])


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_layout_exchanged_segments(key: str) -> None:
    layout = LAYOUTS[key]
    names = list(layout.names)
    order = [names[1], names[0], *names[2:]]
    found = only(buffer_findings(_packed(layout, order), truth(layout), layout, SCORE), "layout")
    assert found.gradient is None
    assert found.details["pairs"] == (("dq", "dk"),)
    assert found.details["offsets"]["dq"] == layout.dk_offset  # type: ignore[index]
    assert "dq and dk are exchanged" in found.text


def test_layout_another_order() -> None:
    layout = LAYOUTS["channel-state"]  # dg is as long as dq; dbeta is shorter
    order = ["dq", "dk", "dv", "dbeta", "dg", "dstate"]
    found = only(buffer_findings(_packed(layout, order), truth(layout), layout, SCORE), "layout")
    assert found.details["order"] == tuple(order)
    assert found.to_dict()["details"]["moved"] == ["dg", "dbeta"]  # type: ignore[index]
    assert "in the order dq, dk, dv, dbeta, dg, dstate" in found.text


def test_layout_of_the_other_gate_mode() -> None:
    # A per-channel gate's dg, but dbeta and dstate where a per-head gate puts them.
    layout = LAYOUTS["channel-state"]
    other = GdnBackwardLayout(2, 8, 3, 4, gate_per_channel=False, carry_state=True)
    expected = truth(layout)
    g = views(expected, layout)
    actual = expected.copy()
    actual[other.dbeta_offset : other.dbeta_offset + layout.beta_elems] = g["dbeta"].reshape(-1)
    actual[other.dstate_offset : other.dstate_offset + layout.state_elems] = g["dstate"].ravel()
    actual[other.dstate_offset + layout.state_elems :] = 0.0
    found = only(buffer_findings(actual, expected, layout, SCORE), "layout")
    assert found.details["layout"] == other.to_dict()
    assert found.details["offsets"]["dbeta"] == other.dbeta_offset  # type: ignore[index]
    assert found.details["missing"] == ("dg",)
    assert "per-head-gate layout" in found.text


def test_layout_nothing_moved_and_nonfinite_buffers() -> None:
    layout = LAYOUTS["head-state"]
    expected = truth(layout)
    assert buffer_findings(expected.astype(np.float32), expected, layout, SCORE) == ()
    broken = expected.copy()
    broken[::7] = np.nan
    assert buffer_findings(broken, expected, layout, SCORE) == ()


def test_size_findings() -> None:
    layout = GdnBackwardLayout(1, 4, 2, 4, carry_state=True)
    without = GdnBackwardLayout(1, 4, 2, 4)
    found = only(size_findings(without.total_elems, layout), "layout")
    assert (
        found.text
        == f"{without.total_elems} elements: the layout without dstate (carry_state=False)"
    )
    assert found.details["layouts"] == (without.to_dict(),)
    channel = GdnBackwardLayout(1, 4, 2, 4, gate_per_channel=True, carry_state=True)
    text = size_findings(channel.total_elems, layout)[0].text
    assert "with a per-channel gate (gate_per_channel=True)" in text
    both = size_findings(GdnBackwardLayout(1, 4, 2, 4, gate_per_channel=True).total_elems, layout)
    assert "per-channel gate (gate_per_channel=True) and without dstate" in both[0].text
    ends = only(size_findings(layout.dbeta_offset, layout), "layout")
    assert ends.details["ends_before"] == "dbeta"
    assert size_findings(2 * layout.total_elems, layout)[0].details["factor"] == 2.0
    assert size_findings(layout.total_elems, layout) == ()
    assert size_findings(layout.total_elems + 1, layout) == ()


# -- combinations ----------------------------------------------------------------------------


def test_a_scale_on_dq_and_a_head_swap_on_dv_are_named_apart() -> None:
    layout = LAYOUTS["head-state"]
    expected = truth(layout)
    g = views(expected, layout)
    actual = pack(
        2.0 * g["dq"], g["dk"], g["dv"][:, :, [1, 0, 2]], g["dg"], g["dbeta"], g["dstate"]
    )
    a = views(actual, layout)
    assert buffer_findings(actual, expected, layout, SCORE) == ()
    by_name = {name: grad_findings(name, a[name], g[name], layout, SCORE) for name in g}
    assert kinds(by_name["dq"]) == ["scale"]
    assert kinds(by_name["dv"]) == ["heads"]
    assert all(not by_name[name] for name in ("dk", "dg", "dbeta", "dstate"))


def test_a_head_swap_with_a_factor_is_one_finding() -> None:
    layout = LAYOUTS["channel"]
    e = grads(layout)["dk"]
    found = only(grad_findings("dk", -0.5 * e[:, :, [1, 0, 2]], e, layout, SCORE), "heads")
    assert found.details["factor"] == pytest.approx(-0.5)
    assert "scaled by -0.5000" in found.text


# -- correct kernels and unrelated data: nothing structural ---------------------------------


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.parametrize("key", ["head-state", "channel-state", "N1"])
def test_correct_float32_kernels_have_no_structural_finding(
    regime: str, method: str, key: str
) -> None:
    layout = LAYOUTS[key]
    x = draw_inputs(layout, regime=regime, seed=7, dtype=np.float64)
    expected = backward(*x)
    actual = backward(*x, dtype=np.float32, method=method)  # type: ignore[arg-type]
    a, e = views(actual, layout), views(expected, layout)
    # Strict criteria make the rounding fail, so that every hypothesis is tried on it.
    for tighter in (1.0, 1e3):
        score = scorer("float32", tighter)
        for name in layout.names:
            found = set(kinds(grad_findings(name, a[name], e[name], layout, score)))
            assert not found & STRUCTURAL, (name, tighter, found)
        assert buffer_findings(actual, expected, layout, score) == ()


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_correct_half_precision_kernels_have_no_structural_finding(regime: str, dtype: str) -> None:
    layout = LAYOUTS["channel-state"]
    expected = truth(layout, regime, 2)
    low = expected.astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    a, e = views(low, layout), views(expected, layout)
    for tighter in (1.0, 1e3):
        score = scorer(dtype, tighter)
        for name in layout.names:
            before = a[name].copy()
            found = set(kinds(grad_findings(name, a[name], e[name], layout, score)))
            assert not found & STRUCTURAL, (name, tighter, found)
            assert np.array_equal(a[name], before)  # never modified


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    key=st.sampled_from(sorted(LAYOUTS)),
    spread=st.sampled_from([1e-3, 1.0, 1e3]),
    real=st.booleans(),
)
def test_unrelated_data_has_no_structural_finding(
    seed: int, key: str, spread: float, real: bool
) -> None:
    # Expected values random or a real gradient; actual values random, of any magnitude.
    layout = LAYOUTS[key]
    rng = np.random.default_rng(seed)
    for name in layout.names:
        shape = layout.shape(name)
        e = grads(layout)[name] if real else rng.standard_normal(shape)
        a = spread * rng.standard_normal(shape)
        found = grad_findings(name, a, e, layout, SCORE)
        assert not set(kinds(found)) & STRUCTURAL, [f.text for f in found]
    flat_a = rng.standard_normal(layout.total_elems)
    flat_e = rng.standard_normal(layout.total_elems)
    assert buffer_findings(flat_a, flat_e, layout, SCORE) == ()


# -- the interface ---------------------------------------------------------------------------


def test_findings_are_read_only_and_json_ready() -> None:
    layout = LAYOUTS["head-state"]
    e = grads(layout)["dv"]
    found = grad_findings("dv", e[:, :, [1, 0, 2]], e, layout, SCORE)[0]
    with pytest.raises(TypeError):
        found.details["pairs"] = ()  # type: ignore[index]
    data = found.to_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["details"]["pairs"] == [[0, 1]]  # type: ignore[index]
    assert hash(found) == hash(Finding(found.kind, found.gradient, found.text))
    # A non-finite number is written as the records write one.
    odd = Finding("rounding", "dq", "", {"score": math.inf, "e": (-math.inf, math.nan)})
    assert odd.to_dict()["details"] == {"score": "inf", "e": ["-inf", "nan"]}
    with pytest.raises(ValueError, match="kind must be one of"):
        Finding("typo", None, "")


def test_bad_arguments() -> None:
    layout = LAYOUTS["head"]
    e = grads(layout)["dq"]
    with pytest.raises(TypeError, match="GdnBackwardLayout"):
        grad_findings("dq", e, e, "layout", SCORE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a gradient"):
        grad_findings("dstate", e, e, layout, SCORE)
    with pytest.raises(ValueError, match="shape"):
        grad_findings("dq", e[:1], e, layout, SCORE)
    with pytest.raises(ValueError, match="shape"):
        buffer_findings(truth(layout)[:-1], truth(layout), layout, SCORE)


def test_expected_values_not_finite() -> None:
    layout = LAYOUTS["head"]
    e = grads(layout)["dq"].copy()
    e[0, 0, 0, 0] = np.nan
    assert grad_findings("dq", 2 * e, e, layout, SCORE) == ()
    a = 2 * e
    a[1, 1, 1, 1] = np.inf
    assert kinds(grad_findings("dq", a, e, layout, SCORE)) == ["nonfinite"]


def test_a_score_that_fails_is_no_pass() -> None:
    layout = LAYOUTS["head"]
    e = grads(layout)["dq"]

    def broken(name: str, a: Array, e: Array) -> float:
        raise FloatingPointError

    assert grad_findings("dq", 2 * e, e, layout, broken) == ()


def _state_score(a: Array, e: Array) -> float:
    return float(np.abs(a - e).max() / np.abs(e).max() / 1e-6)


@pytest.mark.parametrize("name", ["h", "dh"])
def test_a_state_one_chunk_off_is_named(name: str) -> None:
    e = np.random.default_rng(0).standard_normal((2, 5, 2, 4, 4))
    leaving = np.concatenate([e[:, 1:], np.zeros_like(e[:, :1])], axis=1)
    (found,) = tensor_findings(name, leaving, e, _state_score)
    assert (found.kind, found.details["step"]) == ("shift", -1)
    assert found.text.startswith(
        f"{name} is expected shifted by -1 chunk along c: {name}[:, c] holds expected[:, c+1] ("
    )
    assert "leaving chunk c, as another library keeps it?)" in found.text
    entering = np.concatenate([np.zeros_like(e[:, :1]), e[:, :-1]], axis=1)
    (found,) = tensor_findings(name, entering, e, _state_score)
    assert found.details["step"] == 1


@pytest.mark.parametrize("name", ["h", "dh", "final_state"])
def test_a_transposed_state_is_named(name: str) -> None:
    shape = (2, 3, 4, 4) if name == "final_state" else (2, 3, 2, 4, 4)
    e = np.random.default_rng(1).standard_normal(shape)
    (found,) = tensor_findings(name, e.swapaxes(-1, -2), e, _state_score)
    assert found.kind == "transpose"
    assert "(a state kept as [V, K]?)" in found.text


def test_failing_chunks_and_rows_of_a_state_are_named() -> None:
    e = np.random.default_rng(2).standard_normal((3, 6, 2, 4, 4))
    a = e.copy()
    a[1, 2:] *= 1.5  # row 1, from chunk 2 on
    texts = [f.text for f in tensor_findings("h", a, e, _state_score)]
    assert texts == [
        "h fails in batch row 1 of 3",
        "h is right before chunk 2 and wrong from chunk 2 on (C=6)",
    ]
    assert tensor_findings("h", e, e, _state_score) == ()
    tiny = e[:1, :1, :1, :2, :2]  # 4 values: too few to identify a transpose
    assert tensor_findings("h", tiny.swapaxes(-1, -2), tiny, _state_score) == ()
