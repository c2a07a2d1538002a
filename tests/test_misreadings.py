"""Misreadings named by re-running the op: each reading, applied by a kernel written apart
from the kit (tests/panel.py's step-by-step kernel under autograd, or the reference on inputs
read another way), is named; correct kernels and bugs of other kinds are not."""

from __future__ import annotations

import tracemalloc
from typing import Any, NoReturn

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, draw_inputs, make_fixture, unpack
from gdn_layout._floors import term_scales
from gdn_layout.check import _misreadings
from gdn_layout.check._findings import KINDS, Finding
from gdn_layout.files import Fixture
from gdn_layout.reference import backward
from gdn_layout.reference._fused import fused_backward
from gdn_layout.reference._recurrent import step_gradients

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


def test_the_vocabulary_is_the_table_s() -> None:
    assert len(set(READINGS)) == len(READINGS)
    assert "misreading" in KINDS
    assert "overflow" in KINDS
    assert KINDS.index("misreading") < KINDS.index("unwritten")


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
    x = _misreadings._Case(f64[0], f64[1], f64[2], f64[3], f64[4], f64[5], f64[6], True)

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


def test_state_transposed_says_it_plainly() -> None:
    fx = make_fixture(GdnBackwardLayout(1, 12, 2, 4, carry_state=True), regime="mild")
    assert fx.state is not None
    result = compare(_read(fx, state=fx.state.swapaxes(-1, -2)), fx)
    assert result.causes() == [
        "likely cause: every gradient matches the op with the initial state read transposed "
        "(state[b, h, j, i]): the kernel reads the state as [V, K]"
    ]
    assert result.findings[0].details == {"reading": "state_transposed", "variant": None}
    assert result.findings[0].gradient is None


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


def test_a_near_miss_is_nearer_the_reading_in_every_gradient_the_kernel_fails() -> None:
    op: dict[str, Any] = {"dq": np.zeros(4), "dk": np.zeros(4), "dv": np.zeros(4)}
    reading: dict[str, Any] = {"dq": np.full(4, 1.0), "dk": np.full(4, 1.0), "dv": None}
    kernel = {"dq": np.full(4, 0.9), "dk": np.full(4, 0.4), "dv": np.full(4, 5.0)}
    assert _misreadings._nearer(reading, op, kernel, {"dq"})
    assert not _misreadings._nearer(reading, op, kernel, {"dq", "dk"})  # dk nearer the op
    assert _misreadings._nearer(reading, op, kernel, {"dq", "dv"})  # dv: the reading's silent
    assert not _misreadings._nearer(reading, op, kernel, {"dv"})  # nothing it judges fails


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


