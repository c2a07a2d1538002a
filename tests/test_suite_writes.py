"""``write_suite`` is all or nothing: a complete suite appears at once, replaces a whole old one,
and concurrent runs end with one complete, consistent suite."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gdn_layout.generate import write_suite
from gdn_layout.suites import verify_suite
from support import run

generate = importlib.import_module("gdn_layout.generate")
files = importlib.import_module("gdn_layout.files._atomic")


def _next_write_cleans(root: Path) -> None:
    """What the next write of the suite ``root`` does first with what earlier ones left."""
    files._remove_abandoned(root, generate._of_a_suite, generate._not_a_suite)


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


@pytest.mark.slow
def test_overwrite_replaces_the_whole_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    # A failed replacement keeps the old suite as it was.
    with monkeypatch.context() as patch:
        _fail_after(patch, 3)
        with pytest.raises(RuntimeError):
            write_suite(root, seed=2, overwrite=True)
    assert _siblings(root) == ["suite"]
    assert _check_consistent(root)["seed"] == 1
    write_suite(root, seed=2, overwrite=True)
    assert _check_consistent(root)["seed"] == 2
    assert _siblings(root) == ["suite"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["model-weights.safetensors", "kernel-output.npy", "notes", ".hidden"]
)
def test_overwrite_keeps_what_the_manifest_does_not_list(tmp_path: Path, name: str) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    (root / name).write_bytes(b"theirs")
    with pytest.raises(FileExistsError, match=rf"it holds {re.escape(name)}, which its manifest"):
        write_suite(root, seed=2, overwrite=True)
    assert (root / name).read_bytes() == b"theirs"
    (root / name).unlink()
    assert _check_consistent(root)["seed"] == 1
    assert _siblings(root) == ["suite"]


@pytest.mark.parametrize(
    ("manifest", "why"),
    [
        (None, "it has no manifest.json"),
        ('{"fixtures": []}', "its manifest.json is not one gdn-layout wrote"),
        ('{"format": "gdn-layout-fixture-suite"', "its manifest.json is not JSON"),
        (b"\xff", "its manifest.json is not JSON"),
    ],
)
def test_overwrite_refuses_a_folder_that_is_not_a_suite(
    tmp_path: Path, manifest: str | bytes | None, why: str
) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "weights.safetensors").write_bytes(b"keep me")
    if manifest is not None:
        raw = manifest if isinstance(manifest, bytes) else manifest.encode()
        (root / "manifest.json").write_bytes(raw)
    with pytest.raises(FileExistsError, match=f"models is not replaced: {why}"):
        write_suite(root, overwrite=True)
    assert (root / "weights.safetensors").read_bytes() == b"keep me"
    assert _siblings(root) == ["models"]


@pytest.mark.slow
def test_the_command_line_keeps_a_folders_own_files(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "weights.safetensors").write_bytes(b"keep me")
    result = subprocess.run(
        [sys.executable, "-m", "gdn_layout", "fixture", "--suite", str(root), "--force"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "models is not replaced: it has no manifest.json" in result.stderr
    assert (root / "weights.safetensors").read_bytes() == b"keep me"


#: Replaces the suite at argv[1] (seed 2 over seed 1) with three fixtures, and stops at the
#: argv[2]-th call of a file-system operation of the replacement: SIGKILL (argv[3] "kill")
#: or SIGINT ("int"), before the call or after it (argv[4]); argv[5] "fallback" replaces as
#: where renameat2 is unavailable. Prints how many such calls a whole replacement made.
_STOPPED = textwrap.dedent(
    """
    import os, shutil, signal, sys
    import gdn_layout.files._atomic as files
    import gdn_layout.generate as generate

    cases = list(generate._suite_cases())[:3]
    generate._suite_cases = lambda: iter(cases)
    root, stop, how, when, mode = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
    if mode == "fallback":
        files._exchange = lambda a, b: False
    calls = [0]

    def stopping(real):
        def call(*args, **kwargs):
            calls[0] += 1
            at = calls[0] == stop
            if at and when == "before":
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGINT)
            try:
                return real(*args, **kwargs)
            finally:  # returned or raised
                if at and when == "after":
                    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGINT)
        return call

    real_install = files._install

    def install(*args, **kwargs):
        os.rename, os.unlink, os.rmdir = map(stopping, (os.rename, os.unlink, os.rmdir))
        files._exchange = stopping(files._exchange)
        return real_install(*args, **kwargs)

    files._install = install
    generate.write_suite(root, seed=2, overwrite=True)
    print(calls[0])
    """
)


def _stopped_replace(root: Path, stop: int, how: str, when: str, mode: str) -> tuple[int, str]:
    result = subprocess.run(
        [sys.executable, "-c", _STOPPED, str(root), str(stop), how, when, mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_a_replacement_stopped_anywhere_leaves_one_complete_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    cases = list(generate._suite_cases())[:3]
    monkeypatch.setattr(generate, "_suite_cases", lambda: iter(cases))
    first = tmp_path / "first" / "suite"
    write_suite(first, seed=1)
    shutil.copytree(first.parent, tmp_path / "count")
    code, out = _stopped_replace(tmp_path / "count" / "suite", 0, "kill", "before", mode)
    assert code == 0
    calls = int(out)
    assert calls >= 3
    # Killed after one call is killed before the next; an interrupt runs handlers between.
    stops = [(k, how, "before") for k in range(1, calls + 1) for how in ("kill", "int")]
    stops += [(k, "int", "after") for k in range(1, calls + 1)] + [(calls, "kill", "after")]
    roots = [tmp_path / str(i) / "suite" for i in range(len(stops))]
    for root in roots:
        shutil.copytree(first.parent, root.parent)
    with ThreadPoolExecutor(2) as pool:  # each in a folder of its own, two at a time
        runs = [
            pool.submit(_stopped_replace, r, *stop, mode)
            for r, stop in zip(roots, stops, strict=True)
        ]
        codes = [run.result()[0] for run in runs]
    seen = set()
    for root, stop, code in zip(roots, stops, codes, strict=True):
        assert code != 0, stop
        if mode == "exchange":  # the path is never without a complete suite
            assert verify_suite(root) == [], stop
        _next_write_cleans(root)
        assert _siblings(root) == ["suite"], stop
        assert verify_suite(root) == [], stop
        seen.add(_check_consistent(root)["seed"])
    assert seen == {1, 2}  # stopped before the swap, the old suite; after it, the new one


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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("given", [".", "..", "here"])
def test_the_current_folder_or_one_holding_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    # A suite takes its folder's place: the current folder would be left deleted.
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    where = {"here": str(here)}.get(given, given)
    with pytest.raises(ValueError, match=r"is the current folder or holds it.*such as '"):
        write_suite(where, overwrite=True)
    assert os.path.samefile(os.getcwd(), here)
    assert list(here.iterdir()) == []
    assert write_suite("suite")[0].parent == Path("suite")
    _check_consistent(here / "suite")


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [True, False], ids=["exchanged", "renamed aside"])
def test_a_file_that_arrives_during_a_replacement_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    real, checks = generate._not_a_suite, []

    def arriving(folder: Path) -> str | None:
        checks.append(folder)
        why: str | None = real(folder)
        if len(checks) == 2:  # the check just before the move passed; then a file arrives
            (root / "weights.safetensors").write_bytes(b"theirs")
        return why

    monkeypatch.setattr(generate, "_not_a_suite", arriving)
    with pytest.raises(FileExistsError, match=r"it holds weights\.safetensors"):
        write_suite(root, seed=2, overwrite=True)
    assert (root / "weights.safetensors").read_bytes() == b"theirs"
    (root / "weights.safetensors").unlink()
    assert _check_consistent(root)["seed"] == 1
    assert _siblings(root) == ["suite"]


def test_a_manifest_whose_file_names_are_not_strings_is_not_a_suite(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    manifest = {"format": "gdn-layout-fixture-suite", "fixtures": [{"file": ["w"]}]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FileExistsError, match=r"its manifest\.json is not one gdn-layout wrote"):
        write_suite(root, overwrite=True)
    assert _siblings(root) == ["models"]


def _kept_aside(parent: Path) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(".suite.") and p.is_dir()]


@pytest.mark.slow
def test_an_interrupt_just_after_the_exchange_loses_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    real = files._exchange

    def interrupted(a: Path, b: Path) -> bool:
        (root / "weights.safetensors").write_bytes(b"theirs")  # after the check, before the swap
        real(a, b)
        raise KeyboardInterrupt  # as Ctrl-C lands the instant after the swap

    monkeypatch.setattr(files, "_exchange", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_suite(root, seed=2, overwrite=True)
    monkeypatch.setattr(files, "_exchange", real)
    assert _check_consistent(root)["seed"] == 2  # the new suite is in place
    (aside,) = _kept_aside(tmp_path)  # of the old one, its manifest and the file not its own
    assert sorted(os.listdir(aside)) == ["manifest.json", "weights.safetensors"]
    _next_write_cleans(root)
    assert (aside / "weights.safetensors").read_bytes() == b"theirs"
    (aside / "weights.safetensors").unlink()  # once it holds only its own, it goes
    _next_write_cleans(root)
    assert _siblings(root) == ["suite"]


_KILLED_AFTER_EXCHANGE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    import gdn_layout.files._atomic as files
    import gdn_layout.generate as generate

    generate._SUITE_SHAPES = generate._SUITE_SHAPES[:1]
    root, real = Path(sys.argv[1]), files._exchange

    def killed(a, b):
        (root / "weights.safetensors").write_bytes(b"theirs")
        real(a, b)
        os.kill(os.getpid(), signal.SIGKILL)

    files._exchange = killed
    generate.write_suite(root, seed=2, overwrite=True)
    """
)


