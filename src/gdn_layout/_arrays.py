"""Arrays of any library read as NumPy arrays, without a copy where the library allows (and
with one copy from a device's memory), and NumPy arrays given to a library as its own tensors,
on the device asked."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ._dtypes import bfloat16, resolve

__all__ = ["FRAMEWORKS", "as_framework", "as_packed", "device_of"]

#: DLPack's device types (``DLDeviceType``) by number, as :func:`device_of` names them.
_DL_DEVICES: Final = {
    1: "cpu",
    2: "cuda",
    3: "cuda_host",
    4: "opencl",
    7: "vulkan",
    8: "metal",
    9: "vpi",
    10: "rocm",
    11: "rocm_host",
    12: "ext_dev",
    13: "cuda_managed",
    14: "oneapi",
    15: "webgpu",
    16: "hexagon",
    17: "maia",
}
#: The DLPack device types whose memory the CPU reads as it is: NumPy views them.
_HOST: Final = frozenset({1, 3, 11, 13})
_KDLCPU: Final = 1
#: NumPy 2.1 added ``from_dlpack(x, device="cpu", copy=True)``: the standard's cross-device
#: request. Before it, the request is made of ``__dlpack__`` here.
_FROM_DLPACK_TAKES_DEVICE: Final = np.lib.NumpyVersion(np.__version__) >= "2.1.0"
#: What a library raises when an array cannot be exported, or read, as asked.
_REFUSED: Final = (BufferError, TypeError, RuntimeError, ValueError, NotImplementedError)


def as_packed(buffer: object, which: str = "actual", func: str = "compare") -> NDArray[Any]:
    """A NumPy array of a packed buffer given as any array: a NumPy array as it is; an object
    with ``__dlpack__`` (torch, JAX, CuPy, ...) viewed without a copy when it is in host
    memory, else copied to it once, by DLPack's cross-device request
    (``__dlpack__(dl_device=(kDLCPU, 0), copy=True)``) or, where the library refuses that,
    its own copy (torch's ``.cpu()``, CuPy's, ``__array__``); else ``__array__``; else an
    object with ``__cuda_array_interface__`` copied by CuPy.

    A torch bfloat16 tensor is read as ml_dtypes' bfloat16 through its bits; a tensor that
    requires grad is read through ``detach()``. One that cannot be read (on device ``meta``,
    of a float8 dtype, ...) is a TypeError naming ``which``. :func:`device_of` says which
    device the values were read from.
    """
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
    """The device :func:`as_packed` reads ``buffer`` from, as its library names it
    (``"cuda:0"``), or DLPack's device type and index; None for host memory.

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
            kind, index = buffer.__dlpack_device__()
        except _REFUSED:
            return str(getattr(buffer, "device", "unknown"))
        if int(kind) in _HOST:
            return None
        return f"{_DL_DEVICES.get(int(kind), f'device type {int(kind)}')}:{index}"
    if hasattr(buffer, "__cuda_array_interface__"):
        return "cuda"
    return None


def _from_dlpack(tensor: Any) -> NDArray[Any]:
    """A NumPy array of a DLPack producer: a view of host memory, else one copy of device
    memory. A torch bfloat16 tensor, which DLPack does not carry to NumPy, through its
    bits."""
    torch: Any = sys.modules.get("torch")
    bits = torch is not None and isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16
    source = tensor.view(torch.int16) if bits else tensor
    array = _dlpack_view(source) if _in_host_memory(source) else _copied_to_host(source)
    return array.view(bfloat16()) if bits else array


def _in_host_memory(tensor: Any) -> bool:
    try:
        kind, _ = tensor.__dlpack_device__()
    except (*_REFUSED, AttributeError):  # a device DLPack has no name for: copy, or say why
        return False
    return int(kind) in _HOST


def _dlpack_view(tensor: Any) -> NDArray[Any]:
    """``np.from_dlpack``; a dtype DLPack does not carry to NumPy (JAX's bfloat16) through
    the library's own ``__array__``."""
    try:
        return np.from_dlpack(tensor)
    except _REFUSED:
        if not hasattr(tensor, "__array__"):
            raise
        return np.asarray(tensor)


def _copied_to_host(tensor: Any) -> NDArray[Any]:
    """One copy of a tensor in a device's memory, by DLPack's cross-device request; where
    the producer refuses it (an older library, a CUDA tensor of another device than the
    current one), by the library's own copy."""
    try:
        if _FROM_DLPACK_TAKES_DEVICE:
            return np.from_dlpack(tensor, device="cpu", copy=True)
        holder: Any = _HostCapsule(tensor.__dlpack__(dl_device=(_KDLCPU, 0), copy=True))
        return np.from_dlpack(holder)
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
    """A DLPack capsule already in host memory, for ``np.from_dlpack`` before NumPy 2.1,
    which takes an object, not a capsule."""

    def __init__(self, capsule: object) -> None:
        self.capsule = capsule

    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDLCPU, 0)


