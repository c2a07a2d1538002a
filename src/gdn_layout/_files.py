"""Files: atomic writing (a reader sees the old file or folder or the new one, never half of
one), temporaries that only their writer's successors may remove, and opening for reading only
what is a regular file.

A write never removes or replaces what the library did not make. Its temporaries are named in a
record next to them (:class:`Temporaries`) that the live writer holds locked with ``flock``; a
later write removes them only once it can take that lock, so a live writer in any process,
container or PID namespace sharing the folder keeps its work, and a file that merely looks like
a temporary is never touched.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, BinaryIO, Final

__all__ = [
    "NotRegularFileError",
    "Temporaries",
    "atomic_write",
    "install_folder",
    "open_regular",
    "remove_abandoned",
]

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no record is locked, nothing is reclaimed
    fcntl = None  # type: ignore[assignment]


class NotRegularFileError(OSError):
    """A path that names a folder, a FIFO, a device or a socket where a file is expected."""


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], *, overwrite: bool) -> Path:
    """Call ``write`` on a temporary file next to ``path``, flush it to disk, then move it to
    ``path``; return ``path``.

    Nothing is left behind, even when the process is killed: on Linux the temporary file has
    no name (``O_TMPFILE``) until it is linked in place. Elsewhere, and for a replacement, it
    has a name recorded by :class:`Temporaries`, which the next write into the folder removes
    once this writer is gone. Only a regular file is replaced, and the replacement keeps its
    permission bits (and, where allowed, its owner).

    Parameters
    ----------
    path
        The file to create (or replace, with ``overwrite``).
    write
        Writes the whole content to the binary file it is given.
    overwrite
        Replace an existing regular file at ``path``; without it an existing file is never
        replaced, not even one that appears while ``write`` runs.

    Raises
    ------
    FileExistsError
        ``path`` exists and ``overwrite`` is false.
    NotRegularFileError
        ``path`` is a folder, a FIFO, a device, a socket or a symbolic link: never replaced.
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
    remove_abandoned(path.parent)
    try:
        with Temporaries(path) as temporaries:
            fd = _open_unnamed(path.parent)
            if fd is None or not _write_unnamed(fd, path, write, old, overwrite, temporaries):
                _write_named(path, write, old, overwrite, temporaries)
    except OSError as err:
        raise _naming(err, path) from None
    _fsync_dir(path.parent)
    return path


def _replaced(path: Path) -> os.stat_result | None:
    """The status of the file ``path`` names, which a write may replace; None when there is
    none. Anything but a regular file is refused: a write never replaces a device or a FIFO
    (as root, ``/dev/null``) with a file."""
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
    """Give the new file ``fd`` the permission bits, and where allowed the owner, of ``old``."""
    if old is None:
        return
    if hasattr(os, "fchown") and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
        # An ordinary user cannot give a file away: it becomes theirs.
        with contextlib.suppress(PermissionError):
            os.fchown(fd, old.st_uid, old.st_gid)
    os.fchmod(fd, stat.S_IMODE(old.st_mode))  # after the owner, which clears setuid and setgid


# -- temporaries ----------------------------------------------------------------------------------

#: The record of a write's temporaries: ``.{name}.{token}.gdn-lock`` next to them.
_RECORD: Final = re.compile(r"\.(?P<name>.*)\.(?P<token>[0-9a-f]{32})\.gdn-lock", re.DOTALL)
#: What a record starts with: a file holding anything else is not a record.
_MAGIC: Final = "gdn-layout temporaries"
#: A record is at most this long; a longer file is not one.
_RECORD_BYTES: Final = 1 << 16
#: Of the target's name, this many bytes go into temporary names (a name has at most 255).
_NAME_BYTES: Final = 64


def _stem(target: str, token: str) -> str:
    """The start of every name of the write of ``token`` next to ``target``."""
    return f".{os.fsdecode(os.fsencode(target)[:_NAME_BYTES])}.{token}"


