"""The floating dtypes gdn-layout works with; bfloat16 is ml_dtypes', an optional extra.

Every common spelling of a dtype name is accepted, in any case: NumPy's (``float32``),
safetensors' (``F32``), the short one (``f32``) and C's (``single``, ``half``, ``double``).

>>> [canonical_name(n) for n in ("BF16", "f32", "half", "double", "F64", "float16")]
['bfloat16', 'float32', 'float16', 'float64', 'float64', 'float16']
>>> itemsize("bfloat16", "dtype")  # no optional package needed to count bytes
2
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

BF16_HINT: Final = "bfloat16 needs ml_dtypes: pip install 'gdn-layout[bfloat16]'"

#: Every accepted spelling (lower case) of each floating dtype, by its NumPy name.
SPELLINGS: Final = {
    "bfloat16": ("bfloat16", "bf16"),
    "float16": ("float16", "f16", "half", "fp16"),
    "float32": ("float32", "f32", "single", "fp32"),
    "float64": ("float64", "f64", "double", "fp64"),
}
_CANONICAL: Final = {alias: name for name, aliases in SPELLINGS.items() for alias in aliases}
_ITEMSIZE: Final = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
#: The unit roundoff of each dtype: half its machine epsilon, the largest relative error of
#: rounding to it.
UNIT_ROUNDOFF: Final = {
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
    "float32": 2.0**-24,
    "float64": 2.0**-53,
}


def canonical_name(text: str) -> str | None:
    """The NumPy name of a floating dtype spelled ``text`` in any common way, else None."""
    return _CANONICAL.get(text.strip().lower())


def bfloat16() -> np.dtype[Any]:
    """ml_dtypes' bfloat16, or an ImportError that names the extra to install."""
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(BF16_HINT) from None
    bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
    return bf16


def is_floating(dtype: np.dtype[Any]) -> bool:
    """NumPy's floating dtypes, and ml_dtypes' (bfloat16, float8), which are not subtypes of
    ``np.floating``."""
    if np.issubdtype(dtype, np.floating):
        return True
    module = getattr(dtype.type, "__module__", "") or ""
    return module.startswith("ml_dtypes") and dtype.name.startswith(("float", "bfloat"))


def resolve(dtype: object, where: str) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype; ``"bfloat16"`` works as a name even before ml_dtypes is
    imported, and so does every spelling of :data:`SPELLINGS`. A value that is no dtype is a
    TypeError naming ``where``."""
    if isinstance(dtype, str) and (name := canonical_name(dtype)) is not None:
        return bfloat16() if name == "bfloat16" else np.dtype(name)
    try:
        return np.dtype(dtype)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(f"{where} must be a NumPy dtype, got {dtype!r}") from None


def dtype_name(dtype: object, where: str) -> str:
    """The NumPy name of ``dtype``; a name of :data:`SPELLINGS` needs no optional package."""
    if isinstance(dtype, str) and (name := canonical_name(dtype)) is not None:
        return name
    return resolve(dtype, where).name


def itemsize(dtype: object, where: str) -> int:
    """Bytes per element of ``dtype``; a name of :data:`SPELLINGS` needs no optional package."""
    if isinstance(dtype, str) and (name := canonical_name(dtype)) is not None:
        return _ITEMSIZE[name]
    return resolve(dtype, where).itemsize
