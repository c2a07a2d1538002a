"""Files read while other processes may change them: small ones read into memory in one pass,
large ones memory-mapped and stamped (size, modification time, inode) so that a change is
found before their contents are judged, and after.

As with ``numpy.memmap`` and safetensors, a mapped file cut short in place by another program
can fault its reader (SIGBUS) at the next read of a page past the new end; this library's own
writers never truncate in place: they replace the file whole.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Final, NamedTuple, cast

import numpy as np
from numpy.typing import NDArray

from ._safetensors import FixtureError, reason

__all__ = [
    "MAP_THRESHOLD",
    "FileStamp",
    "buffered",
    "check_digest",
    "held",
    "map_file",
    "read_all",
]

#: Files smaller than this many bytes (64 MiB) are read into memory by :func:`load_fixture`
#: even with ``mmap=True``: nothing another process does to the file can then change or break
#: the loaded fixture, and it holds no file descriptor. Larger files are memory-mapped.
MAP_THRESHOLD: Final = 64 * 2**20


class FileStamp(NamedTuple):
    """What tells a file's contents apart without reading them: its absolute path (``where``),
    size, modification time, inode and device, as :func:`os.stat` gives them."""

    where: str
    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path, status: os.stat_result) -> FileStamp:
        """The stamp of the file at ``path`` whose status is ``status``."""
        where = os.path.abspath(path)
        return cls(where, status.st_size, status.st_mtime_ns, status.st_ino, status.st_dev)

    def check(
        self, path: Path, now: FileStamp | None = None, when: str = "since it was loaded"
    ) -> None:
        """Raise :class:`FixtureError` naming ``path`` if the file is no longer the one stamped
        (``now``, or what :func:`os.stat` says of it now): truncated, grown, rewritten,
        replaced or gone.

        A rewrite that keeps the size and falls within the filesystem's timestamp granularity
        (nanoseconds to a few milliseconds on Linux) of the stamped one is not seen.
        """
        if now is None:
            try:
                now = FileStamp.of(path, os.stat(self.where))
            except OSError as err:
                raise FixtureError(
                    f"{path}: changed {when}: it cannot be reached now ({reason(err)}); "
                    "load it again"
                ) from None
        if (now.inode, now.device) != (self.inode, self.device):
            what = f"replaced by another file: inode {self.inode} then, {now.inode} now"
        elif now.size != self.size:
            what = f"{self.size} bytes then, {now.size} now"
        elif now.mtime_ns != self.mtime_ns:
            what = f"rewritten: modified at {self.mtime_ns} ns then, {now.mtime_ns} now"
        else:
            return
        raise FixtureError(
            f"{path}: changed {when} ({what}): its memory-mapped tensors are not what was "
            "loaded; load it again"
        )


@contextlib.contextmanager
def held(stamp: FileStamp | None, path: Path) -> Iterator[None]:
    """Within the block, the file ``stamp`` describes is judged: :class:`FixtureError` naming
    ``path`` if it changed before the block, or after it. Nothing to do for ``stamp`` None
    (in memory)."""
    if stamp is not None:
        stamp.check(path)
    yield
    if stamp is not None:
        stamp.check(path, when="while it was judged")


def map_file(
    file: BinaryIO, status: os.stat_result, path: Path
) -> tuple[NDArray[np.uint8], FileStamp]:
    """The open ``file`` memory-mapped read-only, and the stamp of ``status``, its status
    when it was opened: :class:`FixtureError` if it has changed since."""
    stamp = FileStamp.of(path, status)
    try:
        buffer: NDArray[np.uint8] = (
            np.memmap(file, dtype=np.uint8, mode="r", shape=(status.st_size,))
            if status.st_size
            else np.empty(0, np.uint8)  # mmap cannot map an empty file
        )
    except ValueError as err:  # the file shrank since it was opened
        raise FixtureError(f"{path}: changed while being read: {err}") from None
    stamp.check(path, FileStamp.of(path, os.fstat(file.fileno())), "while being read")
    return buffer, stamp


def read_all(file: BinaryIO, size: int, path: Path) -> NDArray[np.uint8]:
    """All ``size`` bytes of the open ``file`` as a read-only array, read from its start;
    :class:`FixtureError` if the file turns out shorter or longer."""
    buffer = np.empty(size, np.uint8)
    view, stream = buffer.data, buffered(file)
    file.seek(0)
    done = 0
    while done < size:
        count = stream.readinto(view[done:])
        if not count:
            break
        done += count
    if done < size or file.read(1):
        now = f"{done} bytes" if done < size else "more"
        raise FixtureError(f"{path}: changed size while being read ({size} bytes, then {now})")
    buffer.flags.writeable = False
    return buffer


def buffered(file: BinaryIO) -> io.BufferedIOBase:
    """``file`` as what ``files._atomic.open_regular`` returns: with ``readinto``."""
    return cast(io.BufferedIOBase, file)


def check_digest(digest: str, expected: str, path: Path, said: str) -> None:
    """:class:`FixtureError` naming ``path`` if ``digest`` is not ``expected``, the value that
    ``said`` introduces ("the manifest says")."""
    if digest != expected:
        raise FixtureError(f"{path}: SHA-256 {digest}, {said} {expected}")
