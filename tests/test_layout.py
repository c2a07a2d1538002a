"""The layout's own contract: validation, value semantics, derived records and inference.

Parity of every number with rlx-ir is guarded separately, by the golden table (test_golden.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout, Segment
from gdn_layout.layout import layout_html, layout_text

layouts = st.from_type(GdnBackwardLayout)  # registered in conftest.py


@given(layouts)
def test_slices_tile_the_buffer_exactly(layout: GdnBackwardLayout) -> None:
    cursor = 0
    for offset, length in layout.slices():
        assert offset == cursor, "gap or overlap in packed layout"
        cursor += length
    assert cursor == layout.total_elems


@given(layouts)
def test_segment_shapes_multiply_to_their_lengths(layout: GdnBackwardLayout) -> None:
    segments = layout.segments()
    # The lengths from the sizes alone (rlx-ir's gdn.rs), the offsets by adding them up.
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    lengths = [b * s * h * n] * 3 + [b * s * h * (n if layout.gate_per_channel else 1), b * s * h]
    lengths += [b * h * n * n] if layout.carry_state else []
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    assert layout.slices() == list(zip(offsets, lengths, strict=True))
    assert [(s.offset, s.length) for s in segments] == layout.slices()
    assert tuple(s.name for s in segments) == layout.names
    for seg in segments:
        assert math.prod(seg.shape) == seg.length
        assert layout.shape(seg.name) == seg.shape
        assert layout.segment(seg.name) == seg


@given(layouts)
def test_quantities_are_derived_as_gdn_rs_derives_them(layout: GdnBackwardLayout) -> None:
    qkv = layout.qkv_elems
    assert layout.gate_elems == (qkv if layout.gate_per_channel else layout.beta_elems)
    assert (layout.dq_offset, layout.dk_offset, layout.dv_offset) == (0, qkv, 2 * qkv)
    assert layout.dg_offset == 3 * qkv
    assert layout.dbeta_offset == layout.dg_offset + layout.gate_elems
    assert layout.dstate_offset == layout.dbeta_offset + layout.beta_elems
    assert layout.total_elems == layout.dstate_offset + layout.state_elems


@given(layouts)
def test_dict_round_trip_through_json(layout: GdnBackwardLayout) -> None:
    data = json.loads(json.dumps(layout.to_dict()))
    assert GdnBackwardLayout.from_dict(data) == layout


def test_names_and_shapes_follow_the_flags() -> None:
    b, s, h, n = 2, 3, 4, 8
    plain = GdnBackwardLayout(b, s, h, n)
    assert plain.names == ("dq", "dk", "dv", "dg", "dbeta")
    assert plain.shape("dg") == (b, s, h)
    full = GdnBackwardLayout(b, s, h, n, gate_per_channel=True, carry_state=True)
    assert full.names == ("dq", "dk", "dv", "dg", "dbeta", "dstate")
    assert full.shape("dg") == (b, s, h, n)
    assert full.shape("dstate") == (b, h, n, n)
    assert full.segments()[-1] == Segment("dstate", 3 * 192 + 192 + 24, 2 * 4 * 8 * 8, (2, 4, 8, 8))


def test_value_semantics() -> None:
    a = GdnBackwardLayout(2, 3, 4, 8, carry_state=True)
    b = GdnBackwardLayout(np.int64(2), np.uint8(3), 4, 8, False, True)  # type: ignore[arg-type]
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != GdnBackwardLayout(2, 3, 4, 8)
    assert type(b.batch) is int
    assert pickle.loads(pickle.dumps(a)) == a
    assert repr(a) == (
        "GdnBackwardLayout(batch=2, seq=3, heads=4, state_size=8, "
        "gate_per_channel=False, carry_state=True)"
    )
    with pytest.raises(AttributeError):
        a.batch = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        a.total_elems = 3


def test_nbytes() -> None:
    layout = GdnBackwardLayout(2, 3, 4, 8, carry_state=True)
    assert layout.nbytes(np.float64) == 8 * layout.total_elems
    assert layout.nbytes("float16") == 2 * layout.total_elems


def test_sizes_past_int64_are_exact() -> None:
    # Totals between 2**63 and 2**64 fit rlx-ir's usize but not int64: no float or int64
    # arithmetic may touch them.
    b, s, h, n = 2**20, 2**20, 2**6, 2**16
    layout = GdnBackwardLayout(b, s, h, n, carry_state=True)
    assert layout.qkv_elems == 2**62
    assert layout.dstate_offset == 3 * 2**62 + 2 * 2**46
    assert layout.total_elems == 3 * 2**62 + 2 * 2**46 + 2**58
    assert layout.total_elems > 2**63


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"batch": -1}, ValueError, "batch must be a non-negative integer, got -1"),
        ({"seq": 2.0}, TypeError, "seq must be a non-negative integer, got float 2.0"),
        ({"heads": "4"}, TypeError, "heads must be a non-negative integer, got str '4'"),
        (
            {"state_size": None},
            TypeError,
            "state_size must be a non-negative integer, got NoneType",
        ),
        ({"batch": True}, TypeError, "batch must be a non-negative integer, got bool True"),
        ({"seq": np.float32(3)}, TypeError, "seq must be a non-negative integer, got float32"),
        ({"heads": 2**64}, ValueError, "heads must fit in a 64-bit usize"),
        ({"gate_per_channel": 1}, TypeError, "gate_per_channel must be a bool, got int 1"),
        ({"carry_state": "yes"}, TypeError, "carry_state must be a bool, got str 'yes'"),
        ({"carry_state": None}, TypeError, "carry_state must be a bool, got NoneType"),
        ({"batch": 2**32, "seq": 2**32}, ValueError, "does not fit in a 64-bit usize"),
    ],
)
def test_bad_constructor_arguments(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    args: dict[str, Any] = {"batch": 1, "seq": 2, "heads": 3, "state_size": 4} | kwargs
    with pytest.raises(error, match=_literal(message)):
        GdnBackwardLayout(**args)


@pytest.mark.parametrize(
    ("dims", "carry_state"),
    [
        ((2**32, 2**32, 1, 0), False),  # b * s overflows, although b * s * h * n is 0
        ((1, 1, 2**16, 2**24), True),  # only the carried state's b * h * n * n overflows
    ],
)
def test_overflow_in_a_partial_product_is_refused(
    dims: tuple[int, int, int, int], carry_state: bool
) -> None:
    with pytest.raises(ValueError, match="does not fit in a 64-bit usize"):
        GdnBackwardLayout(*dims, carry_state=carry_state)
    if carry_state:
        assert GdnBackwardLayout(*dims).total_elems == 3 * 2**40 + 2 * 2**16


def test_views_show_the_layout_table() -> None:
    layout = GdnBackwardLayout(2, 5, 3, 8, gate_per_channel=True, carry_state=True)
    assert str(layout) == layout_text(layout)
    assert layout._repr_html_() == layout_html(layout)


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        ([1, 2, 3, 4], TypeError, "layout data must be a dict, got list"),
        ({"batch": 1, "seq": 2, "heads": 3}, ValueError, "missing ['state_size']"),
        (
            {"batch": 1, "seq": 2, "heads": 3, "state_size": 4, "chunk": 64},
            ValueError,
            "unknown ['chunk']",
        ),
        ({"batch": 1, "seq": 2, "heads": 3, "state_size": -4}, ValueError, "state_size must"),
        ({"batch": 1, "seq": "2", "heads": 3, "state_size": 4}, TypeError, "seq must be"),
        (
            {"batch": 1, "seq": 2, "heads": 3, "state_size": 4, "carry_state": "true"},
            TypeError,
            "carry_state must be a bool",
        ),
    ],
)
def test_bad_dicts(data: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=_literal(message)):
        GdnBackwardLayout.from_dict(data)


def test_segment_lookup_names_what_exists() -> None:
    with pytest.raises(KeyError, match="no gradient 'dstate' in this layout; it has dq, dk"):
        GdnBackwardLayout(1, 1, 1, 1).segment("dstate")


def test_from_inputs_infers_flags() -> None:
    q = np.zeros((2, 5, 3, 8))
    per_head = GdnBackwardLayout.from_inputs(q, np.zeros((2, 5, 3)))
    assert per_head == GdnBackwardLayout(2, 5, 3, 8)
    carried = GdnBackwardLayout.from_inputs(q, q, np.zeros((2, 3, 8, 8)))
    assert carried == GdnBackwardLayout(2, 5, 3, 8, gate_per_channel=True, carry_state=True)
    assert GdnBackwardLayout.from_inputs((2, 5, 3, 8), (2, 5, 3)) == per_head


def test_from_grads_checks_every_shape() -> None:
    layout = GdnBackwardLayout(2, 5, 3, 8, carry_state=True)
    shapes = [seg.shape for seg in layout.segments()]
    assert GdnBackwardLayout.from_grads(*shapes) == layout
    shapes[2] = (2, 5, 3, 7)
    with pytest.raises(
        ValueError, match=_literal("dv has shape (2, 5, 3, 7), expected (2, 5, 3, 8)")
    ):
        GdnBackwardLayout.from_grads(*shapes)


@pytest.mark.parametrize(
    ("q", "g", "state", "error", "message"),
    [
        (
            (2, 5, 3),
            (2, 5, 3),
            None,
            ValueError,
            "q must have 4 dimensions [B, S, H, N], got shape (2, 5, 3)",
        ),
        (
            (2, 5, 3, 8),
            (2, 5),
            None,
            ValueError,
            "g must have shape [B, S, H] = (2, 5, 3) or [B, S, H, N] = (2, 5, 3, 8) of q, "
            "got (2, 5)",
        ),
        (
            (2, 5, 3, 8),
            (2, 5, 4),
            None,
            ValueError,
            "[B, S, H] = (2, 5, 3) or [B, S, H, N] = (2, 5, 3, 8) of q, got (2, 5, 4)",
        ),
        (
            (2, 5, 3, 8),
            (2, 5, 3),
            (2, 3, 8),
            ValueError,
            "state must have shape [B, H, N, N] = (2, 3, 8, 8) of q, got (2, 3, 8)",
        ),
        ((2, 5, 3, 8), 7, None, TypeError, "g must be an array or a shape, got int"),
    ],
)
def test_bad_inference_inputs(
    q: Any, g: Any, state: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=_literal(message)):
        GdnBackwardLayout.from_inputs(q, g, state)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_only_the_six_fields_are_dataclass_fields() -> None:
    layout = GdnBackwardLayout(2, 3, 4, 8, gate_per_channel=True, carry_state=True)
    _ = layout.total_elems, layout.shapes  # computed and kept
    assert dataclasses.asdict(layout) == {
        "batch": 2,
        "seq": 3,
        "heads": 4,
        "state_size": 8,
        "gate_per_channel": True,
        "carry_state": True,
    }
    assert (
        dataclasses.replace(layout, seq=5).total_elems
        == GdnBackwardLayout(2, 5, 4, 8, gate_per_channel=True, carry_state=True).total_elems
    )


@pytest.mark.parametrize("per_channel", [False, True])
def test_axes_and_input_shapes(per_channel: bool) -> None:
    b, s, h, n = 2, 3, 4, 5
    layout = GdnBackwardLayout(b, s, h, n, gate_per_channel=per_channel, carry_state=True)
    gate_axes = ("b", "s", "h", "n") if per_channel else ("b", "s", "h")
    expected = {
        "dq": ("b", "s", "h", "n"),
        "dk": ("b", "s", "h", "n"),
        "dv": ("b", "s", "h", "n"),
        "dg": gate_axes,
        "dbeta": ("b", "s", "h"),
        "dstate": ("b", "h", "i", "j"),
    }
    assert {seg.name: seg.axes for seg in layout.segments()} == expected
    sizes = {"b": b, "s": s, "h": h, "n": n, "i": n, "j": n}
    for seg in layout.segments():
        assert seg.shape == tuple(sizes[axis] for axis in seg.axes)
    inputs = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "state": "dstate"}
    for name, grad in {**inputs, "dy": "dv", "y": "dv"}.items():
        assert layout.input_shape(name) == tuple(sizes[a] for a in expected[grad])
    with pytest.raises(KeyError, match="no input 'dq'"):
        layout.input_shape("dq")
