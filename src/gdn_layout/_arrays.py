"""Arrays of any library read as NumPy arrays, and NumPy arrays made into a library's tensors
(README.md, *Test the kernel with pytest*)."""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ._dtypes import bfloat16, resolve

__all__ = ["FRAMEWORKS", "as_framework", "as_packed", "device_of"]

#: DLPack's device types (``DLDeviceType``) by number, as :func:`device_of` names them.
_DL_DEVICES: Final = {
    1: "cpu", 2: "cuda", 3: "cuda_host", 4: "opencl", 7: "vulkan", 8: "metal", 9: "vpi",
    10: "rocm", 11: "rocm_host", 12: "ext_dev", 13: "cuda_managed", 14: "oneapi",
    15: "webgpu", 16: "hexagon", 17: "maia",
}  # fmt: skip
#: The DLPack device types whose memory the CPU reads as it is: NumPy views them.
_HOST: Final = frozenset({1, 3, 11, 13})
#: NumPy 2.1 added ``from_dlpack(x, device="cpu", copy=True)``; before it, ``__dlpack__`` is asked.
_FROM_DLPACK_TAKES_DEVICE: Final = np.lib.NumpyVersion(np.__version__) >= "2.1.0"
#: What a library raises when an array cannot be exported, or read, as asked.
_REFUSED: Final = (BufferError, TypeError, RuntimeError, ValueError, NotImplementedError)
#: The libraries :func:`as_framework` makes tensors of.
FRAMEWORKS: Final = ("torch", "jax", "numpy")


def as_packed(buffer: object, which: str = "actual", func: str = "compare") -> NDArray[Any]:
    """``buffer`` as a NumPy array: viewed in host memory, else copied from the device once
    (by DLPack, ``__array__`` or CuPy); what cannot be read is a TypeError naming ``which``."""
    if isinstance(buffer, np.ndarray):
        return buffer
    try:
        if hasattr(buffer, "__dlpack__"):
            tensor: Any = buffer
            if getattr(tensor, "requires_grad", False) is True:  # torch's: the values, no copy
                tensor = tensor.detach()
            return _from_dlpack(tensor)
        if not hasattr(buffer, "__array__") and hasattr(buffer, "__cuda_array_interface__"):
            return _from_cuda(buffer)
    except _REFUSED as error:
        raise TypeError(
            f"{func}: {which} must be an array NumPy can read (a NumPy dtype or bfloat16, "
            f"in memory it can be copied from), got a {type(buffer).__name__} of dtype "
            f"{getattr(buffer, 'dtype', '?')} on device {getattr(buffer, 'device', '?')}: "
            f"{error}"
        ) from None
    if hasattr(buffer, "__array__"):
        return np.asarray(buffer)
    raise TypeError(
        f"{func}: {which} must be an array (NumPy, or any with __dlpack__, "
        f"__cuda_array_interface__ or __array__), got {type(buffer).__name__}"
    )


def device_of(buffer: object) -> str | None:
    """The device :func:`as_packed` reads ``buffer`` from (``"cuda:0"``); None for host memory.

    >>> device_of(np.zeros(3)) is None
    True
    """
    if isinstance(buffer, np.ndarray):
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        return None if buffer.device.type == "cpu" else str(buffer.device)
    if hasattr(buffer, "__dlpack_device__"):
        try:
            kind, index = map(int, buffer.__dlpack_device__())
        except _REFUSED:
            return str(getattr(buffer, "device", "unknown"))
        return None if kind in _HOST else f"{_DL_DEVICES.get(kind, f'device type {kind}')}:{index}"
    return "cuda" if hasattr(buffer, "__cuda_array_interface__") else None


def _from_dlpack(tensor: Any) -> NDArray[Any]:
    """A view of host memory, else one copy; torch's bfloat16, which DLPack does not carry to
    NumPy, through its bits."""
    torch: Any = sys.modules.get("torch")
    bits = torch is not None and isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16
    source = tensor.view(torch.int16) if bits else tensor
    try:
        in_host = int(source.__dlpack_device__()[0]) in _HOST
    except (*_REFUSED, AttributeError):  # a device DLPack has no name for: copy, or say why
        in_host = False
    array = _dlpack_view(source) if in_host else _copied_to_host(source)
    return array.view(bfloat16()) if bits else array


def _dlpack_view(tensor: Any) -> NDArray[Any]:
    """``np.from_dlpack``; JAX's bfloat16, which DLPack does not carry, by ``__array__``."""
    try:
        return np.from_dlpack(tensor)
    except _REFUSED:
        if not hasattr(tensor, "__array__"):
            raise
        return np.asarray(tensor)


def _copied_to_host(tensor: Any) -> NDArray[Any]:
    """One copy of device memory: DLPack's cross-device request, or where it is refused (an
    older library, another than the current CUDA device) the library's own copy."""
    try:
        if _FROM_DLPACK_TAKES_DEVICE:
            return np.from_dlpack(tensor, device="cpu", copy=True)
        capsule = tensor.__dlpack__(dl_device=(1, 0), copy=True)  # kDLCPU
        return np.from_dlpack(_HostCapsule(capsule))  # type: ignore[arg-type]
    except _REFUSED:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(tensor, torch.Tensor):
            return np.from_dlpack(tensor.cpu())
        if hasattr(tensor, "__cuda_array_interface__"):
            return _from_cuda(tensor)
        if hasattr(tensor, "__array__"):
            return np.asarray(tensor)
        raise


