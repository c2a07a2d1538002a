"""Arrays of any library in and out: a case's inputs as a framework's tensors on a device, a
framework's gradients packed and compared, a device's memory read with one copy."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import DTypeLike

from gdn_layout import GdnBackwardLayout, _arrays, pack, unpack
from gdn_layout._arrays import as_packed, device_of
from gdn_layout.check import compare
from gdn_layout.regimes import REGIMES
from gdn_layout.suites import make_case
from support import DeviceArray

DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16]
LAYOUT = GdnBackwardLayout(2, 5, 3, 4, carry_state=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_inputs_as_torch_round_trip_every_dtype(dtype: DTypeLike) -> None:
    torch = pytest.importorskip("torch")
    case = make_case(LAYOUT, dtype=dtype, seed=2)
    tensors = case.inputs_as("torch")
    assert tensors._fields == case.inputs._fields
    for name, tensor, array in zip(tensors._fields, tensors, case.inputs, strict=True):
        assert array is not None
        assert isinstance(tensor, torch.Tensor), name
        assert str(tensor.dtype) == f"torch.{np.dtype(dtype).name}"
        assert tensor.shape == array.shape
        back = (
            tensor.view(torch.int16).numpy().view(array.dtype)
            if tensor.dtype == torch.bfloat16
            else tensor.numpy()
        )
        assert np.array_equal(back, array, equal_nan=True), name
        assert not np.shares_memory(back, array)  # the fixture's arrays are read-only
        tensor.add_(1)  # a kernel may write its inputs
    assert np.array_equal(make_case(LAYOUT, dtype=dtype, seed=2).inputs.q, case.inputs.q)
    x = case.inputs_as("torch", dtype="float64", requires_grad=True)
    assert (x.q.dtype, x.q.requires_grad, x.q.is_leaf) == (torch.float64, True, True)
    for name in ("float99", "tensor"):  # "tensor" names a function of torch, not a dtype
        with pytest.raises(ValueError, match=f"inputs_as: torch has no dtype named '{name}'"):
            case.inputs_as("torch", dtype=name)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=str)
def test_inputs_as_jax_round_trip(dtype: DTypeLike) -> None:
    jax = pytest.importorskip("jax")
    case = make_case(LAYOUT, dtype=dtype, seed=2)
    arrays = case.inputs_as("jax")
    for name, tensor, array in zip(arrays._fields, arrays, case.inputs, strict=True):
        assert array is not None
        assert isinstance(tensor, jax.Array), name
        assert tensor.dtype == array.dtype
        assert np.array_equal(np.asarray(tensor), array, equal_nan=True), name
    wide = make_case(LAYOUT, dtype=np.float64, seed=2)
    if not jax.config.jax_enable_x64:
        with pytest.raises(ValueError, match=r"inputs_as: JAX made float32 of float64: its 64-bit"):
            wide.inputs_as("jax")
        assert wide.inputs_as("jax", dtype="float32").q.dtype == np.float32  # asked: a cast


def test_inputs_as_refuses_what_it_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(LAYOUT, seed=3)
    with pytest.raises(
        ValueError, match=r"framework must be one of \('torch', 'jax', 'numpy'\), got 'tf'"
    ):
        case.inputs_as("tf")
    with pytest.raises(ValueError, match="requires_grad is torch's"):
        case.inputs_as("jax", requires_grad=True)
    with pytest.raises(ValueError, match="inputs_as: numpy has no dtype named 'float8'"):
        case.inputs_as("numpy", dtype="float8")
    if importlib.util.find_spec("jax") is not None:  # JAX's tests skip without it
        with pytest.raises(ValueError, match=r"inputs_as: jax\.numpy has no dtype named 'array'"):
            case.inputs_as("jax", dtype="array")
    monkeypatch.setitem(sys.modules, "torch", None)  # as where torch is not installed
    with pytest.raises(ImportError, match="PyTorch is not installed: pip install torch"):
        case.inputs_as("torch")


@pytest.mark.slow  # imports torch: about a second, once per process
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_pack_and_compare_take_torch_tensors_that_require_grad(dtype: DTypeLike) -> None:
    torch = pytest.importorskip("torch")
    case = make_case(LAYOUT, dtype=dtype, seed=4)
    expected = np.asarray(case.expected)

    def tensor(array: np.ndarray) -> Any:  # a leaf that requires grad, as a kernel's may
        bits = array.dtype == ml_dtypes.bfloat16
        t = torch.from_numpy(np.array(array).view(np.int16) if bits else np.array(array))
        return (t.view(torch.bfloat16) if bits else t).requires_grad_()

    tensors = [tensor(g) for g in unpack(expected, LAYOUT) if g is not None]
    packed = pack(*tensors, layout=LAYOUT)
    assert packed.dtype == expected.dtype
    assert np.array_equal(packed, expected, equal_nan=True)
    out = np.empty_like(expected)
    assert pack(*tensors, out=out) is out
    assert np.array_equal(out, expected, equal_nan=True)
    graph = tensor(expected) * 1  # not a leaf: it has a graph
    assert compare(graph, expected, LAYOUT).passed
    assert case.check(graph).passed


@pytest.mark.slow  # imports torch: about a second, once per process
@pytest.mark.parametrize("kind", ["meta", "float8_e4m3fn"])
def test_tensors_numpy_cannot_read_are_refused_by_name(kind: str) -> None:
    torch = pytest.importorskip("torch")
    case = make_case(LAYOUT, seed=7)
    expected = torch.from_numpy(np.array(case.expected))
    tensor = expected.to("meta") if kind == "meta" else expected.to(getattr(torch, kind))
    received = rf"got a Tensor of dtype {tensor.dtype} on device {tensor.device}: "
    accepted = (
        r"must be an array NumPy can read \(a NumPy dtype or bfloat16, in memory it can be "
        r"copied from\)"
    )
    with pytest.raises(TypeError, match=rf"^compare: actual {accepted}, {received}"):
        compare(tensor, case.expected, LAYOUT)
    with pytest.raises(TypeError, match=rf"^compare: expected {accepted}, {received}"):
        compare(case.expected, tensor, LAYOUT)
    with pytest.raises(TypeError, match=rf"^compare: actual {accepted}, {received}"):
        case.check(tensor)
    grads = [tensor[s.offset : s.offset + s.length].view(s.shape) for s in LAYOUT.segments()]
    with pytest.raises(TypeError, match=rf"^pack: a gradient {accepted}, {received}"):
        pack(*grads, layout=LAYOUT)


#: The spec's forward, step by step, in torch: a stand-in for a user's kernel.
TORCH_FORWARD = """
import torch

