"""Benchmark the reference backward against autograd of the recurrence and of chunked peers.

Two baselines differentiated by PyTorch autograd, and two by JAX:

* **autograd**: what people use as an oracle: the gated delta-net recurrence written step by
  step in PyTorch (as flash-linear-attention's ``naive_recurrent_gated_delta_rule``, with
  matrix products for the contractions).
* **chunked**: what people actually run on a CPU: transformers' ``torch_chunk_gated_delta_rule``
  (the chunked PyTorch implementation of Qwen3-Next, in
  ``transformers.models.qwen3_next.modeling_qwen3_next``), taken from the installed package:
  the undecorated PyTorch function (``inspect.unwrap``; the decorator would dispatch to
  flash-linear-attention's kernels where installed). It is called with our layout
  ``[B, S, H, N]``, the log-gate ``g`` per head, ``beta``, ``initial_state`` when the state is
  carried, ``use_qk_l2norm_in_kernel=False`` (our q and k are already L2-normalised),
  ``output_final_state=False`` and its default ``chunk_size=64``; it scales q by
  ``N ** -0.5`` itself (our ``c``) and pads S to a multiple of 64 itself (zero keys and values,
  ``beta = 0``, ``g = 0``: the padded steps leave the state as it is and their outputs are
  dropped). It casts every input to float32 inside, so for the float64 rows its source
  (``inspect.getsource``) is loaded with that cast retargeted to ``torch.float64``: in float64
  the peer is that retargeted copy, not the package's function as is. It has a per-head gate
  only: the per-channel rows print ``n/a`` for it. Its cost under autograd grows faster than
  linearly in S: the backward of each per-chunk slice (``new_values[:, :, i]`` and the like)
  fills and accumulates a gradient of the full sequence, so at S=4096 most of its backward is
  ``fill_``, ``add_`` and ``copy_`` of whole tensors rather than matrix products. That is the
  peer as people run it on a CPU.
* **jax scan**: the same recurrence as **autograd**, one ``lax.scan`` step per time step, in
  JAX: what a compiler makes of the oracle.
* **jax chunk**: the WY/UT chunked form as flash-linear-attention computes it, chunk 64, in
  JAX (:func:`jax_chunked`): per chunk the cumulative log-gate, the strictly lower
  ``A = -(beta K K^T * decay)``, ``(I - A)^-1`` by ``jax.lax.linalg.triangular_solve``, ``w``
  and ``u``, then the state carried over the chunks by ``lax.scan``. The same algorithm as
  transformers' peer without its per-chunk slicing under autograd: what the chunked form costs
  when a compiler plans its backward. Per-head gate only (``n/a`` on the per-channel rows).

Both JAX sides are ``jax.vjp`` of the forward with cotangent ``dy`` (the gradients of
``sum(y * dy)`` with respect to q, k, v, g, beta and the initial state) under ``jax.jit``, in
float64 where the row is (``jax_enable_x64``); without a carried state the initial state is
zeros and its gradient is dropped. JAX compiles on the first call for the benchmark's shapes:
that compile (``jit(...).lower(...).compile()``) is timed apart and printed, never in the
times. XLA runs on one thread (``--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``); the timing process's CPU time over wall time is printed to
show that no side used more than one core (below 1 it waited for one). Without JAX installed
the JAX columns print ``n/a``.

Every side computes the gradients of ``sum(y * dy)`` (no cotangent on the final state, which
our op does not expose): PyTorch runs the forward (building the graph) and ``loss.backward()``,
JAX its compiled ``vjp``; the reference runs :func:`gdn_layout.reference.backward`, which
itself runs the forward sweep it needs. So every timing covers a full backward from the inputs.

Every process runs with ``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS``
set to 1 (and ``torch.set_num_threads(1)``, and XLA's flags above). It builds its inputs with
the same NumPy generator and seed (already converted to the benchmark dtype; PyTorch gets them
through ``torch.from_numpy``, JAX through ``jax.device_put``) and warms up each side, on a
tiny problem for NumPy and PyTorch, by compiling and running once for JAX. Per configuration:

* peak memory, each side in a fresh subprocess of its own (a peak in one process would hide
  the next side's): the growth of the process's peak resident set size (``VmHWM``, the
  kernel's RSS high-water mark, reset through ``/proc/self/clear_refs`` just before) during
  the first full backward over the resident size just before it (inputs and warm-up already
  resident; for JAX, the first run after compiling), i.e. the extra memory that backward
  needed at its peak, its outputs included.
  The same measure on every side; it counts pages actually touched, so memory that the
  allocator kept from the warm-up and reused is not counted. For NumPy,
  ``tracemalloc``'s peak of traced allocations during a separate call is printed alongside;
  PyTorch's CPU allocator keeps no peak statistics, so it has no such second figure.
* time: every side in one more subprocess, interleaved: round after round each side runs one
  full backward, and each keeps its best (wall clock; a single run for autograd at S=4096).
  A load from elsewhere on the shared machine then falls on every side alike rather than on
  whichever subprocess ran during it.

Ratios are taken between sides measured in the same run (the machine may be shared and noisy):
time ratios are a side's time / the reference's, memory ratios a side's peak / autograd's.

The achieved rate is in recurrence-equivalent GFLOP/s: the flops of the spec's step-by-step
forward and backward, divided by the reference's time. Counting a multiply-add as 2 flops and
keeping the ``N^2`` terms (the ``O(N)`` ones are left out), per step and per (batch, head):

* forward ``7 N^2``: ``P = A * S_prev`` N^2, ``m = k @ P`` 2N^2, ``S_t = P + outer(k, u)``
  2N^2, ``y = c * q @ S_t`` 2N^2;
* backward ``15 N^2``: ``dq = c * S_t @ dy`` 2N^2, ``dS += c * outer(q, dy)`` 2N^2,
  ``dk = dS @ u`` 2N^2, ``du = k @ dS`` 2N^2, ``dk += P @ dm`` 2N^2, ``dS += outer(k, dm)``
  2N^2, ``dg = A * sum(S_prev * dP)`` 2N^2, ``dS = A * dP`` N^2;

so ``22 * B * S * H * N^2`` flops in all (the same count for both gate modes). Beside it is
the machine's limit: a single-thread ``np.matmul`` of two 512 x 512 matrices in the row's dtype,
best of several, measured in the timing process of the same row.

Each side's **share of the flop floor** is the time its own algorithm's matrix-product flops
would take at that matmul rate, over its time: ``22 N^2`` a step and head for the step-by-step
sides (autograd, jax scan), :func:`chunked_flops` for the chunked ones (the reference at its
chunk length, transformers' peer and jax chunk at 64). 1 would be a side that did nothing but
large matrix products; it says how far each is from what its algorithm needs, not which
algorithm is better (the chunked count is the larger).

Before measuring, a pre-flight check asserts that each baseline gives the same gradients as the
reference and prints the largest difference (max |a - b| / max |b| per gradient): autograd and
jax scan in all four gate/state modes on a small problem and on the first benchmark
configuration, in float64; the chunked peer (float64 copy) and jax chunk per head with and
without a carried state on a problem whose length is not a multiple of their chunk, and on the
first benchmark configuration, in float64; and the float32 peer and JAX sides against the
float64 reference, loosely.

Beside it, ``chunk GF/s`` is the rate in the chunked algorithm's own matrix-product flops
(:func:`chunked_flops`: what its forward and backward sweeps multiply, per chunk of ``L`` steps,
``22 L N^2 + 26 L^2 N + 16/3 L^3`` per (batch, head), elementwise work left out).

Two more sections follow the table, each run in its own subprocess with one BLAS thread:

* **fixture / truth**: :func:`gdn_layout.make_fixture` (float64 forward and backward,
  one run of the float32 step-by-step backward, which also gives its ``y`` and states, the
  floors) over the float64 backward alone on the same
  inputs (the fixture's truth), with the time of each part; at B=1, S=4096, H=16, N=128, and
  at the real scale below unless ``--quick``.
* **workers**: the float64 backward at B=1, S=4096, H=16, N=64 with ``workers=1`` and
  ``workers=2`` (best of several, interleaved), its scaling, its rate in the chunked
  algorithm's flops beside a single-thread ``np.matmul``'s, and its peak traced memory with
  each. Then what two threads give over one, each doing the same work, in the same run: a
  512 x 512 ``np.matmul`` (on a shared machine the second core may be busy: this says how much
  there was to take), and the calls a worker makes on one chunk of its heads,
  ``[H/2, 64, N]``: a matrix product, and an elementwise product into a buffer of each
  thread's own, which is also run in two forked processes; and a worker's share of the heads
  run as a whole backward in each of two threads, and in each of two processes. Threads share
  the GIL, processes do not: the two figures of the whole backward say how much of the
  workers' shortfall is the GIL's, and those of the single calls how little of it large calls
  lose.

The last row is at a real model's scale (Qwen3-Next's linear attention: B=1, S=8192, H=16,
N=128, float32): autograd of the recurrence and jax scan are not run there (their extrapolated
time and memory are printed instead: both keep every step's states for their backward,
some 25 GiB); the other sides are run with a time limit.

Run: ``python benchmarks/bench_reference.py`` (needs the ``bench`` extra, i.e. PyTorch,
transformers and JAX; without PyTorch the benchmark prints why it is skipped and exits
successfully, without transformers the chunked columns print ``n/a``, without JAX the JAX
ones). ``--quick`` runs a small configuration only.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import resource
import subprocess
import sys
import textwrap
import time
import tracemalloc
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.reference import backward

Array = NDArray[Any]
_NAMES = ("q", "k", "v", "g", "beta")
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_PEER_MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"
_PEER_NAME = "torch_chunk_gated_delta_rule"
_PEER_CHUNK = 64
_SIDES = ("numpy", "torch", "peer", "jax scan", "jax chunk")
_SIDE_NAMES = {
    "numpy": "reference",
    "torch": "autograd",
    "peer": "chunked",
    "jax scan": "jax scan",
    "jax chunk": "jax chunk",
}
_JAX_SIDES = ("jax scan", "jax chunk")
# One core for XLA: no Eigen thread pool, one intra-op thread.
_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


class Config(NamedTuple):
    batch: int
    seq: int
    heads: int
    size: int
    dtype: str
    per_channel: bool
    carry: bool
    repeats: int

    def label(self) -> str:
        gate = "per-channel" if self.per_channel else "per-head"
        state = "state" if self.carry else "no state"
        return (
            f"B={self.batch} S={self.seq} H={self.heads} N={self.size} {self.dtype} {gate}, {state}"
        )

    def flops(self) -> int:
        """Recurrence-equivalent flops of forward + backward: ``22 * B * S * H * N^2``."""
        return 22 * self.batch * self.seq * self.heads * self.size**2

    def chunked_flops(self) -> float:
        """The chunked backward's own matrix-product flops (:func:`chunked_flops`)."""
        return chunked_flops(self.batch, self.seq, self.heads, self.size)


