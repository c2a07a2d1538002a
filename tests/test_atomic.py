"""Files and folders written whole or not at all (docs/files.md, *Saving* and *Suites*): at
most a killed writer's temporary is left, which the next write removes, never a live writer's;
a replaced file keeps its mode and owner; errors name the user's path."""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout
from gdn_layout.files import load_fixture, save_fixture
from gdn_layout.generate import make_fixture

files = importlib.import_module("gdn_layout.files._atomic")
codec = importlib.import_module("gdn_layout.files._safetensors")

LAYOUT = GdnBackwardLayout(1, 3, 2, 4)

#: Saves a fixture, stopping for good halfway through its data: the parent kills it there.
_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import gdn_layout.files._safetensors as codec
    from gdn_layout import GdnBackwardLayout
    from gdn_layout import make_fixture, save_fixture

    def stalled(out, tensors, metadata):
        out.write(b"x" * 100_000)
        out.flush()
        print("writing", flush=True)
        time.sleep(60)

    codec.write = stalled
    save_fixture(sys.argv[1], make_fixture(GdnBackwardLayout(1, 3, 2, 4)))
    """
)


@contextlib.contextmanager
def _stalled_writer(target: Path, prefix: tuple[str, ...] = ()) -> Iterator[None]:
    """A writer of ``target`` in another process, stalled mid-write within the block and
    killed (SIGKILL) at its end."""
    writer = subprocess.Popen(
        [*prefix, sys.executable, "-c", _KILLED_WRITER, str(target)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
        yield
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)


def _others(folder: Path, *keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="temporaries are reclaimed through flock")
@pytest.mark.parametrize("name", ["a\nb.safetensors", "\U0001f600" * 55])
def test_a_killed_writer_s_temporary_is_removed_by_the_next_write_of_its_file(
    tmp_path: Path, name: str
) -> None:
    target = tmp_path / name
    with _stalled_writer(target):
        pass
    (left,) = tmp_path.iterdir()  # its one temporary, nothing under the file's name
    assert left.name.startswith(".")
    assert left.name.endswith(".gdn-tmp")
    assert left.stat().st_size >= 100_000
    save_fixture(tmp_path / "other.safetensors", make_fixture(LAYOUT))
    assert left.exists()  # another file's write leaves it
    fixture = make_fixture(LAYOUT)
    save_fixture(target, fixture)
    assert _others(tmp_path) == sorted([name, "other.safetensors"])
    np.testing.assert_array_equal(load_fixture(target).packed, fixture.packed)


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="temporaries are reclaimed through flock")
def test_a_live_writer_keeps_its_temporary(tmp_path: Path) -> None:
    target = tmp_path / "x.safetensors"
    with _stalled_writer(target):
        (running,) = _others(tmp_path)
        save_fixture(target, make_fixture(LAYOUT))
        save_fixture(target, make_fixture(LAYOUT), overwrite=True)
        assert _others(tmp_path) == sorted([running, "x.safetensors"])  # still writing: kept
    save_fixture(target, make_fixture(LAYOUT), overwrite=True)
    assert _others(tmp_path) == ["x.safetensors"]


@pytest.mark.parametrize(
    "name",
    [
        ".x.safetensors." + "0" * 32 + ".gdn-lock",
        ".x.safetensors.0123456789abcdef.gdn-tmp.bak",  # a temporary's name, and more
        ".y.safetensors.0123456789abcdef.gdn-tmp",  # another file's temporary
    ],
)
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_look_alike_of_a_temporary_survives_every_write(
    tmp_path: Path, name: str, kind: str
) -> None:
    mine = tmp_path / name
    if kind == "folder":
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
    else:
        mine.write_text("mine")
    fixture = make_fixture(LAYOUT)
    save_fixture(tmp_path / "x.safetensors", fixture)
    save_fixture(tmp_path / "x.safetensors", fixture, overwrite=True)
    assert (mine / "notes.txt" if kind == "folder" else mine).read_text() == "mine"
    assert _others(tmp_path) == sorted([name, "x.safetensors"])


def test_a_replaced_file_keeps_its_mode_and_is_private_while_written(tmp_path: Path) -> None:
    path = tmp_path / "secret.bin"
    path.write_bytes(b"old")
    path.chmod(0o640)
    modes: list[int] = []

    def write(out: IO[bytes]) -> None:
        out.write(b"new")
        modes.append(stat.S_IMODE(os.fstat(out.fileno()).st_mode))

    files.atomic_write(path, write, overwrite=True)
    assert modes
    assert all(mode & 0o077 == 0 for mode in modes), [oct(m) for m in modes]
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert path.read_bytes() == b"new"
    assert _others(tmp_path) == ["secret.bin"]


def _node(kind: str, path: Path) -> None:
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a character device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "a symbolic link":
        (path.parent / "target.safetensors").write_bytes(b"theirs")
        path.symlink_to("target.safetensors")
    else:
        path.mkdir()


_ROOT = pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs the superuser")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize(
    "kind",
    ["a FIFO", pytest.param("a character device", marks=_ROOT), "a symbolic link", "a folder"],
)
def test_overwrite_replaces_only_a_regular_file(tmp_path: Path, kind: str) -> None:
    node = tmp_path / "x.safetensors"
    _node(kind, node)
    before = os.lstat(node)
    with pytest.raises(files.NotRegularFileError, match=f"not replaced: .*{kind}") as info:
        save_fixture(node, make_fixture(LAYOUT), overwrite=True)
    assert str(node) in str(info.value)
    after = os.lstat(node)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (
        before.st_mode,
        before.st_ino,
        before.st_rdev,
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_file_that_appears_during_the_write_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"

    def write(out: IO[bytes]) -> None:
        out.write(b"mine")
        path.write_bytes(b"theirs")  # another program, meanwhile

    with pytest.raises(FileExistsError, match=r"x\.bin exists; pass overwrite=True"):
        files.atomic_write(path, write, overwrite=False)
    assert path.read_bytes() == b"theirs"
    assert _others(tmp_path) == ["x.bin"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_full_disk_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool
) -> None:
    target = tmp_path / "x.safetensors"
    if overwrite:
        target.write_bytes(b"old")

    def full(out: IO[bytes], tensors: Any, metadata: Any) -> None:
        out.write(b"x" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(codec, "write", full)
    with pytest.raises(OSError, match="No space left on device") as info:
        save_fixture(target, make_fixture(LAYOUT), overwrite=overwrite)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(target)
    assert _others(tmp_path) == (["x.safetensors"] if overwrite else [])


def test_a_read_only_folder_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As on a read-only filesystem: no file is created, and removing the temporary fails too.
    real_open = os.open

    def refused(path: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def read_only(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_CREAT:
            refused(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    monkeypatch.setattr(os, "unlink", refused)
    target = tmp_path / "x.safetensors"
    with pytest.raises(OSError, match="Read-only file system") as info:
        save_fixture(target, make_fixture(LAYOUT))
    assert str(info.value) == f"[Errno 30] Read-only file system: '{target}'"


@_ROOT
def test_a_replaced_file_keeps_its_setuid_bits_and_owner(tmp_path: Path) -> None:
    fixture = make_fixture(LAYOUT)
    path = save_fixture(tmp_path / "x.safetensors", fixture)
    os.chown(path, 65534, 65534)
    path.chmod(0o6755)
    save_fixture(path, fixture, overwrite=True)
    status = path.stat()
    assert (stat.S_IMODE(status.st_mode), status.st_uid, status.st_gid) == (0o6755, 65534, 65534)


# -- folders --------------------------------------------------------------------------------------


def _fill(built: Path) -> str:
    (built / "new.txt").write_text("new")
    return "filled"


def _replaceable(folder: Path) -> str | None:
    """A folder may be replaced when it holds only ``*.txt`` files."""
    odd = [p.name for p in folder.iterdir() if p.suffix != ".txt"]
    return f"it holds {odd[0]}" if odd else None


def _write(target: Path, overwrite: bool = True) -> str:
    result: str = files.write_folder(
        target,
        _fill,
        overwrite=overwrite,
        replaceable=_replaceable,
        own=lambda folder: [p.name for p in folder.glob("*.txt")],
    )
    return result


@pytest.mark.parametrize("old", ["missing", "empty", "full"])
def test_a_folder_is_replaced_whole(tmp_path: Path, old: str) -> None:
    target = tmp_path / "suite"
    if old != "missing":
        target.mkdir()
        if old == "full":
            (target / "old.txt").write_text("old")
    assert _write(target) == "filled"
    assert sorted(os.listdir(target)) == ["new.txt"]
    assert _others(tmp_path) == ["suite"]


@pytest.mark.parametrize(
    ("made", "overwrite", "message"),
    [
        ("old.txt", False, "suite exists and is not empty; pass overwrite=True to replace it"),
        ("model.bin", True, "suite is not replaced: it holds model.bin"),
        ("file", True, "suite exists and is not a folder"),
    ],
)
def test_a_folder_is_replaced_only_when_allowed(
    tmp_path: Path, made: str, overwrite: bool, message: str
) -> None:
    target = tmp_path / "suite"
    if made == "file":
        target.write_text("mine")
    else:
        target.mkdir()
        (target / made).write_text("mine")
    with pytest.raises(FileExistsError, match=f"^{re.escape(str(tmp_path))}/{message}$"):
        _write(target, overwrite=overwrite)
    assert (target if made == "file" else target / made).read_text() == "mine"
    assert _others(tmp_path) == ["suite"]


@pytest.mark.parametrize("where", ["fill", "mkdir"])
def test_a_failed_write_leaves_nothing_and_names_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    target = tmp_path / "suite"

    def full(built: Path) -> str:
        (built / "a.txt").write_text("partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(built / "b.txt"))

    def refused(path: Any, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))

    if where == "mkdir":
        monkeypatch.setattr(os, "mkdir", refused)
    with pytest.raises(OSError, match=r"No space left|Permission denied") as info:
        files.write_folder(target, full, overwrite=False, replaceable=_replaceable, own=list)
    assert info.value.filename == str(target / "b.txt" if where == "fill" else target)
    assert _others(tmp_path) == []


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="temporaries are reclaimed through flock")
def test_a_killed_folder_writer_s_work_goes_with_the_next_write(tmp_path: Path) -> None:
    target = tmp_path / "suite"
    script = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        import gdn_layout.files._atomic as files

        def stalled(built):
            (built / "half.txt").write_text("half")
            print("writing", flush=True)
            time.sleep(60)

        files.write_folder(
            Path(sys.argv[1]), stalled, overwrite=True, replaceable=lambda f: "no", own=list
        )
        """
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", script, str(target)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
        (running,) = _others(tmp_path)
        _write(target)
        assert _others(tmp_path) == sorted([running, "suite"])  # a live writer's: kept
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    _write(target)
    assert _others(tmp_path) == ["suite"]


def test_a_mount_point_is_refused_in_one_line(tmp_path: Path) -> None:
    target = tmp_path / "mnt"
    target.mkdir()
    (target / "old.txt").write_text("old")
    done = subprocess.run(["mount", "--bind", str(target), str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("no bind mount can be made here")
    try:
        with pytest.raises(OSError, match="mount point") as info:
            _write(target)
        assert str(info.value) == f"{target} is a mount point, which cannot be replaced; " + (
            "give a folder inside it"
        )
        assert sorted(os.listdir(target)) == ["old.txt"]
    finally:
        subprocess.run(["umount", str(target)], check=True)
    assert _others(tmp_path) == ["mnt"]


@_ROOT
def test_another_user_s_look_alike_folder_is_never_touched(tmp_path: Path) -> None:
    planted = tmp_path / ".suite.0123456789abcdef.gdn-tmp"
    planted.mkdir()
    (planted / "keys.txt").write_text("theirs")
    os.chown(planted / "keys.txt", 65534, 65534)
    os.chown(planted, 65534, 65534)
    _write(tmp_path / "suite")
    assert (planted / "keys.txt").read_text() == "theirs"
