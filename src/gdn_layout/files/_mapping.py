"""Files read while other programs may change them: small ones read whole, large ones
memory-mapped and stamped; docs/files.md, *Memory mapping*."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Final, NamedTuple

import numpy as np
from numpy.typing import NDArray

from ._safetensors import FixtureError, reason

#: Files smaller than this (64 MiB) are read into memory by :func:`load_fixture` even with
#: ``mmap=True``; larger ones are memory-mapped.
MAP_THRESHOLD: Final = 64 * 2**20


class FileStamp(NamedTuple):
    """A file's absolute path (``where``), size, modification time, inode and device."""

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
        """FixtureError naming ``path`` if the file is not the one stamped (``now``, or as
        :func:`os.stat` finds it)."""
        try:
            now = now or FileStamp.of(path, os.stat(self.where))
        except OSError as err:
            now = None
            what = f"it cannot be reached now ({reason(err)})"
        else:
            what = (
                f"{self.size} bytes then, {now.size} now"
                if now.size != self.size
                else "rewritten or replaced: a new modification time or inode"
            )
        if now is None or now[1:] != self[1:]:
            raise FixtureError(
                f"{path}: changed {when} ({what}): its memory-mapped tensors are not what "
                "was loaded; load it again"
            )


@contextlib.contextmanager
def held(stamp: FileStamp | None, path: Path) -> Iterator[None]:
    """The file ``stamp`` describes checked before and after the block (nothing for None)."""
    if stamp is not None:
        stamp.check(path)
    yield
    if stamp is not None:
        stamp.check(path, when="while it was judged")


def map_file(
    file: BinaryIO, status: os.stat_result, path: Path
) -> tuple[NDArray[np.uint8], FileStamp]:
    """The open ``file`` mapped read-only, and the stamp of ``status``, checked once mapped."""
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
    """All ``size`` bytes of the open ``file`` as a read-only array; FixtureError if it
    turns out shorter or longer."""
    file.seek(0)
    data = file.read(size + 1)
    if len(data) != size:
        raise FixtureError(
            f"{path}: changed size while being read ({size} bytes, then {len(data)})"
        )
    return np.frombuffer(data, np.uint8)


def check_digest(digest: str, expected: str, path: Path, said: str) -> None:
    """FixtureError naming ``path`` if ``digest`` is not ``expected`` (what ``said`` says)."""
    if digest != expected:
        raise FixtureError(f"{path}: SHA-256 {digest}, {said} {expected}")
