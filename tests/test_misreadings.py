"""Misreadings named by re-running the op: each reading, applied by a kernel written apart
from the kit (tests/panel.py's step-by-step kernel under autograd, or the reference on inputs
read another way), is named; correct kernels and bugs of other kinds are not."""

from __future__ import annotations

from typing import Any, NoReturn

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, make_fixture, unpack
from gdn_layout._floors import term_scales
from gdn_layout.check import _misreadings
from gdn_layout.check._findings import Finding
from gdn_layout.files import Fixture
from gdn_layout.reference import backward

BF16 = np.dtype(ml_dtypes.bfloat16)

READINGS = tuple(r.name for r in _misreadings.READINGS)

#: Each reading, and the variants a port has of it (``panel.misread``'s ``variant``).
PANEL = (
    *((name, "") for name in READINGS if name != "scale"),
    ("gate_shift", "early"),
    ("beta_missing", "dv"),
    ("scale", "1"),
    ("scale", "1/N"),
    ("scale", "16"),
)


def _named(found: tuple[Finding, ...]) -> list[object]:
    return [f.details["reading"] for f in found if f.kind == "misreading"]


@pytest.fixture(scope="module", params=["scalar", "channel"])
def fixture(request: pytest.FixtureRequest) -> Fixture:
    layout = GdnBackwardLayout(
        2, 40, 2, 8, gate_per_channel=request.param == "channel", carry_state=True
    )
    return make_fixture(layout, regime="mixed", seed=3)


@pytest.mark.slow
@pytest.mark.parametrize(("reading", "variant"), PANEL, ids=lambda v: str(v) or "-")
def test_an_independent_kernel_s_misreading_is_named(
    fixture: Fixture, reading: str, variant: str
) -> None:
    panel = pytest.importorskip("panel")
    pytest.importorskip("torch")
    if not next(r for r in _misreadings.READINGS if r.name == reading).applies(fixture.layout):
        pytest.skip(f"{reading} cannot change this layout")
    result = compare(panel.misread(fx := fixture, reading, variant), fx)
    assert not result.passed
    named = _named(result.findings)
    assert named == [reading], [f.text for f in result.findings]
    # the reading explains every gradient: no per-gradient guess is left beside it
    assert all(not g.findings for g in result.grads)
    text = result.findings[0].text
    assert text.startswith("every gradient matches the op with ")


#: The readings a port's glue can make inside autograd, whose gradients then come back to the
#: tensors the user passed rather than to the kernel's own slots.
TWO_WAYS = ("state_transposed", "gate_exp_twice", "g_beta_swapped", "qk_swapped")


@pytest.mark.slow
@pytest.mark.parametrize("reading", TWO_WAYS)
def test_a_reading_is_named_whichever_way_its_gradients_come_back(
    fixture: Fixture, reading: str
) -> None:
    panel = pytest.importorskip("panel")
    pytest.importorskip("torch")
    if not next(r for r in _misreadings.READINGS if r.name == reading).applies(fixture.layout):
        pytest.skip(f"{reading} cannot change this layout")
    own = panel.misread(fixture, reading)
    chained = panel.misread(fixture, reading, attributed=True)
    assert not np.array_equal(own, chained)  # the two ways differ on this case
    for kernel in (own, chained):
        result = compare(kernel, fixture)
        assert _named(result.findings) == [reading], [f.text for f in result.findings]
        assert all(not g.findings for g in result.grads)


@pytest.mark.slow
@pytest.mark.parametrize("mapping", ["qk_swapped", "gate_exp_twice", "g_beta_swapped"])
def test_a_public_kernel_called_through_autograd_with_a_port_s_mapping_is_named(
    mapping: str,
) -> None:
    # transformers' chunked function, its gradients by autograd back to what the user passed.
    panel = pytest.importorskip("panel")
    pytest.importorskip("transformers")
    layout = GdnBackwardLayout(2, 70, 2, 8, carry_state=True)  # across a 64-step chunk
    fx = make_fixture(layout, regime="mixed", seed=7)
    assert compare(panel.transformers_chunked(fx), fx).passed
    result = compare(panel.transformers_chunked(fx, mapping), fx)
    assert _named(result.findings) == [mapping], [f.text for f in result.findings]
    assert result.findings[0].details["variant"] == _misreadings._CHAINED