def chunked_flops(batch: int, seq: int, heads: int, size: int, length: int | None = None) -> float:
    """Matrix-product flops of the chunked backward, forward sweep included.

    Per chunk of ``L`` steps (the reference's ``min(64, 4N)`` unless ``length`` is given) and
    per (batch, head), a multiply-add counted as 2:
    the products with the ``N x N`` state (``r``, the state's update, their backward, ``d_xe``:
    ``22 L N^2``), the chunk's ``L x L`` couplings with ``N``-vectors (``lx`` twice, ``inv @``,
    their backward: ``26 L^2 N``), and the triangular inverses, pair decays and straddling
    sums (``16/3 L^3``).
    """
    if length is None:
        length = max(1, min(64, 4 * size))
    per_step = 22 * size**2 + 26 * length * size + 16 / 3 * length**2
    return float(batch * seq * heads * per_step)


def make_inputs(config: Config, seed: int = 0) -> dict[str, Array]:
    """Inputs in ``config.dtype``: L2-normalised q and k, gates like a trained model's."""
    rng = np.random.default_rng(seed)
    shape = (config.batch, config.seq, config.heads, config.size)
    q = rng.standard_normal(shape)
    k = rng.standard_normal(shape)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    gate_shape = shape if config.per_channel else shape[:3]
    inputs = {
        "q": q,
        "k": k,
        "v": rng.standard_normal(shape),
        # log of a sigmoid of a standard normal: decays between 0 and 1, mostly 0.3 to 0.9
        "g": -np.logaddexp(0.0, -rng.standard_normal(gate_shape) - 2.0),
        "beta": 1.0 / (1.0 + np.exp(-rng.standard_normal(shape[:3]))),
        "dy": rng.standard_normal(shape),
    }
    if config.carry:
        inputs["state"] = rng.standard_normal(
            (config.batch, config.heads, config.size, config.size)
        )
    return {name: np.ascontiguousarray(value, dtype=config.dtype) for name, value in inputs.items()}


# --------------------------------------------------------------------------------------------
# The three sides
# --------------------------------------------------------------------------------------------


def numpy_side(inputs: dict[str, Array]) -> Array:
    """The reference backward: the packed gradient, in the inputs' dtype."""
    q, k, v, g, beta = (inputs[name] for name in _NAMES)
    return backward(q, k, v, g, beta, inputs["dy"], inputs.get("state"), dtype=q.dtype)


def _leaves(tensors: dict[str, Any]) -> dict[str, Any]:
    return {
        name: tensor.detach().requires_grad_(True)
        for name, tensor in tensors.items()
        if name != "dy"
    }