def my_forward(q, k, v, g, beta, state):
    batch, seq, heads, n = q.shape
    s = q.new_zeros(batch, heads, n, n) if state is None else state
    ys = []
    for t in range(seq):
        a = torch.exp(g[:, t])
        a = a[..., :, None] if a.dim() == 3 else a[..., None, None]
        p = a * s
        m = torch.einsum("bhi,bhij->bhj", k[:, t], p)
        u = (v[:, t] - m) * beta[:, t, :, None]
        s = p + k[:, t, :, :, None] * u[:, :, None, :]
        ys.append(torch.einsum("bhi,bhij->bhj", q[:, t], s) / n**0.5)
    return torch.stack(ys, dim=1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1,5,2,4,state", "2,9,3,8,channel", "1,1,1,8,channel"])
def test_the_readme_torch_kernel_test_runs_as_written(
    pytester: pytest.Pytester, layout: str
) -> None:
    pytest.importorskip("torch")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"```python\n(from gdn_layout import pack\n.*?)```", readme, re.DOTALL)
    assert block is not None
    pytester.makepyfile(test_kernel=TORCH_FORWARD + block.group(1))
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-layout", layout)
    result.assert_outcomes(passed=len(REGIMES))  # one case per gate regime
    # The same test of a kernel whose dbeta has the wrong sign fails in every regime.
    pytester.makepyfile(
        test_kernel=TORCH_FORWARD + block.group(1).replace("x.beta.grad", "-x.beta.grad")
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-layout", layout)
    result.assert_outcomes(failed=len(REGIMES))
    result.stdout.fnmatch_lines(["*gradient(s) dbeta differ*"])


def test_numpy_inputs_are_writable_copies_and_rlx_inputs_put_the_state_before_dy() -> None:
    case = make_case(GdnBackwardLayout(1, 4, 2, 4, carry_state=True), regime="mild")
    i = case.inputs
    assert all(a is b for a, b in zip(case.rlx_inputs, (*i[:5], i.state, i.dy), strict=True))
    x = case.inputs_as("numpy")
    assert all(a.flags.writeable and a.flags.c_contiguous for a in x)
    assert not any(np.shares_memory(a, b) for a, b in zip(x, case.inputs, strict=True))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(x, case.inputs, strict=True))
    assert case.inputs_as("numpy", dtype="float64").q.dtype == np.float64
    with pytest.raises(ValueError, match="requires_grad is torch's; NumPy arrays have no"):
        case.inputs_as("numpy", requires_grad=True)