def test_a_reading_in_the_update_but_not_in_dg_is_named_but_dg() -> None:
    # The per-channel decay on value columns in the state update, but dg formed as the op
    # forms it for key rows: every gradient but dg matches the reading.
    fx = make_fixture(
        GdnBackwardLayout(2, 40, 2, 8, gate_per_channel=True, carry_state=True),
        regime="mixed",
        seed=3,
    )
    q, k, v, g, beta, dy, state = fx.inputs
    f64 = [np.asarray(t, np.float64) for t in (q, k, v, g, beta, dy, state)]
    x = _misreadings._Slice(f64[0], f64[1], f64[2], f64[3], f64[4], f64[5], f64[6], True)

    axis = _misreadings._step_form(x, columns=True)
    kernel = np.array(fx.packed, np.float32)
    grads = unpack(kernel, fx.layout)
    for name in ("dq", "dk", "dv", "dbeta", "dstate"):
        getattr(grads, name)[...] = axis[name]
    result = compare(kernel, fx)
    assert _named(result.findings) == ["gate_axis"], [f.text for f in result.findings]
    finding = result.findings[0]
    assert finding.details["but"] == "dg"
    assert finding.text.startswith(
        "every gradient but dg matches the op with the per-channel decay on value columns"
    )
    assert finding.text.endswith("dg is the op's, formed as for the inputs as given")
    # dg, as the op forms it, is the op's: nothing else is wrong with it
    assert result["dg"].passed
    grads.dg[...] = np.asarray(axis["dg"], np.float32)  # the reading everywhere: named whole
    whole = compare(kernel, fx)
    assert _named(whole.findings) == ["gate_axis"]
    assert "but" not in whole.findings[0].details


def _read(fx: Fixture, **changed: Any) -> NDArray[Any]:
    """The reference on the fixture's inputs read another way: a kernel with that reading."""
    x: dict[str, Any] = dict(
        zip(("q", "k", "v", "g", "beta", "dy", "state"), fx.inputs, strict=True)
    )
    x.update(changed)
    return backward(*x.values(), dtype=np.float32)


def test_the_reference_on_misread_inputs_is_named() -> None:
    fx = make_fixture(GdnBackwardLayout(2, 24, 2, 4, carry_state=True), regime="mild", seed=1)
    q, k, _, g, beta, _, state = fx.inputs
    assert state is not None
    cases = {
        "state_transposed": _read(fx, state=state.swapaxes(-1, -2)),
        "gate_exp_twice": _read(fx, g=np.exp(g)),
        "g_beta_swapped": _read(fx, g=beta, beta=g),
        "qk_swapped": _read(fx, q=k, k=q),
        "scale": _read(fx, q=q * np.sqrt(fx.layout.state_size)),  # the scale 1 ...
    }
    unpack(cases["scale"], fx.layout).dq[...] *= np.sqrt(fx.layout.state_size)  # ... in dq too
    for reading, kernel in cases.items():
        result = compare(kernel, fx)
        assert _named(result.findings) == [reading], (reading, result.causes())
    assert "the scale 1 instead of 1/sqrt(N)" in compare(cases["scale"], fx).findings[0].text


