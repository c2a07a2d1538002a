"""The dtype names and the precision classes (gdn_layout._dtypes)."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gdn_layout._dtypes import (
    DTYPES,
    PRECISIONS,
    UNIT_ROUNDOFF,
    canonical_name,
    default_precision,
    itemsize,
    precision_of,
    round_mantissa,
)
from gdn_layout.files._safetensors import dtype_code, dtype_of_code


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_seven_bits_are_bfloat16s_rounding(values: list[float]) -> None:
    x = np.array(values, np.float32)
    expected = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(round_mantissa(x, 7), expected)
    assert np.array_equal(round_mantissa(x[::-1], 7), expected[::-1])  # any strides


def test_ten_bits_round_to_nearest_even_and_keep_nans() -> None:
    ulp = 2.0**-10
    x = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, -(1 + ulp / 2), np.inf, -0.0], np.float32)
    assert round_mantissa(x, 10).tolist() == [1.0, 1 + 2 * ulp, -1.0, np.inf, -0.0]
    nans = np.array([0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(np.float32)
    assert np.isnan(round_mantissa(nans, 10)).all()
    with pytest.raises(ValueError, match="round_mantissa: bits must be from 1 to 22, got 23"):
        round_mantissa(x, 23)


def test_a_class_is_named_in_any_spelling_or_by_its_dtype() -> None:
    assert precision_of("TF32", "p") is PRECISIONS["tf32"]
    assert precision_of(" bf16 ", "p") is PRECISIONS["bfloat16"]
    assert precision_of(np.float16, "p") is PRECISIONS["float16"]
    assert precision_of(np.dtype(ml_dtypes.bfloat16), "p") is PRECISIONS["bfloat16"]
    for bad in ("fp8", 3, np.int8):
        with pytest.raises(ValueError, match=r"^p must be one of float64, float32, tf32, "):
            precision_of(bad, "p")


def test_the_default_class_is_the_less_precise_buffer_s() -> None:
    f32, bf16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
    assert default_precision(f32, bf16) is PRECISIONS["bfloat16"]
    assert default_precision(np.dtype(np.float64), np.dtype(np.int64)).name == "float64"
    for p in PRECISIONS.values():  # each class judges its buffers: their roundoff is its own
        assert p.unit_roundoff == UNIT_ROUNDOFF[p.buffer]
        assert p.product_roundoff >= p.compute_roundoff


def test_each_dtype_s_facts_are_numpy_s_and_safetensors_() -> None:
    for d in DTYPES.values():
        dtype = d.numpy()
        assert dtype.name == d.name
        assert dtype.itemsize == d.itemsize == itemsize(d.name, "d")
        u = d.unit_roundoff  # half the gap above 1: 1 + u rounds (to even) to 1
        near_one = np.array([1.0, 1 + u, 1 + 2 * u]).astype(dtype).astype(np.float64)
        assert near_one.tolist() == [1.0, 1.0, 1 + 2 * u]
        assert d.spellings[:2] == (d.name, d.code.lower())
        assert all(canonical_name(s.upper()) == d.name for s in d.spellings)
        assert dtype_code(dtype, "d") == d.code
        assert dtype_of_code(d.code, "t", Path("f")) == dtype
        assert PRECISIONS[d.precision].buffer == d.name
    unit_roundoffs = [d.unit_roundoff for d in DTYPES.values()]
    assert unit_roundoffs == sorted(unit_roundoffs)  # from the most precise
