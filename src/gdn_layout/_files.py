"""Files: atomic writing (a reader sees the old file or the new one, never half of one), and
opening for reading only what is a regular file."""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, BinaryIO, Final

__all__ = [
    "NotRegularFileError",
    "atomic_write",
    "install_folder",
    "open_regular",
    "remove_abandoned",
    "temporary_name",
]


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], *, overwrite: bool) -> Path:
    """Call ``write`` on a temporary file next to ``path``, flush it to disk, then move it to
    ``path``; return ``path``.

    Nothing is left behind, even when the process is killed: on Linux the temporary file has
    no name (``O_TMPFILE``) until it is linked in place. Elsewhere it has a name that carries
    the writer's process id (:func:`temporary_name`), and every write into the folder first
    removes the temporary files of writers that are no longer running.

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
    OSError
        Writing failed (a full disk, a read-only folder, ...); the error names ``path``.
    """
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: the folder {path.parent} does not exist")
    remove_abandoned(path.parent)
    try:
        fd = _open_unnamed(path.parent)
        if fd is None or not _write_unnamed(fd, path, write, overwrite):
            _write_named(path, write, overwrite)
    except OSError as err:
        raise _naming(err, path) from None
    _fsync_dir(path.parent)
    return path


def temporary_name(path: Path, suffix: str = "tmp") -> Path:
    """A hidden name next to ``path`` for a temporary file or folder of this process: it
    carries the process id, so that :func:`remove_abandoned` knows when it is abandoned."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}")


#: The names :func:`temporary_name` makes.
_TEMPORARY: Final = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.(tmp|old)")


def remove_abandoned(folder: Path) -> None:
    """Remove the temporary files and folders in ``folder`` whose writer is no longer running.

    Only names made by :func:`temporary_name` are considered, and only on systems that can
    tell whether a process runs (POSIX); anything that cannot be removed is left.
    """
    if os.name != "posix":  # pragma: no cover - no safe "is this process alive" elsewhere
        return
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = _TEMPORARY.fullmatch(entry.name)
        if match is None or _running(int(match["pid"])):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            pass


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, as someone else's
        return True
    return True


def _naming(err: OSError, path: Path) -> OSError:
    """``err`` as an error of the same kind that names ``path``, the file being written."""
    if err.errno is None or err.filename == os.fspath(path):  # our own message names it
        return err
    return OSError(err.errno, err.strerror, os.fspath(path))


def _open_unnamed(folder: Path) -> int | None:
    """A file without a name in ``folder`` (Linux ``O_TMPFILE``), or None when unavailable."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, flag | os.O_WRONLY, 0o666)
    except OSError as err:
        if err.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None  # the filesystem has no unnamed files
        raise


def _write_unnamed(
    fd: int, path: Path, write: Callable[[IO[bytes]], None], overwrite: bool
) -> bool:
    """Write into the unnamed file ``fd`` and link it in place; False if it cannot be linked."""
    with os.fdopen(fd, "wb") as out:
        write(out)
        out.flush()
        os.fsync(out.fileno())
        try:
            if not overwrite:
                try:  # fails if path appeared meanwhile: an existing file is never replaced
                    _link_fd(out.fileno(), path)
                except FileExistsError:
                    raise FileExistsError(
                        f"{path} exists; pass overwrite=True to replace it"
                    ) from None
                return True
            tmp = temporary_name(path)
            _link_fd(out.fileno(), tmp)
        except _CannotLink:  # pragma: no cover - a kernel or sandbox without linkat
            return False
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def _link_fd(fd: int, path: Path) -> None:
    # linkat(2) of /proc/self/fd/N with AT_SYMLINK_FOLLOW, as open(2) documents for O_TMPFILE.
    # Through a dir_fd, since without one os.link may call link(2), which links the symlink.
    try:
        proc = os.open("/proc/self/fd", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:  # pragma: no cover
        raise _CannotLink from err
    try:
        os.link(str(fd), path, src_dir_fd=proc, follow_symlinks=True)
    except OSError as err:
        if err.errno in (errno.EXDEV, errno.EPERM, errno.ENOENT, errno.EOPNOTSUPP):
            raise _CannotLink from err  # pragma: no cover
        raise
    finally:
        os.close(proc)


class _CannotLink(Exception):
    """An unnamed file could not be linked in: write a named temporary file instead."""


def _write_named(path: Path, write: Callable[[IO[bytes]], None], overwrite: bool) -> None:
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


def _create_temp(path: Path) -> Path:
    # A hidden name in the same folder, so that the rename stays on one filesystem; created
    # with O_EXCL and mode 0o666 so that the final file gets the usual umask permissions.
    for _ in range(100):
        tmp = temporary_name(path)
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666
            )
        except FileExistsError:  # pragma: no cover - 32 random bits taken
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


# -- folders ------------------------------------------------------------------------------------


def install_folder(
    built: Path,
    target: Path,
    *,
    overwrite: bool,
    replaceable: Callable[[Path], str | None],
) -> None:
    """Move the complete folder ``built`` to ``target`` (its sibling) by renaming it.

    A missing or empty ``target`` is taken at once. Otherwise, with ``overwrite``, a
    ``target`` for which ``replaceable`` says nothing (it returns why not, or None) is renamed
    away, ``built`` is renamed in, and the old folder is removed: a reader sees the old folder
    or the new one, never a mixture. When several writers race, each rename is atomic and the
    last one wins; every one of them ends with a complete folder at ``target``.

    Raises
    ------
    FileExistsError
        ``target`` exists and is not empty (without ``overwrite``), is not a folder, or is not
        ``replaceable``.
    """
    for _ in range(100):
        try:
            os.rename(built, target)  # takes the place of a missing or empty folder only
            return
        except OSError as err:
            if err.errno == errno.ENOTDIR:
                raise FileExistsError(f"{target} exists and is not a folder") from None
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if not overwrite:
            raise FileExistsError(
                f"{target} exists and is not empty; pass overwrite=True to replace it"
            )
        why = replaceable(target)
        if why is not None:
            raise FileExistsError(f"{target} is not replaced: {why}")
        old = temporary_name(target, "old")
        try:
            os.rename(target, old)
        except FileNotFoundError:  # another writer moved it first: try again
            continue
        shutil.rmtree(old, ignore_errors=True)
    raise FileExistsError(f"{target}: other writers kept replacing it")  # pragma: no cover


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