class Temporaries:
    """The temporary files and folders of one write next to ``target``, named in a record that
    this writer holds locked while it runs.

    The record (``.{name}.{token}.gdn-lock``, ``token`` 128 random bits) is made on the first
    :meth:`new` and holds one line per temporary, each appended before the temporary is made.
    :func:`remove_abandoned` removes what a record names only once it can take the record's
    lock, that is once its writer has ended however it ended; a temporary marked ``old`` (a
    folder moved aside to be replaced) is moved back when nothing took its place.
    Where ``flock`` is unavailable no record is made and nothing is ever reclaimed.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> with Temporaries(folder / "suite") as temporaries:
    ...     built = temporaries.new()
    ...     built.mkdir()
    ...     remove_abandoned(folder)  # its writer runs: kept
    ...     sorted(p.suffix for p in folder.iterdir())
    ['.0', '.gdn-lock']
    >>> remove_abandoned(folder)  # its writer is done: removed, and the record with it
    >>> list(folder.iterdir())
    []
    """

    def __init__(self, target: Path) -> None:
        self.target = target
        self.token = secrets.token_hex(16)
        self._stem = _stem(target.name, self.token)
        self._fd: int | None = None
        self._started = False
        self._count = 0

    def new(self, role: str = "new") -> Path:
        """A fresh name next to the target, recorded (with ``role``, ``"new"`` or ``"old"``)
        before it is returned."""
        path = self.target.with_name(f"{self._stem}.{self._count}")
        self._count += 1
        self._mark(path, role)
        return path

    def _mark(self, path: Path, role: str) -> None:
        """Record what ``path`` (one of :meth:`new`'s names) holds now."""
        if not self._started:
            self._started = True
            self._fd = _lock_record(self.target.with_name(f"{self._stem}.gdn-lock"))
            self._append({"magic": _MAGIC, "token": self.token, "target": self.target.name})
        self._append({"name": path.name, "role": role})

    def _append(self, line: dict[str, str]) -> None:
        if self._fd is not None:
            os.write(self._fd, (json.dumps(line) + "\n").encode())

    def __enter__(self) -> Temporaries:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._fd is None:
            return
        # A temporary that is still there (an interrupted removal) keeps its record, for the
        # next write to reclaim once this lock is released.
        names = (self.target.with_name(f"{self._stem}.{i}") for i in range(self._count))
        if not any(os.path.lexists(name) for name in names):
            with contextlib.suppress(OSError):
                os.unlink(self.target.with_name(f"{self._stem}.gdn-lock"))
        os.close(self._fd)
        self._fd = None


def _lock_record(path: Path) -> int | None:
    """A new record file at ``path``, locked by this process; None where locks are unavailable
    (nothing is then reclaimed, which is safe)."""
    if fcntl is None:  # pragma: no cover
        return None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:  # pragma: no cover - a filesystem without locks
        os.close(fd)
        os.unlink(path)
        return None
    return fd


def remove_abandoned(folder: Path) -> None:
    """Remove the temporaries in ``folder`` whose writer has ended.

    Only what a record of :class:`Temporaries` names is considered, and only once the record's
    lock can be taken; a name that merely looks like a temporary, a record that cannot be read
    or parsed, and anything that cannot be removed are left as they are.
    """
    if fcntl is None:  # pragma: no cover
        return
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = _RECORD.fullmatch(entry.name)
        if match is not None:
            _reclaim(folder, entry.name, match["token"])


def _reclaim(folder: Path, record: str, token: str) -> None:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(folder / record, flags)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its writer is running
            return
        parsed = _parse_record(os.read(fd, _RECORD_BYTES + 1), token)
        if parsed is None:
            return
        target, roles = parsed
        if record != f"{_stem(target, token)}.gdn-lock":  # not the record its writer made
            return
        for name, role in roles.items():
            _settle(folder / name, folder / target, role)
        os.unlink(folder / record)
    except OSError:
        return
    finally:
        os.close(fd)


def _parse_record(data: bytes, token: str) -> tuple[str, dict[str, str]] | None:
    """The target and the temporaries (name: last role) of a record; None for anything that is
    not a complete record of ``token``. A last line cut short by a kill is dropped."""
    if len(data) > _RECORD_BYTES:
        return None
    try:
        lines = [
            json.loads(line)
            for line in data.decode().splitlines(keepends=True)
            if line.endswith("\n")
        ]
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not lines or not all(isinstance(line, dict) for line in lines):
        return None
    head, *rest = lines
    target = head.get("target")
    if head.get("magic") != _MAGIC or head.get("token") != token or not _plain(target):
        return None
    stem = _stem(target, token) + "."
    roles: dict[str, str] = {}
    for line in rest:
        name, role = line.get("name"), line.get("role")
        if not (_plain(name) and name.startswith(stem) and name[len(stem) :].isdigit()):
            return None
        if role not in ("new", "old"):
            return None
        roles[name] = role
    return target, roles


