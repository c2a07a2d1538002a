"""``check._explain``: what runs on a failing comparison, in which order and by which policy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout, compare, generate, make_fixture, unpack
from gdn_layout.check import _misreadings
from gdn_layout.reference import backward


def _counted(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """The calls of ``module.name`` from now on, which still runs."""
    calls: list[Any] = []
    original = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_a_gradient_failing_alone_is_re_run_unless_its_own_values_explain_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = GdnBackwardLayout(2, 40, 2, 8)
    fx = make_fixture(layout, regime="mild")
    out = backward(*fx.inputs, dtype=np.float32)
    dv = unpack(out, layout).dv
    dv[...] = dv[:, :, ::-1].copy()  # dv's heads exchanged: named by its own values
    ran = _counted(monkeypatch, _misreadings, "step_gradients")
    result = compare(out, fx)
    assert result.failed == ("dv",)
    assert [f.kind for f in result["dv"].findings] == ["heads"]
    assert not ran
    unpack(out, layout).dv[...] = unpack(backward(*fx.inputs, dtype=np.float32), layout).dv
    unpack(out, layout).dq[...] *= 2  # a factor: a reading may scale one gradient alone
    result = compare(out, fx)
    assert result.failed == ("dq",)
    assert [f.kind for f in result["dq"].findings] == ["scale"]
    assert ran
    assert not any(f.kind == "misreading" for f in result.findings)


def test_bare_buffers_re_run_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    fx = make_fixture(GdnBackwardLayout(1, 12, 2, 4, carry_state=True), regime="mild")
    q, k, v, g, beta, dy, state = fx.inputs
    assert state is not None
    kernel = backward(q, k, v, g, beta, dy, state.swapaxes(-1, -2), dtype=np.float32)
    ran = _counted(monkeypatch, _misreadings, "step_gradients")
    result = compare(kernel, fx.packed, fx.layout, floors=fx.floors)
    assert not result.passed
    assert not ran
    assert not any(f.kind == "misreading" for f in result.findings)
    assert [f.kind for f in compare(kernel, fx).findings] == ["misreading"]
    assert ran


def test_rows_of_identical_inputs_whose_gradients_differ_are_named() -> None:
    layout = GdnBackwardLayout(2, 20, 2, 4)
    fx = generate._identical_rows_fixture(layout, np.dtype(np.float32), "mixed", 11)
    good = backward(*fx.inputs, dtype=np.float32)
    assert compare(good, fx).passed
    row_bug = good.copy()
    unpack(row_bug, layout).dv[1] *= 1.5  # only the second row is wrong
    rows = [f for f in compare(row_bug, fx).findings if f.kind == "rows"]
    assert [f.details["rows"] for f in rows] == [(1,)]
    assert rows[0].text.endswith("fail where the others pass: a bug in the rows after the first?")
    first = good.copy()
    unpack(first, layout).dv[0] *= 1.5  # only the first row is wrong: it is named, not row 1
    rows = [f for f in compare(first, fx).findings if f.kind == "rows"]
    assert [f.details["rows"] for f in rows] == [(0,)]
    nudged = good.copy()  # rows a bit apart within the criterion, and every row wrong alike
    dk = unpack(nudged, layout).dk
    dk[1:] = np.nextafter(dk[1:], np.float32(np.inf))
    unpack(nudged, layout).dv[...] *= 1.5
    assert not any(f.kind == "rows" for f in compare(nudged, fx).findings)
    everywhere = good.copy()
    unpack(everywhere, layout).dv[...] *= 1.5  # every row wrong alike
    assert not any(f.kind == "rows" for f in compare(everywhere, fx).findings)
    other = make_fixture(layout, seed=1)  # rows of their own
    wrong = backward(*other.inputs, dtype=np.float32)
    unpack(wrong, layout).dv[1] *= 1.5
    assert not any(f.kind == "rows" for f in compare(wrong, other).findings)


def _noisy(part: Any) -> None:
    part += 0.1 * np.abs(part).mean() * np.random.default_rng(0).standard_normal(part.shape)


def test_a_wrong_hand_over_in_the_backward_is_worded_for_the_backward() -> None:
    # dk and dv wrong before step 24, dq right: the cotangent handed back across step 24.
    layout = GdnBackwardLayout(1, 40, 2, 8, carry_state=True)
    fx = make_fixture(layout, regime="mild", seed=2)
    out = backward(*fx.inputs, dtype=np.float32)
    for name in ("dk", "dv"):
        _noisy(getattr(unpack(out, layout), name)[:, :24])
    result = compare(out, fx)
    assert result["dq"].passed
    steps = [f for g in result.grads for f in g.findings if f.kind == "boundary"]
    assert steps, result.causes()
    for finding in steps:
        assert finding.details["step"] == 24
        assert "handed back across step 24 in the backward sweep" in finding.text
        assert finding.text.startswith(str(finding.details["seen"]))


def test_a_step_wrong_from_on_where_dq_passes_is_not_said_to_be_handed_back() -> None:
    # dk wrong from step 24 on: a cotangent handed back across step 24 would make the steps
    # before it wrong, not those after.
    layout = GdnBackwardLayout(1, 40, 2, 8)
    fx = make_fixture(layout, regime="mild", seed=2)
    out = backward(*fx.inputs, dtype=np.float32)
    _noisy(unpack(out, layout).dk[:, 24:])
    result = compare(out, fx)
    assert result["dq"].passed
    found = [f for f in result["dk"].findings if f.kind == "boundary"]
    assert [f.details["side"] for f in found] == ["from"]
    assert "backward sweep" not in found[0].text


@pytest.mark.parametrize("carried", [True, False])
def test_an_error_fading_where_dq_passes_names_the_initial_state_only_where_one_is_carried(
    carried: bool,
) -> None:
    # dk wrong from the first step, its error fading by a factor of 3 a step: with a carried
    # state, the backward's recomputed states from it; without one, nothing to read wrong.
    layout = GdnBackwardLayout(1, 24, 2, 8, carry_state=carried)
    fx = make_fixture(layout, regime="mild", seed=3)
    out = backward(*fx.inputs, dtype=np.float32)
    dk = unpack(out, layout).dk
    dk *= (1 + 0.3 * 3.0 ** -np.arange(layout.seq, dtype=np.float32))[None, :, None, None]
    result = compare(out, fx)
    assert result["dq"].passed
    (found,) = [f for f in result["dk"].findings if f.kind == "boundary"]
    assert found.details["side"] == "fades"
    assert found.text.startswith(str(found.details["seen"]))
    assert ("initial state" in found.text) is carried
    assert ("backward sweep" in found.text) is carried


def test_a_step_found_where_dq_fails_keeps_the_forward_s_words() -> None:
    # A state not carried forward: dq fails too, so the step is not the backward's.
    layout = GdnBackwardLayout(1, 40, 2, 8)
    fx = make_fixture(layout, regime="mild", seed=2)
    out = backward(*fx.inputs, dtype=np.float32)
    grads = unpack(out, layout)
    for name in ("dq", "dk"):
        _noisy(getattr(grads, name)[:, 24:])
    found = [f for g in compare(out, fx).grads for f in g.findings if f.kind == "boundary"]
    assert found
    assert not any("backward sweep" in f.text for f in found)


def test_dstate_failing_alone_with_nothing_found_is_the_end_of_the_backward_sweep() -> None:
    layout = GdnBackwardLayout(1, 20, 2, 8, carry_state=True)
    fx = make_fixture(layout, regime="mild", seed=4)
    out = backward(*fx.inputs, dtype=np.float32)
    dstate = unpack(out, layout).dstate
    assert dstate is not None
    dstate += 0.05 * np.abs(dstate).mean() * np.random.default_rng(1).standard_normal(dstate.shape)
    result = compare(out, fx)
    assert result.failed == ("dstate",)
    assert [f.text.split(":")[0] for f in result["dstate"].findings] == [
        "only dstate fails, and dq passes (the forward's states are right)"
    ]
    dstate *= 0  # a dstate never written is its own finding, not the sweep's
    assert [f.kind for f in compare(out, fx)["dstate"].findings] == ["unwritten"]
