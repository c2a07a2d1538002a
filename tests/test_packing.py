"""unpack gives views and never copies; pack writes the same bytes back, safely, with NumPy's
``out=``, ``dtype=`` and ``casting=``; every documented error names what is wrong."""

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

from gdn_layout import GdnBackwardLayout, empty, pack, unpack, zeros
from support import DeviceArray

layouts = st.from_type(GdnBackwardLayout)  # registered in conftest.py
dtypes = st.sampled_from([np.dtype(d) for d in (np.float16, np.float32, np.float64)])
dtypes |= st.just(np.dtype(ml_dtypes.bfloat16))


def _ramp(n: int, dtype: Any) -> NDArray[Any]:
    # Distinct values exact in float16 and bfloat16 (integers below 256).
    return (np.arange(n) % 251).astype(dtype)


def _hand_sliced(flat: NDArray[Any], layout: GdnBackwardLayout) -> list[NDArray[Any]]:
    """The oracle: slicing by the Rust offsets, shapes written out."""
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    shapes: list[tuple[int, ...]] = [(b, s, h, n)] * 3
    shapes += [(b, s, h, n) if layout.gate_per_channel else (b, s, h)]
    shapes += [(b, s, h), (b, h, n, n)][: 2 if layout.carry_state else 1]
    return [
        flat[..., off : off + length].reshape(flat.shape[:-1] + shape)
        for (off, length), shape in zip(layout.slices(), shapes, strict=True)
    ]


@given(layouts, dtypes, st.integers(1, 3), st.booleans())
def test_unpack_is_views_of_hand_slicing_and_pack_inverts_it(
    layout: GdnBackwardLayout, dtype: np.dtype[Any], step: int, lead: bool
) -> None:
    base = _ramp(2 * 3 * layout.total_elems * step, dtype)
    flat = base.reshape(2, 3, -1)[..., ::step] if lead else base[: layout.total_elems * step : step]
    grads = unpack(flat, layout)
    assert (grads.dstate is None) == (not layout.carry_state)
    views = [g for g in grads if g is not None]
    for got, want in zip(views, _hand_sliced(flat, layout), strict=True):
        assert got.shape == want.shape
        assert got.dtype == dtype
        assert np.array_equal(got.astype(np.float64), want.astype(np.float64))
        assert got.size == 0 or np.shares_memory(got, base)
    if not lead:
        packed = pack(*views)
        assert packed.dtype == dtype
        assert not np.shares_memory(packed, flat)
        assert np.array_equal(packed.view(np.uint8), np.ascontiguousarray(flat).view(np.uint8))


@given(layouts, st.integers(-7, 7), st.booleans())
def test_pack_from_views_that_overlap_out_matches_packing_copies(
    layout: GdnBackwardLayout, shift: int, reverse: bool
) -> None:
    # Views of out's own memory, displaced by `shift` elements (and maybe walking it
    # backwards): a naive in-order copy would read data it already overwrote.
    total = layout.total_elems
    buf = np.arange(total + abs(shift), dtype=np.float64)
    out, source = buf[max(shift, 0) :][:total], buf[max(-shift, 0) :][:total]
    views = [v for v in unpack(source[::-1] if reverse else source, layout) if v is not None]
    expected = pack(*[v.copy() for v in views], layout=layout)
    assert pack(*views, layout=layout, out=out) is out
    assert np.array_equal(out, expected)


def test_pack_swaps_two_gradients_through_one_buffer() -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    out = np.arange(layout.total_elems, dtype=np.float64)
    g = unpack(out, layout)
    expected = np.concatenate([g.dk, g.dq, g.dv, g.dg, g.dbeta], axis=None)
    pack(g.dk, g.dq, g.dv, g.dg, g.dbeta, out=out)
    assert np.array_equal(out, expected)