def torch_side(tensors: dict[str, Any]) -> dict[str, Any]:
    """Forward in PyTorch, step by step, then autograd; returns ``{name: gradient}``."""
    import torch

    leaves = _leaves(tensors)
    q, k, v, g, beta = (leaves[name] for name in _NAMES)
    batch, seq, heads, size = q.shape
    scale = size**-0.5
    per_channel = g.dim() == 4
    state = leaves["state"] if "state" in leaves else q.new_zeros(batch, heads, size, size)
    outputs = []
    for t in range(seq):
        decay = torch.exp(g[:, t])
        decay = decay.unsqueeze(-1) if per_channel else decay[..., None, None]
        p = state * decay
        kt = k[:, t]
        m = (kt.unsqueeze(-2) @ p).squeeze(-2)
        u = (v[:, t] - m) * beta[:, t, :, None]
        state = p + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outputs.append(scale * (q[:, t].unsqueeze(-2) @ state).squeeze(-2))
    y = torch.stack(outputs, dim=1)
    (y * tensors["dy"]).sum().backward()
    return {name: leaf.grad for name, leaf in leaves.items()}


def peer_available() -> str | None:
    """None when the chunked peer can be loaded, else why not."""
    try:
        load_peer("float64")
    except Exception as error:  # ImportError, or a transformers that fails on this torch
        return f"transformers' {_PEER_NAME} cannot be loaded ({type(error).__name__}: {error})"
    return None


def _undecorated(peer: Any) -> Callable[..., Any]:
    """The PyTorch function under transformers' decorators: ``inspect.unwrap``, and where the
    decorator made a module (transformers 5.25 and later), the function its ``forward`` calls."""
    function = inspect.unwrap(peer)
    if not inspect.isfunction(function):
        forward = getattr(type(function), "forward", None)
        inner = inspect.getclosurevars(forward).nonlocals.get("func") if forward else None
        if inner is None:
            raise RuntimeError(f"cannot find the PyTorch function inside {type(peer).__name__}")
        function = inspect.unwrap(inner)
    found: Callable[..., Any] = function
    return found


def load_peer(dtype: str) -> Callable[..., Any]:
    """transformers' ``torch_chunk_gated_delta_rule``, as the installed package defines it.

    The undecorated PyTorch function (the decorator would dispatch to flash-linear-attention's
    kernels where installed). For ``dtype="float64"``, its source is loaded again (in a copy of
    its module's namespace) with its cast of the inputs to ``torch.float32`` retargeted to
    ``torch.float64``; the rest of the source is unchanged.
    """
    module = importlib.import_module(_PEER_MODULE)
    function = _undecorated(getattr(module, _PEER_NAME))
    if dtype == "float32":
        return function
    if dtype != "float64":
        raise ValueError(f"no chunked peer in {dtype}")
    lines = textwrap.dedent(inspect.getsource(function)).splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("def "))  # no decorators
    source = "".join(lines[start:])
    casts = source.count("torch.float32")
    if casts != 1:
        raise RuntimeError(f"expected one cast to torch.float32 in {_PEER_NAME}, found {casts}")
    namespace = dict(vars(module))
    code = compile(
        source.replace("torch.float32", "torch.float64"), inspect.getfile(function), "exec"
    )
    exec(code, namespace)
    retargeted: Callable[..., Any] = namespace[_PEER_NAME]
    return retargeted


def peer_side(tensors: dict[str, Any], peer: Callable[..., Any]) -> dict[str, Any]:
    """transformers' chunked forward, then autograd; returns ``{name: gradient}``."""
    leaves = _leaves(tensors)
    q, k, v, g, beta = (leaves[name] for name in _NAMES)
    if g.dim() != 3:
        raise ValueError("the chunked peer has a per-head gate only")
    y, final = peer(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=_PEER_CHUNK,
        initial_state=leaves.get("state"),
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
    )
    assert final is None
    (y * tensors["dy"]).sum().backward()
    return {name: leaf.grad for name, leaf in leaves.items()}


def _torch_tensors(inputs: dict[str, Array]) -> dict[str, Any]:
    import torch

    return {name: torch.from_numpy(value.copy()) for name, value in inputs.items()}


# --------------------------------------------------------------------------------------------
# JAX: the recurrence under lax.scan, and the chunked form as flash-linear-attention has it
# --------------------------------------------------------------------------------------------


def _one_core_xla(flags: str) -> str:
    return flags if _XLA_FLAGS in flags else f"{flags} {_XLA_FLAGS}".strip()


def load_jax() -> Any:
    """JAX with float64 enabled, its CPU backend held to one thread (the flags must be set
    before its first import)."""
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = _one_core_xla(os.environ.get("XLA_FLAGS", ""))
    jax: Any = importlib.import_module("jax")  # optional: typed as Any, as if absent
    jax.config.update("jax_enable_x64", True)
    return jax


def jax_available() -> str | None:
    """None when JAX can be imported, else why not."""
    try:
        load_jax()
    except Exception as error:  # ImportError, or a jaxlib that does not load here
        return f"JAX cannot be loaded ({type(error).__name__}: {error})"
    return None


def jax_recurrence(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any) -> Any:
    """``y`` of the recurrence, one ``lax.scan`` step per time step (the ``autograd`` side's
    operations)."""
    jax = load_jax()
    lax, jnp = jax.lax, jax.numpy

    scale = q.shape[-1] ** -0.5
    per_channel = g.ndim == 4

    def step(s: Any, x: tuple[Any, ...]) -> tuple[Any, Any]:
        qt, kt, vt, gt, bt = x
        decay = jnp.exp(gt)
        p = s * (decay[..., :, None] if per_channel else decay[..., None, None])
        m = (kt[..., None, :] @ p)[..., 0, :]
        u = (vt - m) * bt[..., None]
        s = p + kt[..., :, None] * u[..., None, :]
        return s, scale * (qt[..., None, :] @ s)[..., 0, :]

    _, y = lax.scan(step, state, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
    return jnp.moveaxis(y, 0, 1)


def jax_chunked(q: Any, k: Any, v: Any, g: Any, beta: Any, state: Any) -> Any:
    """``y`` of the WY/UT chunked form, chunks of 64 steps, per-head gate.

    As flash-linear-attention's ``chunk_gated_delta_rule`` computes it: per chunk the
    cumulative log-gate ``G``, ``A = -(beta_i k_i . k_j exp(G_i - G_j))`` strictly below the
    diagonal, ``T = (I - A)^-1`` by a triangular solve, ``w = T (beta k exp(G))`` and
    ``u = T (beta v)``; then one ``lax.scan`` over the chunks carries the state. S is padded
    to a multiple of 64 as transformers' peer pads it (zero keys and values, ``beta = 0``,
    ``g = 0``: the state passes the padded steps unchanged).
    """
    jax = load_jax()
    lax, jnp = jax.lax, jax.numpy

    batch, seq, heads, size = q.shape
    length = _PEER_CHUNK
    pad = -seq % length
    chunks = (seq + pad) // length

    def chunked(a: Any) -> Any:  # [B, S, H, ...] -> [C, B, H, L, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(batch, chunks, length, heads, *a.shape[3:])
        return jnp.moveaxis(a, (1, 3), (0, 2))

    q, k, v, g, beta = (chunked(a) for a in (q * size**-0.5, k, v, g, beta))
    gc = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((length, length), dtype=bool))
    decay = jnp.where(lower, jnp.exp(gc[..., :, None] - gc[..., None, :]), 0.0)
    kt = jnp.swapaxes(k, -1, -2)
    a = jnp.where(jnp.tril(lower, -1), -(beta[..., None] * (k @ kt) * decay), 0.0)
    eye = jnp.eye(length, dtype=q.dtype)
    t = lax.linalg.triangular_solve(
        eye - a, jnp.broadcast_to(eye, a.shape), left_side=True, lower=True
    )
    w = t @ (k * (beta * jnp.exp(gc))[..., None])
    u = t @ (v * beta[..., None])
    qk = (q @ kt) * decay  # within a chunk, lower triangle with the diagonal

    def step(s: Any, x: tuple[Any, ...]) -> tuple[Any, Any]:
        qi, ki, ui, wi, gi, qki = x
        fresh = ui - wi @ s
        y = (qi * jnp.exp(gi)[..., None]) @ s + qki @ fresh
        last = gi[..., -1:]
        carried = jnp.swapaxes(ki * jnp.exp(last - gi)[..., None], -1, -2) @ fresh
        return s * jnp.exp(last)[..., None] + carried, y

    _, y = lax.scan(step, state, (q, k, u, w, gc, qk))
    y = jnp.moveaxis(y, (0, 2), (1, 3)).reshape(batch, chunks * length, heads, size)
    return y[:, :seq]


