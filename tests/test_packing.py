"""unpack gives views and never copies; pack writes the same bytes back, safely."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, GdnGrads, empty, pack, unpack, zeros
from support import DeviceArray

DTYPES = [
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(ml_dtypes.bfloat16),
]

layouts = st.from_type(GdnBackwardLayout)  # registered in conftest.py
dtypes = st.sampled_from(DTYPES)


def _ramp(n: int, dtype: np.dtype[Any]) -> NDArray[Any]:
    # Distinct values small enough to be exact in float16 and bfloat16 (integers below 256).
    return (np.arange(n) % 251).astype(dtype)


def _expected_views(flat: NDArray[Any], layout: GdnBackwardLayout) -> list[NDArray[Any]]:
    """Hand-written slicing from the Rust offsets: the oracle unpack is checked against."""
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    shapes: list[tuple[int, ...]] = [(b, s, h, n)] * 3 + [
        (b, s, h, n) if layout.gate_per_channel else (b, s, h)
    ]
    shapes += [(b, s, h), (b, h, n, n)][: 2 if layout.carry_state else 1]
    return [
        flat[..., off : off + length].reshape(flat.shape[:-1] + shape)
        for (off, length), shape in zip(layout.slices(), shapes, strict=True)
    ]


def _fields(grads: GdnGrads) -> list[NDArray[Any]]:
    return [g for g in grads if g is not None]


@given(layouts, dtypes)
def test_unpack_matches_hand_slicing_and_shares_memory(
    layout: GdnBackwardLayout, dtype: np.dtype[Any]
) -> None:
    flat = _ramp(layout.total_elems, dtype)
    grads = unpack(flat, layout)
    assert (grads.dstate is None) == (not layout.carry_state)
    expected = _expected_views(flat, layout)
    for got, want in zip(_fields(grads), expected, strict=True):
        assert got.shape == want.shape
        assert got.dtype == dtype
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64))
        assert got.size == 0 or np.shares_memory(got, flat)


@given(layouts, dtypes)
def test_pack_inverts_unpack(layout: GdnBackwardLayout, dtype: np.dtype[Any]) -> None:
    flat = _ramp(layout.total_elems, dtype)
    packed = pack(*unpack(flat, layout))
    assert packed.dtype == dtype
    assert packed.shape == (layout.total_elems,)
    assert not np.shares_memory(packed, flat)
    assert np.array_equal(packed.view(np.uint8), flat.view(np.uint8))


@given(layouts, st.integers(-3, 3).filter(bool), st.booleans())
def test_pack_reads_strided_inputs(layout: GdnBackwardLayout, step: int, into_out: bool) -> None:
    base = _ramp(layout.total_elems * abs(step), np.dtype(np.float64))
    flat = base[::step][: layout.total_elems]
    out = np.full(layout.total_elems, -1.0) if into_out else None
    assert np.array_equal(pack(*unpack(flat, layout), out=out), flat)


@given(layouts, st.integers(1, 3), st.booleans())
def test_unpack_keeps_strides_and_leading_axes(
    layout: GdnBackwardLayout, step: int, lead: bool
) -> None:
    base = _ramp(2 * 3 * layout.total_elems * step, np.dtype(np.float32))
    flat = base.reshape(2, 3, -1)[..., ::step] if lead else base[: layout.total_elems * step : step]
    grads = unpack(flat, layout)
    for got, want in zip(_fields(grads), _expected_views(flat, layout), strict=True):
        assert got.shape == want.shape
        assert np.array_equal(got, want)
        assert got.size == 0 or np.shares_memory(got, base)


@given(layouts, st.integers(-7, 7), st.booleans())
def test_pack_from_views_that_overlap_out_matches_packing_copies(
    layout: GdnBackwardLayout, shift: int, reverse: bool
) -> None:
    # The views come from the same memory as out, displaced by `shift` elements (and maybe
    # walking it backwards): a naive in-order copy would read data it already overwrote.
    total = layout.total_elems
    buf = np.arange(total + abs(shift), dtype=np.float64)
    out = buf[max(shift, 0) :][:total]
    source = buf[max(-shift, 0) :][:total]
    if reverse:
        source = source[::-1]
    views = unpack(source, layout)
    expected = pack(*[v.copy() for v in views if v is not None], layout=layout)
    assert pack(*views, layout=layout, out=out) is out
    assert np.array_equal(out, expected)


def test_pack_into_its_own_views_is_a_no_op() -> None:
    layout = GdnBackwardLayout(2, 3, 2, 4, carry_state=True)
    out = np.arange(layout.total_elems, dtype=np.float32)
    before = out.copy()
    assert pack(*unpack(out, layout), out=out) is out
    assert np.array_equal(out, before)


def test_pack_reads_each_input_before_overwriting_it() -> None:
    # dq's source is dk's destination and vice versa: a swap through one buffer.
    layout = GdnBackwardLayout(1, 2, 1, 2)
    out = np.arange(layout.total_elems, dtype=np.float64)
    g = unpack(out, layout)
    expected = np.concatenate(
        [g.dk.ravel(), g.dq.ravel(), g.dv.ravel(), g.dg.ravel(), g.dbeta.ravel()]
    )
    pack(g.dk, g.dq, g.dv, g.dg, g.dbeta, out=out)
    assert np.array_equal(out, expected)


def test_unpack_read_only_input_gives_read_only_views() -> None:
    layout = GdnBackwardLayout(1, 2, 2, 2, carry_state=True)
    flat = np.zeros(layout.total_elems)
    flat.flags.writeable = False
    for view in _fields(unpack(flat, layout)):
        assert not view.flags.writeable


def test_unpack_memmap_views_stay_file_backed(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(1, 3, 2, 4, gate_per_channel=True, carry_state=True)
    path = tmp_path / "grads.bin"
    np.arange(layout.total_elems, dtype=np.float32).tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="r+")
    grads = unpack(mapped, layout)
    assert grads.dstate is not None
    grads.dstate[0, 1, 2, 3] = -1.0
    mapped.flush()
    on_disk = np.fromfile(path, dtype=np.float32)
    assert on_disk[layout.dstate_offset + 1 * 16 + 2 * 4 + 3] == -1.0
    for view in _fields(grads):
        assert isinstance(view, np.memmap)
        assert np.shares_memory(view, mapped)


def test_writes_through_views_land_in_the_buffer() -> None:
    layout = GdnBackwardLayout(2, 3, 4, 8)
    flat, grads = zeros(layout, dtype=np.float64)
    grads.dbeta[1, 2, 3] = 5.0
    assert flat[layout.dbeta_offset + (1 * 3 + 2) * 4 + 3] == 5.0
    assert flat.sum() == 5.0


def test_nbytes_knows_bfloat16_by_name() -> None:
    assert LAYOUT.nbytes("bfloat16") == 2 * LAYOUT.total_elems


def test_empty_and_zeros() -> None:
    layout = GdnBackwardLayout(1, 4, 2, 8, carry_state=True)
    flat, grads = empty(layout, dtype=ml_dtypes.bfloat16)
    assert flat.dtype == ml_dtypes.bfloat16
    assert flat.shape == (layout.total_elems,)
    assert all(np.shares_memory(v, flat) for v in _fields(grads))
    flat, grads = zeros(layout)
    assert flat.dtype == np.float32
    assert not flat.any()
    assert grads.dstate is not None
    assert grads.dstate.shape == (1, 2, 8, 8)


def test_pack_result_dtype_rules() -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    grads = [np.ones(s.shape, np.float32) for s in layout.segments()]
    assert pack(*grads).dtype == np.float32
    grads[3] = grads[3].astype(np.float64)
    assert pack(*grads).dtype == np.float64
    assert pack(*grads, dtype=np.float16).dtype == np.float16
    out = np.zeros(layout.total_elems, np.float16)
    assert pack(*grads, out=out).dtype == np.float16
    assert pack(*grads, out=out, dtype=np.float16) is out


def test_pack_casting_follows_copyto() -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    grads = [np.full(s.shape, 1.5, np.float64) for s in layout.segments()]
    out = np.zeros(layout.total_elems, np.int32)
    with pytest.raises(
        TypeError, match="cannot cast dq from float64 to int32 with casting='same_kind'"
    ):
        pack(*grads, out=out)
    assert not out.any(), "nothing may be written before every check passed"
    pack(*grads, out=out, casting="unsafe")
    assert np.array_equal(out, np.ones(layout.total_elems, np.int32))
    with pytest.raises(
        TypeError, match="cannot cast dq from float64 to float32 with casting='safe'"
    ):
        pack(*grads, dtype=np.float32, casting="safe")
    assert pack(*grads, dtype=np.float32, casting="same_kind").dtype == np.float32


def test_pack_infers_the_layout_from_the_arrays() -> None:
    layout = GdnBackwardLayout(2, 3, 2, 4, gate_per_channel=True, carry_state=True)
    flat = np.arange(layout.total_elems, dtype=np.float64)
    grads = [g.tolist() for g in unpack(flat, layout) if g is not None]
    assert np.array_equal(pack(*grads), flat)


LAYOUT = GdnBackwardLayout(1, 2, 3, 4)
CARRIED = GdnBackwardLayout(1, 2, 3, 4, carry_state=True)


def _grads(layout: GdnBackwardLayout) -> list[Any]:
    return [np.zeros(s.shape) for s in layout.segments()]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (
            lambda: unpack(_any([0.0] * 84), LAYOUT),
            TypeError,
            "unpack: flat must be a NumPy array, got list",
        ),
        (
            lambda: unpack(np.array(0.0), LAYOUT),
            ValueError,
            "layout.total_elems = 84 elements along its last axis, got a 0-d array",
        ),
        (
            lambda: unpack(np.zeros(83), LAYOUT),
            ValueError,
            "must have layout.total_elems = 84 elements along its last axis, got shape (83,), "
            "for GdnBackwardLayout(batch=1, seq=2, heads=3, state_size=4",
        ),
        (lambda: unpack(np.zeros((84, 2)), LAYOUT), ValueError, "got shape (84, 2)"),
        (
            lambda: unpack(np.zeros(84), _any((1, 2, 3, 4))),
            TypeError,
            "unpack: layout must be a GdnBackwardLayout, got tuple",
        ),
        (
            lambda: empty(_any((1, 2, 3, 4))),
            TypeError,
            "layout must be a GdnBackwardLayout, got tuple",
        ),
        (
            lambda: _pack(*_grads(LAYOUT)[:2], np.zeros((1, 2, 3, 5)), *_grads(LAYOUT)[3:]),
            ValueError,
            "dv has shape (1, 2, 3, 5), expected (1, 2, 3, 4)",
        ),
        (
            lambda: _pack(*_grads(LAYOUT)[:3], np.zeros((1, 2)), _grads(LAYOUT)[4]),
            ValueError,
            "pack: dg must have shape [B, S, H] = (1, 2, 3) or [B, S, H, N] = (1, 2, 3, 4) of dq, "
            "got (1, 2)",
        ),
        (
            lambda: _pack(*_grads(LAYOUT)[:4], np.zeros((1, 2, 4)), layout=LAYOUT),
            ValueError,
            "pack: dbeta has shape (1, 2, 4), expected (1, 2, 3) for GdnBackwardLayout(",
        ),
        (
            lambda: _pack(*_grads(CARRIED)[:5], layout=CARRIED),
            ValueError,
            "pack: dstate is missing, but the layout has carry_state=True",
        ),
        (
            lambda: _pack(*_grads(LAYOUT), np.zeros((1, 3, 4, 4)), layout=LAYOUT),
            ValueError,
            "pack: dstate is given, but the layout has carry_state=False",
        ),
        (
            lambda: _pack(*_grads(LAYOUT), layout=_any((1, 2, 3, 4))),
            TypeError,
            "pack: layout must be a GdnBackwardLayout, got tuple",
        ),
        (
            lambda: _pack(*_grads(LAYOUT), out=_any([0.0] * 84)),
            TypeError,
            "pack: out must be a NumPy array, got list",
        ),
        (
            lambda: _pack(*_grads(LAYOUT), out=np.zeros(85)),
            ValueError,
            "pack: out must have shape (84,) for GdnBackwardLayout(batch=1, seq=2, heads=3, "
            "state_size=4, gate_per_channel=False, carry_state=False), got (85,)",
        ),
        (lambda: _pack(*_grads(LAYOUT), out=np.zeros((1, 84))), ValueError, "got (1, 84)"),
        (
            lambda: _pack(*_grads(LAYOUT), out=_read_only(84)),
            ValueError,
            "pack: out must be writeable, got a read-only array",
        ),
        (
            lambda: _pack(*_grads(LAYOUT), dtype="nope"),
            TypeError,
            "pack: dtype must be a NumPy dtype, got 'nope'",
        ),
        (
            lambda: _pack(*_grads(LAYOUT)[:4], np.full((1, 2, 3), "x")),
            TypeError,
            "pack: gradients are numbers; the packed dtype would be <U32",
        ),
        (lambda: empty(LAYOUT, dtype="nope"), TypeError, "empty: dtype must be a NumPy dtype"),
        (lambda: zeros(LAYOUT, dtype=_any(3.5)), TypeError, "zeros: dtype must be a NumPy dtype"),
        (
            lambda: LAYOUT.nbytes("nope"),
            TypeError,
            "nbytes: dtype must be a NumPy dtype, got 'nope'",
        ),
        (
            lambda: _pack(*_grads(LAYOUT), out=np.zeros(84), dtype=np.float32),
            TypeError,
            "pack: dtype=float32 conflicts with out.dtype=float64",
        ),
        (
            lambda: _pack(*_grads(LAYOUT), casting=_any("nope")),
            ValueError,
            "pack: casting must be one of ('no', 'equiv', 'safe', 'same_kind', 'unsafe'), "
            "got 'nope'",
        ),
        (
            lambda: _pack(*_grads(LAYOUT), dtype=np.int8),
            TypeError,
            "pack: cannot cast dq from float64 to int8 with casting='same_kind'",
        ),
    ],
)
def test_bad_inputs(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


def _read_only(n: int) -> NDArray[np.float64]:
    array = np.zeros(n)
    array.flags.writeable = False
    return array


def _any(value: object) -> Any:
    """Let a deliberately mistyped argument through to the runtime check."""
    return value


def _pack(*args: Any, **kwargs: Any) -> Any:
    return pack(*args, **kwargs)


def test_pack_reads_gradients_on_a_device_with_one_copy_each() -> None:
    layout = GdnBackwardLayout(2, 3, 2, 4, carry_state=True)
    packed = _ramp(layout.total_elems, np.dtype(np.float32))
    grads: list[Any] = [DeviceArray(np.array(g)) for g in unpack(packed, layout) if g is not None]
    assert np.array_equal(pack(*grads, layout=layout), packed)
    assert all(len(g.copies) == 1 for g in grads)


def test_a_wrong_dq_is_named_not_the_gradient_it_makes_look_wrong() -> None:
    layout = GdnBackwardLayout(2, 5, 3, 4, carry_state=True)
    grads = _grads(layout)
    grads[0] = grads[0].swapaxes(1, 2)  # [B, H, S, N]
    expected = (
        f"pack: dq has shape (2, 3, 5, 4), expected (2, 5, 3, 4) for {layout!r}, "
        "the layout of the other gradients"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        pack(*grads)


def _wrong_shapes(layout: GdnBackwardLayout, name: str) -> list[tuple[int, ...]]:
    """Shapes that no layout fitting the other gradients gives ``name``: its axes exchanged, one
    axis longer, one axis fewer or more."""
    shape = layout.shape(name)
    other_gate = GdnBackwardLayout(
        layout.batch,
        layout.seq,
        layout.heads,
        layout.state_size,
        gate_per_channel=not layout.gate_per_channel,
    ).shape("dg")
    candidates = {(*shape[:i], *shape[i + 1 :]) for i in range(len(shape))}
    candidates |= {(*shape, 2), (3, *shape)}
    candidates |= {(*shape[:i], shape[i] + 1, *shape[i + 1 :]) for i in range(len(shape))}
    candidates |= {
        (*shape[:i], *shape[i + 1 : i + 2], *shape[i : i + 1], *shape[i + 2 :])
        for i in range(len(shape) - 1)
    }
    candidates.discard(shape)
    if name == "dg":
        candidates.discard(other_gate)  # the other gate mode's dg: a layout of its own
    return sorted(candidates)


@given(layouts, st.data())
def test_a_gradient_of_a_wrong_shape_is_named(
    layout: GdnBackwardLayout, data: st.DataObject
) -> None:
    """Whichever gradient alone has a wrong shape, pack's error names it, with the shape it
    received and the one expected."""
    names = list(layout.names)
    name = data.draw(st.sampled_from(names))
    wrong = data.draw(st.sampled_from(_wrong_shapes(layout, name)))
    grads = _grads(layout)
    grads[names.index(name)] = np.zeros(wrong)
    with pytest.raises(ValueError, match=f"^pack: {name} ") as raised:
        pack(*grads)
    message = str(raised.value)
    assert str(wrong) in message
    assert str(layout.shape(name)) in message
