"""Files and folders written whole or not at all, and files opened for reading only when they
are regular files: docs/files.md, *Saving* and *Suites: all or nothing*."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, BinaryIO, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: nothing is locked, nothing reclaimed
    fcntl = None  # type: ignore[assignment]

_T = TypeVar("_T")
_DIRECTORY = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECTORY", 0)


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
    except OSError as err:
        if isinstance(err, FileExistsError) or os.path.lexists(path):
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
    """Build a folder with ``fill`` (given a new empty folder next to ``target``), then put it
    at ``target``; return what ``fill`` returned.

    With ``overwrite``, a ``target`` that ``replaceable`` does not object to (it returns why
    not, or None) is exchanged with the new folder, checked again, and of it only the entries
    ``own`` names are removed (None: unfinished work, removed whole).

    Raises
    ------
    FileExistsError
        ``target`` is not a folder, is not empty (without ``overwrite``) or not replaceable.
    OSError
        ``fill`` or a move failed: nothing of the new folder is left, and the error names
        ``target`` where it named the temporary folder.
    """
    if os.path.ismount(target):  # refused before the work, not after it
        raise _mount_point(target)
    _remove_abandoned(target, own, replaceable if overwrite else None)
    built = _temporary(target)
    fd = None
    try:
        os.mkdir(built)
        fd = os.open(built, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        _lock(fd)
        try:
            result = fill(built)
            mode = _status(target)
            with _locked_folder(target):  # the old folder, moved aside, is not another's
                old = _install(built, target, overwrite=overwrite, replaceable=replaceable)
                _keep_identity(fd, mode)  # once in place: a read-only mode would bar moves
                if old is not None:
                    _remove_own(old, own)
        except BaseException:
            if _same(fd, built):
                shutil.rmtree(built, ignore_errors=True)
            else:  # stopped the instant after the exchange: the old folder lies there
                _remove_own(built, own)
            raise
    except OSError as err:
        if fd is None:
            with contextlib.suppress(OSError):
                os.rmdir(built)
        raise _naming(err, target, built) from None
    finally:
        if fd is not None:
            os.close(fd)
    _fsync_dir(target.parent)
    return result


@contextlib.contextmanager
def _locked_folder(path: Path) -> Iterator[None]:
    """The folder at ``path`` (if any) locked as a temporary is, so that once moved aside it
    is this writer's to remove, not another's to reclaim."""
    try:
        fd = os.open(path, _DIRECTORY)
    except OSError:  # missing, or not a folder: _install says what
        yield
        return
    try:
        if fcntl is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits for another writer replacing it
        yield
    finally:
        os.close(fd)


def _install(
    built: Path, target: Path, *, overwrite: bool, replaceable: Callable[[Path], str | None]
) -> Path | None:
    """Move ``built`` to ``target``; the name of the folder it replaced, if any."""
    try:
        os.rename(built, target)  # takes the place of a missing or empty folder only
        return None
    except OSError as err:
        if err.errno == errno.ENOTDIR:
            raise FileExistsError(f"{target} exists and is not a folder") from None
        if err.errno == errno.EBUSY:
            raise _mount_point(target) from None
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    if not overwrite:
        raise FileExistsError(
            f"{target} exists and is not empty; pass overwrite=True to replace it"
        )
    _require_replaceable(target, replaceable)
    try:
        if exchanged := _exchange(built, target):
            old = built  # what was at target is now at built's name
        else:
            old = _temporary(target)
            os.rename(target, old)
    except OSError as err:
        if err.errno == errno.EBUSY:
            raise _mount_point(target) from None
        raise
    try:
        _require_replaceable(old, replaceable, target)  # what arrived since the check
        if not exchanged:
            os.rename(built, target)
    except BaseException:
        if exchanged:
            _exchange(built, target)
        else:
            os.rename(old, target)
        raise
    return old


def _mount_point(target: Path) -> OSError:
    return OSError(f"{target} is a mount point, which cannot be replaced; give a folder inside it")


def _require_replaceable(
    folder: Path, replaceable: Callable[[Path], str | None], target: Path | None = None
) -> None:
    why = replaceable(folder)
    if why is not None:
        raise FileExistsError(f"{target or folder} is not replaced: {why}")


def _remove_own(folder: Path, own: Callable[[Path], Iterable[str] | None]) -> None:
    """Remove the regular files of ``folder`` that ``own`` names, through the open folder (a
    link planted in its place leads nowhere else), then it if empty; all of it when ``own``
    names nothing. The last name (a manifest) goes only when nothing else is left, so that a
    folder keeping something of someone else's still says what in it was its own."""
    try:
        fd = os.open(folder, _DIRECTORY)
    except OSError:
        return
    try:
        status = os.fstat(fd)
        if status.st_uid == os.geteuid() and not status.st_mode & stat.S_IWUSR:
            os.fchmod(fd, stat.S_IMODE(status.st_mode) | stat.S_IRWXU)  # a read-only suite
        listed = own(folder)
        if listed is None:
            shutil.rmtree(folder, ignore_errors=True)
            return
        *names, last = [*listed] or [""]
        for name in names:
            _unlink_regular(name, fd)
        if last and os.listdir(fd) == [last]:
            _unlink_regular(last, fd)
    except OSError:
        pass
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _unlink_regular(name: str, folder: int) -> None:
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=folder)


