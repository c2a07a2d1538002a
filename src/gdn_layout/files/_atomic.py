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
            fd = _open_unnamed(path.parent, private=old is not None)
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
#: What a temporary may hold, and so what an abandoned one becomes: ``new``, the writer's own
#: work (removed); ``checked``, a replaced folder found to hold only what may be removed
#: (removed); ``old``, the target moved aside, and ``swap``, the writer's work or, once
#: exchanged, what was at the target, not yet checked: moved back where nothing took the
#: target's place, else removed only when it is a regular file (``swap``) or a folder that
#: ``replaceable`` allows, and otherwise left as it is: nothing unchecked is removed.
ROLES: Final = ("new", "checked", "old", "swap")


def _stem(target: str, token: str) -> str:
    """The start of every name of the write of ``token`` next to ``target``."""
    return f".{os.fsdecode(os.fsencode(target)[:_NAME_BYTES])}.{token}"


class Temporaries:
    """The temporary files and folders of one write next to ``target``, named in a record that
    this writer holds locked while it runs.

    The record (``.{name}.{token}.gdn-lock``, ``token`` 128 random bits) is made on the first
    :meth:`new` and holds one line per temporary and change of what it holds (its role, one of
    :data:`ROLES`), each appended before the change. :func:`remove_abandoned` settles what a
    record names only once it can take the record's lock, that is once its writer has ended
    however it ended.
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
        self._roles: dict[str, str] = {}

    def new(self, role: str = "new") -> Path:
        """A fresh name next to the target, recorded (with ``role``, one of :data:`ROLES`)
        before it is returned."""
        path = self.target.with_name(f"{self._stem}.{self._count}")
        self._count += 1
        self.mark(path, role)
        return path

    def role(self, path: Path) -> str | None:
        """What ``path`` (one of :meth:`new`'s names) was last recorded to hold."""
        return self._roles.get(path.name)

    def mark(self, path: Path, role: str) -> None:
        """Record what ``path`` (one of :meth:`new`'s names) holds now, before it holds it."""
        self._roles[path.name] = role
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


def remove_abandoned(folder: Path, replaceable: Callable[[Path], str | None] | None = None) -> None:
    """Settle the temporaries in ``folder`` whose writer has ended (see :data:`ROLES`).

    Only what a record of :class:`Temporaries` names is considered, and only once the record's
    lock can be taken; a name that merely looks like a temporary, a record that cannot be read
    or parsed, and anything that cannot be removed are left as they are. ``replaceable`` says
    whether an unchecked folder may go (None) or why not, as for :func:`install_folder`; without
    it no such folder is removed. A record stays while it names something left in place.
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
            _reclaim(folder, entry.name, match["token"], replaceable)


def _reclaim(
    folder: Path, record: str, token: str, replaceable: Callable[[Path], str | None] | None
) -> None:
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
        settled = [
            _settle(folder / name, folder / target, role, replaceable)
            for name, role in roles.items()
        ]
        if all(settled):
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
        if role not in ROLES:
            return None
        roles[name] = role
    return target, roles


def _plain(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name


def _settle(
    temporary: Path, target: Path, role: str, replaceable: Callable[[Path], str | None] | None
) -> bool:
    """Remove an abandoned temporary, move an unchecked one back where nothing took the
    target's place, or leave it; whether it is gone."""
    try:
        mode = os.lstat(temporary).st_mode
    except FileNotFoundError:
        return True
    folder = stat.S_ISDIR(mode)
    if role in ("old", "swap"):
        if _rename_noreplace(temporary, target):
            return True
        allowed = stat.S_ISREG(mode) and role == "swap"  # what overwrite was asked to replace
        if folder and replaceable is not None:
            allowed = replaceable(temporary) is None
        if not allowed:
            return False
    if folder:
        shutil.rmtree(temporary)
    else:
        os.unlink(temporary)
    return True


# -- writing a file -------------------------------------------------------------------------------


def _naming(err: OSError, path: Path) -> OSError:
    """``err`` as an error of the same kind that names ``path``, the file being written."""
    if err.errno is None or err.filename == os.fspath(path):  # our own message names it
        return err
    return type(err)(err.errno, err.strerror, os.fspath(path))


def _open_unnamed(folder: Path, *, private: bool) -> int | None:
    """A file without a name in ``folder`` (Linux ``O_TMPFILE``), or None when unavailable;
    ``private``: readable by its owner alone (until it gets the mode of a file it replaces)."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, flag | os.O_WRONLY, 0o600 if private else 0o666)
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
        _swap_in(tmp, path, temporaries)
    except BaseException:
        if temporaries.role(tmp) == "new":
            tmp.unlink(missing_ok=True)
        raise
    return True


def _swap_in(tmp: Path, path: Path, temporaries: Temporaries) -> None:
    """Move the complete file ``tmp`` to ``path``, replacing the regular file there.

    Where the system can, the two are exchanged in one step and what came out of ``path`` is
    checked where it now lies: a FIFO, a device, a link or a folder that took the file's place
    since it was checked is put back, and the write refused. Elsewhere ``os.replace``, which
    leaves that window open."""
    temporaries.mark(tmp, "swap")  # from here on it may hold what was at path
    try:
        exchanged = _exchange(tmp, path)
    except FileNotFoundError:  # path went away since it was checked: take its place
        temporaries.mark(tmp, "new")
        _rename_new(tmp, path)
        return
    if not exchanged:
        temporaries.mark(tmp, "new")
        os.replace(tmp, path)
        return
    mode = os.lstat(tmp).st_mode
    if not stat.S_ISREG(mode):
        _exchange(tmp, path)  # put it back
        temporaries.mark(tmp, "new")
        os.unlink(tmp)
        raise NotRegularFileError(f"{path}: not replaced: it became {_kind(mode)} during the write")
    os.unlink(tmp)


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
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    # Replacing, the file is its owner's alone until it has the old one's mode.
    fd = os.open(tmp, flags, 0o666 if old is None else 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            _fill(out, write, old)
        if overwrite:
            _swap_in(tmp, path, temporaries)
        else:
            _link_new(tmp, path)
    except BaseException:
        if temporaries.role(tmp) == "new":
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
    replaced, and what was there is checked again once it is out of the way (what arrived
    since the first check is then put back, with the old folder, and the write refused) and
    removed only after. Linux exchanges the two in one step (``renameat2(RENAME_EXCHANGE)``):
    at every instant, and after any signal or kill, ``target`` is the old folder or the new
    one. Elsewhere the old folder is renamed aside and ``built`` renamed in: ``target`` is
    then missing for the instant between the two renames, and a write stopped there is undone
    by the next. A folder moved out of the way is recorded before it is moved, so that one
    left behind by a kill is moved back or, once checked, removed, and never removed
    unchecked. Concurrent writers each end with a complete folder at ``target``, the last
    one's.

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
        temporaries.mark(built, "swap")  # from here on it may hold the old folder
        try:
            exchanged = _exchange(built, target)
        except FileNotFoundError:  # another writer moved it: try again
            temporaries.mark(built, "new")
            continue
        if not exchanged:
            temporaries.mark(built, "new")
            if _replace_aside(built, target, temporaries, replaceable):
                return
            continue
        try:
            _require_replaceable(built, replaceable, target)  # what arrived since the check
        except FileExistsError:
            _exchange(built, target)
            temporaries.mark(built, "new")
            raise
        _remove_checked(built, temporaries)
        return
    raise FileExistsError(f"{target}: other writers kept replacing it")  # pragma: no cover


def _replace_aside(
    built: Path, target: Path, temporaries: Temporaries, replaceable: Callable[[Path], str | None]
) -> bool:
    """Without an exchange: rename ``target`` aside, check it, rename ``built`` in; False when
    another writer moved ``target`` or took its place meanwhile (try again)."""
    old = temporaries.new("old")
    try:
        os.rename(target, old)
    except FileNotFoundError:  # another writer moved it first
        return False
    try:
        _require_replaceable(old, replaceable, target)  # what arrived since the check
        try:
            os.rename(built, target)
        except OSError as err:
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # Another writer's folder took the place: the old one is checked, so it goes,
            # and the next round replaces theirs.
            _remove_checked(old, temporaries)
            return False
    except BaseException:
        if temporaries.role(old) == "old":
            _rename_noreplace(old, target)
        raise
    _remove_checked(old, temporaries)
    return True


def _remove_checked(folder: Path, temporaries: Temporaries) -> None:
    """Remove a replaced folder once checked, recording first that it may go."""
    temporaries.mark(folder, "checked")
    shutil.rmtree(folder, ignore_errors=True)


def _require_replaceable(
    folder: Path, replaceable: Callable[[Path], str | None], target: Path | None = None
) -> None:
    why = replaceable(folder)
    if why is not None:
        raise FileExistsError(f"{target or folder} is not replaced: {why}")


#: ``renameat2``'s flags: swap two paths; rename only onto nothing. And the "current folder".
_RENAME_EXCHANGE: Final = 2
_RENAME_NOREPLACE: Final = 1
_AT_FDCWD: Final = -100


def _renameat2(a: Path, b: Path, flag: int) -> bool:
    """``renameat2(a, b, flag)``; False where the system cannot, OSError when it fails."""
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
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flag) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # pragma: no cover
        return False  # a kernel or filesystem without it
    raise OSError(code, os.strerror(code), os.fspath(b))


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one step; False where the system cannot."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def _rename_noreplace(a: Path, b: Path) -> bool:
    """Rename ``a`` to ``b`` if nothing is at ``b``; whether it was renamed. Without
    ``RENAME_NOREPLACE`` a rename after a check, which a path appearing in between defeats."""
    try:
        if _renameat2(a, b, _RENAME_NOREPLACE):
            return True
    except FileExistsError:
        return False
    except OSError as err:
        if err.errno == errno.ENOTEMPTY:
            return False
        raise
    if os.path.lexists(b):  # pragma: no cover - not Linux
        return False
    os.rename(a, b)  # pragma: no cover
    return True  # pragma: no cover


def _rename_new(a: Path, b: Path) -> None:
    """Rename ``a`` to ``b``, which must not exist."""
    if not _rename_noreplace(a, b):
        raise FileExistsError(f"{b} appeared during the write; it is not replaced")


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
    if not stat.S_ISREG(mode):
        raise NotRegularFileError(f"{path}: {what}not a regular file: it is {_kind(mode)}")


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "of another kind")
