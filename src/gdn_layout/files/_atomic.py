"""Files and folders written whole or not at all, and files read only when regular:
docs/files.md, *Saving* and *Suites: all or nothing*."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, BinaryIO, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: nothing is locked, nothing reclaimed
    fcntl = None  # type: ignore[assignment]

_T = TypeVar("_T")


class NotRegularFileError(OSError):
    """A path that names a folder, a FIFO, a device or a socket where a file is expected."""


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], *, overwrite: bool) -> Path:
    """Call ``write`` on a temporary file next to ``path``, fsync it and move it to ``path``.

    Raises
    ------
    FileExistsError
        ``path`` exists and ``overwrite`` is false (checked again as the file moves in).
    NotRegularFileError
        ``path`` is not a regular file (a folder, a FIFO, a device, a symbolic link).
    FileNotFoundError
        The folder of ``path`` does not exist.
    OSError
        Writing failed (a full disk, a read-only folder, ...); the error names ``path``.
    """
    if not overwrite and os.path.lexists(path):
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    old = _replaced(path) if overwrite else None
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path}: the folder {path.parent} does not exist")
    _remove_abandoned(path)
    tmp = _temporary(path)
    try:
        # A replacement is its owner's alone until it has the old file's mode.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        with os.fdopen(os.open(tmp, flags, 0o666 if old is None else 0o600), "wb") as out:
            _lock(out.fileno())
            write(out)
            out.flush()
            _keep_identity(out.fileno(), old)
            os.fsync(out.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                _link_new(tmp, path)
    except OSError as err:
        raise _naming(err, path, tmp) from None
    finally:
        with contextlib.suppress(OSError):  # a read-only folder's EROFS: the first error stands
            os.unlink(tmp)
    _fsync_dir(path.parent)
    return path


def _link_new(tmp: Path, path: Path) -> None:
    """Give ``tmp`` the name ``path``, which must not exist: a hard link fails if it does."""
    try:
        os.link(tmp, path)
    except OSError:
        if os.path.lexists(path):
            raise FileExistsError(f"{path} exists; pass overwrite=True to replace it") from None
        os.rename(tmp, path)  # pragma: no cover - a filesystem without hard links


def write_folder(
    target: Path,
    fill: Callable[[Path], _T],
    *,
    overwrite: bool,
    replaceable: Callable[[Path], str | None],
    own: Callable[[Path], Iterable[str] | None],
) -> _T:
    """Build a folder with ``fill`` (given a new empty folder next to ``target``), then rename
    it to ``target``; return what ``fill`` returned.

    With ``overwrite``, a ``target`` that ``replaceable`` does not object to (it returns why
    not, or None) is renamed aside first, then of it only the entries ``own`` names are
    removed (None: unfinished work, removed whole).

    Raises
    ------
    FileExistsError
        ``target`` is not a folder, is not empty (without ``overwrite``) or not replaceable.
    OSError
        ``target`` is a mount point, or ``fill`` or a rename failed: nothing of the new folder
        is left, and the error names ``target`` where it named the temporary folder.
    """
    if os.path.ismount(target):  # refused before the work (a bind mount: as it is renamed)
        raise _mount_point(target)
    _remove_abandoned(target, own)
    built = _temporary(target)
    try:
        os.mkdir(built)
        fd = os.open(built, os.O_RDONLY)
        try:
            _lock(fd)
            result = fill(built)
            _install(built, target, overwrite, replaceable, own)
        finally:
            os.close(fd)
    except BaseException as err:
        shutil.rmtree(built, ignore_errors=True)
        if isinstance(err, OSError) and err.errno == errno.EBUSY:
            raise _mount_point(target) from None
        if isinstance(err, OSError):
            raise _naming(err, target, built) from None
        raise
    _fsync_dir(target.parent)
    return result


def _mount_point(target: Path) -> OSError:
    return OSError(f"{target} is a mount point, which cannot be replaced; give a folder inside it")


def _install(
    built: Path,
    target: Path,
    overwrite: bool,
    replaceable: Callable[[Path], str | None],
    own: Callable[[Path], Iterable[str] | None],
) -> None:
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
    aside = _temporary(target)
    os.rename(target, aside)
    try:
        os.rename(built, target)
    except BaseException:
        with contextlib.suppress(OSError):  # another's suite came in meanwhile: it stays
            os.rename(aside, target)
        raise
    _remove_own(aside, own)


def _remove_own(folder: Path, own: Callable[[Path], Iterable[str] | None]) -> None:
    """Remove the regular files of ``folder`` that ``own`` names, the last (a manifest) only
    when nothing else is left, then the folder if empty; all of it when ``own`` gives None."""
    listed = own(folder)
    if listed is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    *names, last = [*listed] or [""]
    for name in names:
        _unlink_regular(folder / name)
    with contextlib.suppress(OSError):
        if last and os.listdir(folder) == [last]:  # what else is left keeps its manifest
            _unlink_regular(folder / last)
        os.rmdir(folder)


def _unlink_regular(path: Path) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)


def _prefix(target: Path) -> str:
    """``.NAME.``, a name over 64 bytes cut to 48 and a digest of the whole."""
    name = os.fsencode(target.name)
    if len(name) > 64:
        name = name[:48] + b"~" + hashlib.sha256(name).hexdigest()[:12].encode()
    return "." + os.fsdecode(name) + "."


def _temporary(target: Path) -> Path:
    return target.with_name(f"{_prefix(target)}{secrets.token_hex(8)}.gdn-tmp")


def _lock(fd: int) -> None:
    """Hold ``fd`` locked while this writer runs: its temporary is then never reclaimed."""
    if fcntl is not None:
        with contextlib.suppress(OSError):  # a filesystem without locks: never reclaimed
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _remove_abandoned(
    target: Path, own: Callable[[Path], Iterable[str] | None] | None = None
) -> None:
    """Remove this user's temporaries of earlier writes of ``target`` that no live writer
    holds locked (folders, given ``own``, as :func:`_remove_own` does)."""
    if fcntl is None:  # pragma: no cover
        return
    pattern = re.compile(re.escape(_prefix(target)) + "[0-9a-f]{16}" + re.escape(".gdn-tmp"))
    with contextlib.suppress(OSError), os.scandir(target.parent) as entries:
        found = [Path(e.path) for e in entries if pattern.fullmatch(e.name)]
    for path in found:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                status = os.fstat(fd)
                if status.st_uid != os.geteuid():
                    continue  # another user's: never this library's work
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its writer runs
                if stat.S_ISREG(status.st_mode):
                    os.unlink(path)
                elif stat.S_ISDIR(status.st_mode) and own is not None:
                    _remove_own(path, own)
            finally:
                os.close(fd)


def _naming(err: OSError, path: Path, temporary: Path) -> OSError:
    """``err`` naming ``path``, the user's, where it named nothing or ``temporary``."""
    name, where = os.fspath(temporary), err.filename
    where = os.fsdecode(where) if where is not None else ""
    if err.errno is None or where == os.fspath(path):
        return err
    if where.startswith(name) or not where:
        return type(err)(err.errno, err.strerror, os.fspath(path) + where[len(name) :])
    return err