def _from_cuda(buffer: object) -> NDArray[Any]:
    """One copy of an array in CUDA memory known by ``__cuda_array_interface__``, by CuPy,
    which reads that interface without a copy."""
    import importlib

    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        raise TypeError(
            "its __cuda_array_interface__ needs CuPy to copy it to host memory: pip install "
            "cupy-cuda12x (or the build for your CUDA)"
        ) from None
    return np.asarray(cupy.asarray(buffer).get())


#: The libraries :func:`as_framework` makes tensors of.
FRAMEWORKS: Final = ("torch", "jax", "numpy")


def as_framework(
    array: NDArray[Any],
    framework: str,
    *,
    dtype: object = None,
    device: object = None,
    requires_grad: bool = False,
    func: str = "inputs_as",
) -> Any:
    """``array`` as a new tensor of ``framework`` (``"torch"``, ``"jax"`` or ``"numpy"``), in
    ``dtype`` (the framework's dtype or its name, e.g. ``"bfloat16"``; default: the array's
    own), on ``device`` (default: the framework's; see :meth:`~gdn_layout.suites.Case.
    inputs_as`).

    A copy, made once from ``array`` onto the device: a fixture's arrays are read-only, and a
    kernel may write its inputs. bfloat16 arrays (ml_dtypes') become torch bfloat16 tensors
    through their bits. ``requires_grad`` is torch's; JAX takes gradients of functions, not
    of arrays.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"{func}: framework must be one of {FRAMEWORKS}, got {framework!r}")
    if framework == "numpy":
        if requires_grad:
            raise ValueError(f"{func}: requires_grad is torch's; NumPy arrays have no gradient")
        if device is not None and device != "cpu":
            raise ValueError(f"{func}: device must be None or 'cpu' for NumPy, got {device!r}")
        copy = np.array(array)  # writable, C-ordered
        return copy if dtype is None else copy.astype(resolve(dtype, f"{func}: dtype"))
    if framework == "jax":
        if requires_grad:
            raise ValueError(f"{func}: requires_grad is torch's; JAX differentiates functions")
        jax = _imported("jax", "JAX", "jax", func)
        wanted = array.dtype if dtype is None else np.dtype(_named(jax.numpy, dtype, func))
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
    torch = _imported("torch", "PyTorch", "torch", func)
    chosen = _torch_device(torch, device, func)
    if not (array.flags.aligned and array.dtype.isnative and min(array.strides, default=0) >= 0):
        array = np.array(array)  # what torch cannot view: copied on the host first
    source = array.view(np.int16) if array.dtype.name == "bfloat16" else array
    with warnings.catch_warnings():
        # a view of the read-only array, read once by the copy below and never written
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        view = torch.from_numpy(source)
    if source is not array:
        view = view.view(torch.bfloat16)
    tensor = view.to(
        device=chosen,
        dtype=None if dtype is None else _named(torch, dtype, func),
        copy=True,
        memory_format=torch.contiguous_format,
    )
    return tensor.requires_grad_(requires_grad)


def _torch_device(torch: Any, device: object, func: str) -> Any:
    """``device`` as a ``torch.device`` this process has: ``cpu``, ``meta``, or the
    accelerator's (``cuda:0``, ...)."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"{func}: device must be a torch.device, its name or an index, got "
            f"{type(device).__name__}"
        )
    accelerator = getattr(torch, "accelerator", None)  # torch 2.6 and later
    if accelerator is not None and accelerator.is_available():
        kind = accelerator.current_accelerator().type
        count = accelerator.device_count()
    else:
        kind, count = "cuda", torch.cuda.device_count() if torch.cuda.is_available() else 0
    offered = ("cpu", "meta", *((kind,) if count else ()), *(f"{kind}:{i}" for i in range(count)))
    try:
        chosen = torch.device(device)
    except (RuntimeError, ValueError):
        chosen = None
    if chosen is None or (
        chosen.type not in ("cpu", "meta") and (chosen.type != kind or (chosen.index or 0) >= count)
    ):
        raise ValueError(
            f"{func}: device must be one torch has here ({', '.join(map(repr, offered))}), "
            f"got {device!r}"
        )
    return chosen


def _jax_device(jax: Any, device: object, func: str) -> Any:
    """``device`` as a ``jax.Device``: one given, or a platform's (``"cpu"``, ``"gpu"``, ...)
    first device, or its device ``i`` for ``"gpu:i"``."""
    if device is None or isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise TypeError(
            f"{func}: device must be a jax.Device or a platform's name, got {type(device).__name__}"
        )
    import jax.extend

    platform, _, index = device.partition(":")
    try:
        devices = jax.devices(platform) if platform else []
        if devices and (index == "" or (index.isdigit() and int(index) < len(devices))):
            return devices[int(index or 0)]
    except RuntimeError:  # JAX has no such platform here
        pass
    offered = [
        name
        for backend in jax.extend.backend.backends()
        for name in (backend, *(f"{backend}:{i}" for i in range(len(jax.devices(backend)))))
    ]
    raise ValueError(
        f"{func}: device must be a jax.Device or one JAX has here "
        f"({', '.join(map(repr, offered))}), got {device!r}"
    )


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
