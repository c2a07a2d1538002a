"""What a layout asks of the machine: whether its arrays can exist, the memory its fixture
needs and whether that is available (docs/memory.md)."""

from __future__ import annotations

import os
from typing import Final

import numpy as np
from numpy.typing import DTypeLike

from ._checks import array_can_exist, integer, not_a_layout
from ._floors import PANEL, precisions_of
from .layout import GdnBackwardLayout, layout_caption
from .reference._chunked import chunk_length
from .reference._fused import FUSED_CHUNK, KEEP_BYTES
from .reference._threads import resolve_workers

__all__ = [
    "available_memory",
    "fixture_memory",
    "human_bytes",
    "impossible_arrays",
    "memory_refusal",
]

#: What a first run imports and sets up.
_FIRST_RUN: Final = 4 << 20


def fixture_memory(
    layout: GdnBackwardLayout,
    *,
    dtype: DTypeLike = np.float32,
    states: int | None = None,
    precisions: tuple[str, ...] | str | None = None,
    workers: int | None = 1,
) -> int:
    """The peak memory, in bytes, of :func:`~gdn_layout.make_fixture` of ``layout`` with these
    arguments and saving the result, within 2x: the arrays the largest phase holds
    (docs/memory.md).

    >>> layout = GdnBackwardLayout(1, 4096, 4, 64)
    >>> fixture_memory(layout, states=1) > fixture_memory(layout) > layout.nbytes(np.float64)
    True
    """
    from .files._fixture import resolve_dtype  # files imports this module

    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "fixture_memory")
    if states is not None:
        states = integer(states, "fixture_memory: states", least=1, or_none=True)
    resolved = resolve_dtype(dtype, "fixture_memory")
    stored = resolved.itemsize
    forms = {form for c in precisions_of(resolved, precisions) for form, _ in PANEL[c]}
    threads = resolve_workers(workers, "fixture_memory")
    b, s, h, n = layout.batch, layout.seq, layout.heads, layout.state_size
    state, qkv = b * h * n * n, layout.qkv_elems
    inputs = 4 * qkv + layout.gate_elems + layout.beta_elems + layout.state_elems
    kept = 2 * -(-s // states) * state if states else 0  # h and dh
    final = state if layout.carry_state or states else 0
    results = layout.total_elems + qkv + kept + final  # the gradients, y and the states
    if b * h * n == 0:  # nothing runs: the inputs are drawn, copied and stored, results zero
        return _FIRST_RUN + inputs * stored + (inputs + results) * 10
    # The reference keeps a state at each chunk boundary (per channel, each step of a stack)
    # and a per-head gate's pairwise decays in a chunk; the fused runs a state at each
    # boundary of their 64-step chunks and of ``states``, and per channel [B, H, C, C, N].
    length = chunk_length(n)
    ref_chunks = -(-s // length) + 3 * min(s, length) * layout.gate_per_channel
    pairs = 0 if layout.gate_per_channel else b * h * s * length
    truth = (inputs + results + ref_chunks * state + pairs) * 8
    chunks = -(-s // FUSED_CHUNK) + (-(-s // states) if states else 0)
    products = 5 * b * h * FUSED_CHUNK**2 * n * layout.gate_per_channel
    run = (inputs + results + 2 * chunks * state + products) * 4
    # and the forward's chunks kept for the backward, up to KEEP_BYTES
    per_step = 6 * FUSED_CHUNK + 6 * n + FUSED_CHUNK * n * layout.gate_per_channel
    run += min(KEEP_BYTES, b * h * s * per_step * 4)
    runs = run * len(forms) if threads > 1 else run + results * 4  # beside the last's results
    return _FIRST_RUN + inputs * stored + max(truth, results * 8 + runs)


def available_memory() -> tuple[int, str] | None:
    """The memory available, in bytes, and where the figure comes from: what this process's
    cgroup (v2) leaves under its ``memory.max`` when below the machine's ``MemAvailable``
    (``/proc/meminfo``); None when the system says neither."""
    machine = _machine_memory()
    limit = _cgroup_room()
    if limit is not None and (machine is None or limit < machine[0]):
        return limit, "memory.max of this process's cgroup"
    return machine


def _cgroup_room() -> int | None:
    """``memory.max - memory.current`` of this process's own cgroup (v2); None without one."""
    try:
        with open("/proc/self/cgroup") as listing:
            path = next(line[3:].strip() for line in listing if line.startswith("0::"))
        folder = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as limit:
            text = limit.read().strip()
        if text == "max":
            return None
        with open(os.path.join(folder, "memory.current")) as current:
            return max(0, int(text) - int(current.read()))
    except (OSError, ValueError, StopIteration):
        return None


def _machine_memory() -> tuple[int, str] | None:
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_refusal(
    layout: GdnBackwardLayout, needed: int, *, states: int | None = None
) -> str | None:
    """Why a run of ``layout`` that needs ``needed`` bytes cannot fit in the memory available,
    naming both figures; None when it can, or when the system does not say."""
    available = available_memory()
    if available is None or needed <= available[0]:
        return None
    what, advice = layout_caption(layout), "smaller dimensions"
    if states:
        what += ", its states kept every " + ("step" if states == 1 else f"{states} steps")
        advice += " or longer chunks of states"
    return (
        f"{what} needs about {human_bytes(needed)} of memory, but "
        f"{human_bytes(available[0])} is available ({available[1]}); choose {advice}"
    )


def impossible_arrays(layout: GdnBackwardLayout) -> str | None:
    """Why no array can have the shape of one of the gradients of ``layout`` (float64), or
    None (NumPy refuses one whose non-zero dimensions span more bytes than it can address)."""
    for segment in layout.segments():
        if not array_can_exist(segment.shape, 8):
            return (
                f"{layout!r}: {segment.name} would have shape {segment.shape}, which no array "
                "can have (its non-zero dimensions span more bytes than memory can address)"
            )
    return None


def human_bytes(nbytes: int) -> str:
    """``nbytes`` in B, KiB, ..., PiB, e.g. ``"1.5 MiB"``.

    >>> human_bytes(1000), human_bytes(3 << 19)
    ('1000 B', '1.5 MiB')
    """
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"