def jax_side(side: str, inputs: dict[str, Array]) -> tuple[Callable[[], Any], float]:
    """A compiled ``jax.vjp`` of ``side``'s forward with cotangent ``dy`` (the gradients of
    ``sum(y * dy)``), as a call that waits for its results, and its compile time in seconds.

    Without a carried state the forward starts from zeros and ``dstate`` is dropped.
    """
    jax = load_jax()
    forward = jax_recurrence if side == "jax scan" else jax_chunked
    q = inputs["q"]
    batch, _, heads, size = q.shape
    state = inputs.get("state", np.zeros((batch, heads, size, size), q.dtype))
    args = [*(inputs[name] for name in _NAMES), state]
    arrays = [jax.device_put(a) for a in (*args, inputs["dy"])]

    def gradients(*arrays: Any) -> Any:
        _, pull = jax.vjp(forward, *arrays[:6])
        return pull(arrays[6])

    start = time.perf_counter()
    compiled = jax.jit(gradients).lower(*arrays).compile()
    seconds = time.perf_counter() - start

    def run() -> Any:
        return jax.block_until_ready(compiled(*arrays))

    return run, seconds


def jax_gradients(side: str, inputs: dict[str, Array]) -> dict[str, Array]:
    """``side``'s gradients by name, as the pre-flight compares them."""
    grads = jax_side(side, inputs)[0]()
    names = [*_NAMES, "state"] if "state" in inputs else list(_NAMES)
    return {name: np.asarray(grad) for name, grad in zip(names, grads, strict=False)}


# --------------------------------------------------------------------------------------------
# Pre-flight: the baselines compute the same gradients
# --------------------------------------------------------------------------------------------


def _compare(
    config: Config,
    side: Callable[[dict[str, Array]], dict[str, Any]],
    what: str,
    tolerance: float,
    reference_dtype: str | None = None,
) -> None:
    """Assert ``side``'s gradients equal the reference's within ``tolerance`` (relative)."""
    inputs = make_inputs(config, seed=1)
    mine_inputs = inputs
    if reference_dtype is not None:
        mine_inputs = {name: value.astype(reference_dtype) for name, value in inputs.items()}
    flat = numpy_side(mine_inputs)
    layout = GdnBackwardLayout.from_inputs(
        mine_inputs["q"], mine_inputs["g"], mine_inputs.get("state")
    )
    ours = unpack(flat, layout)
    theirs = side(inputs)
    worst = []
    for name, grad in theirs.items():
        mine = getattr(ours, "d" + name)
        expected = np.asarray(grad).astype(mine.dtype)
        scale = float(np.max(np.abs(expected)))
        error = float(np.max(np.abs(mine - expected))) / scale
        assert error <= tolerance, (
            f"pre-flight failed: {what}: d{name} is off by {error:.3g} relative "
            f"(tolerance {tolerance:.3g}) for {config.label()}"
        )
        worst.append(f"d{name} {error:.1e}")
    print(f"pre-flight ok: {what}, {config.label()}: {', '.join(worst)}")


def preflight(first: Config, with_peer: bool, with_jax: bool) -> None:
    small = [
        Config(2, 37, 3, 8, "float64", per_channel, carry, 1)
        for per_channel in (False, True)
        for carry in (False, True)
    ]
    first64 = first._replace(dtype="float64")
    for config in [*small, first64]:
        _compare(config, lambda x: torch_side(_torch_tensors(x)), "autograd == reference", 1e-9)
    padded = [Config(2, 150, 3, 8, "float64", False, carry, 1) for carry in (False, True)]
    if with_peer:
        peer64, peer32 = load_peer("float64"), load_peer("float32")
        for config in [*padded, first64._replace(per_channel=False)]:
            _compare(
                config,
                lambda x: peer_side(_torch_tensors(x), peer64),
                "chunked (float64 copy) == reference",
                1e-9,
            )
        for config in padded:
            _compare(
                config._replace(dtype="float32"),
                lambda x: peer_side(_torch_tensors(x), peer32),
                "chunked (float32, as packaged) ~ float64 reference",
                1e-4,
                reference_dtype="float64",
            )
    if not with_jax:
        return
    # float64: every gate/state mode for the scan, padded lengths for the chunked form
    forms = {
        "jax scan": [*small, first64],
        "jax chunk": [*padded, first64._replace(per_channel=False)],
    }
    for side, configs in forms.items():
        for config in configs:
            _compare(config, lambda x: jax_gradients(side, x), f"{side} == reference", 1e-9)  # noqa: B023
        _compare(
            padded[1]._replace(dtype="float32"),
            lambda x: jax_gradients(side, x),  # noqa: B023
            f"{side} (float32) ~ float64 reference",
            1e-4,
            reference_dtype="float64",
        )


# --------------------------------------------------------------------------------------------
# Measuring, one side per subprocess
# --------------------------------------------------------------------------------------------