# -- devices -------------------------------------------------------------------------------


def _torch_with_cuda() -> Any:
    """torch, where a CUDA device is here; the test is skipped otherwise, never failed."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    return torch


@pytest.mark.slow  # imports torch: about a second, once per process
@pytest.mark.parametrize("device", ["cpu:0", "torch.device('cpu')", "meta", "cuda"])
def test_inputs_as_torch_makes_each_tensor_once_on_the_device(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = _torch_with_cuda() if device == "cuda" else pytest.importorskip("torch")
    given = torch.device("cpu") if device.startswith("torch.") else device
    case = make_case(LAYOUT, dtype=ml_dtypes.bfloat16, seed=8)
    viewed: list[np.ndarray] = []
    from_numpy = torch.from_numpy

    def spy(array: np.ndarray) -> Any:
        viewed.append(array)
        return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", spy)
    x = case.inputs_as("torch", dtype="float32", device=given, requires_grad=True)
    # The one copy is made from the fixture's own memory: no host copy before it.
    assert len(viewed) == len(case.inputs)
    assert all(np.shares_memory(v, a) for v, a in zip(viewed, case.inputs, strict=True))
    for name, tensor, array in zip(x._fields, x, case.inputs, strict=True):
        assert tensor.device.type == torch.device(given).type, name
        assert (tensor.dtype, tensor.requires_grad, tensor.is_leaf) == (torch.float32, True, True)
        assert array is not None
        assert tensor.shape == array.shape
        assert tensor.is_contiguous()
        if tensor.device.type != "meta":
            back = tensor.detach().cpu().numpy()
            assert np.array_equal(back, np.asarray(array, np.float32), equal_nan=True), name
            assert not np.shares_memory(back, array)


@pytest.mark.slow  # imports JAX: about a second, once per process
@pytest.mark.parametrize("device", ["cpu:0", "jax.devices('cpu')[0]"])
def test_inputs_as_jax_makes_each_array_once_on_the_device(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    jax = pytest.importorskip("jax")
    given = jax.devices("cpu")[0] if device.startswith("jax.") else device
    case = make_case(LAYOUT, dtype=ml_dtypes.bfloat16, seed=8)
    put: list[np.ndarray] = []
    device_put = jax.device_put

    def spy(array: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        put.append(array)
        return device_put(array, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    x = case.inputs_as("jax", device=given)
    assert all(p is a for p, a in zip(put, case.inputs, strict=True))  # no host copy first
    for name, array, expected in zip(x._fields, x, case.inputs, strict=True):
        assert expected is not None
        assert array.devices() == {jax.devices("cpu")[0]}, name
        assert array.dtype == expected.dtype
        assert np.array_equal(np.asarray(array), expected, equal_nan=True), name
        assert not np.shares_memory(np.asarray(array), expected)  # JAX's own memory


@pytest.mark.slow  # imports torch and JAX: about a second each, once per process
def test_inputs_as_refuses_a_device_the_framework_does_not_have_here() -> None:
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")

    case = make_case(LAYOUT, seed=3)
    past = f"cuda:{torch.cuda.device_count()}"  # one past the last CUDA device: none here
    cpus = len(jax.devices("cpu"))
    refused: list[tuple[str, list[object], str]] = [
        ("torch", [past, "no-such-device", 999], "one torch has here"),
        (
            "jax",
            [f"cpu:{cpus}", "no-such-platform", "", "cpu:-1", "cpu:x"],
            "a jax.Device or one JAX has here",
        ),
    ]
    for framework, devices, has in refused:
        for device in devices:
            expected = f"inputs_as: device must be {has}, got {device!r}"
            with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
                case.inputs_as(framework, device=device)
    for device in ["cuda", "gpu", torch.device("cpu")]:
        got = re.escape(repr(device))
        with pytest.raises(
            ValueError, match=rf"^inputs_as: device must be None or 'cpu' for NumPy, got {got}$"
        ):
            case.inputs_as("numpy", device=device)
    for framework, device, expected in [
        ("torch", 2.5, "a torch.device, its name or an index, got float"),
        ("torch", True, "a torch.device, its name or an index, got bool"),
        ("jax", 0, "a jax.Device or a platform's name, got int"),
        ("jax", torch.device("cpu"), "a jax.Device or a platform's name, got device"),
    ]:
        with pytest.raises(TypeError, match=rf"^inputs_as: device must be {expected}$"):
            case.inputs_as(framework, device=device)


@pytest.mark.parametrize("numpy_takes_device", [True, False], ids=["numpy>=2.1", "older"])
def test_an_array_on_a_device_is_read_with_one_cross_device_copy(
    numpy_takes_device: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if numpy_takes_device and not _arrays._FROM_DLPACK_TAKES_DEVICE:
        pytest.skip("this NumPy has no from_dlpack(device=...)")
    monkeypatch.setattr(_arrays, "_FROM_DLPACK_TAKES_DEVICE", numpy_takes_device)
    host = np.linspace(-1.0, 1.0, 12, dtype=np.float32)
    for device, name in [((2, 0), "cuda:0"), ((10, 1), "rocm:1"), ((99, 2), "device type 99:2")]:
        array = DeviceArray(host, device)
        read = as_packed(array)
        assert len(array.copies) == 1  # one request, one copy
        assert np.shares_memory(read, array.copies[0])  # NumPy took the copy as it was given
        assert np.array_equal(read, host)
        assert not np.shares_memory(read, host)
        assert device_of(array) == name


def test_an_array_in_host_memory_is_viewed_without_a_copy() -> None:
    host = np.linspace(-1.0, 1.0, 12, dtype=np.float32)
    pinned = DeviceArray(host, (3, 0))  # CUDA's pinned host memory
    assert np.shares_memory(as_packed(pinned), host)
    assert not pinned.copies
    assert device_of(pinned) is None


def test_an_array_no_copy_reaches_is_refused_by_name() -> None:
    array = DeviceArray(np.zeros(4, np.float32), honour=False)
    with pytest.raises(
        TypeError,
        match=r"^pack: a gradient must be an array NumPy can read .* got a DeviceArray of dtype "
        r"float32 on device device\(2, 0\): cannot export",
    ):
        as_packed(array, "a gradient", "pack")


class _CudaArray:
    """An array known only by ``__cuda_array_interface__`` (no DLPack, no ``__array__``)."""

    def __init__(self, host: np.ndarray) -> None:
        self.host, self.dtype, self.device = host, host.dtype, "cuda"
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": host.dtype.str}


def test_an_array_with_a_cuda_array_interface_is_copied_by_cupy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = np.arange(6, dtype=np.float32)
    copies: list[np.ndarray] = []

    class _View:  # CuPy's array of the interface, read without a copy; .get() copies once
        def __init__(self, array: _CudaArray) -> None:
            self.array = array

        def get(self) -> np.ndarray:
            copies.append(self.array.host.copy())
            return copies[-1]

    class _Cupy:
        asarray = _View

    monkeypatch.setitem(sys.modules, "cupy", _Cupy)
    read = as_packed(_CudaArray(host))
    assert len(copies) == 1
    assert read is copies[0]
    assert np.array_equal(read, host)
    assert device_of(_CudaArray(host)) == "cuda"
    monkeypatch.setitem(sys.modules, "cupy", None)  # as where CuPy is not installed
    with pytest.raises(TypeError, match=r"^compare: actual must be .* needs CuPy to copy it"):
        as_packed(_CudaArray(host))


@pytest.mark.slow  # imports JAX: about a second, once per process
def test_jax_arrays_on_a_cpu_device_are_read_without_a_copy() -> None:
    jax = pytest.importorskip("jax")
    case = make_case(LAYOUT, seed=9)
    on_device = jax.device_put(np.array(case.expected), jax.devices("cpu")[0])
    assert np.shares_memory(as_packed(on_device), as_packed(on_device))
    assert device_of(on_device) is None
    assert compare(on_device, case.expected, LAYOUT).passed
    bf16 = jax.device_put(np.asarray(case.expected, ml_dtypes.bfloat16))  # DLPack lacks bf16
    assert as_packed(bf16).dtype == ml_dtypes.bfloat16
    torch = pytest.importorskip("torch")
    assert device_of(torch.zeros(2)) is None
    assert device_of(torch.zeros(2, device="meta")) == "meta"


@pytest.mark.slow
def test_a_kernel_on_a_cuda_device_is_checked_without_moving_its_tensors() -> None:
    torch = _torch_with_cuda()
    case = make_case(LAYOUT, seed=10)
    x = case.inputs_as("torch", device="cuda")
    assert all(t is None or t.device.type == "cuda" for t in x)
    expected = torch.from_numpy(np.array(case.expected)).to("cuda")
    assert case.check(expected).passed
    for dtype in (torch.float32, torch.bfloat16):
        assert np.array_equal(as_packed(expected.to(dtype)), as_packed(expected.cpu().to(dtype)))
    wrong = expected.clone()
    wrong[LAYOUT.segment("dv").offset] += 1
    with pytest.raises(AssertionError, match=rf"\(read from {expected.device}\)"):
        case.check(wrong)