@pytest.mark.parametrize("regime", ["mild", "qwen", "extreme"])
def test_correct_kernels_and_other_bugs_get_no_misreading(regime: str) -> None:
    fx = make_fixture(GdnBackwardLayout(2, 40, 2, 8, carry_state=True), regime=regime, seed=5)
    good = backward(*fx.inputs, dtype=np.float32)
    assert compare(good, fx).passed
    for bug in ("dq times 2", "dv's heads exchanged", "one wrong element", "dbeta zero"):
        out = good.copy()
        grads = unpack(out, fx.layout)
        if bug == "dq times 2":
            grads.dq[...] *= 2
        elif bug == "dv's heads exchanged":
            grads.dv[...] = grads.dv[:, :, ::-1].copy()
        elif bug == "one wrong element":
            grads.dk[1, 7, 1, 3] = 1e3
        else:
            grads.dbeta[...] = 0.0
        result = compare(out, fx)
        assert not result.passed
        assert not _named(result.findings), (bug, result.causes())


def test_a_kernel_failing_off_the_slice_is_not_re_run(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = GdnBackwardLayout(3, 8, 2, 4)
    fx = make_fixture(layout, regime="mild")
    out = backward(*fx.inputs, dtype=np.float32)
    unpack(out, layout).dv[2] *= 2  # row 2: outside the slice of rows 0 and 1
    ran = []
    monkeypatch.setattr(_misreadings, "step_gradients", lambda *a, **k: ran.append(a))
    assert not compare(out, fx).passed
    assert not ran


def test_dv_without_beta_is_named_where_a_scaled_shift_also_fits() -> None:
    # S=3, N=128, bfloat16, beta_missing's dv variant: dv alone fails, and its own finding is
    # a shift by -2 steps with a fitted factor (on the one step left); the re-run names the
    # reading.
    fx = make_fixture(
        GdnBackwardLayout(1, 3, 1, 128, carry_state=True), regime="mild", seed=101, dtype=BF16
    )
    q, k, v, g, beta, dy, state = fx.inputs
    kernel = backward(q, k, v, g, beta, dy, state, dtype=np.float32)
    grads = unpack(kernel, fx.layout)
    grads.dv[...] /= np.asarray(beta, np.float32)[..., None]
    result = compare(kernel.astype(BF16), fx)
    assert result.failed == ("dv",)
    assert _named(result.findings) == ["beta_missing"]


@pytest.mark.slow
def test_a_near_miss_of_a_reading_is_judged_on_its_float32_rounding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Extreme decay, S=300, N=128: a float32 kernel adding a cotangent of ones to the final
    # state misses that reading's float64 values by its own float32 rounding, which is above
    # the op's floors on dk; the kernel is nearer the reading than the op, so it runs again
    # in float32.
    panel = pytest.importorskip("panel")
    pytest.importorskip("torch")
    fx = make_fixture(GdnBackwardLayout(1, 300, 1, 128), regime="extreme", seed=197)
    kernel = panel.misread(fx, "final_state_cotangent", "")
    assert _named(compare(kernel, fx).findings) == ["final_state_cotangent"]
    monkeypatch.setattr(_misreadings, "_nearer", lambda *a: False)
    assert _named(compare(kernel, fx).findings) == []


@pytest.mark.slow
def test_a_reading_is_judged_on_the_rounding_of_its_chunked_form_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A per-channel gate under extreme decay, S=300, N=128: the kernel's float32 dbeta
    # misses the reading's by 86 times what the reading's float32 step-by-step form does,
    # and by 2.3 times what its fused chunked form does (a cancellation of the ones'
    # cotangent against the decayed state): the fixture's floors are the worst of both
    # forms for the op, and so are the reading's.
    panel = pytest.importorskip("panel")
    pytest.importorskip("torch")
    layout = GdnBackwardLayout(1, 300, 1, 128, gate_per_channel=True)
    fx = make_fixture(layout, regime="extreme", seed=209)
    kernel = panel.misread(fx, "final_state_cotangent", "")
    assert _named(compare(kernel, fx).findings) == ["final_state_cotangent"]

    def step_by_step_only(*args: object) -> NoReturn:
        raise _misreadings._NoForm

    monkeypatch.setattr(_misreadings, "_fused_form", step_by_step_only)
    assert _named(compare(kernel, fx).findings) == []


@pytest.mark.slow
def test_a_folded_kernel_failing_in_dstate_alone_gets_its_zero_rows_named() -> None:
    # Extreme decay forgets row 0's last state before row 1's first steps: only dstate
    # shows the fold, its row 1 zero (a folded run has one initial state).
    panel = pytest.importorskip("panel")
    pytest.importorskip("torch")
    fx = make_fixture(GdnBackwardLayout(2, 65, 2, 16, carry_state=True), regime="extreme")
    result = compare(panel.misread(fx, "batch_folded", ""), fx)
    assert result.failed == ("dstate",)
    assert not _named(result.findings)
    (found,) = result["dstate"].findings
    assert (found.kind, found.details["rows"]) == ("unwritten", (1,))
    assert "the batch rows run as one sequence" in found.text


@pytest.mark.parametrize("regime", ["mild", "extreme"])
@pytest.mark.parametrize(
    "layout",
    [
        GdnBackwardLayout(2, 70, 2, 8, carry_state=True),
        GdnBackwardLayout(2, 70, 2, 8, gate_per_channel=True, carry_state=True),
        GdnBackwardLayout(2, 3, 1, 4),
    ],
    ids=str,
)
def test_every_reading_s_chunked_form_computes_that_reading(
    layout: GdnBackwardLayout, regime: str
) -> None:
    # The chunked run's rounding sets a reading's floors only if it computes the same
    # reading: in float64, every variant of every reading it takes is the step-by-step one.
    fx = make_fixture(layout, regime=regime, seed=5)
    rows, heads = slice(0, layout.batch), slice(0, layout.heads)
    x = _misreadings._case_slice(fx.inputs, layout, rows, heads)
    scales = term_scales(x.q, x.k, *unpack(fx.packed, layout)[:2], per_channel=x.per_channel)
    for reading in _misreadings.READINGS:
        if reading.name == "scale" or not reading.applies(layout):
            continue
        steps = dict(reading.truths(x))
        try:
            chunked = dict(reading.truths(x._replace(chunked=True)))
        except _misreadings._NoForm:
            assert reading.name in {"gate_as_decay", "gate_axis"}  # a decay, value columns
            continue
        assert chunked.keys() == steps.keys(), reading.name
        for words, grads in steps.items():
            for name in layout.names:
                e, a = grads[name], chunked[words][name]
                assert (e is None) == (a is None), (reading.name, words, name)
                if e is None:
                    continue
                scale = float(np.max(np.abs(e), initial=0.0))
                if name == "dg":  # exact to its terms' rounding, as the op's chunked form
                    scale = max(scale, scales["dg"])
                error = float(np.max(np.abs(a - e), initial=0.0))
                assert error <= 1e-9 * scale, (reading.name, words, name, error / scale)


def test_bare_arrays_have_no_inputs_to_re_run() -> None:
    fx = make_fixture(GdnBackwardLayout(1, 12, 2, 4, carry_state=True), regime="mild")
    assert fx.state is not None
    kernel = _read(fx, state=fx.state.swapaxes(-1, -2))
    result = compare(kernel, fx.packed, fx.layout, floors=fx.floors, scales=fx.scales)
    assert not _named(result.findings)


def test_an_overflowing_masked_decay_is_overflow_not_unwritten() -> None:
    layout = GdnBackwardLayout(1, 128, 2, 8)
    for regime, named in (("extreme", True), ("mild", False)):
        fx = make_fixture(layout, regime=regime)
        out = backward(*fx.inputs, dtype=np.float32)
        unpack(out, layout).dq[0, 70:] = np.nan  # in the second chunk of 64
        kinds = [f.kind for f in compare(out, fx).findings]
        assert ("overflow" in kinds) is named
        assert "nonfinite" in kinds
        if named:
            assert kinds[0] == "overflow"
            text = compare(out, fx).findings[0].text
            assert "more than float32's exp takes (88.72)" in text
            assert text.endswith("mask before exp")
    fx = make_fixture(layout, regime="extreme")
    nan = np.full_like(fx.packed, np.nan)
    kinds = [f.kind for f in compare(nan, fx).findings]
    assert kinds[0] == "overflow"
    assert "unwritten" not in kinds


def test_a_nan_outside_the_long_chunks_is_not_overflow() -> None:
    layout = GdnBackwardLayout(1, 128, 2, 8)
    fx = make_fixture(layout, regime="extreme")
    g = fx.g.copy()
    g[:, :64] = -200 / 64  # a span of 200: past float32's exp, within float64's
    g[:, 64:] = -1e-3  # the second chunk barely decays
    spans = -g.reshape(1, 2, 64, 2).sum(axis=2)
    assert spans[0, 0].min() > 88.8
    assert spans[0, 0].max() < 709
    assert spans[0, 1].max() < 1
    grads = {"dq": np.zeros((1, 128, 2, 8))}
    grads["dq"][0, 100, 1, 3] = np.nan
    assert _misreadings.overflow_finding(grads, g, np.dtype(np.float32)) is None
    grads["dq"][0, 10, 1, 3] = np.nan
    found = _misreadings.overflow_finding(grads, g, np.dtype(np.float32))
    assert found is not None
    assert found.details["gradients"] == ("dq",)
    assert _misreadings.overflow_finding(grads, g, np.dtype(np.float64)) is None  # 709.8


@pytest.mark.slow
@pytest.mark.parametrize("reading", ["gate_exp_twice", "g_beta_swapped"])
def test_a_reading_whose_op_overflows_is_named_on_the_values_left(reading: str) -> None:
    panel = pytest.importorskip("panel")
    pytest.importorskip("torch")
    fx = make_fixture(GdnBackwardLayout(2, 200, 2, 8, carry_state=True), regime="mild", seed=3)
    kernel = panel.misread(fx, reading)
    assert not np.isfinite(kernel).all()  # the kernel overflowed, as its op does in float32
    assert _named(compare(kernel, fx).findings) == [reading]


@pytest.mark.parametrize("variant", ["", "early"])
def test_a_gate_read_a_step_off_under_equal_gates_is_named_by_its_dg_shift(variant: str) -> None:
    # Under a gate of 0 the reading leaves the forward as it is: only dg moves a step, which
    # is the shift finding, and its words name the reading.
    panel = pytest.importorskip("panel")
    pytest.importorskip("torch")
    fx = make_fixture(GdnBackwardLayout(1, 40, 2, 8, carry_state=True), regime="zero", seed=2)
    result = compare(panel.misread(fx, "gate_shift", variant), fx)
    assert [g.name for g in result.grads if not g.passed] == ["dg"]
    (finding,) = result["dg"].findings
    assert finding.kind == "shift"
    when = "early" if variant else "late"
    assert f"or the gate read one step {when}" in finding.text, finding.text
    assert finding.details["or_reading"] == "gate_shift"
    assert not any(f.kind == "misreading" for f in result.findings)  # nothing tells them apart


@pytest.mark.parametrize(("shape", "seed"), [((1, 255, 2, 16), 1), ((2, 130, 2, 8), 0)])
def test_a_reading_that_shows_in_one_gradient_alone_is_named(
    shape: tuple[int, int, int, int], seed: int
) -> None:
    # Under strong decay, a bfloat16 kernel that reads the state transposed fails in dg alone:
    # the other gradients move less than bfloat16's floors. Every reading is tried on it, its
    # floors no lower than the reading's own values rounded to bfloat16.
    fixture = make_fixture(
        GdnBackwardLayout(*shape, carry_state=True), regime="strong", seed=seed, dtype=BF16
    )
    q, k, v, g, beta, dy, state = fixture.inputs
    assert state is not None
    kernel = backward(q, k, v, g, beta, dy, state.swapaxes(-1, -2), dtype=np.float32)
    result = compare(kernel.astype(BF16), fixture)
    assert result.failed == ("dg",)
    assert [dict(f.details)["reading"] for f in result.findings] == ["state_transposed"]