def _same(fd: int, path: Path) -> bool:
    """Whether ``path`` names the file or folder open as ``fd``."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _prefix(target: Path) -> str:
    """The start of a temporary's name of ``target``: ``.NAME.``, a name over 64 bytes cut to
    48 and a digest of the whole (names that share a beginning share no temporary)."""
    name = os.fsencode(target.name)
    if len(name) > 64:
        name = name[:48] + b"~" + hashlib.sha256(name).hexdigest()[:12].encode()
    return "." + os.fsdecode(name) + "."


def _temporary(target: Path) -> Path:
    """A fresh name next to ``target`` for a temporary of its write."""
    return target.with_name(f"{_prefix(target)}{secrets.token_hex(8)}.gdn-tmp")


def _lock(fd: int) -> None:
    """Hold ``fd`` locked while this writer runs: its temporary is then never reclaimed."""
    if fcntl is not None:
        with contextlib.suppress(OSError):  # a filesystem without locks: never reclaimed
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _remove_abandoned(
    target: Path,
    own: Callable[[Path], Iterable[str] | None] | None = None,
    replaceable: Callable[[Path], str | None] | None = None,
) -> None:
    """Remove this user's temporaries of earlier writes of ``target`` whose writer has ended
    (folders as :func:`_remove_own` does). Given ``replaceable``, a whole folder left where
    ``target`` is missing (a writer stopped between two renames) is moved back instead."""
    if fcntl is None:  # pragma: no cover
        return
    pattern = re.compile(re.escape(_prefix(target)) + "[0-9a-f]{16}" + re.escape(".gdn-tmp"))
    with contextlib.suppress(OSError), os.scandir(target.parent) as entries:
        found = [Path(e.path) for e in entries if pattern.fullmatch(e.name)]
    for path in found:
        with contextlib.suppress(OSError), _unlocked(path) as kind:
            if kind == "file":
                os.unlink(path)
            elif kind == "folder" and own is not None:
                if replaceable is not None and not os.path.lexists(target):
                    names = own(path)
                    whole = names is not None and replaceable(path) is None
                    if whole and all(os.path.lexists(path / n) for n in names or ()):
                        os.rename(path, target)
                        continue
                _remove_own(path, own)


@contextlib.contextmanager
def _unlocked(path: Path) -> Iterator[str | None]:
    """``path``'s kind ("file" or "folder") when it is this user's and no writer holds it
    locked, else None."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        status = os.fstat(fd)
        try:
            if status.st_uid != os.geteuid():  # another user's: never this writer's work
                raise OSError
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its writer runs
        except OSError:
            yield None
            return
        mode = status.st_mode
        yield "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else None
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one step (Linux ``renameat2``); False where the
    system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # pragma: no cover - a C library older than glibc 2.28
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # pragma: no cover
        return False  # a kernel or filesystem without it
    raise OSError(code, os.strerror(code), os.fspath(b))


def _naming(err: OSError, path: Path, temporary: Path) -> OSError:
    """``err`` naming ``path``, the user's, where it named nothing or ``temporary``."""
    name, where = os.fspath(temporary), err.filename
    where = os.fsdecode(where) if where is not None else ""
    if err.errno is None or where == os.fspath(path):
        return err
    if where.startswith(name) or not where:
        return type(err)(err.errno, err.strerror, os.fspath(path) + where[len(name) :])
    return err


def _status(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _replaced(path: Path) -> os.stat_result | None:
    """The status of the regular file a write may replace (None when there is none); never a
    link, a device or a FIFO (as root, ``/dev/null``)."""
    status = _status(path)
    if status is not None and stat.S_ISLNK(status.st_mode):
        raise NotRegularFileError(
            f"{path}: not replaced: it is a symbolic link; give the path of the file it names"
        )
    if status is not None:
        _require_regular(status.st_mode, path, "not replaced: ")
    return status


def _keep_identity(fd: int, old: os.stat_result | None) -> None:
    """Give ``fd`` the permission bits, and where allowed the owner, of ``old`` (when it is
    of the same kind)."""
    if old is None or stat.S_IFMT(old.st_mode) != stat.S_IFMT(os.fstat(fd).st_mode):
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
