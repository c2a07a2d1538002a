"""``_arrays``: a case's inputs in RLX's order and as a framework's tensors; a framework's
gradients packed."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import DTypeLike

from gdn_layout import GdnBackwardLayout, pack, unpack
from gdn_layout.check import compare
from gdn_layout.reference import backward
from gdn_layout.regimes import REGIMES
from gdn_layout.suites import make_case

DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16]
LAYOUT = GdnBackwardLayout(2, 5, 3, 4, carry_state=True)


@pytest.mark.parametrize("carry", [False, True])
def test_rlx_inputs_put_the_state_before_dy(carry: bool) -> None:
    layout = GdnBackwardLayout(1, 3, 2, 4, carry_state=carry)
    case = make_case(layout, seed=1)
    x = case.inputs
    expected = (x.q, x.k, x.v, x.g, x.beta, *((x.state,) if carry else ()), x.dy)
    assert len(case.rlx_inputs) == len(expected)
    assert all(a is b for a, b in zip(case.rlx_inputs, expected, strict=True))


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


@pytest.mark.slow
def test_inputs_as_jax_refuses_to_make_float32_of_float64() -> None:
    jax = pytest.importorskip("jax")
    case = make_case(LAYOUT, dtype=np.float64, seed=2)
    if jax.config.jax_enable_x64:
        pytest.skip("64-bit types are on in this process")
    with pytest.raises(ValueError, match=r"inputs_as: JAX made float32 of float64: its 64-bit"):
        case.inputs_as("jax")
    assert case.inputs_as("jax", dtype="float32").q.dtype == np.float32  # asked: a cast


@pytest.mark.slow
def test_inputs_as_torch_takes_a_dtype_and_requires_grad() -> None:
    torch = pytest.importorskip("torch")
    case = make_case(LAYOUT, seed=3)
    x = case.inputs_as("torch", dtype="float64", requires_grad=True)
    assert x.q.dtype == torch.float64
    assert x.q.requires_grad
    assert x.q.is_leaf
    assert case.inputs_as("torch", dtype=torch.bfloat16).k.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="torch has no dtype named 'float99'"):
        case.inputs_as("torch", dtype="float99")


def test_inputs_as_refuses_what_it_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(LAYOUT, seed=3)
    with pytest.raises(
        ValueError, match=r"framework must be one of \('torch', 'jax', 'numpy'\), got 'tf'"
    ):
        case.inputs_as("tf")
    with pytest.raises(ValueError, match="requires_grad is torch's"):
        case.inputs_as("jax", requires_grad=True)
    monkeypatch.setitem(sys.modules, "torch", None)  # as where torch is not installed
    with pytest.raises(ImportError, match="PyTorch is not installed: pip install torch"):
        case.inputs_as("torch")


@pytest.mark.slow  # imports torch: about a second, once per process
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_pack_takes_torch_gradients_without_converting_them_first(dtype: DTypeLike) -> None:
    torch = pytest.importorskip("torch")
    case = make_case(LAYOUT, dtype=dtype, seed=4)
    expected = np.asarray(case.expected)
    grads = [g for g in unpack(expected, LAYOUT) if g is not None]
    tensors = [
        torch.from_numpy(np.array(g).view(np.int16)).view(torch.bfloat16)
        if g.dtype == ml_dtypes.bfloat16
        else torch.from_numpy(np.array(g))
        for g in grads
    ]
    packed = pack(*tensors, layout=LAYOUT)
    assert packed.dtype == expected.dtype
    assert np.array_equal(packed, expected, equal_nan=True)
    out = np.empty_like(expected)
    assert pack(*tensors, out=out) is out
    assert np.array_equal(out, expected, equal_nan=True)


@pytest.mark.slow  # imports torch: about a second, once per process
def test_a_torch_kernel_is_checked_on_torch_inputs() -> None:
    torch = pytest.importorskip("torch")
    case = make_case(LAYOUT, seed=5)
    x = case.inputs_as("torch")
    q, k, v, g, beta, dy = (t.numpy() for t in x[:6])
    grads = unpack(backward(q, k, v, g, beta, dy, x.state.numpy(), dtype=np.float32), LAYOUT)
    as_tensors = [torch.from_numpy(np.array(g)) for g in grads if g is not None]
    assert case.check(pack(*as_tensors)).passed


@pytest.mark.slow  # imports torch: about a second, once per process
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_tensors_that_require_grad_are_read_detached(dtype: DTypeLike) -> None:
    torch = pytest.importorskip("torch")
    case = make_case(LAYOUT, dtype=dtype, seed=6)
    expected = np.asarray(case.expected)

    def tensor(array: np.ndarray) -> Any:  # a leaf that requires grad, as a kernel's may
        if array.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(np.array(array).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.array(array))

    grads = [tensor(g).requires_grad_() for g in unpack(expected, LAYOUT) if g is not None]
    assert np.array_equal(pack(*grads, layout=LAYOUT), expected, equal_nan=True)
    packed = tensor(expected).requires_grad_() * 1  # not a leaf: it has a graph
    assert packed.requires_grad
    assert compare(packed, expected, LAYOUT).passed
    assert case.check(packed).passed


@pytest.mark.slow  # imports torch: about a second, once per process
@pytest.mark.parametrize("kind", ["meta", "float8_e4m3fn"])
def test_tensors_numpy_cannot_read_are_refused_by_name(kind: str) -> None:
    torch = pytest.importorskip("torch")
    case = make_case(LAYOUT, seed=7)
    expected = torch.from_numpy(np.array(case.expected))
    tensor = expected.to("meta") if kind == "meta" else expected.to(getattr(torch, kind))
    received = rf"got a Tensor of dtype {tensor.dtype} on device {tensor.device}: "
    accepted = r"must be an array NumPy can read \(a NumPy dtype or bfloat16, in CPU memory\)"
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


def test_numpy_inputs_are_writable_copies() -> None:
    case = make_case(GdnBackwardLayout(1, 4, 2, 4, carry_state=True), regime="mild")
    x = case.inputs_as("numpy")
    assert all(a.flags.writeable and a.flags.c_contiguous for a in x)
    assert not any(np.shares_memory(a, b) for a, b in zip(x, case.inputs, strict=True))
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(x, case.inputs, strict=True))
    assert case.inputs_as("numpy", dtype="float64").q.dtype == np.float64
    with pytest.raises(ValueError, match="requires_grad is torch's; NumPy arrays have no"):
        case.inputs_as("numpy", requires_grad=True)