def _reset_peak_rss() -> int:
    """Reset the peak resident set size to the current one, where Linux allows; return it.

    Writing 5 to ``/proc/self/clear_refs`` resets the process's RSS high-water mark, so that
    the peak measured next is not hidden by an earlier, higher one (such as the float64
    temporaries that built the inputs). Elsewhere the earlier peak stays as the baseline.
    """
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass
    return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    """The RSS high-water mark: ``VmHWM`` on Linux, else ``ru_maxrss``.

    ``ru_maxrss`` is not used on Linux because it keeps the parent's peak across ``execve``,
    which would hide the peak of a small subprocess behind the benchmark driver's.
    """
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kilobytes elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def matmul_gflops(dtype: str, size: int = 512, repeats: int = 30) -> float:
    """GFLOP/s of one ``np.matmul`` of two ``size x size`` matrices, best of ``repeats``."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size)).astype(dtype) for _ in range(2))
    out = np.empty((size, size), dtype=dtype)
    np.matmul(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def fixture_worker(config: Config) -> dict[str, Any]:
    """Time ``make_fixture`` and its parts against the float64 backward (the truth)."""
    from gdn_layout import reference
    from gdn_layout._floors import CHUNKED_RUNS, ROUNDINGS, _measure, _named
    from gdn_layout.generate import draw_inputs, make_fixture
    from gdn_layout.reference._fused import fused_backward
    from gdn_layout.reference._states import step_by_step

    layout = GdnBackwardLayout(
        config.batch, config.seq, config.heads, config.size, carry_state=True
    )
    make_fixture(GdnBackwardLayout(1, 8, 2, 4, carry_state=True))  # warm-up
    x = draw_inputs(layout, dtype=np.float32)
    wide: list[Any] = [None if a is None else a.astype(np.float64) for a in x]

    def timed(run: Callable[[], Any]) -> tuple[Any, float]:
        start = time.perf_counter()
        result = run()
        return result, time.perf_counter() - start

    times: dict[str, float] = {}
    packed, times["truth"] = timed(lambda: backward(*wide, dtype=np.float64))
    q, k, v, g, beta, _dy, state = wide
    _, times["forward"] = timed(lambda: reference.forward(q, k, v, g, beta, state))
    (low, _), times["step by step"] = timed(lambda: step_by_step(*x))
    low_named, truth_named = _named(low, {}, layout), _named(packed, {}, layout)
    wanted = {"step-by-step": set(ROUNDINGS)}
    _, times["floors"] = timed(lambda: _measure({"step-by-step": low_named}, truth_named, wanted))
    for form in ("chunked", "chunked-tf32"):  # a float32 fixture's chunked runs
        _, times[form] = timed(lambda: fused_backward(*x, bits=CHUNKED_RUNS[form]))  # noqa: B023
    _, times["fixture"] = timed(lambda: make_fixture(layout))  # float32's floors
    _, times["every class"] = timed(lambda: make_fixture(layout, precisions="all"))
    _, times["no floors"] = timed(lambda: make_fixture(layout, calibrate=False))
    _, times["truth again"] = timed(lambda: backward(*wide, dtype=np.float64))
    return times


def sampled_margin(shapes: list[tuple[int, int, int, int]], seed: int = 3) -> tuple[float, float]:
    """What the floors' step-by-step form on a sample of rows and heads
    (``_floors.sampled_pairs``, ``_floors.Sample``) does to the floors of every class: for
    every shape, gate regime and mode, tensor and figure, the floors with the sample against
    those of the whole run, from the same runs. The lowest ratio is to be at least 1 (no floor
    lowered); the highest says how far ``_floors.SAMPLE_MARGIN`` raises a floor."""
    from gdn_layout import reference
    from gdn_layout._floors import (
        CHUNKED_RUNS,
        PANEL,
        SAMPLE_MARGIN,
        Sample,
        _named,
        _picked,
        panel_floors,
        sampled_pairs,
    )
    from gdn_layout.files import GdnInputs
    from gdn_layout.generate import draw_inputs, reference_outputs
    from gdn_layout.reference._fused import fused_backward
    from gdn_layout.reference._states import step_by_step
    from gdn_layout.regimes import REGIMES

    classes = tuple(PANEL)
    lowest, highest = math.inf, 0.0
    for batch, seq, heads, size in shapes:
        for per_channel in (False, True):
            layout = GdnBackwardLayout(
                batch, seq, heads, size, gate_per_channel=per_channel, carry_state=True
            )
            pairs = sampled_pairs(layout)
            assert pairs is not None, layout
            for regime in REGIMES:
                x = draw_inputs(layout, regime=regime, seed=seed)
                wide = GdnInputs._make(None if a is None else a.astype(np.float64) for a in x)
                truth = _named(reference.backward(*wide), reference_outputs(wide, None), layout)
                runs = {"step-by-step": _named(*step_by_step(*x), layout)}
                for form, bits in CHUNKED_RUNS.items():
                    runs[form] = _named(*fused_backward(*x, bits=bits)[:2], layout)
                whole = panel_floors(runs, truth, None, classes)
                # a run on the sample alone gives the whole run's values there, bit for bit
                step = {n: np.asarray(a) for n, a in runs.pop("step-by-step").items()}
                on = {
                    form: {n: _picked(n, np.asarray(run[n]), layout, pairs) for n in truth}
                    for form, run in {**runs, "step-by-step": step}.items()
                }
                there = {n: _picked(n, a, layout, pairs) for n, a in truth.items()}
                sample = Sample("step-by-step", there, on)
                sampled = panel_floors(runs, truth, None, classes, sample)
                ratios = [
                    sampled[c][n][i] / whole[c][n][i]
                    for c in classes
                    for n in truth
                    for i in (0, 1)
                    if whole[c][n][i] > 0
                ]
                lowest, highest = min(lowest, *ratios), max(highest, *ratios)
                print(
                    f"{batch}x{seq}x{heads}x{size} {'channel' if per_channel else 'scalar':7s} "
                    f"{regime:8s}: sampled floors {min(ratios):.2f} to {max(ratios):.2f}x the "
                    "whole run's",
                    flush=True,
                )
    print(
        f"sampled floors (the estimate {SAMPLE_MARGIN:g}x over) {lowest:.2f} to "
        f"{highest:.2f}x the whole run's"
    )
    return lowest, highest


def _scaling(work: Callable[[], None], processes: bool = False, repeats: int = 5) -> float:
    """How much more ``work`` two threads (or two forked processes) do than one in the same
    time: each runs it once, all starting together; best of ``repeats``."""
    import multiprocessing
    import threading

    def in_processes(count: int) -> float:
        context = multiprocessing.get_context("fork")  # the children inherit ``work``
        start = context.Barrier(count)
        times: multiprocessing.SimpleQueue[float] = context.SimpleQueue()

        def child() -> None:
            start.wait()  # every child forked before any starts: none runs alone
            began = time.perf_counter()
            work()
            times.put(time.perf_counter() - began)

        children = [context.Process(target=child) for _ in range(count)]
        for process in children:
            process.start()
        for process in children:
            process.join()
        return max(times.get() for _ in children)

    def in_threads(count: int) -> float:
        start = threading.Barrier(count + 1)

        def thread() -> None:
            start.wait()
            work()

        threads = [threading.Thread(target=thread) for _ in range(count)]
        for each in threads:
            each.start()
        start.wait()
        began = time.perf_counter()
        for each in threads:
            each.join()
        return time.perf_counter() - began

    best = {1: math.inf, 2: math.inf}
    for _ in range(repeats):
        for count in best:
            best[count] = min(best[count], (in_processes if processes else in_threads)(count))
    return 2 * best[1] / best[2]


def scaling_worker(config: Config) -> dict[str, Any]:
    """The float64 backward with one and two workers (time and traced peak), and the two-thread
    scaling of a large matmul and of the calls a worker makes on one chunk of its heads."""
    inputs = make_inputs(config)
    q, k, v, g, beta = (inputs[name] for name in _NAMES)
    args = (q, k, v, g, beta, inputs["dy"], inputs.get("state"))
    tiny: list[Any] = [a[:, :8] for a in args[:6]] + [args[6]]  # the first 8 steps
    backward(*tiny)  # warm-up
    best = {1: math.inf, 2: math.inf}
    for _ in range(config.repeats):
        for workers in best:
            start = time.perf_counter()
            backward(*args, dtype=config.dtype, workers=workers)
            best[workers] = min(best[workers], time.perf_counter() - start)
    traced = {}
    for workers in best:
        tracemalloc.start()
        backward(*args, dtype=config.dtype, workers=workers)
        traced[workers] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((512, 512)).astype(config.dtype) for _ in range(2))
    share = config.heads // 2  # a worker's heads
    chunk = (share, 64, config.size)  # its part of one chunk of 64 steps
    x, y = (rng.standard_normal(chunk).astype(config.dtype) for _ in range(2))

    def products() -> None:
        for _ in range(20):
            np.matmul(a, b)

    def chunk_products() -> None:
        for _ in range(2000):
            np.matmul(x, np.swapaxes(y, 1, 2))

    half: list[Any] = [tensor[:, :, :share] for tensor in args[:6]]
    half.append(None if args[6] is None else args[6][:, :share])

    def half_backward() -> None:  # a worker's share, run as a whole backward of its own
        backward(*half, dtype=config.dtype)

    def chunk_multiplies() -> None:
        out = np.empty(chunk, config.dtype)  # each thread its own, as each worker's heads
        for _ in range(5000):
            np.multiply(x, y, out=out)

    return {
        "time": best,
        "traced": traced,
        "matmul_gflops": matmul_gflops(config.dtype),
        "scaling": {
            "matmul": _scaling(products),
            "chunk matmul": _scaling(chunk_products),
            "chunk multiply": _scaling(chunk_multiplies),
            "chunk multiply, processes": _scaling(chunk_multiplies, processes=True),
            "half backward": _scaling(half_backward, repeats=3),
            "half backward, processes": _scaling(half_backward, processes=True, repeats=3),
        },
        "chunk": list(chunk),
    }


def _prepare(side: str, config: Config) -> tuple[Callable[[], object], float | None]:
    """``side``'s full backward on the benchmark inputs as a call, warmed up on a tiny problem
    (NumPy, PyTorch) or compiled for these shapes but not yet run (JAX: XLA's allocator keeps
    the first run's buffers, whose pages a second run would not show), and JAX's compile
    time."""
    inputs = make_inputs(config)
    if side in _JAX_SIDES:
        return jax_side(side, inputs)
    tiny = make_inputs(config._replace(seq=4))
    if side == "numpy":
        numpy_side(tiny)
        return lambda: numpy_side(inputs), None
    import torch

    torch.set_num_threads(1)
    tensors = _torch_tensors(inputs)
    compute: Callable[[dict[str, Any]], object] = torch_side
    if side == "peer":
        peer = load_peer(config.dtype)

        def compute(tensors: dict[str, Any]) -> object:
            return peer_side(tensors, peer)

    compute(_torch_tensors(tiny))
    return lambda: compute(tensors), None


def memory_worker(side: str, config: Config) -> dict[str, Any]:
    """The growth of peak RSS during ``side``'s first full backward (after JAX's compile), and
    for the reference, tracemalloc's peak during another."""
    run, _ = _prepare(side, config)
    before = _reset_peak_rss()
    result = run()
    rss_delta = _peak_rss_bytes() - before
    del result
    traced = None
    if side == "numpy":
        tracemalloc.start()
        run()
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return {"rss_delta": rss_delta, "traced_peak": traced}


