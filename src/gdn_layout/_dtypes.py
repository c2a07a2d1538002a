"""The floating dtypes gdn-layout works with; bfloat16 is ml_dtypes', an optional extra."""

from __future__ import annotations

from typing import Any, Final

import numpy as np

BF16_HINT: Final = "bfloat16 needs ml_dtypes: pip install 'gdn-layout[bfloat16]'"


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
    imported. A value that is no dtype is a TypeError naming ``where``."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return bfloat16()
    try:
        return np.dtype(dtype)  # type: ignore[call-overload,no-any-return]
    except TypeError:
        raise TypeError(f"{where} must be a NumPy dtype, got {dtype!r}") from None
