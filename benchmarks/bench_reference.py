"""Benchmark the reference backward against PyTorch autograd of the same recurrence.

The baseline is what people use as an oracle today: the gated delta-net recurrence written step
by step in PyTorch (as flash-linear-attention's ``naive_recurrent_gated_delta_rule``, with
matrix products for the contractions) and differentiated by autograd. Both sides compute the
gradients of ``sum(y * dy)``: PyTorch runs the forward (building the graph) and
``loss.backward()``; the reference runs :func:`gdn_layout.reference.backward`, which itself
runs the forward sweep it needs. So both timings cover a full backward from the inputs.

Every configuration runs each side in a fresh subprocess with ``OPENBLAS_NUM_THREADS``,
``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to 1 (and ``torch.set_num_threads(1)``). A
subprocess builds its inputs with the same NumPy generator and seed (already converted to the
benchmark dtype; PyTorch gets them through ``torch.from_numpy``), warms up on a tiny problem,
then records:

* peak memory: the growth of the process's peak resident set size (``VmHWM``, the kernel's
  RSS high-water mark, reset through ``/proc/self/clear_refs`` just before) during
  the first full backward over the resident size just before it (inputs and warm-up already
  resident), i.e. the extra memory that backward needed at its peak, its outputs included.
  The same measure on both sides; it counts pages actually touched, so memory that the
  allocator kept from the warm-up and reused is not counted. For NumPy,
  ``tracemalloc``'s peak of traced allocations during a separate call is printed alongside;
  PyTorch's CPU allocator keeps no peak statistics, so it has no such second figure.
* time: the best of several full backwards (wall clock).

Before measuring, a pre-flight check asserts that the PyTorch baseline and the reference give
the same gradients (all four gate/state modes on a small problem, and the first benchmark
configuration in float64).

Run: ``python benchmarks/bench_reference.py`` (needs the ``bench`` extra, i.e. PyTorch; without
it the benchmark prints why it is skipped and exits successfully). ``--quick`` runs a small
configuration only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.reference import backward

Array = NDArray[Any]
_NAMES = ("q", "k", "v", "g", "beta")
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


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
# The two sides
# --------------------------------------------------------------------------------------------


def numpy_side(inputs: dict[str, Array]) -> Array:
    """The reference backward: the packed gradient, in the inputs' dtype."""
    q, k, v, g, beta = (inputs[name] for name in _NAMES)
    return backward(q, k, v, g, beta, inputs["dy"], inputs.get("state"), dtype=q.dtype)


def torch_side(tensors: dict[str, Any]) -> dict[str, Any]:
    """Forward in PyTorch, step by step, then autograd; returns ``{name: gradient}``."""
    import torch

    leaves = {
        name: tensor.detach().requires_grad_(True)
        for name, tensor in tensors.items()
        if name != "dy"
    }
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


def _torch_tensors(inputs: dict[str, Array]) -> dict[str, Any]:
    import torch

    return {name: torch.from_numpy(value.copy()) for name, value in inputs.items()}


# --------------------------------------------------------------------------------------------
# Pre-flight: the baseline computes the same gradients
# --------------------------------------------------------------------------------------------


def preflight(first: Config) -> None:
    checks = [
        Config(2, 37, 3, 8, "float64", per_channel, carry, 1)
        for per_channel in (False, True)
        for carry in (False, True)
    ]
    checks.append(first._replace(dtype="float64"))
    for config in checks:
        inputs = make_inputs(config, seed=1)
        flat = numpy_side(inputs)
        layout = GdnBackwardLayout.from_inputs(inputs["q"], inputs["g"], inputs.get("state"))
        ours = unpack(flat, layout)
        theirs = torch_side(_torch_tensors(inputs))
        for name, grad in theirs.items():
            mine = getattr(ours, "d" + name)
            expected = grad.numpy()
            scale = float(np.max(np.abs(expected)))
            error = float(np.max(np.abs(mine - expected)))
            assert error <= 1e-9 * scale, (
                f"pre-flight: d{name} differs from PyTorch autograd by {error:.3g} "
                f"(scale {scale:.3g}) for {config.label()}"
            )
        print(f"pre-flight ok: autograd == reference for {config.label()}")


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


def worker(side: str, config: Config) -> dict[str, Any]:
    inputs = make_inputs(config)
    tiny = make_inputs(config._replace(seq=4))
    if side == "torch":
        import torch

        torch.set_num_threads(1)
        tensors, tiny_tensors = _torch_tensors(inputs), _torch_tensors(tiny)
        del inputs

        def run() -> object:
            return torch_side(tensors)

        torch_side(tiny_tensors)
    else:

        def run() -> object:
            return numpy_side(inputs)

        numpy_side(tiny)

    before = _reset_peak_rss()
    start = time.perf_counter()
    result = run()
    times = [time.perf_counter() - start]
    rss_delta = _peak_rss_bytes() - before
    del result
    traced = None
    if side == "numpy":
        tracemalloc.start()
        run()
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    for _ in range(config.repeats - 1):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return {"time": min(times), "rss_delta": rss_delta, "traced_peak": traced}


def measure(side: str, config: Config) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(dict.fromkeys(_THREAD_VARS, "1"))
    command = [sys.executable, __file__, "--worker", side, json.dumps(config._asdict())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{side} worker failed for {config.label()}:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _mib(n: float) -> str:
    return f"{n / 2**20:8.1f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small configuration")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        side, raw = args.worker
        print(json.dumps(worker(side, Config(**json.loads(raw)))))
        return 0

    try:
        import torch
    except ImportError:
        print(
            "bench_reference: skipped: PyTorch is not installed; it is the baseline. "
            "Install the benchmark extra: pip install 'gdn-layout[bench]'"
        )
        return 0

    if args.quick:
        configs = [Config(1, 64, 2, 16, dtype, False, True, 3) for dtype in ("float32", "float64")]
    else:
        configs = [
            Config(1, 512, 8, 64, dtype, per_channel, True, 5)
            for per_channel in (False, True)
            for dtype in ("float32", "float64")
        ]
        configs += [
            Config(1, 4096, 8, 64, dtype, False, True, 1) for dtype in ("float32", "float64")
        ]

    print(f"torch {torch.__version__}, numpy {np.__version__}, one thread per side")
    preflight(configs[0])
    print()
    header = (
        f"{'configuration':<46} {'autograd':>9} {'reference':>9} {'speed-up':>9}   "
        f"{'autograd peak':>13} {'reference peak':>14} {'ratio':>6}   {'ref traced':>12}"
    )
    print(header)
    print("-" * len(header))
    for config in configs:
        theirs = measure("torch", config)
        ours = measure("numpy", config)
        speedup = theirs["time"] / ours["time"]
        memory = ours["rss_delta"] / theirs["rss_delta"] if theirs["rss_delta"] else float("nan")
        print(
            f"{config.label():<46} {theirs['time']:8.3f}s {ours['time']:8.3f}s "
            f"{speedup:8.1f}x   {_mib(theirs['rss_delta']):>13} {_mib(ours['rss_delta']):>14} "
            f"{memory:6.3f}   {_mib(ours['traced_peak']):>12}",
            flush=True,
        )
    print()
    print(
        "time: best full backward (autograd: forward + backward; reference: backward()). "
        "peak: growth of peak RSS during the first full backward; ratio = reference/autograd. "
        "ref traced: tracemalloc peak of the reference backward."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