def timing_worker(config: Config, repeats: dict[str, int]) -> dict[str, Any]:
    """Every side of ``repeats`` in this one process, interleaved: round after round, each side
    runs once while its repeats last; the best wall time of each, the process's CPU time over
    wall time in that run (1 for one core), JAX's compile times, and the matmul peak."""
    runs, compile_seconds = {}, {}
    for side in repeats:
        runs[side], seconds = _prepare(side, config)
        if seconds is not None:
            compile_seconds[side] = seconds
            runs[side]()  # the first run: its buffers allocated, as the others' warm-up
    best: dict[str, float] = dict.fromkeys(repeats, math.inf)
    cores: dict[str, float] = {}
    for round_ in range(max(repeats.values())):
        for side, run in runs.items():
            if round_ >= repeats[side]:
                continue
            cpu, start = time.process_time(), time.perf_counter()
            run()
            wall = time.perf_counter() - start
            if wall < best[side]:
                best[side], cores[side] = wall, (time.process_time() - cpu) / wall
    return {
        "time": best,
        "cores": cores,
        "compile": compile_seconds,
        "matmul_gflops": matmul_gflops(config.dtype),
    }


def worker(side: str, payload: dict[str, Any]) -> dict[str, Any]:
    if side == "timing":
        return timing_worker(Config(**payload["config"]), payload["repeats"])
    config = Config(**payload)
    if side == "fixture":
        return fixture_worker(config)
    if side == "scaling":
        return scaling_worker(config)
    return memory_worker(side, config)