class _HostCapsule:
    """A DLPack capsule in host memory, for ``np.from_dlpack`` before NumPy 2.1."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def _from_cuda(buffer: object) -> NDArray[Any]:
    """One copy of ``__cuda_array_interface__`` memory, by CuPy."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        raise TypeError(
            "its __cuda_array_interface__ needs CuPy to copy it to host memory: pip install "
            "cupy-cuda12x (or the build for your CUDA)"
        ) from None
    return np.asarray(cupy.asarray(buffer).get())


def as_framework(
    array: NDArray[Any],
    framework: str,
    *,
    dtype: object = None,
    device: object = None,
    requires_grad: bool = False,
    func: str = "inputs_as",
) -> Any:
    """``array`` as a new tensor of ``framework``, in ``dtype`` (the framework's or its name),
    on ``device``: one copy, since a fixture's arrays are read-only and a kernel may write."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"{func}: framework must be one of {FRAMEWORKS}, got {framework!r}")
    if requires_grad and framework != "torch":
        why = {"numpy": "NumPy arrays have no gradient", "jax": "JAX differentiates functions"}
        raise ValueError(f"{func}: requires_grad is torch's; {why[framework]}")
    if framework == "numpy":
        if device is not None and device != "cpu":
            raise ValueError(f"{func}: device must be None or 'cpu' for NumPy, got {device!r}")
        copy = np.array(array)  # writable, C-ordered
        if dtype is None:
            return copy
        try:
            return copy.astype(resolve(dtype, f"{func}: dtype"))
        except TypeError:
            if not isinstance(dtype, str):
                raise
            raise ValueError(f"{func}: numpy has no dtype named {dtype!r}") from None
    if framework == "jax":
        jax = _imported("jax", "JAX", func)
        wanted = array.dtype if dtype is None else _named(jax.numpy, dtype, func)
        out = jax.device_put(array, _jax_device(jax, device, func))
        if array.size and out.unsafe_buffer_pointer() == array.ctypes.data:
            out = out.copy()  # JAX's CPU keeps an aligned array's memory: the fixture's here
        if dtype is not None:
            out = out.astype(wanted)  # on the device
        if out.dtype != wanted:  # JAX without x64 makes float32 of float64, silently
            raise ValueError(
                f"{func}: JAX made {out.dtype} of {wanted}: its 64-bit types are off; call "
                "jax.config.update('jax_enable_x64', True) first, or pass dtype='float32'"
            )
        return out
    torch = _imported("torch", "PyTorch", func)
    chosen = _torch_device(torch, device, func)
    if not (array.flags.aligned and array.dtype.isnative and min(array.strides, default=0) >= 0):
        array = np.array(array)  # what torch cannot view: copied on the host first
    bits = array.dtype.name == "bfloat16"
    with warnings.catch_warnings():  # a view of a read-only array, read once by the copy below
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        view = torch.from_numpy(array.view(np.int16) if bits else array)
    tensor = (view.view(torch.bfloat16) if bits else view).to(
        device=chosen,
        dtype=None if dtype is None else _named(torch, dtype, func),
        copy=True,
        memory_format=torch.contiguous_format,
    )
    return tensor.requires_grad_(requires_grad)


def _torch_device(torch: Any, device: object, func: str) -> Any:
    """``device`` as a ``torch.device`` this process has."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"{func}: device must be a torch.device, its name or an index, got "
            f"{type(device).__name__}"
        )
    try:
        chosen = torch.device(device)
        torch.empty(0, device=chosen)  # refused where this process has no such device
    except (RuntimeError, ValueError, AssertionError):  # AssertionError: a build without CUDA
        raise ValueError(f"{func}: device must be one torch has here, got {device!r}") from None
    return chosen


def _jax_device(jax: Any, device: object, func: str) -> Any:
    """``device`` as a ``jax.Device``: one given, a platform's first, or ``"gpu:i"``'s."""
    if device is None or isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise TypeError(
            f"{func}: device must be a jax.Device or a platform's name, got {type(device).__name__}"
        )
    platform, _, index = device.partition(":")
    try:
        devices = jax.devices(platform) if platform else []
        if devices and (index == "" or (index.isdigit() and int(index) < len(devices))):
            return devices[int(index or 0)]
    except RuntimeError:  # JAX has no such platform here
        pass
    raise ValueError(f"{func}: device must be a jax.Device or one JAX has here, got {device!r}")


def _imported(module: str, name: str, func: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{func}: {name} is not installed: pip install {module}") from None


def _named(library: Any, dtype: object, func: str) -> Any:
    """A dtype of ``library`` given as one or by its name: torch's ``torch.dtype``, JAX's as a
    NumPy dtype. A name of something else (``"tensor"``) is no dtype."""
    found: Any = getattr(library, dtype, None) if isinstance(dtype, str) else dtype
    if library.__name__ == "torch":
        ok = isinstance(found, library.dtype)
    else:
        try:
            found, ok = np.dtype(found), found is not None
        except TypeError:
            ok = False
    if not ok and isinstance(dtype, str):
        raise ValueError(f"{func}: {library.__name__} has no dtype named {dtype!r}")
    if not ok:
        raise TypeError(f"{func}: dtype must be a {library.__name__} dtype, got {dtype!r}")
    return found