def _plain(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def _settle(temporary: Path, target: Path, role: str) -> None:
    """Remove an abandoned temporary, or move an ``old`` one back where nothing replaced it."""
    if not os.path.lexists(temporary):
        return
    if role == "old" and not os.path.lexists(target):
        os.rename(temporary, target)
    elif os.path.isdir(temporary) and not os.path.islink(temporary):
        shutil.rmtree(temporary)
    else:
        os.unlink(temporary)


# -- writing a file -------------------------------------------------------------------------------


def _naming(err: OSError, path: Path) -> OSError:
    """``err`` as an error of the same kind that names ``path``, the file being written."""
    if err.errno is None or err.filename == os.fspath(path):  # our own message names it
        return err
    return type(err)(err.errno, err.strerror, os.fspath(path))


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
    fd: int,
    path: Path,
    write: Callable[[IO[bytes]], None],
    old: os.stat_result | None,
    overwrite: bool,
    temporaries: Temporaries,
) -> bool:
    """Write into the unnamed file ``fd`` and link it in place; False if it cannot be linked."""
    with os.fdopen(fd, "wb") as out:
        _fill(out, write, old)
        try:
            if not overwrite:
                try:  # fails if path appeared meanwhile: an existing file is never replaced
                    _link_fd(out.fileno(), path)
                except FileExistsError:
                    raise FileExistsError(
                        f"{path} exists; pass overwrite=True to replace it"
                    ) from None
                return True
            tmp = temporaries.new()
            _link_fd(out.fileno(), tmp)
        except _CannotLink:  # pragma: no cover - a kernel or sandbox without linkat
            return False
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def _fill(out: IO[bytes], write: Callable[[IO[bytes]], None], old: os.stat_result | None) -> None:
    """The whole content, with the mode (and owner) of the file it replaces, on disk."""
    write(out)
    out.flush()
    _keep_identity(out.fileno(), old)
    os.fsync(out.fileno())


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


def _write_named(
    path: Path,
    write: Callable[[IO[bytes]], None],
    old: os.stat_result | None,
    overwrite: bool,
    temporaries: Temporaries,
) -> None:
    # A recorded name in the same folder, so that the rename stays on one filesystem; created
    # with O_EXCL and mode 0o666 so that a new file gets the usual umask permissions.
    tmp = temporaries.new()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as out:
            _fill(out, write, old)
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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
    temporaries: Temporaries,
    *,
    overwrite: bool,
    replaceable: Callable[[Path], str | None],
) -> None:
    """Move the complete folder ``built`` (a name of ``temporaries``) to ``target``, its
    sibling.

    A missing or empty ``target`` is taken by a rename. Otherwise, with ``overwrite``, a
    ``target`` for which ``replaceable`` says nothing (it returns why not, or None) is
    exchanged with ``built`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``), checked again
    where it now lies, and removed: at every instant, and after any signal or kill, ``target``
    is the old folder or the new one. Where the exchange is unavailable the old folder is
    renamed aside (recorded as ``old``, so that an interrupted replacement is undone by the
    next write) and ``built`` renamed in: ``target`` is then missing for the instant between
    the two renames. Concurrent writers each end with a complete folder at ``target``.

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
        _require_replaceable(target, replaceable)
        if _exchange(built, target):
            try:
                _require_replaceable(built, replaceable, target)  # what arrived since the check
            except FileExistsError:
                _exchange(built, target)
                raise
            shutil.rmtree(built, ignore_errors=True)
            return
        old = temporaries.new("old")
        try:
            os.rename(target, old)
        except FileNotFoundError:  # another writer moved it first: try again
            continue
        try:
            os.rename(built, target)
        except BaseException:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    raise FileExistsError(f"{target}: other writers kept replacing it")  # pragma: no cover


def _require_replaceable(
    folder: Path, replaceable: Callable[[Path], str | None], target: Path | None = None
) -> None:
    why = replaceable(folder)
    if why is not None:
        raise FileExistsError(f"{target or folder} is not replaced: {why}")


#: ``renameat2``'s flag that swaps two paths, and the "current folder" for its folder fds.
_RENAME_EXCHANGE: Final = 2
_AT_FDCWD: Final = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one step; False where the system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # pragma: no cover - a C library older than glibc 2.28
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # pragma: no cover
        return False  # a kernel or filesystem without the exchange
    raise OSError(code, os.strerror(code), os.fspath(b))


# -- reading --------------------------------------------------------------------------------------


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


def _require_regular(mode: int, path: Path, what: str = "") -> None:
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
    raise NotRegularFileError(f"{path}: {what}not a regular file: it is {kind}")
