"""``write_suite`` is all or nothing: a complete suite appears at once, replaces a whole old one,
and concurrent runs end with one complete, consistent suite."""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gdn_layout.fixtures import write_suite

generate = importlib.import_module("gdn_layout.generate")


@pytest.fixture(autouse=True)
def small_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of the suite's shapes (32 fixtures) are enough to see how a suite is written."""
    monkeypatch.setattr(generate, "_SUITE_SHAPES", generate._SUITE_SHAPES[:2])


def _check_consistent(root: Path) -> dict[str, Any]:
    """The manifest lists exactly the files there, each with its size and SHA-256."""
    manifest: dict[str, Any] = json.loads((root / "manifest.json").read_text())
    listed = {entry["file"]: entry for entry in manifest["fixtures"]}
    assert {p.name for p in root.iterdir()} == {*listed, "manifest.json"}
    for name, entry in listed.items():
        data = (root / name).read_bytes()
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name
    seeds = [entry["seed"] for entry in manifest["fixtures"]]
    assert seeds == [manifest["seed"] + i for i in range(len(seeds))]
    return manifest


def _siblings(root: Path) -> list[str]:
    return sorted(p.name for p in root.parent.iterdir())


def _fail_after(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    real = generate.make_fixture
    made: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        if len(made) == count:
            raise RuntimeError("stopped on purpose")
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "make_fixture", failing)


def test_a_folder_with_other_files_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    root.mkdir()
    (root / "rlx-b2s5h3n8-scalar-nostate-zero.safetensors").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="exists and is not empty; pass overwrite=True"):
        write_suite(root)
    assert [p.name for p in root.iterdir()] == ["rlx-b2s5h3n8-scalar-nostate-zero.safetensors"]
    assert _siblings(root) == ["suite"]


def test_a_failed_suite_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "suite"
    _fail_after(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        write_suite(root)
    assert _siblings(root) == []


def test_overwrite_replaces_the_whole_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    (root / "stale-from-an-older-version.safetensors").write_bytes(b"stale")
    # A failed replacement keeps the old suite as it was.
    with monkeypatch.context() as patch:
        _fail_after(patch, 3)
        with pytest.raises(RuntimeError):
            write_suite(root, seed=2, overwrite=True)
    assert _siblings(root) == ["suite"]
    assert (root / "stale-from-an-older-version.safetensors").exists()
    write_suite(root, seed=2, overwrite=True)
    assert _check_consistent(root)["seed"] == 2
    assert _siblings(root) == ["suite"]


def test_overwrite_refuses_a_folder_that_is_not_a_suite(tmp_path: Path) -> None:
    root = tmp_path / "home"
    root.mkdir()
    (root / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"not replaced: it holds notes\.txt"):
        write_suite(root, overwrite=True)
    assert (root / "notes.txt").read_text() == "keep me"
    assert _siblings(root) == ["home"]


#: Writes a suite; with a folder as its third argument, pauses after 4 fixtures until the
#: file "go" appears there (after saying so with the file "paused").
_RUN = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import gdn_layout.generate as generate

    generate._SUITE_SHAPES = generate._SUITE_SHAPES[:2]
    if len(sys.argv) > 3:
        signals, real, made = Path(sys.argv[3]), generate.make_fixture, []

        def pausing(*args, **kwargs):
            if len(made) == 4:
                (signals / "paused").touch()
                while not (signals / "go").exists():
                    time.sleep(0.01)
            made.append(1)
            return real(*args, **kwargs)

        generate.make_fixture = pausing
    generate.write_suite(sys.argv[1], seed=int(sys.argv[2]), overwrite=True)
    """
)


def test_concurrent_runs_end_with_one_complete_suite(tmp_path: Path) -> None:
    # The worst interleaving, made deterministic: one run starts, the other runs from start
    # to end while the first is paused, then the first finishes.
    root, signals = tmp_path / "out" / "suite", tmp_path / "signals"
    signals.mkdir()
    first = subprocess.Popen([sys.executable, "-c", _RUN, str(root), "20", str(signals)])
    try:
        while not (signals / "paused").exists():
            assert first.poll() is None, "the first run ended before its pause"
            time.sleep(0.01)
        second = subprocess.run([sys.executable, "-c", _RUN, str(root), "10"], timeout=300)
        assert second.returncode == 0
        assert _check_consistent(root)["seed"] == 10
    finally:
        (signals / "go").touch()
        assert first.wait(timeout=300) == 0
    assert _check_consistent(root)["seed"] == 20
    assert _siblings(root) == ["suite"]


def test_the_current_folder_can_hold_a_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    paths = write_suite(".")
    assert paths[0] == Path(".") / paths[0].name
    _check_consistent(tmp_path / "here")
