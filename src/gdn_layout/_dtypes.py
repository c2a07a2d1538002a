"""The floating dtypes (:data:`DTYPES`) and the precision classes a kernel is judged in
(:data:`PRECISIONS`, docs/criterion.md).

>>> [canonical_name(n) for n in ("BF16", "f32", "half", "double", "F64")]
['bfloat16', 'float32', 'float16', 'float64', 'float64']
>>> itemsize("bfloat16", "dtype")  # no optional package needed to count bytes
2
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

BF16_HINT: Final = (
    "bfloat16 needs ml_dtypes: pip install 'gdn-layout[bfloat16]' "
    "(from a clone: pip install '.[bfloat16]')"
)


class DType(NamedTuple):
    """A floating dtype gdn-layout handles, with its facts."""

    name: str  # NumPy's (ml_dtypes' for bfloat16)
    code: str  # safetensors'
    itemsize: int
    unit_roundoff: float  # half the machine epsilon: the largest relative rounding error
    tolerances: tuple[float, float]  # torch.testing.assert_close's default (rtol, atol)
    spellings: tuple[str, ...]  # every accepted one, lower case: the name, the code, others
    precision: str  # the class its buffers are judged in by default (PRECISIONS)
    ml_dtypes: bool = False  # defined by ml_dtypes (an optional extra), not NumPy

    def numpy(self) -> np.dtype[Any]:
        """The NumPy dtype (ml_dtypes', or an ImportError naming the extra)."""
        return bfloat16() if self.ml_dtypes else np.dtype(self.name)


#: The floating dtypes, from the most precise: the one table of dtype facts.
DTYPES: Final = {
    d.name: d
    for d in (
        DType("float64", "F64", 8, 2.0**-53, (1e-7, 1e-7), ("float64", "f64", "double", "fp64"),
              "float64"),
        DType("float32", "F32", 4, 2.0**-24, (1.3e-6, 1e-5), ("float32", "f32", "single", "fp32"),
              "float32"),
        DType("float16", "F16", 2, 2.0**-11, (1e-3, 1e-5), ("float16", "f16", "half", "fp16"),
              "float16"),
        DType("bfloat16", "BF16", 2, 2.0**-8, (1.6e-2, 1e-5), ("bfloat16", "bf16"), "bfloat16",
              ml_dtypes=True),
    )
}  # fmt: skip
#: Every accepted spelling of each dtype, from the least precise (as the command line lists them).
SPELLINGS: Final = {d.name: d.spellings for d in reversed(DTYPES.values())}
UNIT_ROUNDOFF: Final = {d.name: d.unit_roundoff for d in DTYPES.values()}
_BY_SPELLING: Final = {alias: d for d in DTYPES.values() for alias in d.spellings}


class Precision(NamedTuple):
    """A precision class: what a kernel computes in (docs/criterion.md)."""

    name: str  # as precision= takes it
    buffer: str  # the dtype of the kernel's inputs and outputs
    #: Mantissa bits of the operands of its matrix products (accumulated in float32), or None
    #: when they are the computation dtype's own.
    product_bits: int | None
    default_floors: tuple[float, float]  # (rms, max) for fixtures that carry none of it
    spellings: tuple[str, ...] = ()  # other accepted spellings (lower case)

    @property
    def unit_roundoff(self) -> float:
        """Of the buffers."""
        return DTYPES[self.buffer].unit_roundoff

    @property
    def compute_roundoff(self) -> float:
        """Of the computation dtype: float64's for float64, else float32's."""
        return DTYPES["float64" if self.buffer == "float64" else "float32"].unit_roundoff

    @property
    def product_roundoff(self) -> float:
        """Of a product's terms: its operands' unit roundoff, or the computation dtype's."""
        if self.product_bits is None:
            return self.compute_roundoff
        return 2.0 ** -(self.product_bits + 1)


#: The precision classes, from the most precise. ``float64`` and ``float32`` compute in
#: their dtype throughout; ``tf32`` is float32 with matrix products on operands rounded to 10
#: mantissa bits (Triton's default for float32 ``tl.dot`` on tensor cores); ``bfloat16`` and
#: ``float16`` keep inputs and outputs in that dtype, compute in float32 and multiply matrices
#: of that dtype. The default floors are the largest measured over the standard suite's first
#: four regimes on gradients of more than 256 elements, rounded up; float64's are float32's
#: scaled by the ratio of the unit roundoffs, as measured ones are.
PRECISIONS: Final = {
    p.name: p
    for p in (
        Precision(
            "float64", "float64", None, (3e-5 * 2.0**-29, 5e-4 * 2.0**-29),
            DTYPES["float64"].spellings[1:],
        ),
        Precision("float32", "float32", None, (3e-5, 5e-4), DTYPES["float32"].spellings[1:]),
        Precision("tf32", "float32", 10, (3e-3, 3e-2)),
        Precision("bfloat16", "bfloat16", 7, (1e-2, 0.15), DTYPES["bfloat16"].spellings[1:]),
        Precision("float16", "float16", 10, (6e-3, 3e-2), DTYPES["float16"].spellings[1:]),
    )
}  # fmt: skip
_PRECISION_NAMES: Final = {
    alias: p.name for p in PRECISIONS.values() for alias in (p.name, *p.spellings)
}


def precision_of(value: object, where: str) -> Precision:
    """The precision class spelled ``value``, or of the dtype ``value``; else a ValueError."""
    if isinstance(value, str):
        name = _PRECISION_NAMES.get(value.strip().lower())
    else:  # a dtype, or a scalar type: its class
        try:
            name = DTYPES[np.dtype(value).name].precision  # type: ignore[call-overload]
        except (TypeError, KeyError):
            name = None
    if name is None:
        raise ValueError(f"{where} must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return PRECISIONS[name]


def default_precision(*dtypes: np.dtype[Any]) -> Precision:
    """The default class of buffers of ``dtypes``: the less precise one's (others: float64)."""
    known = [DTYPES.get(d.name, DTYPES["float64"]) for d in dtypes]
    return PRECISIONS[max(known, key=lambda d: d.unit_roundoff).precision]


def canonical_name(text: str) -> str | None:
    """The NumPy name of a floating dtype spelled ``text`` in any common way, else None."""
    dtype = _BY_SPELLING.get(text.strip().lower())
    return None if dtype is None else dtype.name


def bfloat16() -> np.dtype[Any]:
    """ml_dtypes' bfloat16, or an ImportError that names the extra to install."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(BF16_HINT) from None
    bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bf16


def finfo(dtype: np.dtype[Any]) -> Any:
    """``numpy.finfo``; ml_dtypes' for bfloat16, which NumPy before 2 does not take.

    >>> float(finfo(np.dtype(np.float32)).max) > 3e38
    True
    """
    if dtype.name == "bfloat16":
        import ml_dtypes  # a bfloat16 array comes with it

        return ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    return np.finfo(dtype)


def is_floating(dtype: np.dtype[Any]) -> bool:
    """NumPy's floating dtypes, and ml_dtypes' (not subtypes of ``np.floating``)."""
    if np.issubdtype(dtype, np.floating):
        return True
    module = getattr(dtype.type, "__module__", "") or ""
    return module.startswith("ml_dtypes") and dtype.name.startswith(("float", "bfloat"))


def resolve(dtype: object, where: str) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype, any spelling of :data:`SPELLINGS` too; else a TypeError."""
    if isinstance(dtype, str) and (name := canonical_name(dtype)) is not None:
        return DTYPES[name].numpy()
    try:
        return np.dtype(dtype)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(f"{where} must be a NumPy dtype, got {dtype!r}") from None


def dtype_name(dtype: object, where: str) -> str:
    """The NumPy name of ``dtype``; a name of :data:`SPELLINGS` needs no optional package."""
    named = canonical_name(dtype) if isinstance(dtype, str) else None
    return named or resolve(dtype, where).name


def itemsize(dtype: object, where: str) -> int:
    """Bytes per element of ``dtype``; a name of :data:`SPELLINGS` needs no optional package."""
    named = canonical_name(dtype) if isinstance(dtype, str) else None
    return DTYPES[named].itemsize if named else resolve(dtype, where).itemsize


def round_mantissa(values: NDArray[np.float32], bits: int) -> NDArray[np.float32]:
    """float32 ``values`` rounded to ``bits`` explicit mantissa bits (to nearest, ties to
    even), in float32's exponent range: TF32 is 10 bits, bfloat16 7.

    >>> x = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 1.0 + 2.0**-12], np.float32)
    >>> round_mantissa(x, 10).tolist()  # ties go to the even neighbour
    [1.0, 1.001953125, 1.0]
    >>> bool(np.isnan(round_mantissa(np.array([0x7FFFFFFF], np.uint32).view(np.float32), 7)[0]))
    True
    """
    if not 0 < bits < 23:
        raise ValueError(f"round_mantissa: bits must be from 1 to 22, got {bits!r}")
    drop = 23 - bits
    x = np.asarray(values, np.float32)
    raw = x.view(np.uint32)
    out = np.right_shift(raw, np.uint32(drop))
    out &= np.uint32(1)
    out += np.uint32((1 << (drop - 1)) - 1)
    out += raw
    out &= np.uint32((0xFFFFFFFF >> drop) << drop)
    rounded = out.view(np.float32)
    nan = np.isnan(x)
    if nan.any():  # a NaN stays one, whatever its payload
        rounded[nan] = x[nan]
    return rounded
