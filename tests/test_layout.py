"""The layout's contract: it tiles the buffer as gdn.rs does, validates its arguments, has value
semantics and infers itself from arrays. Parity of every number with rlx-ir: test_golden.py."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout, Segment

layouts = st.from_type(GdnBackwardLayout)  # registered in conftest.py


@given(layouts)
def test_segments_tile_the_buffer_with_gdn_rs_lengths(layout: GdnBackwardLayout) -> None:
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    lengths = [b * s * h * n] * 3 + [b * s * h * (n if layout.gate_per_channel else 1), b * s * h]
    lengths += [b * h * n * n] if layout.carry_state else []
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]  # no gap, no overlap
    sizes = {"b": b, "s": s, "h": h, "n": n, "i": n, "j": n}
    assert layout.slices() == list(zip(offsets, lengths, strict=True))
    assert sum(lengths) == layout.total_elems == layout.dstate_offset + layout.state_elems
    assert layout.dbeta_offset == layout.dg_offset + layout.gate_elems
    for seg in layout.segments():
        assert math.prod(seg.shape) == seg.length
        assert layout.segment(seg.name) == seg
        assert seg.shape == tuple(sizes[axis] for axis in seg.axes)
    assert tuple(seg.name for seg in layout.segments()) == layout.names
    assert GdnBackwardLayout.from_dict(json.loads(json.dumps(layout.to_dict()))) == layout
    assert GdnBackwardLayout.from_grads(*layout.shapes) == layout


def test_names_shapes_and_input_shapes_follow_the_flags() -> None:
    plain = GdnBackwardLayout(2, 3, 4, 8)
    assert plain.names == ("dq", "dk", "dv", "dg", "dbeta")
    assert plain.shape("dg") == plain.input_shape("beta") == (2, 3, 4)
    full = GdnBackwardLayout(2, 3, 4, 8, gate_per_channel=True, carry_state=True)
    assert full.segments()[-1] == Segment("dstate", 3 * 192 + 192 + 24, 2 * 4 * 8 * 8, (2, 4, 8, 8))
    assert full.shape("dg") == full.input_shape("y") == (2, 3, 4, 8)
    assert full.segment("dstate").axes == ("b", "h", "i", "j")
    with pytest.raises(KeyError, match="no gradient 'dstate' in this layout; it has dq, dk"):
        plain.segment("dstate")
    with pytest.raises(KeyError, match="no input 'dq'"):
        full.input_shape("dq")


def test_value_semantics() -> None:
    a = GdnBackwardLayout(2, 3, 4, 8, carry_state=True)
    b = GdnBackwardLayout(np.int64(2), np.uint8(3), 4, 8, False, True)  # type: ignore[arg-type]
    assert a == b
    assert hash(a) == hash(b)
    assert type(b.batch) is int
    assert a != GdnBackwardLayout(2, 3, 4, 8)
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a) == (
        "GdnBackwardLayout(batch=2, seq=3, heads=4, state_size=8, "
        "gate_per_channel=False, carry_state=True)"
    )
    _ = a.total_elems, a.shapes  # computed and kept, but no field
    assert (
        dataclasses.asdict(a)
        == a.to_dict()
        == dict(batch=2, seq=3, heads=4, state_size=8, gate_per_channel=False, carry_state=True)
    )
    assert (
        dataclasses.replace(a, seq=5).total_elems
        == GdnBackwardLayout(2, 5, 4, 8, False, True).total_elems
    )
    for name in ("batch", "total_elems"):
        with pytest.raises(AttributeError):
            setattr(a, name, 3)
    assert a.nbytes(np.float64) == 8 * a.total_elems
    assert a.nbytes("bfloat16") == 2 * a.total_elems


def test_sizes_past_int64_are_exact_and_overflow_is_refused_where_rust_panics() -> None:
    layout = GdnBackwardLayout(2**20, 2**20, 2**6, 2**16, carry_state=True)
    assert layout.total_elems == 3 * 2**62 + 2 * 2**46 + 2**58 > 2**63
    # b * s overflows although b * s * h * n is 0; only the carried state's b * h * n * n does.
    for dims, carry in [((2**32, 2**32, 1, 0), False), ((1, 1, 2**16, 2**24), True)]:
        with pytest.raises(ValueError, match="does not fit in a 64-bit usize"):
            GdnBackwardLayout(*dims, carry_state=carry)
    assert GdnBackwardLayout(1, 1, 2**16, 2**24).total_elems == 3 * 2**40 + 2 * 2**16


def _made(**kwargs: Any) -> GdnBackwardLayout:
    return GdnBackwardLayout(**({"batch": 1, "seq": 2, "heads": 3, "state_size": 4} | kwargs))


FROM_DICT: Any = GdnBackwardLayout.from_dict
BAD: list[tuple[Any, type[Exception], str]] = [
    (lambda: _made(batch=-1), ValueError, "batch must be a non-negative integer, got -1"),
    (lambda: _made(seq=2.0), TypeError, "seq must be a non-negative integer, got float 2.0"),
    (lambda: _made(heads="4"), TypeError, "heads must be a non-negative integer, got str '4'"),
    (lambda: _made(state_size=None), TypeError,
     "state_size must be a non-negative integer, got NoneType"),
    (lambda: _made(batch=True), TypeError, "batch must be a non-negative integer, got bool True"),
    (lambda: _made(seq=np.float32(3)), TypeError, "seq must be a non-negative integer, got float3"),
    (lambda: _made(heads=2**64), ValueError, "heads must fit in a 64-bit usize"),
    (lambda: _made(gate_per_channel=1), TypeError, "gate_per_channel must be a bool, got int 1"),
    (lambda: _made(carry_state="yes"), TypeError, "carry_state must be a bool, got str 'yes'"),
    (lambda: FROM_DICT([1, 2, 3, 4]), TypeError, "layout data must be a dict, got list"),
    (lambda: FROM_DICT({"batch": 1, "seq": 2, "heads": 3}), ValueError, "missing ['state_size']"),
    (lambda: FROM_DICT(_made().to_dict() | {"chunk": 6}), ValueError, "unknown ['chunk']"),
    (lambda: FROM_DICT(_made().to_dict() | {"seq": "2"}), TypeError, "seq must be"),
    (lambda: GdnBackwardLayout.from_inputs((2, 5, 3), (2, 5, 3)), ValueError,
     "q must have 4 dimensions [B, S, H, N], got shape (2, 5, 3)"),
    (lambda: GdnBackwardLayout.from_inputs((2, 5, 3, 8), (2, 5, 4)), ValueError,
     "g must have shape [B, S, H] = (2, 5, 3) or [B, S, H, N] = (2, 5, 3, 8) of q, got (2, 5, 4)"),
    (lambda: GdnBackwardLayout.from_inputs((2, 5, 3, 8), (2, 5, 3), (2, 3, 8)), ValueError,
     "state must have shape [B, H, N, N] = (2, 3, 8, 8) of q, got (2, 3, 8)"),
    (lambda: GdnBackwardLayout.from_inputs((2, 5, 3, 8), 7), TypeError,
     "g must be an array or a shape, got int"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "message"), BAD)
def test_bad_arguments_are_named(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_from_inputs_infers_the_flags() -> None:
    q = np.zeros((2, 5, 3, 8))
    assert GdnBackwardLayout.from_inputs(q, np.zeros((2, 5, 3))) == GdnBackwardLayout(2, 5, 3, 8)
    carried = GdnBackwardLayout.from_inputs(q, q, np.zeros((2, 3, 8, 8)))
    assert carried == GdnBackwardLayout(2, 5, 3, 8, gate_per_channel=True, carry_state=True)
    shapes = list(carried.shapes)
    shapes[2] = (2, 5, 3, 7)
    with pytest.raises(
        ValueError, match=re.escape("dv has shape (2, 5, 3, 7), expected (2, 5, 3, 8)")
    ):
        GdnBackwardLayout.from_grads(*shapes)
