"""Writes leave nothing behind, even when the writer is killed, and their errors name the file."""

from __future__ import annotations

import errno
import importlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout
from gdn_layout.fixtures import load_fixture, make_fixture, save_fixture

files = importlib.import_module("gdn_layout._files")
codec = importlib.import_module("gdn_layout._safetensors")

LAYOUT = GdnBackwardLayout(1, 3, 2, 4)

#: Saves a fixture, stopping for good halfway through its data: the parent kills it there.
_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import gdn_layout._files as files
    import gdn_layout._safetensors as codec
    from gdn_layout import GdnBackwardLayout
    from gdn_layout.fixtures import make_fixture, save_fixture

    if sys.argv[2] == "named":
        files._open_unnamed = lambda folder: None  # as where O_TMPFILE is not available

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


@pytest.mark.skipif(not hasattr(os, "O_TMPFILE"), reason="no unnamed temporary files here")
def test_a_writer_killed_mid_write_leaves_no_file(tmp_path: Path) -> None:
    _kill_mid_write(tmp_path / "x.safetensors", "unnamed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.name != "posix", reason="abandoned files are recognised by process id")
def test_a_killed_writers_named_temporary_is_removed_by_the_next_write(tmp_path: Path) -> None:
    _kill_mid_write(tmp_path / "x.safetensors", "named")
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".x.safetensors.")
    assert left.name.endswith(".tmp")
    assert left.stat().st_size >= 100_000
    # A temporary of a running writer (this process) stays; the abandoned one goes.
    alive = files.temporary_name(tmp_path / "y.safetensors")
    alive.write_bytes(b"in progress")
    save_fixture(tmp_path / "z.safetensors", make_fixture(LAYOUT))
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name, "z.safetensors"]


def test_the_named_fallback_still_writes_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "_open_unnamed", lambda folder: None)
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