@pytest.mark.parametrize("per_channel", [False, True])
def test_the_chunked_re_run_takes_a_group_of_heads_at_a_time_within_its_bytes(
    per_channel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Heads are independent: a group at a time gives every head's values as one run does,
    # and the run's own memory stays within _FUSED_BYTES (a per-channel chunk's temporaries
    # are 64 times its inputs).
    layout = GdnBackwardLayout(2, 256, 48, 16, gate_per_channel=per_channel, carry_state=True)
    q, k, v, g, beta, dy, state = draw_inputs(layout, regime="mixed", seed=4)
    assert state is not None
    cot = np.ones(state.shape, np.float32)
    args = (q, k, v, g, beta, dy, state, cot)
    runs = []

    def counted(*a: Any, **kw: Any) -> Any:
        runs.append(a[0].shape[2])
        return fused_backward(*a, **kw)

    monkeypatch.setattr(_misreadings, "fused_backward", counted)
    tracemalloc.start()
    grouped = _misreadings._fused_form(*args)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(runs) > 1, runs  # the heads did not fit one group
    assert sum(runs) == layout.heads
    held = sum(a.nbytes for a in grouped.values())  # the result, and the slices' copies
    assert peak - 2 * held <= _misreadings._FUSED_BYTES, peak / 2**20
    monkeypatch.setattr(_misreadings, "_FUSED_BYTES", 1 << 60)
    whole = _misreadings._fused_form(*args)
    assert grouped.keys() == whole.keys()
    for name, values in whole.items():
        most = float(np.abs(values).max())
        np.testing.assert_allclose(grouped[name], values, rtol=1e-6, atol=1e-6 * most)


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


#: A sequence the screen runs on (_misreadings.ruled_out): its two ends of _ENDS steps each are
#: run first, and a reading the kernel misses there by more than any floors allow is not re-run.
_SCREENED_SEQ = 8 * _misreadings._ENDS + 40


@pytest.fixture(scope="module", params=["scalar", "channel"])
def long_fixture(request: pytest.FixtureRequest) -> Fixture:
    layout = GdnBackwardLayout(
        2, _SCREENED_SEQ, 2, 8, gate_per_channel=request.param == "channel", carry_state=True
    )
    return make_fixture(layout, regime="mixed", seed=3)


@pytest.mark.slow
@pytest.mark.parametrize(("reading", "variant"), PANEL, ids=lambda v: str(v) or "-")
def test_the_screen_leaves_an_independent_kernel_s_misreading_named(
    long_fixture: Fixture, reading: str, variant: str
) -> None:
    panel = pytest.importorskip("panel")
    pytest.importorskip("torch")
    fx = long_fixture
    if not next(r for r in _misreadings.READINGS if r.name == reading).applies(fx.layout):
        pytest.skip(f"{reading} cannot change this layout")
    result = compare(panel.misread(fx, reading, variant), fx)
    assert _named(result.findings) == [reading], [f.text for f in result.findings]


def test_the_screen_leaves_the_reference_on_misread_inputs_named() -> None:
    fx = make_fixture(
        GdnBackwardLayout(2, _SCREENED_SEQ, 2, 4, carry_state=True), regime="mild", seed=1
    )
    q, k, _, g, beta, _, state = fx.inputs
    assert state is not None
    late = np.zeros_like(g)
    late[:, 1:] = g[:, :-1]
    cases = {
        "state_transposed": _read(fx, state=state.swapaxes(-1, -2)),
        "gate_shift": _read(fx, g=late),
        "beta_missing": _read(fx, beta=np.ones_like(beta)),
        "qk_swapped": _read(fx, q=k, k=q),
    }
    for reading, kernel in cases.items():
        assert _named(compare(kernel, fx).findings) == [reading], reading


def _noisy(fx: Fixture, names: tuple[str, ...]) -> NDArray[Any]:
    """The fixture's gradients with noise of a thousandth of their RMS on ``names``: failing
    where nothing explains them."""
    out = np.array(fx.packed, np.float32)
    grads = unpack(out, fx.layout)
    rng = np.random.default_rng(0)
    for name in names:
        part = getattr(grads, name)
        part += (1e-3 * np.sqrt(np.mean(part**2)) * rng.standard_normal(part.shape)).astype(
            part.dtype
        )
    return out


def test_the_screen_spares_re_runs_and_changes_no_finding(
    long_fixture: Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # dk and dg fail, dv passes: most readings change dq on the first steps and dv on the
    # last, where the kernel is the op's; their re-runs are not made, and what compare says
    # is what it says with every reading re-run.
    fx = long_fixture
    kernel = _noisy(fx, ("dk", "dg"))
    runs: list[object] = []
    run = step_gradients

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append(args)
        return run(*args, **kwargs)

    monkeypatch.setattr(_misreadings, "step_gradients", counted)
    screened = compare(kernel, fx)
    spared = len(runs)
    assert screened["dv"].passed
    assert not screened["dk"].passed
    monkeypatch.setattr(_misreadings, "_misses", lambda *args: set())
    runs.clear()
    every = compare(kernel, fx)
    assert spared < len(runs)
    assert screened.causes() == every.causes()
    assert [g.findings for g in screened.grads] == [g.findings for g in every.grads]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_what_a_screen_takes_from_the_op_s_run_is_its_reading_s_full_run(
    long_fixture: Fixture, dtype: type
) -> None:
    # A reading that differs from the op in its initial state, its final cotangent or its
    # rows' seam alone shares the op's sweep or forward: the values its screen takes from the
    # op's run, or runs from its checkpoints and cotangents, are those of its full run.
    fx = long_fixture
    layout = fx.layout
    plain = _misreadings._case_slice(fx.inputs, layout, slice(0, 2), slice(0, layout.heads))
    plain = plain._replace(**{f: getattr(plain, f).astype(dtype) for f in plain._fields[:7]})
    shared = plain._replace(op=lambda: _misreadings._op_run(plain), ends=True)
    more = 0
    for reading in _misreadings.READINGS:
        if reading.name == "scale" or not reading.applies(layout):
            continue
        full = dict(reading.truths(plain))
        alone = dict(reading.truths(plain._replace(ends=True)))
        for words, grads in reading.truths(shared):
            for name, values in grads.items():
                if values is None:
                    continue
                known = ~np.isnan(values)
                whole, before = full[words][name], alone[words][name]
                assert whole is not None
                assert before is not None
                assert (values[known] == whole[known]).all(), (reading.name, name)
                more += int(known.sum() - (~np.isnan(before)).sum())
    assert more > 0


def test_the_op_s_run_is_made_once_for_every_reading_that_shares_it(
    long_fixture: Fixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    fx = long_fixture
    runs: list[Any] = []
    run = step_gradients

    def counted(*args: Any, **kwargs: Any) -> Any:
        runs.append((np.asarray(args[0]).dtype, kwargs.get("record") is not None))
        return run(*args, **kwargs)

    monkeypatch.setattr(_misreadings, "step_gradients", counted)
    compare(_noisy(fx, ("dk", "dg")), fx)
    recorded = [dtype for dtype, record in runs if record]
    assert recorded  # the op itself is one of the readings' runs (beta_missing's dv)
    assert len(recorded) == len(set(recorded))  # once in each dtype


def test_a_reading_found_stops_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    # The first reading verified is the cause shown: no reading after it is re-run.
    fx = make_fixture(GdnBackwardLayout(1, 12, 2, 4, carry_state=True), regime="mild")
    assert fx.state is not None
    tried: list[str] = []

    def logged(reading: _misreadings.Reading) -> _misreadings.Reading:
        def truths(x: Any) -> Any:
            tried.append(reading.name)
            return reading.truths(x)

        return reading._replace(truths=truths)

    monkeypatch.setattr(_misreadings, "READINGS", tuple(map(logged, _misreadings.READINGS)))
    result = compare(_read(fx, state=fx.state.swapaxes(-1, -2)), fx)
    assert _named(result.findings) == ["state_transposed"]
    assert set(tried) == {"state_transposed"}