def measure(
    side: str,
    config: Config,
    timeout: float | None = None,
    repeats: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Run a worker in a fresh one-thread subprocess; raise TimeoutError past ``timeout`` s.

    ``side="timing"`` times the sides of ``repeats`` (``{side: repeats}``) in one process.
    """
    env = dict(os.environ)
    env.update(dict.fromkeys(_THREAD_VARS, "1"))
    env["XLA_FLAGS"] = _one_core_xla(env.get("XLA_FLAGS", ""))
    payload: dict[str, Any] = config._asdict()
    if repeats is not None:
        payload = {"config": payload, "repeats": repeats}
    command = [sys.executable, __file__, "--worker", side, json.dumps(payload)]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, check=False, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        raise TimeoutError(f"{side} worker took more than {timeout:.0f} s") from error
    if done.returncode != 0:
        raise RuntimeError(f"{side} worker failed for {config.label()}:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------


class Row(NamedTuple):
    """A configuration and, for each side not run, why (``{side: reason}``; an empty reason
    prints an extrapolation from a measured row).

    ``autograd_repeats``, when given, replaces ``config.repeats`` for autograd of the
    recurrence alone (too slow to repeat at long lengths); ``timeout`` bounds each memory
    subprocess, and twice it the timing subprocess, in seconds.
    """

    config: Config
    skip: dict[str, str]
    autograd_repeats: int | None = None
    timeout: float | None = None


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _time(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.3f}s"


def _ratio(a: float | None, b: float | None, unit: str = "x") -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.{1 if unit == 'x' else 3}f}{unit}"


def side_flops(side: str, config: Config) -> float:
    """The flops ``side``'s algorithm needs: the recurrence's ``22 N^2`` a step and head for
    the step-by-step sides, the chunked count for the chunked ones (the reference's chunk
    length, or the peers' 64)."""
    if side in ("torch", "jax scan"):
        return float(config.flops())
    length = None if side == "numpy" else _PEER_CHUNK
    return chunked_flops(config.batch, config.seq, config.heads, config.size, length)


_SHORT = {"numpy": "ref", "torch": "ag", "peer": "ch", "jax scan": "js", "jax chunk": "jc"}
_TABLES: dict[str, list[tuple[str, int]]] = {
    "time": [
        ("configuration", 45),
        *((_SIDE_NAMES[side], 9) for side in _SIDES),
        *((f"{_SHORT[side]}/ref", 7) for side in _SIDES[1:]),
    ],
    "memory": [
        ("configuration", 45),
        *((f"{_SHORT[side]} peak", 11) for side in _SIDES),
        *((f"{_SHORT[side]}/ag", 6) for side in _SIDES if side != "torch"),
        ("ref traced", 11),
    ],
    "floor": [
        ("configuration", 45),
        ("matmul", 7),
        ("GFLOP/s", 7),
        ("chunk GF/s", 10),
        *((_SHORT[side], 5) for side in _SIDES),
        ("js compile", 10),
        ("jc compile", 10),
        ("cpu/wall", 8),
    ],
}


def _line(table: str, cells: list[str]) -> str:
    first, *rest = zip(cells, _TABLES[table], strict=True)
    return f"{first[0]:<{first[1][1]}}" + "".join(f" {c:>{w}}" for c, (_, w) in rest)


def _header(table: str) -> str:
    header = _line(table, [name for name, _ in _TABLES[table]])
    return f"{header}\n{'-' * len(header)}"


def extrapolate(side: str, row: Row, measured: dict[Config, dict[str, dict[str, Any]]]) -> str:
    """``side``'s time and peak for ``row``, scaled by B*S*H*N^2 from the largest measured row."""
    same = [
        c
        for c, sides in measured.items()
        if c.dtype == row.config.dtype and not c.per_channel and side in sides
    ]
    if not same:
        return "not run"
    base = max(same, key=lambda c: c.flops())
    factor = row.config.flops() / base.flops()
    seconds = measured[base][side]["time"] * factor
    peak = measured[base][side]["rss_delta"] * factor
    return (
        f"not run: scaled by B*S*H*N^2 from {base.label()}, it would take ~{seconds / 60:.0f} min "
        f"and ~{peak / 2**30:.0f} GiB"
    )


def measure_row(row: Row, notes: list[str]) -> dict[str, dict[str, Any]]:
    """Each side's peak in its own subprocess, then every side's time in one process."""
    config = row.config
    sides = [side for side in _SIDES if side not in row.skip]
    results: dict[str, dict[str, Any]] = {}
    for side in sides:
        try:
            results[side] = measure(side, config, timeout=row.timeout)
        except TimeoutError as error:
            notes.append(f"{config.label()}: {_SIDE_NAMES[side]} memory n/a: {error}")
    repeats = {side: config.repeats for side in sides}
    if "torch" in repeats and row.autograd_repeats:
        repeats["torch"] = row.autograd_repeats
    timeout = None if row.timeout is None else 2 * row.timeout
    try:
        timing = measure("timing", config, timeout=timeout, repeats=repeats)
    except TimeoutError as error:
        notes.append(f"{config.label()}: times n/a: {error}")
        return results
    for side in sides:
        found = results.setdefault(side, {"rss_delta": None, "traced_peak": None})
        found["time"] = timing["time"][side]
        found["cores"] = timing["cores"][side]
        found["compile"] = timing["compile"].get(side)
        found["matmul_gflops"] = timing["matmul_gflops"]
    return results


def print_tables(
    rows: list[Row], measured: dict[Config, dict[str, dict[str, Any]]], notes: list[str]
) -> None:
    def get(config: Config, side: str, key: str) -> float | None:
        value: float | None = measured[config].get(side, {}).get(key)
        return value

    print(
        "\ntime: best full backward, every side interleaved in one process "
        "(x/ref: that side's time / the reference's)"
    )
    print(_header("time"))
    for row in rows:
        c = row.config
        times = [get(c, side, "time") for side in _SIDES]
        cells = [_time(t) for t in times] + [_ratio(t, times[0]) for t in times[1:]]
        print(_line("time", [c.label(), *cells]))
    print(
        "\nmemory: growth of peak RSS during the first full backward, each side in its own "
        "process (x/ag: that peak / autograd's)"
    )
    print(_header("memory"))
    for row in rows:
        c = row.config
        peaks = {side: get(c, side, "rss_delta") for side in _SIDES}
        cells = [_mib(peaks[side]) for side in _SIDES]
        cells += [_ratio(peaks[side], peaks["torch"], "") for side in _SIDES if side != "torch"]
        print(_line("memory", [c.label(), *cells, _mib(get(c, "numpy", "traced_peak"))]))
    print("\nflop floor: each side's share of it, its flops / matmul peak / its time")
    print(_header("floor"))
    for row in rows:
        c = row.config
        ours, peak = get(c, "numpy", "time"), get(c, "numpy", "matmul_gflops")
        if ours is None or peak is None:
            continue
        shares = []
        for side in _SIDES:
            seconds = get(c, side, "time")
            floor = side_flops(side, c) / (peak * 1e9)
            shares.append("n/a" if seconds is None else f"{floor / seconds:.2f}")
        compiles = [get(c, side, "compile") for side in _JAX_SIDES]
        cores = [x for side in _SIDES if (x := get(c, side, "cores")) is not None]
        cells = [
            f"{peak:.1f}",
            f"{c.flops() / ours / 1e9:.2f}",
            f"{c.chunked_flops() / ours / 1e9:.2f}",
            *shares,
            *(_time(seconds) for seconds in compiles),
            f"{max(cores):.2f}",
        ]
        print(_line("floor", [c.label(), *cells]))
    print()
    print(
        "autograd and chunked: forward + backward under torch autograd; jax scan and jax chunk: "
        "jax.vjp of the forward under jax.jit; reference: backward().\n"
        "ref traced: tracemalloc peak of the reference backward.\n"
        "matmul: single-thread np.matmul of 512x512 in the row's dtype, best of 30, in the "
        "timing process. GFLOP/s: recurrence-equivalent rate of the reference, "
        "22*B*S*H*N^2 / time; chunk GF/s: in its chunked algorithm's own matrix-product flops.\n"
        "floor shares: ag, js: 22*N^2 flops a step and head; ref, ch, jc: "
        "22*N^2 + 26*L*N + 16/3*L^2 (L: the chunk length, 64 for ch and jc); compile: "
        "jax.jit(...).lower(...).compile(), apart from the times; cpu/wall: the timing process's "
        "CPU time over wall time in the best run, the largest over the sides (at most 1 on one "
        "core; below 1, the process waited for a core).\n"
        "chunked: transformers' torch_chunk_gated_delta_rule (chunk 64, pads S itself); in "
        "float64 a copy of its source with its float32 cast retargeted to float64."
    )
    for note in notes:
        print(note)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small configuration")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument(
        "--sampled",
        action="store_true",
        help="only how far the floors' sampled step-by-step figures fall below the whole run's",
    )
    args = parser.parse_args()
    if args.worker:
        side, raw = args.worker
        print(json.dumps(worker(side, json.loads(raw))))
        return 0
    if args.sampled:
        shapes = [(1, 512, 16, 64)] if args.quick else [(1, 512, 16, 64), (1, 4096, 16, 128)]
        sampled_margin(shapes)
        return 0

    try:
        import torch
    except ImportError:
        print(
            "bench_reference: skipped: PyTorch is not installed; it is the baseline. "
            "Install the benchmark extra: pip install 'gdn-layout[bench]'"
        )
        return 0

    per_head_only = "per-head gate only"
    per_channel_skip = {"peer": per_head_only, "jax chunk": per_head_only}
    if args.quick:
        rows = [
            Row(Config(1, 64, 2, 16, dtype, False, True, 3), {}) for dtype in ("float32", "float64")
        ]
    else:
        rows = [
            Row(Config(1, 512, 8, 64, dtype, False, True, 5), {})
            for dtype in ("float32", "float64")
        ]
        rows += [
            Row(Config(1, 512, 8, 64, dtype, True, True, 5), dict(per_channel_skip))
            for dtype in ("float32", "float64")
        ]
        rows += [
            Row(Config(1, 4096, 8, 64, dtype, False, True, 3), {}, autograd_repeats=1)
            for dtype in ("float32", "float64")
        ]
        # Both keep every step's states for their backward: some 25 GiB here.
        rows.append(
            Row(
                Config(1, 8192, 16, 128, "float32", False, True, 2),
                {"torch": "", "jax scan": ""},
                timeout=400,
            )
        )
    missing = peer_available()
    no_jax = jax_available()
    for row in rows:
        if missing is not None:
            row.skip.setdefault("peer", missing)
        if no_jax is not None:
            for side in _JAX_SIDES:
                row.skip.setdefault(side, no_jax)

    versions = f"torch {torch.__version__}, numpy {np.__version__}"
    if missing is None:
        transformers = importlib.import_module("transformers")
        versions += f", transformers {transformers.__version__}"
    else:
        versions += f"; chunked peer n/a: {missing}"
    versions += f"; JAX n/a: {no_jax}" if no_jax else f", jax {load_jax().__version__}"
    print(f"{versions}; one thread per side")
    preflight(rows[0].config, with_peer=missing is None, with_jax=no_jax is None)
    measured: dict[Config, dict[str, dict[str, Any]]] = {}
    notes: list[str] = []
    for row in rows:
        print(f"measuring {row.config.label()}", file=sys.stderr, flush=True)
        measured[row.config] = measure_row(row, notes)
        for side, reason in row.skip.items():
            if not reason:
                reason = extrapolate(side, row, measured)
            elif reason == per_head_only:
                continue
            notes.append(f"{row.config.label()}: {_SIDE_NAMES[side]} {reason}")
    print_tables(rows, measured, notes)
    fixture_and_workers(args.quick)
    return 0


def fixture_and_workers(quick: bool) -> None:
    """The fixture / truth and workers sections (see the module docstring)."""
    print("\nfixture / truth: make_fixture (float32, carried state) over the float64 backward")
    shapes = [(1, 512, 4, 32)] if quick else [(1, 4096, 16, 128), (1, 8192, 16, 128)]
    for batch, seq, heads, size in shapes:
        config = Config(batch, seq, heads, size, "float32", False, True, 1)
        times = measure("fixture", config)
        truth = min(times["truth"], times["truth again"])
        named = ("forward", "step by step", "chunked", "chunked-tf32", "floors")
        parts = ", ".join(f"{name} {times[name]:.2f}s" for name in named)
        # The fixture before the panel: no floors, plus the step-by-step run and its floors.
        before = times["no floors"] + times["step by step"] + times["floors"]
        every = times["every class"]
        print(
            f"B={batch} S={seq} H={heads} N={size}: fixture {times['fixture']:.2f}s, truth "
            f"{truth:.2f}s, ratio {times['fixture'] / truth:.2f} ({parts}); the step-by-step "
            f"floors alone {before:.2f}s, ratio {before / truth:.2f}; every class "
            f"{every:.2f}s, ratio {every / truth:.2f}"
        )
    print("\nworkers: the float64 backward, one BLAS thread per worker")
    config = Config(1, 512 if quick else 4096, 4 if quick else 16, 64, "float64", False, True, 3)
    result = measure("scaling", config)
    one, two = result["time"]["1"], result["time"]["2"]
    flops = config.chunked_flops()
    peak, scaling = result["matmul_gflops"], result["scaling"]
    chunk = "x".join(map(str, result["chunk"]))
    print(
        f"{config.label()}: workers=1 {one:.3f}s, workers=2 {two:.3f}s, scaling {one / two:.2f}x; "
        f"chunk GF/s {flops / one / 1e9:.1f} and {flops / two / 1e9:.1f} against np.matmul "
        f"{peak:.1f} in one thread; traced peak {_mib(result['traced']['1'])} and "
        f"{_mib(result['traced']['2'])}"
    )
    print(
        f"two threads over one, the same work each: np.matmul 512x512 {scaling['matmul']:.2f}x "
        "(what the machine had to give); a worker's calls on one chunk, np.matmul "
        f"[{chunk}] @ [{chunk}]^T {scaling['chunk matmul']:.2f}x, np.multiply(out=) "
        f"[{chunk}] {scaling['chunk multiply']:.2f}x, the same in two processes "
        f"{scaling['chunk multiply, processes']:.2f}x"
    )
    print(
        f"a worker's share, a backward of {result['chunk'][0]} heads, run whole in each: two "
        f"threads {scaling['half backward']:.2f}x, two processes "
        f"{scaling['half backward, processes']:.2f}x (threads share the GIL, held between "
        "NumPy's calls and through its calls on small arrays)"
    )


if __name__ == "__main__":
    sys.exit(main())
