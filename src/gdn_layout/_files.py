"""Files: atomic writing (a reader sees the old file or the new one, never half of one), and
opening for reading only what is a regular file."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, BinaryIO

__all__ = ["NotRegularFileError", "atomic_write", "open_regular"]


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], *, overwrite: bool) -> Path:
    """Call ``write`` on a temporary file next to ``path``, flush it to disk, then rename it
    to ``path``; return ``path``.

    Parameters
    ----------
    path
        The file to create (or replace, with ``overwrite``).
    write
        Writes the whole content to the binary file it is given.
    overwrite
        Replace an existing ``path``; without it an existing file is never replaced, not
        even one that appears while ``write`` runs.

    Raises
    ------
    FileExistsError
        ``path`` exists and ``overwrite`` is false.
    FileNotFoundError
        The folder of ``path`` does not exist.
    """
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: the folder {path.parent} does not exist")
    tmp = _create_temp(path)
    try:
        with open(tmp, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _create_temp(path: Path) -> Path:
    # A hidden name in the same folder, so that the rename stays on one filesystem; created
    # with O_EXCL and mode 0o666 so that the final file gets the usual umask permissions.
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666
            )
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"could not create a temporary file next to {path}")  # pragma: no cover


def _link_new(tmp: Path, path: Path) -> None:
    # A hard link fails if path appeared meanwhile, so an existing file is never replaced.
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it") from None
    except OSError:  # pragma: no cover - filesystems without hard links
        if path.exists():
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it") from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


# -- reading --------------------------------------------------------------------------------------


class NotRegularFileError(OSError):
    """A path that names a folder, a FIFO, a device or a socket where a file is expected."""


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for binary reading, refusing anything that is not a regular file.

    The kind is checked before the file is opened, so that a FIFO or a device is never opened
    (opening a FIFO for reading waits for a writer); the file is then opened without blocking
    and checked again, in case the path was replaced in between.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    NotRegularFileError
        ``path`` is a folder, a FIFO, a device or a socket.
    OSError
        Any other failure to reach the file (a symlink loop, no permission, ...).
    """
    _require_regular(os.stat(path).st_mode, path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        _require_regular(os.fstat(fd).st_mode, path)
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    file.raw.name = os.fspath(path)  # type: ignore[attr-defined]  # as open(path) names it
    return file


def _require_regular(mode: int, path: Path) -> None:
    if stat.S_ISREG(mode):
        return
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    kind = next((name for test, name in kinds if test(mode)), "of another kind")
    raise NotRegularFileError(f"{path}: not a regular file: it is {kind}")
