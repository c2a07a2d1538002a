"""Arrays of any library read as NumPy arrays, without a copy where the library allows, and
NumPy arrays given to a library as its own tensors."""

from __future__ import annotations

import warnings
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ._dtypes import bfloat16, resolve

__all__ = ["FRAMEWORKS", "as_framework", "as_packed"]


def as_packed(buffer: object, which: str = "actual", func: str = "compare") -> NDArray[Any]:
    """A NumPy view of a packed buffer given as any array: a NumPy array as it is, an object
    with ``__dlpack__`` (a CPU torch or JAX array) read without a copy, else ``__array__``.
    A torch bfloat16 tensor is viewed as ml_dtypes' bfloat16, also without a copy; a tensor
    that requires grad is read through ``detach()``. One that NumPy cannot read (on device
    ``meta``, of a float8 dtype, ...) is a TypeError naming ``which``."""
    if isinstance(buffer, np.ndarray):
        return buffer
    if hasattr(buffer, "__dlpack__"):
        tensor: Any = buffer
        if getattr(tensor, "requires_grad", False) is True:  # torch's: the values, no copy
            tensor = tensor.detach()
        try:
            return _from_dlpack(tensor)
        except (BufferError, TypeError, RuntimeError, ValueError) as error:
            raise TypeError(
                f"{func}: {which} must be an array NumPy can read (a NumPy dtype or bfloat16, "
                f"in CPU memory), got a {type(buffer).__name__} of dtype "
                f"{getattr(buffer, 'dtype', '?')} on device {getattr(buffer, 'device', '?')}: "
                f"{error}"
            ) from None
    if hasattr(buffer, "__array__"):
        return np.asarray(buffer)
    raise TypeError(
        f"{func}: {which} must be an array (NumPy, or any with __dlpack__ or __array__), "
        f"got {type(buffer).__name__}"
    )


def _from_dlpack(tensor: Any) -> NDArray[Any]:
    """``np.from_dlpack``, and a torch bfloat16 tensor, which DLPack does not carry to NumPy,
    through its bits."""
    try:
        return np.from_dlpack(tensor)
    except (BufferError, TypeError, RuntimeError, ValueError):
        if str(getattr(tensor, "dtype", "")) != "torch.bfloat16":
            raise
        import torch

        return np.from_dlpack(tensor.view(torch.int16)).view(bfloat16())


#: The libraries :func:`as_framework` makes tensors of.
FRAMEWORKS: Final = ("torch", "jax", "numpy")


def as_framework(
    array: NDArray[Any],
    framework: str,
    *,
    dtype: object = None,
    requires_grad: bool = False,
    func: str = "inputs_as",
) -> Any:
    """``array`` as a new tensor of ``framework`` (``"torch"``, ``"jax"`` or ``"numpy"``), in
    ``dtype`` (the framework's dtype or its name, e.g. ``"bfloat16"``; default: the array's
    own).

    A copy: a fixture's arrays are read-only, and a kernel may write its inputs. bfloat16
    arrays (ml_dtypes') become torch bfloat16 tensors through their bits. ``requires_grad``
    is torch's; JAX takes gradients of functions, not of arrays.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"{func}: framework must be one of {FRAMEWORKS}, got {framework!r}")
    if framework == "numpy":
        if requires_grad:
            raise ValueError(f"{func}: requires_grad is torch's; NumPy arrays have no gradient")
        copy = np.array(array)  # writable, C-ordered
        return copy if dtype is None else copy.astype(resolve(dtype, f"{func}: dtype"))
    if framework == "jax":
        if requires_grad:
            raise ValueError(f"{func}: requires_grad is torch's; JAX differentiates functions")
        jnp = _imported("jax.numpy", "JAX", "jax", func)
        wanted = array.dtype if dtype is None else np.dtype(_named(jnp, dtype, func))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # said below, as an error
            out = jnp.asarray(np.array(array), dtype=wanted)
        if out.dtype != wanted:  # JAX without x64 makes float32 of float64, silently
            raise ValueError(
                f"{func}: JAX made {out.dtype} of {wanted}: its 64-bit types are off; call "
                "jax.config.update('jax_enable_x64', True) first, or pass dtype='float32'"
            )
        return out
    torch = _imported("torch", "PyTorch", "torch", func)
    if array.dtype.name == "bfloat16":
        tensor = torch.from_numpy(np.array(array).view(np.int16)).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.array(array))
    if dtype is not None:
        tensor = tensor.to(_named(torch, dtype, func))
    return tensor.requires_grad_(requires_grad)


def _imported(module: str, name: str, package: str, func: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{func}: {name} is not installed: pip install {package}") from None


def _named(library: Any, dtype: object, func: str) -> Any:
    """A dtype of ``library`` given as one or by its name."""
    if not isinstance(dtype, str):
        return dtype
    found = getattr(library, dtype, None)
    if found is None:
        raise ValueError(f"{func}: {library.__name__} has no dtype named {dtype!r}")
    return found
