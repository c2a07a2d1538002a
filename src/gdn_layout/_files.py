"""Atomic file writing: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["atomic_write"]


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
