"""Arrays of any library read as NumPy arrays, without a copy where the library allows."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from ._dtypes import bfloat16

__all__ = ["as_packed"]


def as_packed(buffer: object, which: str = "actual", func: str = "compare") -> NDArray[Any]:
    """A NumPy view of a packed buffer given as any array: a NumPy array as it is, an object
    with ``__dlpack__`` (a CPU torch or JAX array) read without a copy, else ``__array__``.
    A torch bfloat16 tensor is viewed as ml_dtypes' bfloat16, also without a copy."""
    if isinstance(buffer, np.ndarray):
        return buffer
    if hasattr(buffer, "__dlpack__"):
        try:
            return np.from_dlpack(buffer)
        except (BufferError, TypeError, RuntimeError, ValueError):
            if str(getattr(buffer, "dtype", "")) != "torch.bfloat16":
                raise
            import torch

            bits = np.from_dlpack(buffer.view(torch.int16))  # type: ignore[attr-defined]
            return bits.view(bfloat16())
    if hasattr(buffer, "__array__"):
        return np.asarray(buffer)
    raise TypeError(
        f"{func}: {which} must be an array (NumPy, or any with __dlpack__ or __array__), "
        f"got {type(buffer).__name__}"
    )