def _replaced(path: Path) -> os.stat_result | None:
    """The status of the regular file a write may replace (None when there is none); never a
    link, a device or a FIFO (as root, ``/dev/null``)."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(status.st_mode):
        raise NotRegularFileError(
            f"{path}: not replaced: it is a symbolic link; give the path of the file it names"
        )
    _require_regular(status.st_mode, path, "not replaced: ")
    return status


def _keep_identity(fd: int, old: os.stat_result | None) -> None:
    """Give ``fd`` the permission bits, and where allowed the owner, of ``old``."""
    if old is None:
        return
    if hasattr(os, "fchown") and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
        with contextlib.suppress(PermissionError):  # an ordinary user cannot give files away
            os.fchown(fd, old.st_uid, old.st_gid)
    os.fchmod(fd, stat.S_IMODE(old.st_mode))  # after the owner, which clears setuid and setgid


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # e.g. Windows cannot open a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def open_regular(path: Path, *, dir_fd: int | None = None) -> BinaryIO:
    """Open ``path`` (in the open folder ``dir_fd`` when given) for binary reading; a
    :class:`NotRegularFileError` before opening it (a FIFO's open would wait) and after."""
    name = path.name if dir_fd is not None else path
    _require_regular(os.stat(name, dir_fd=dir_fd).st_mode, path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        _require_regular(os.fstat(fd).st_mode, path)
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    file.raw.name = os.fspath(path)  # type: ignore[attr-defined]  # as open(path) names it
    return file


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _require_regular(mode: int, path: Path, what: str = "") -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "of another kind")
        raise NotRegularFileError(f"{path}: {what}not a regular file: it is {kind}")