def test_views_are_read_only_file_backed_and_write_through(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(1, 3, 2, 4, gate_per_channel=True, carry_state=True)
    frozen = np.zeros(layout.total_elems)
    frozen.flags.writeable = False
    assert not any(v.flags.writeable for v in unpack(frozen, layout) if v is not None)
    path = tmp_path / "grads.bin"
    np.arange(layout.total_elems, dtype=np.float32).tofile(path)
    mapped = np.memmap(path, dtype=np.float32, mode="r+")
    grads = unpack(mapped, layout)
    assert all(isinstance(v, np.memmap) for v in grads if v is not None)
    assert grads.dstate is not None
    grads.dstate[0, 1, 2, 3] = -1.0
    mapped.flush()
    assert np.fromfile(path, dtype=np.float32)[layout.dstate_offset + 16 + 8 + 3] == -1.0


def test_empty_and_zeros() -> None:
    layout = GdnBackwardLayout(1, 4, 2, 8, carry_state=True)
    flat, grads = empty(layout, dtype="bfloat16")
    assert (flat.dtype, flat.shape) == (ml_dtypes.bfloat16, (layout.total_elems,))
    assert all(np.shares_memory(v, flat) for v in grads if v is not None)
    flat, grads = zeros(layout)
    assert flat.dtype == np.float32
    assert not flat.any()
    grads.dbeta[0, 2, 1] = 5.0
    assert flat[layout.dbeta_offset + 2 * 2 + 1] == flat.sum() == 5.0


def test_pack_dtype_and_casting_follow_numpy() -> None:
    layout = GdnBackwardLayout(1, 2, 1, 2)
    grads = [np.full(s.shape, 1.5, np.float32) for s in layout.segments()]
    assert pack(*grads).dtype == np.float32
    grads[3] = grads[3].astype(np.float64)
    assert pack(*grads).dtype == np.float64  # np.result_type
    assert pack(*grads, dtype=np.float16).dtype == np.float16
    out = np.zeros(layout.total_elems, np.float16)
    assert pack(*grads, out=out, dtype=np.float16) is out
    ints = np.zeros(layout.total_elems, np.int32)
    with pytest.raises(
        TypeError, match="cannot cast dq from float32 to int32 with casting='same_kind'"
    ):
        pack(*grads, out=ints)
    assert not ints.any(), "nothing may be written before every check passed"
    pack(*grads, out=ints, casting="unsafe")
    assert np.array_equal(ints, np.ones(layout.total_elems, np.int32))
    with pytest.raises(
        TypeError, match="cannot cast dg from float64 to float32 with casting='safe'"
    ):
        pack(*grads, dtype=np.float32, casting="safe")
    lists = [g.tolist() for g in grads]  # array_likes, and the layout inferred from them
    assert np.array_equal(pack(*lists), pack(*grads))


def test_pack_reads_gradients_on_a_device_with_one_copy_each() -> None:
    layout = GdnBackwardLayout(2, 3, 2, 4, carry_state=True)
    packed = _ramp(layout.total_elems, np.float32)
    grads: list[Any] = [DeviceArray(np.array(g)) for g in unpack(packed, layout) if g is not None]
    assert np.array_equal(pack(*grads, layout=layout), packed)
    assert all(len(g.copies) == 1 for g in grads)


LAYOUT = GdnBackwardLayout(1, 2, 3, 4)
CARRIED = GdnBackwardLayout(1, 2, 3, 4, carry_state=True)
GRADS = [np.zeros(s.shape) for s in LAYOUT.segments()]
READ_ONLY = np.zeros(84)
READ_ONLY.flags.writeable = False
PACK: Any = pack  # the table passes mistyped arguments on purpose
UNPACK: Any = unpack
EMPTY: Any = empty
ZEROS: Any = zeros
SHAPE_84 = "GdnBackwardLayout(batch=1, seq=2, heads=3, state_size=4, gate_per_channel=False"


B84 = f"for {SHAPE_84}"
BAD: list[tuple[Any, type[Exception], str]] = [
    (lambda: UNPACK([0.0] * 84, LAYOUT), TypeError, "unpack: flat must be a NumPy array, got list"),
    (lambda: UNPACK(np.array(0.0), LAYOUT), ValueError,
     "84 elements along its last axis, got a 0-d"),
    (lambda: UNPACK(np.zeros(83), LAYOUT), ValueError,
     f"unpack: flat must have layout.total_elems = 84 elements along its last axis, got "
     f"shape (83,), {B84}"),
    (lambda: UNPACK(np.zeros(84), (1, 2)), TypeError,
     "unpack: layout must be a GdnBackwardLayout, got tuple"),
    (lambda: EMPTY((1, 2, 3, 4)), TypeError, "layout must be a GdnBackwardLayout, got tuple"),
    (lambda: EMPTY(LAYOUT, dtype="nope"), TypeError, "empty: dtype must be a NumPy dtype"),
    (lambda: ZEROS(LAYOUT, dtype=3.5), TypeError, "zeros: dtype must be a NumPy dtype"),
    (lambda: LAYOUT.nbytes("nope"), TypeError, "nbytes: dtype must be a NumPy dtype, got 'nope'"),
    (lambda: PACK(*GRADS[:2], np.zeros((1, 2, 3, 5)), *GRADS[3:]), ValueError,
     "pack: dv has shape (1, 2, 3, 5), expected (1, 2, 3, 4)"),
    (lambda: PACK(*GRADS[:3], np.zeros((1, 2)), GRADS[4]), ValueError,
     "pack: dg must have shape [B, S, H] = (1, 2, 3) or [B, S, H, N] = (1, 2, 3, 4) of dq, "
     "got (1, 2)"),
    (lambda: PACK(*GRADS[:4], np.zeros((1, 2, 4)), layout=LAYOUT), ValueError,
     f"pack: dbeta has shape (1, 2, 4), expected (1, 2, 3) {B84}"),
    (lambda: PACK(*GRADS, layout=CARRIED), ValueError,
     "pack: dstate is missing, but the layout has carry_state=True"),
    (lambda: PACK(*GRADS, np.zeros((1, 3, 4, 4)), layout=LAYOUT), ValueError,
     "pack: dstate is given, but the layout has carry_state=False"),
    (lambda: PACK(*GRADS, layout=(1, 2)), TypeError,
     "pack: layout must be a GdnBackwardLayout, got tuple"),
    (lambda: PACK(*GRADS, out=[0.0] * 84), TypeError, "pack: out must be a NumPy array, got list"),
    (lambda: PACK(*GRADS, out=np.zeros(85)), ValueError,
     f"pack: out must have shape (84,) {B84}, carry_state=False), got (85,)"),
    (lambda: PACK(*GRADS, out=np.zeros((1, 84))), ValueError, "got (1, 84)"),
    (lambda: PACK(*GRADS, out=READ_ONLY), ValueError,
     "pack: out must be writeable, got a read-only array"),
    (lambda: PACK(*GRADS, dtype="nope"), TypeError,
     "pack: dtype must be a NumPy dtype, got 'nope'"),
    (lambda: PACK(*GRADS[:4], np.full((1, 2, 3), "x")), TypeError,
     "pack: gradients are numbers; the packed dtype would be <U32"),
    (lambda: PACK(*GRADS, out=np.zeros(84), dtype="f4"), TypeError,
     "pack: dtype=float32 conflicts with out.dtype=float64"),
    (lambda: PACK(*GRADS, casting="nope"), ValueError,
     "pack: casting must be one of ('no', 'equiv', 'safe', 'same_kind', 'unsafe'), got 'nope'"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), BAD)
def test_bad_inputs(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_a_wrong_dq_is_named_not_the_gradient_it_makes_look_wrong() -> None:
    layout = GdnBackwardLayout(2, 5, 3, 4, carry_state=True)
    grads = [np.zeros(shape) for shape in layout.shapes]
    grads[0] = grads[0].swapaxes(1, 2)  # [B, H, S, N]
    expected = (
        f"pack: dq has shape (2, 3, 5, 4), expected (2, 5, 3, 4) for {layout!r}, "
        "the layout of the other gradients"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        pack(*grads)


def _wrong_shapes(layout: GdnBackwardLayout, name: str) -> list[tuple[int, ...]]:
    """Shapes no layout fitting the other gradients gives ``name``: an axis dropped, added,
    longer, or two exchanged (and, for dg, not the other gate mode's)."""
    shape = layout.shape(name)
    candidates = {(*shape[:i], *shape[i + 1 :]) for i in range(len(shape))}
    candidates |= {(*shape, 2), (3, *shape)}
    candidates |= {(*shape[:i], shape[i] + 1, *shape[i + 1 :]) for i in range(len(shape))}
    candidates |= {
        (*shape[:i], *shape[i + 1 : i + 2], *shape[i : i + 1], *shape[i + 2 :])
        for i in range(len(shape) - 1)
    }
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    other = GdnBackwardLayout(b, s, h, n, gate_per_channel=not layout.gate_per_channel)
    return sorted(candidates - {shape, *([other.shape("dg")] if name == "dg" else [])})


@given(layouts, st.data())
def test_a_gradient_of_a_wrong_shape_is_named(
    layout: GdnBackwardLayout, data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(layout.names))
    wrong = data.draw(st.sampled_from(_wrong_shapes(layout, name)))
    grads = [
        np.zeros(wrong if n == name else s)
        for n, s in zip(layout.names, layout.shapes, strict=True)
    ]
    with pytest.raises(ValueError, match=f"^pack: {name} ") as raised:
        pack(*grads)
    assert str(wrong) in str(raised.value)
    assert str(layout.shape(name)) in str(raised.value)
