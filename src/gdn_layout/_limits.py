"""What a layout asks of the machine: whether its arrays can exist, and whether the memory its
fixture needs (:func:`gdn_layout.generate.fixture_memory`) is available."""

from __future__ import annotations

import os

from ._checks import array_can_exist
from .layout import GdnBackwardLayout, layout_caption

__all__ = [
    "available_memory",
    "human_bytes",
    "impossible_arrays",
    "memory_refusal",
]


#: Where this process's cgroup (v2) is named, and where cgroups are mounted; module
#: attributes so that tests can point them at files of their own.
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def available_memory() -> tuple[int, str] | None:
    """The memory available to a new allocation, in bytes, and where the figure comes from:
    what this process's own cgroup (v2) leaves under its ``memory.max`` (a container's
    limit), when it has one below the machine's; else Linux's ``MemAvailable`` (free memory
    plus what the page cache would give back) when ``/proc/meminfo`` has it, else the free
    physical pages ``os.sysconf`` reports; None when this system says none of these."""
    machine = _machine_memory()
    limit = _cgroup_room()
    if limit is not None and (machine is None or limit < machine[0]):
        return limit, "memory.max of this process's cgroup"
    return machine


def _cgroup_room() -> int | None:
    """``memory.max - memory.current`` of this process's own cgroup (v2); None without one."""
    try:
        with open(PROC_CGROUP) as listing:
            path = next(line[3:].strip() for line in listing if line.startswith("0::"))
        folder = os.path.join(CGROUP_ROOT, path.lstrip("/"))
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


def memory_refusal(
    layout: GdnBackwardLayout, needed: int, *, states: int | None = None
) -> str | None:
    """Why a run of ``layout`` that needs ``needed`` bytes (its estimate,
    :func:`gdn_layout.generate.fixture_memory`, with ``states``) cannot fit in the memory
    available, naming both figures; None when it can, or when the system does not say."""
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
