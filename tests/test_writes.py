"""Writes leave nothing behind, even when the writer is killed, and their errors name the file."""

from __future__ import annotations

import errno
import importlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout
from gdn_layout.files import load_fixture, save_fixture
from gdn_layout.generate import make_fixture, write_suite
from support import deadline

files = importlib.import_module("gdn_layout.files._atomic")
codec = importlib.import_module("gdn_layout.files._safetensors")
generate = importlib.import_module("gdn_layout.generate")

LAYOUT = GdnBackwardLayout(1, 3, 2, 4)

#: Saves a fixture, stopping for good halfway through its data: the parent kills it there.
_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import gdn_layout.files._atomic as files
    import gdn_layout.files._safetensors as codec
    from gdn_layout import GdnBackwardLayout
    from gdn_layout import make_fixture, save_fixture

    if sys.argv[2] == "named":
        files._open_unnamed = lambda folder, **_: None  # as where O_TMPFILE is not available

    def stalled(out, tensors, metadata):
        out.write(b"x" * 100_000)
        out.flush()
        print("writing", flush=True)
        time.sleep(60)

    codec.write = stalled
    save_fixture(sys.argv[1], make_fixture(GdnBackwardLayout(1, 3, 2, 4)))
    """
)


def _kill_mid_write(target: Path, mode: str) -> None:
    writer = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(target), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="no unnamed temporary files here")
def test_a_writer_killed_mid_write_leaves_no_file(tmp_path: Path) -> None:
    _kill_mid_write(tmp_path / "x.safetensors", "unnamed")
    assert list(tmp_path.iterdir()) == []


def _others(folder: Path, *keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="temporaries are reclaimed through flock")
def test_a_killed_writers_named_temporary_is_removed_by_the_next_write(tmp_path: Path) -> None:
    _kill_mid_write(tmp_path / "x.safetensors", "named")
    left = sorted(tmp_path.iterdir(), key=lambda p: p.suffix)
    assert [p.suffix for p in left] == [".0", ".gdn-lock"]  # the temporary and its record
    assert left[0].name.startswith(".x.safetensors.")
    assert left[0].stat().st_size >= 100_000
    # The temporary of a running writer (this process, holding its record) stays.
    with files.Temporaries(tmp_path / "y.safetensors") as running:
        alive = running.new()
        alive.write_bytes(b"in progress")
        save_fixture(tmp_path / "z.safetensors", make_fixture(LAYOUT))
        assert _others(tmp_path, "z.safetensors") == sorted(
            [alive.name, alive.with_suffix(".gdn-lock").name]
        )
        alive.unlink()
    assert _others(tmp_path) == ["z.safetensors"]


def _in_new_pid_namespace() -> list[str] | None:
    """The command prefix that runs a program in a PID namespace of its own, or None."""
    command = ["unshare", "--pid", "--fork", "--kill-child=SIGKILL"]
    try:
        done = subprocess.run(
            [*command, sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return command if done.returncode == 0 and done.stdout.strip() == "1" else None


NAMESPACE = _in_new_pid_namespace()


@pytest.mark.slow
@pytest.mark.skipif(NAMESPACE is None, reason="no PID namespace can be made here")
def test_a_live_writer_in_another_pid_namespace_keeps_its_temporary(tmp_path: Path) -> None:
    # Its process id (1 in its namespace) names a process here: liveness is its held lock.
    assert NAMESPACE is not None
    writer = subprocess.Popen(
        [
            *NAMESPACE,
            sys.executable,
            "-c",
            _KILLED_WRITER,
            str(tmp_path / "x.safetensors"),
            "named",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "writing"
        before = _others(tmp_path)
        assert len(before) == 2  # its temporary and its record
        save_fixture(tmp_path / "z.safetensors", make_fixture(LAYOUT))
        assert _others(tmp_path, "z.safetensors") == before  # still writing: kept
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    # Its writer dies with unshare, a moment later; then the next write removes its work.
    with deadline(30):
        while _others(tmp_path) != ["z.safetensors"]:
            save_fixture(tmp_path / "z.safetensors", make_fixture(LAYOUT), overwrite=True)
            time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        ".x.safetensors.123.abcdef12.tmp",  # the name a temporary once had, of no live pid
        ".x.safetensors.99999999999999999999.abcdef12.old",  # a "pid" past any integer type
        ".x.safetensors." + "0" * 32 + ".gdn-lock",  # a record's name, holding something else
        ".x.safetensors." + "0" * 32 + ".0",  # the name a recorded temporary would have
    ],
)
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_look_alike_of_a_temporary_survives_every_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, kind: str
) -> None:
    monkeypatch.setattr(generate, "_SUITE_SHAPES", generate._SUITE_SHAPES[:1])
    mine = tmp_path / name
    if kind == "folder":
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
    else:
        mine.write_text("mine")
    fixture = make_fixture(LAYOUT)
    save_fixture(tmp_path / "x.safetensors", fixture)
    save_fixture(tmp_path / "x.safetensors", fixture, overwrite=True)
    write_suite(tmp_path / "suite")
    write_suite(tmp_path / "suite", overwrite=True)
    assert (mine / "notes.txt" if kind == "folder" else mine).read_text() == "mine"
    assert _others(tmp_path) == sorted([name, "suite", "x.safetensors"])


def test_a_forged_record_cannot_name_what_is_not_its_temporary(tmp_path: Path) -> None:
    token = "1" * 32
    (tmp_path / "notes.txt").write_text("mine")
    lines = [
        {"magic": "gdn-layout temporaries", "token": token, "target": "notes.txt"},
        {"name": "notes.txt", "role": "new"},
    ]
    record = tmp_path / f".notes.txt.{token}.gdn-lock"
    record.write_text("".join(json.dumps(line) + "\n" for line in lines))
    save_fixture(tmp_path / "x.safetensors", make_fixture(LAYOUT))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert record.exists()


@pytest.mark.parametrize("fallback", [False, True], ids=["unnamed", "named"])
def test_a_replaced_file_keeps_its_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    if fallback:
        monkeypatch.setattr(files, "_open_unnamed", lambda folder, **_: None)
    fixture = make_fixture(LAYOUT)
    path = save_fixture(tmp_path / "x.safetensors", fixture)
    path.chmod(0o600)
    save_fixture(path, fixture, overwrite=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _others(tmp_path) == ["x.safetensors"]


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _null_device(path: Path) -> Path:
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def _link(path: Path) -> Path:
    (path.parent / "target.safetensors").write_bytes(b"theirs")
    path.symlink_to("target.safetensors")
    return path


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (_fifo, "a FIFO"),
        pytest.param(
            _null_device,
            "a character device",
            marks=pytest.mark.skipif(
                os.name != "posix" or os.geteuid() != 0, reason="only the superuser makes devices"
            ),
        ),
        (_link, "a symbolic link"),
        (_folder, "a folder"),
    ],
)
def test_overwrite_replaces_only_a_regular_file(tmp_path: Path, make: Any, kind: str) -> None:
    node = make(tmp_path / "x.safetensors")
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


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("fallback", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize(("make", "kind"), [(_fifo, "a FIFO"), (_link, "a symbolic link")])
def test_what_takes_the_files_place_during_the_write_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool, make: Any, kind: str
) -> None:
    if fallback:
        monkeypatch.setattr(files, "_open_unnamed", lambda folder, **_: None)
    path = save_fixture(tmp_path / "x.safetensors", make_fixture(LAYOUT))
    real = files._exchange

    def arriving(a: Path, b: Path) -> bool:  # after the check, before the swap
        path.unlink()
        make(path)
        monkeypatch.setattr(files, "_exchange", real)
        return bool(real(a, b))

    monkeypatch.setattr(files, "_exchange", arriving)
    with pytest.raises(files.NotRegularFileError, match=f"not replaced: it became {kind}"):
        save_fixture(path, make_fixture(LAYOUT, seed=1), overwrite=True)
    assert (stat.S_ISFIFO if kind == "a FIFO" else stat.S_ISLNK)(os.lstat(path).st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("fallback", [False, True], ids=["unnamed", "named"])
def test_a_private_file_stays_private_while_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    if fallback:
        monkeypatch.setattr(files, "_open_unnamed", lambda folder, **_: None)
    path = tmp_path / "secret.bin"
    path.write_bytes(b"old")
    path.chmod(0o600)
    modes: list[int] = []

    def write(out: IO[bytes]) -> None:
        out.write(b"new")
        modes.append(stat.S_IMODE(os.fstat(out.fileno()).st_mode))
        modes.extend(stat.S_IMODE(p.stat().st_mode) for p in tmp_path.glob(".secret.bin.*.0"))

    files.atomic_write(path, write, overwrite=True)
    assert modes
    assert all(mode & 0o077 == 0 for mode in modes), [oct(m) for m in modes]
    assert len(modes) == (2 if fallback else 1)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == b"new"


def test_the_named_fallback_still_writes_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "_open_unnamed", lambda folder, **_: None)
    fixture = make_fixture(LAYOUT)
    path = save_fixture(tmp_path / "x.safetensors", fixture)
    save_fixture(path, fixture, overwrite=True)
    with pytest.raises(FileExistsError):
        save_fixture(path, fixture)
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]
    np.testing.assert_array_equal(load_fixture(path).packed, fixture.packed)


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
    assert str(target) in str(info.value)
    assert [p.name for p in tmp_path.iterdir()] == (["x.safetensors"] if overwrite else [])


def test_a_read_only_folder_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def read_only(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_CREAT | getattr(os, "O_TMPFILE", 0)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    target = tmp_path / "x.safetensors"
    with pytest.raises(OSError, match="Read-only file system") as info:
        save_fixture(target, make_fixture(LAYOUT))
    assert info.value.filename == str(target)


@pytest.mark.skipif(
    os.name != "posix" or os.geteuid() == 0, reason="permissions do not bind the superuser"
)
def test_a_folder_without_write_permission_names_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError) as info:
            save_fixture(folder / "x.safetensors", make_fixture(LAYOUT))
        assert str(folder / "x.safetensors") in str(info.value)
    finally:
        folder.chmod(0o755)


def test_a_record_under_another_name_cannot_reclaim_a_live_writers_temporaries(
    tmp_path: Path,
) -> None:
    with files.Temporaries(tmp_path / "suite") as live:
        built = live.new()
        built.mkdir()
        # Anyone who lists the folder sees the token; a record of their own names the build.
        lines = [
            {"magic": "gdn-layout temporaries", "token": live.token, "target": "suite"},
            {"name": built.name, "role": "new"},
        ]
        forged = tmp_path / f".other.{live.token}.gdn-lock"
        forged.write_text("".join(json.dumps(line) + "\n" for line in lines))
        files.remove_abandoned(tmp_path)
        assert built.is_dir()
        built.rmdir()


@pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0, reason="only the superuser gives files away"
)
@pytest.mark.parametrize("fallback", [False, True], ids=["unnamed", "named"])
def test_a_replaced_file_keeps_its_setuid_bits_and_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: bool
) -> None:
    if fallback:
        monkeypatch.setattr(files, "_open_unnamed", lambda folder, **_: None)
    fixture = make_fixture(LAYOUT)
    path = save_fixture(tmp_path / "x.safetensors", fixture)
    os.chown(path, 65534, 65534)
    path.chmod(0o6755)
    save_fixture(path, fixture, overwrite=True)
    status = path.stat()
    assert (stat.S_IMODE(status.st_mode), status.st_uid, status.st_gid) == (0o6755, 65534, 65534)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["a\nb.safetensors", "\u00e9" * 60 + ".safetensors", "\U0001f600" * 55 + ".st"]
)
def test_odd_names_are_written_replaced_and_cleaned_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(files, "_open_unnamed", lambda folder, **_: None)  # named temporaries
    _kill_mid_write(tmp_path / name, "named")  # leaves a temporary and its record
    assert len(_others(tmp_path)) == 2
    fixture = make_fixture(LAYOUT)
    path = save_fixture(tmp_path / name, fixture)  # reclaims them first
    assert _others(tmp_path) == [name]
    save_fixture(path, fixture, overwrite=True)
    assert _others(tmp_path) == [name]
