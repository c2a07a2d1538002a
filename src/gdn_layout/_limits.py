"""What a layout asks of the machine: whether its arrays can exist, roughly how much memory a
run needs, and how much the machine has available."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from ._checks import array_can_exist
from .layout import GdnBackwardLayout, layout_caption

__all__ = [
    "address_space_memory",
    "available_memory",
    "cgroup_memory",
    "fixture_memory",
    "human_bytes",
    "impossible_arrays",
    "memory_refusal",
]

#: Bytes of peak memory per element, measured for ``make_fixture`` with the float64 reference
#: and ``save_fixture`` (peak RSS less the interpreter's, over layouts of 1.8 to 6.4 M packed
#: elements): per element of ``q`` (inputs, ``y`` and the gradient, each in float64 and in
#: the stored dtype, and the reference's work), per extra element of a per-channel gate, and
#: per element of ``[B, H, N, N]`` (the state and its gradient).
_PER_QKV: Final = 128
_PER_GATE: Final = 16
_PER_STATE: Final = 96
#: The interpreter, NumPy and this package.
_BASE: Final = 64 << 20


def fixture_memory(layout: GdnBackwardLayout) -> int:
    """The approximate peak memory, in bytes, of making and saving a fixture of ``layout``.

    An estimate within a factor of about 1.5 either way, for refusing up front a run that
    cannot fit; not a bound.

    >>> fixture_memory(GdnBackwardLayout(1, 4096, 4, 64)) // 2**20
    193
    """
    b, h, n = layout.batch, layout.heads, layout.state_size
    gate = layout.gate_elems if layout.gate_per_channel else 0
    return _BASE + _PER_QKV * layout.qkv_elems + _PER_GATE * gate + _PER_STATE * b * h * n * n


#: Where cgroup v2 is mounted, and where the kernel says which cgroup this process is in;
#: module attributes so that tests can point them at a tree of their own.
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def available_memory() -> tuple[int, str] | None:
    """The memory available to a new allocation, in bytes, and where the figure comes from;
    None when this system does not say.

    The least of: Linux's ``MemAvailable`` (free memory plus what the page cache would give
    back) when ``/proc/meminfo`` has it, else the free physical pages ``os.sysconf`` reports;
    the room left under the cgroup v2 memory limit of this process's cgroup or of any
    cgroup above it (:func:`cgroup_memory`); and the room left under the address-space limit
    ``RLIMIT_AS`` (:func:`address_space_memory`).
    """
    figures = [
        figure
        for figure in (_system_memory(), cgroup_memory(), address_space_memory())
        if figure is not None
    ]
    return min(figures, key=lambda figure: figure[0]) if figures else None


def _system_memory() -> tuple[int, str] | None:
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    fields = line.split()
                    unit = 1024 if fields[2:3] == [b"kB"] else 1
                    return int(fields[1]) * unit, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    if pages < 0 or size <= 0:
        return None
    return pages * size, "free physical memory"


def cgroup_memory(
    root: Path | None = None, proc_cgroup: Path | None = None
) -> tuple[int, str] | None:
    """The room under the tightest cgroup v2 memory limit of this process: ``memory.max``
    less ``memory.current`` of its cgroup (the ``0::/path`` line of ``/proc/self/cgroup``,
    under ``/sys/fs/cgroup``) or of a cgroup above it, whichever is least, with the
    ``memory.max`` file it comes from; None without cgroup v2 or without a limit (``max``).
    """
    root = CGROUP_ROOT if root is None else root
    proc_cgroup = PROC_CGROUP if proc_cgroup is None else proc_cgroup
    try:
        lines = proc_cgroup.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    paths = [line[3:] for line in lines if line.startswith("0::")]
    if not paths:
        return None  # cgroup v1 only, or none
    folder = root
    levels = [folder]
    for part in Path(paths[0]).parts[1:]:
        folder = folder / part
        levels.append(folder)
    found: tuple[int, str] | None = None
    for level in levels:
        try:
            limit = (level / "memory.max").read_text().strip()
            if limit == "max":
                continue
            room = max(0, int(limit) - int((level / "memory.current").read_text()))
        except (OSError, ValueError):
            continue
        if found is None or room < found[0]:
            found = room, f"{level / 'memory.max'} less memory.current"
    return found


def address_space_memory() -> tuple[int, str] | None:
    """The room under the soft ``RLIMIT_AS`` (``ulimit -v``): the limit less this process's
    virtual size (``VmSize`` in ``/proc/self/status``); None without a limit."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (AttributeError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    size = 0
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmSize:"):
                    size = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        return soft, "the RLIMIT_AS soft limit"
    return max(0, soft - size), "the RLIMIT_AS soft limit less this process's VmSize"


def memory_refusal(layout: GdnBackwardLayout, factor: float = 1.0) -> str | None:
    """Why a run of ``factor`` times :func:`fixture_memory` cannot fit in the memory
    available, naming both figures; None when it can, or when the system does not say."""
    needed = int(fixture_memory(layout) * factor)
    available = available_memory()
    if available is None or needed <= available[0]:
        return None
    return (
        f"{layout_caption(layout)} needs about {human_bytes(needed)} of memory, but "
        f"{human_bytes(available[0])} is available ({available[1]}); choose smaller dimensions"
    )


def impossible_arrays(layout: GdnBackwardLayout) -> str | None:
    """Why no array can have the shape of one of the gradients of ``layout`` (float64), or
    None: NumPy refuses a shape whose non-zero dimensions span more bytes than it can
    address, even when another dimension is 0."""
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