@pytest.mark.slow
def test_a_kill_just_after_the_exchange_loses_no_file(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_AFTER_EXCHANGE, str(root)], timeout=120, check=False
    )
    assert done.returncode == -9
    write_suite(root, seed=3, overwrite=True)  # reclaims what it may, first
    assert _check_consistent(root)["seed"] == 3
    (aside,) = _kept_aside(tmp_path)
    assert (aside / "weights.safetensors").read_bytes() == b"theirs"


@pytest.mark.slow
def test_a_suite_left_aside_goes_back_only_to_a_free_place(tmp_path: Path) -> None:
    # A replacement by two renames, stopped between them: the old suite lies aside.
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    aside = files._temporary(root)
    os.rename(root, aside)
    root.mkdir()  # someone's folder takes the place: theirs is kept, the old suite goes
    theirs = os.stat(root).st_ino
    _next_write_cleans(root)
    assert os.stat(root).st_ino == theirs
    assert _siblings(root) == ["suite"]
    root.rmdir()
    write_suite(root, seed=1)
    os.rename(root, aside)
    _next_write_cleans(root)  # the place is free: it goes back
    assert _check_consistent(root)["seed"] == 1
    assert _siblings(root) == ["suite"]


def test_the_command_line_refuses_the_current_folder_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    done = run("fixture", "--suite", ".", "--force")
    assert done.returncode == 2
    assert done.stderr == (
        "gdn-layout fixture: error: --suite '.' is the current folder or holds it: a suite "
        "takes the place of its folder, which would leave the current one deleted; give a "
        "folder inside it, such as 'suite'\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_replaced_suite_keeps_its_folder_s_mode(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    root.chmod(0o700)
    write_suite(root, seed=2, overwrite=True)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert _check_consistent(root)["seed"] == 2


@pytest.mark.slow
def test_a_listed_file_that_is_a_symbolic_link_is_named_so(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    (name, *_) = (p.name for p in write_suite(root, seed=1))
    (tmp_path / "elsewhere.safetensors").write_bytes((root / name).read_bytes())
    (root / name).unlink()
    (root / name).symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(FileExistsError, match=rf"the files {re.escape(name)} it lists are not"):
        write_suite(root, seed=2, overwrite=True)
    assert (root / name).is_symlink()


@pytest.mark.slow
def test_a_reader_sees_the_old_suite_or_the_new_one_whole(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    stop = threading.Event()
    problems: list[list[str]] = []

    def read() -> int:
        reads = 0
        while not stop.is_set():
            problems.append(verify_suite(root))
            reads += 1
        return reads

    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(read)
        for seed in range(2, 6):
            write_suite(root, seed=seed, overwrite=True)
        stop.set()
        assert reader.result() > 0
    assert all(found == [] for found in problems), [p for p in problems if p][:3]


def test_the_command_line_refuses_a_mount_point_in_one_line(tmp_path: Path) -> None:
    point = tmp_path / "mnt"
    point.mkdir()
    if subprocess.run(["mount", "--bind", point, point], capture_output=True).returncode:
        pytest.skip("no bind mount can be made here")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(generate, "_SUITE_SHAPES", generate._SUITE_SHAPES[:1])
            done = run("fixture", "--suite", str(point))
    finally:
        subprocess.run(["umount", point], check=True)
    assert done.returncode == 2
    assert done.stderr == (
        f"gdn-layout fixture: error: {point} is a mount point, which cannot be replaced; "
        "give a folder inside it\n"
    )
    assert _siblings(point) == ["mnt"]


@pytest.mark.slow
def test_a_new_suite_is_written_where_an_old_one_was_left_aside(tmp_path: Path) -> None:
    # Without overwrite a suite left aside by a stopped replacement is not put back in the
    # way of the new one: it goes, and the new one takes the place.
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    os.rename(root, files._temporary(root))
    write_suite(root, seed=2)
    assert _check_consistent(root)["seed"] == 2
    assert _siblings(root) == ["suite"]
