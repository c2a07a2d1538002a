"""``generate``: fixtures made from drawn inputs, and the standard suite, written all or nothing,
and what it covers.

``write_suite`` is all or nothing: a complete suite appears at once, replaces a whole old one,
and concurrent runs end with one complete, consistent suite.

The standard suite reaches every chunk boundary a kernel is likely to use, and a kernel that
drops its state at a boundary past the first suite's sequences fails it.
"""

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
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, unpack
from gdn_layout.files import Fixture, load_fixture, save_fixture
from gdn_layout.generate import draw_inputs, make_fixture, write_suite
from gdn_layout.reference import backward
from gdn_layout.regimes import REGIME_SINCE, REGIMES
from gdn_layout.suites import Case, make_case, verify_suite
from support import DTYPES, FLAGS, assert_same_fixture, dtype_id, run, same_bits

generate = importlib.import_module("gdn_layout.generate")
files = importlib.import_module("gdn_layout.files._atomic")


def _next_write_cleans(root: Path) -> None:
    """What the next write of the suite ``root`` does first with what earlier ones left."""
    files._remove_abandoned(root, generate._of_a_suite, generate._not_a_suite)


@pytest.fixture
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


@pytest.mark.usefixtures("small_suite")
def test_a_folder_with_other_files_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    root.mkdir()
    (root / "rlx-b2s5h3n8-scalar-nostate-zero.safetensors").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="exists and is not empty; pass overwrite=True"):
        write_suite(root)
    assert [p.name for p in root.iterdir()] == ["rlx-b2s5h3n8-scalar-nostate-zero.safetensors"]
    assert _siblings(root) == ["suite"]


@pytest.mark.usefixtures("small_suite")
def test_a_failed_suite_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "suite"
    _fail_after(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        write_suite(root)
    assert _siblings(root) == []


@pytest.mark.slow
def test_a_suite_does_not_depend_on_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A few of the standard shapes, so that the test stays short; the suite's own order.
    shapes = generate._SUITE_SHAPES
    monkeypatch.setattr(generate, "_SUITE_SHAPES", (*shapes[:3], shapes[-1]))
    folders = {}
    for workers in (1, 3):
        seen: list[float] = []
        root = tmp_path / f"w{workers}"
        write_suite(root, seed=100, workers=workers, progress=seen.append)
        assert seen == sorted(seen)
        assert seen[-1] == 1.0
        folders[workers] = {p.name: p.read_bytes() for p in sorted(root.iterdir())}
    assert folders[1] == folders[3]
    assert len(folders[1]) == 1 + 4 * 2 * 2 * len(generate.REGIMES)  # and manifest


def test_a_worker_process_ending_abruptly_is_a_runtime_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Killed:  # a pool whose processes die, as the system's OOM killer leaves it
        def __init__(self, **_: Any) -> None:
            pass

        def __enter__(self) -> Killed:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def submit(self, *_: object) -> Future[Any]:
            future: Future[Any] = Future()
            future.set_exception(BrokenProcessPool("A process in the pool was terminated"))
            return future

    monkeypatch.setattr(generate, "ProcessPoolExecutor", Killed)
    root = tmp_path / "suite"
    with pytest.raises(RuntimeError, match=r"^write_suite: a worker process ended abruptly"):
        write_suite(root, workers=2)
    assert _siblings(root) == []


@pytest.mark.slow
def test_a_case_failing_in_a_worker_process_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The workers are other processes: the failure comes back from one of them, the
    # parent's monkeypatches not reaching it.
    good = list(generate._suite_cases())[:5]
    bad = good[-1]._replace(regime="no-such-regime")
    monkeypatch.setattr(generate, "_suite_cases", lambda: iter([*good, bad]))
    root = tmp_path / "suite"
    with pytest.raises(ValueError, match="no-such-regime"):
        write_suite(root, workers=2)
    assert _siblings(root) == []


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
@pytest.mark.slow
def test_a_replaced_suite_keeps_its_folder_s_mode(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    root.chmod(0o700)
    write_suite(root, seed=2, overwrite=True)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert _check_consistent(root)["seed"] == 2


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
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


@pytest.mark.usefixtures("small_suite")
def test_the_command_line_refuses_a_mount_point_in_one_line(tmp_path: Path) -> None:
    point = tmp_path / "mnt"
    point.mkdir()
    if subprocess.run(["mount", "--bind", point, point], capture_output=True).returncode:
        pytest.skip("no bind mount can be made here")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(generate, "_SUITE_SHAPES", generate._SUITE_SHAPES[:1])
            done = run("fixture", "--suite", str(point), "--quiet")  # its error alone
    finally:
        subprocess.run(["umount", point], check=True)
    assert done.returncode == 2
    assert done.stderr == (
        f"gdn-layout fixture: error: {point} is a mount point, which cannot be replaced; "
        "give a folder inside it\n"
    )
    assert _siblings(point) == ["mnt"]


@pytest.mark.usefixtures("small_suite")
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


CASES = list(generate._suite_cases())


@pytest.mark.parametrize("chunk", generate.CHUNK_SIZES)
@pytest.mark.parametrize("regime", REGIMES)
def test_every_regime_crosses_two_boundaries_of_every_chunk_size(chunk: int, regime: str) -> None:
    layouts = [c.layout for c in CASES if c.regime == regime]
    assert max(layout.seq for layout in layouts) > 2 * chunk
    for per_channel in (False, True):
        for carry in (False, True):
            assert any(
                (layout.seq - 1) // chunk >= 2
                and (layout.gate_per_channel, layout.carry_state) == (per_channel, carry)
                for layout in layouts
            )


@pytest.mark.parametrize("chunk", generate.CHUNK_SIZES)
def test_a_last_chunk_of_one_step_and_one_short_of_full(chunk: int) -> None:
    seqs = {c.layout.seq for c in CASES}
    assert any(seq % chunk == 1 for seq in seqs if seq > chunk)
    assert any(seq % chunk == chunk - 1 for seq in seqs)


def test_n128_reaches_256_steps_and_identical_rows_are_there() -> None:
    assert any(c.layout.state_size == 128 and c.layout.seq >= 256 for c in CASES)
    twins = [c for c in CASES if c.identical_rows]
    assert {c.regime for c in twins} == set(REGIMES)
    assert all(c.layout.batch >= 2 and c.layout.seq > 128 for c in twins)


def test_identical_rows_hold_the_same_inputs_and_gradients() -> None:
    case = next(c for c in CASES if c.identical_rows and c.layout.carry_state)
    fixture = generate._identical_rows_fixture(case.layout, np.dtype(np.float32), "mixed", 5)
    for name, array in fixture.tensors().items():
        rows = unpack(array, case.layout) if name == "packed" else [array]
        for part in rows:
            if part is not None:
                assert all(np.array_equal(part[0], part[b]) for b in range(1, len(part))), name


def test_the_manifest_records_the_boundaries_each_case_crosses() -> None:
    assert generate.boundaries_crossed(513) == {16: 32, 32: 16, 64: 8, 128: 4, 256: 2}
    assert generate.boundaries_crossed(256) == {16: 15, 32: 7, 64: 3, 128: 1, 256: 0}
    assert generate.boundaries_crossed(1) == dict.fromkeys(generate.CHUNK_SIZES, 0)
    assert generate.boundaries_crossed(0) == dict.fromkeys(generate.CHUNK_SIZES, 0)


def _dropped_state(fixture: Fixture, t: int, dtype: Any) -> NDArray[Any]:
    """A chunked kernel that forgets the state at step ``t``: two independent scans."""
    x, layout = fixture.inputs, fixture.layout
    q, k, v, g, beta, dy = x[:6]
    head = backward(
        q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], dy[:, :t], x.state, dtype=dtype
    )
    tail = backward(q[:, t:], k[:, t:], v[:, t:], g[:, t:], beta[:, t:], dy[:, t:], dtype=dtype)
    first = unpack(head, GdnBackwardLayout.from_inputs(x.q[:, :t], x.g[:, :t], x.state))
    second = unpack(tail, GdnBackwardLayout.from_inputs(x.q[:, t:], x.g[:, t:]))
    out = np.empty(layout.total_elems, dtype)
    grads = unpack(out, layout)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        getattr(grads, name)[:, :t] = getattr(first, name)
        getattr(grads, name)[:, t:] = getattr(second, name)
    if grads.dstate is not None:
        grads.dstate[...] = first.dstate
    return out


@pytest.mark.slow
@pytest.mark.parametrize("t", [48, 128, 256])
@pytest.mark.parametrize("regime", REGIMES)
def test_a_state_dropped_past_the_first_suites_sequences_fails(t: int, regime: str) -> None:
    # The first suite's longest sequence was 100: a state dropped at 128 or 256 passed it.
    # The chunk-boundary shapes, in two of their gate and state modes.
    cases = [
        c
        for c in CASES
        if c.regime == regime
        and c.layout.seq > t
        and c.name.startswith(("s255", "s513"))
        and c.layout.gate_per_channel != c.layout.carry_state
    ]
    assert cases
    caught = above_rounding = 0
    for case in cases:
        fixture = generate.make_fixture(case.layout, regime=regime, seed=7)
        truth = np.asarray(fixture.packed, np.float64)
        change = np.abs(_dropped_state(fixture, t, np.float64) - truth).max()
        if change <= 1e-5 * np.sqrt(np.mean(np.square(truth))):
            continue  # the decay erased the state before t: nothing to catch in float32
        above_rounding += 1
        result = compare(
            _dropped_state(fixture, t, np.float32),
            fixture.packed,
            fixture.layout,
            floors=fixture.floors,
        )
        caught += not result.passed
    assert caught == above_rounding
    if regime in ("zero", "mild", "mixed"):  # the state lives past t: the change is there
        assert above_rounding > 0


def test_a_kernel_wrong_past_the_first_row_is_named_on_identical_rows() -> None:
    case = next(c for c in CASES if c.identical_rows and c.regime == "mixed")
    fixture = generate._identical_rows_fixture(case.layout, np.dtype(np.float32), "mixed", 11)
    suite_case = Case(case.name, fixture)
    good = backward(*fixture.inputs, dtype=np.float32)
    suite_case.check(good)
    row_bug = good.copy()
    unpack(row_bug, case.layout).dv[1] *= 1.5  # only the second row is wrong
    with pytest.raises(AssertionError, match=r"row\(s\) 1 fail where the others pass") as info:
        suite_case.check(row_bug)
    assert "dv" in str(info.value)
    everywhere = good.copy()
    unpack(everywhere, case.layout).dv[...] *= 1.5  # every row wrong alike: no such line
    with pytest.raises(AssertionError) as info:
        suite_case.check(everywhere)
    assert "identical inputs" not in str(info.value)
    other = make_case(GdnBackwardLayout(2, 5, 2, 4), seed=1)  # rows of their own
    wrong = backward(*other.inputs, dtype=np.float32)
    unpack(wrong, other.layout).dv[1] *= 1.5
    with pytest.raises(AssertionError) as info:
        other.check(wrong)
    assert "identical inputs" not in str(info.value)


CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
SMALL = GdnBackwardLayout(batch=2, seq=5, heads=3, state_size=4, carry_state=True)


# -- generation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("per_channel", "carry"), FLAGS)
def test_make_fixture_stores_the_answer_for_its_stored_inputs(
    dtype: np.dtype[Any], per_channel: bool, carry: bool
) -> None:
    # One step has a closed form (gated-delta-net.md: c = 1/sqrt(N), S_1 = A*S_0 + outer(k, u) with
    # u = beta * (v - k @ (A*S_0))), computed here from the stored inputs in float64: the
    # fixture must hold it up to the final rounding to its dtype.
    layout = GdnBackwardLayout(2, 1, 3, 4, gate_per_channel=per_channel, carry_state=carry)
    fixture = make_fixture(layout, dtype=dtype, regime="strong", seed=11)
    assert fixture.dtype == dtype
    assert fixture.compute_dtype == "float64"
    assert (fixture.regime, fixture.seed) == ("strong", 11)
    assert all(a.dtype == dtype for a in fixture.tensors().values())
    q, k, v, g, beta, dy = (np.asarray(a, dtype=np.float64) for a in fixture.inputs[:6])
    c, b = 1 / np.sqrt(layout.state_size), beta[..., None]
    decay = np.exp(g)[..., None] if per_channel else np.exp(g)[..., None, None]
    if carry:
        assert fixture.state is not None
        prior = decay[:, 0] * np.asarray(fixture.state, dtype=np.float64)  # [B, H, N, N]
        m = np.einsum("bhi,bhij->bhj", k[:, 0], prior)
        u = (v[:, 0] - m) * b[:, 0]
        state = prior + k[:, 0, :, :, None] * u[:, :, None, :]
        y = c * np.einsum("bhi,bhij->bhj", q[:, 0], state)[:, None]
    else:
        y = c * b * v * (k * q).sum(-1, keepdims=True)
    eps = float(ml_dtypes.finfo(dtype).eps)  # type: ignore[no-untyped-call]
    np.testing.assert_allclose(np.asarray(fixture.y, np.float64), y, rtol=eps, atol=eps)
    if not carry:  # and the gradients of sum(y * dy), by hand
        kq, dyv = (k * q).sum(-1, keepdims=True), (dy * v).sum(-1, keepdims=True)
        expected = {
            "dq": c * b * dyv * k,
            "dk": c * b * dyv * q,
            "dv": c * b * kq * dy,
            "dg": np.zeros(layout.shape("dg")),  # no state before the one step to decay
            "dbeta": c * (dyv * kq)[..., 0],
        }
        for name, value in expected.items():
            got = np.asarray(getattr(fixture.grads, name), np.float64)
            np.testing.assert_allclose(got, value, rtol=eps, atol=eps, err_msg=name)


def test_make_fixture_is_deterministic(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(1, 4, 2, 4, carry_state=True)
    a, b = make_fixture(layout, seed=3), make_fixture(layout, seed=3)
    assert_same_fixture(a, b)
    assert not same_bits(make_fixture(layout, seed=4).q, a.q)
    path = save_fixture(tmp_path / "a.safetensors", a)
    assert_same_fixture(load_fixture(path), a)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_channel", [False, True])
def test_draw_inputs_regimes(dtype: np.dtype[Any], per_channel: bool) -> None:
    layout = GdnBackwardLayout(2, 64, 3, 16, gate_per_channel=per_channel, carry_state=True)
    tol = {8: 1e-12, 4: 1e-6, 2: 2e-2}[dtype.itemsize]
    gates = {}
    for regime in REGIMES:
        x = draw_inputs(layout, regime=regime, seed=5, dtype=dtype)
        assert all(a is not None and a.dtype == dtype for a in x)
        assert x.g.shape == layout.shape("dg")
        assert x.state is not None
        for name in ("q", "k"):
            norms = np.linalg.norm(getattr(x, name).astype(np.float64), axis=-1)
            np.testing.assert_allclose(norms, 1.0, atol=tol, err_msg=name)
        beta = x.beta.astype(np.float64)
        assert beta.min() > 0.0
        assert beta.max() < 1.0
        for name in ("v", "dy", "state"):
            values = getattr(x, name).astype(np.float64)
            assert abs(values.mean()) < 0.1, name
            assert 0.9 < values.std() < 1.1, name
        gates[regime] = x.g.astype(np.float64)
    assert not gates["zero"].any()
    assert gates["mild"].max() < 0.0
    assert gates["mild"].min() >= -0.1 - tol
    assert np.exp(gates["mild"]).min() > 0.9
    assert gates["strong"].max() <= -3.0 + tol * 8
    assert gates["strong"].min() >= -8.0 - tol * 8
    assert np.exp(gates["strong"]).max() < 0.051
    mixed = gates["mixed"]
    fractions = [np.mean(mixed == 0), np.mean((mixed < 0) & (mixed > -1)), np.mean(mixed <= -3)]
    assert sum(fractions) == pytest.approx(1.0)
    assert all(0.25 < f < 0.42 for f in fractions), fractions
    extreme = gates["extreme"]
    assert extreme.max() <= -10.0 + tol * 30
    assert extreme.min() >= -30.0 - tol * 30
    assert extreme.std() > 5.0  # spread over the range, not stuck at one end
    # qwen: g = -exp(A_log) * softplus(a + dt_bias), exp(A_log) in [1, 16] per head, so
    # g / -softplus is one constant per head; with a ~ N(0, 1) and |dt_bias| <= 1, softplus
    # lies in (0, 7) and the gates in (-112, 0).
    qwen = gates["qwen"]
    assert qwen.max() < 0.0
    assert qwen.min() > -112.0
    if dtype.itemsize == 8:
        heads = np.moveaxis(qwen, 2, 0).reshape(layout.heads, -1)
        ranges = heads.max(axis=1) - heads.min(axis=1)
        assert (ranges > 0.5).all()  # a varies per step (and per channel)


def test_qwen_gates_decay_at_a_rate_per_head() -> None:
    # -g = exp(A_log) * softplus(a + dt_bias): positive, below 16 * softplus(max a + 1), and
    # with exp(A_log) and dt_bias drawn per head, the heads' typical rates differ.
    for per_channel in (False, True):
        layout = GdnBackwardLayout(3, 40, 4, 4, gate_per_channel=per_channel)
        g = draw_inputs(layout, regime="qwen", seed=2, dtype=np.float64).g
        rates = -np.moveaxis(g, 2, 0).reshape(layout.heads, -1)
        assert (rates > 0).all()
        assert (rates < 16 * 7).all()
        medians = np.median(rates, axis=1)
        assert medians.max() / medians.min() > 1.5


def test_the_suite_s_manifest_lists_its_cases_in_order(suite: tuple[Path, list[Path]]) -> None:
    root, _ = suite
    entries = json.loads((root / "manifest.json").read_text())["fixtures"]
    listed = [(e["file"], e["regime"], e["seed"] - 100) for e in entries]  # written with seed 100
    assert listed == [(c.name, c.regime, i) for i, c in enumerate(generate._suite_cases())]


def test_each_revision_of_the_suite_keeps_its_files_names_and_seeds() -> None:
    # Each revision's (seed, name, regime), pinned: later revisions add files after them, so
    # their files keep their seeds and bytes. Revision 0 is gdn-layout 0.1.0's suite; 1 added
    # the qwen and extreme regimes, 2 the chunk-boundary shapes.
    cases = list(generate._suite_cases())
    assert len(cases) == len(generate._SUITE_SHAPES) * 2 * 2 * len(REGIMES)
    pinned = {
        0: "8a3b5453f5f9c13efff53ab232b766e2de1e84e3047a76435c8fd5996b2f1b6a",
        2: "6ad52ccdcb27c350cb9a787eb021f62254dd56f2c900119fb13a87ca3d92048c",
    }
    for revision, digest in pinned.items():
        lines = [f"{i} {c.name} {c.regime}" for i, c in enumerate(cases) if c.since <= revision]
        assert hashlib.sha256("\n".join(lines).encode()).hexdigest() == digest, revision
    assert {c.regime for c in cases if c.since == 1} == {"qwen", "extreme"}


def test_draw_inputs_streams_are_independent() -> None:
    base = GdnBackwardLayout(1, 6, 2, 4)
    a = draw_inputs(base, regime="zero", seed=9)
    b = draw_inputs(
        GdnBackwardLayout(1, 6, 2, 4, gate_per_channel=True, carry_state=True),
        regime="strong",
        seed=9,
    )
    for name in ("q", "k", "v", "beta", "dy"):
        assert same_bits(getattr(a, name), getattr(b, name)), name
    assert same_bits(draw_inputs(base, seed=9).q, a.q)
    assert not same_bits(draw_inputs(base, seed=10).q, a.q)


def test_draw_inputs_rejects_bad_arguments() -> None:
    regimes = re.escape(str(REGIMES))
    with pytest.raises(
        ValueError, match=rf"draw_inputs: regime must be one of {regimes}, got 'hot'"
    ):
        draw_inputs(SMALL, regime="hot")
    dtypes = "float64, float32, float16 or bfloat16"
    with pytest.raises(TypeError, match=f"draw_inputs: dtype must be {dtypes}, got int32"):
        draw_inputs(SMALL, dtype=np.int32)
    with pytest.raises(TypeError, match="got 'float17'"):
        draw_inputs(SMALL, dtype="float17")
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        draw_inputs(SMALL, seed=-1)
    with pytest.raises(
        TypeError, match=r"draw_inputs: seed must be a non-negative integer, got float 1\.5"
    ):
        draw_inputs(SMALL, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layout must be a GdnBackwardLayout, got tuple"):
        draw_inputs((1, 2, 3, 4))  # type: ignore[arg-type]


# -- the suite -----------------------------------------------------------------------------------


def test_suite_manifest_lists_every_file(suite: tuple[Path, list[Path]]) -> None:
    root, paths = suite
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["format"] == "gdn-layout-fixture-suite"
    assert manifest["dtype"] == "F32"
    entries = manifest["fixtures"]
    assert sorted(e["file"] for e in entries) == sorted(p.name for p in root.glob("*.safetensors"))
    assert [root / e["file"] for e in entries] == paths
    assert sorted(e["seed"] for e in entries) == list(range(100, 100 + len(entries)))
    for entry in entries:
        path = root / entry["file"]
        fixture = load_fixture(path)
        assert fixture.layout.to_dict() == entry["layout"]
        assert (fixture.regime, fixture.seed) == (entry["regime"], entry["seed"])
        assert CODES[fixture.dtype.name] == entry["dtype"]
        assert entry["bytes"] == path.stat().st_size
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_suite_coverage_and_size(suite: tuple[Path, list[Path]]) -> None:
    _root, paths = suite
    fixtures = [load_fixture(p) for p in paths]
    layouts = {f.layout for f in fixtures}
    combos = {(f.layout.gate_per_channel, f.layout.carry_state, f.regime) for f in fixtures}
    assert combos == {(pc, cs, r) for pc in (False, True) for cs in (False, True) for r in REGIMES}
    shapes = {(lay.batch, lay.seq, lay.heads, lay.state_size) for lay in layouts}
    for flags in FLAGS:
        same_flags = {
            (lay.batch, lay.seq, lay.heads, lay.state_size)
            for lay in layouts
            if (lay.gate_per_channel, lay.carry_state) == flags
        }
        assert same_flags == shapes  # every shape in every mode
    assert any(s == 1 for _, s, _, _ in shapes)
    assert any(n == 1 for *_, n in shapes)
    assert any(b > 1 and h > 1 for b, _, h, _ in shapes)
    assert any(s % 64 != 0 and s > 64 for _, s, _, _ in shapes)
    assert any(s % 64 == 1 and s > 64 for _, s, _, _ in shapes)
    total = sum(p.stat().st_size for p in paths)
    assert total < 128 * 2**20
    # The same set in float64 stays within twice that: every tensor byte doubles.
    tensor_bytes = sum(sum(a.nbytes for a in f.tensors().values()) for f in fixtures)
    assert total + tensor_bytes < 256 * 2**20


def test_suite_refuses_to_overwrite(suite: tuple[Path, list[Path]]) -> None:
    root, _ = suite
    with pytest.raises(FileExistsError, match=r"exists and is not empty; pass overwrite=True"):
        write_suite(root)


@pytest.mark.slow
def test_suite_is_reproducible(suite: tuple[Path, list[Path]]) -> None:
    _, paths = suite
    for path in paths[-30:-20]:  # the last of S = 513 and the first identical rows
        stored = load_fixture(path)
        assert stored.regime is not None
        assert stored.seed is not None
        if path.name.startswith("twin-"):
            again = generate._identical_rows_fixture(
                stored.layout, stored.dtype, stored.regime, stored.seed
            )
        else:
            again = make_fixture(stored.layout, regime=stored.regime, seed=stored.seed)
        assert_same_fixture(stored, again)


def _seeds(cases: Iterable[Any]) -> dict[str, int]:
    """Each suite case's file name and its seed's offset: file i has seed ``seed + i``."""
    return {case.name: i for i, case in enumerate(cases)}


def test_a_regime_appended_keeps_every_file_of_the_suite_its_name_and_seed() -> None:
    """Adding a gate regime is a change to gdn_layout.regimes alone: one more entry in its
    table, with a revision of its own. The suite gains every shape in it, after all of
    today's files, which keep their names and seeds (and so their bytes); a second regime
    appended after it moves none of the first one's."""
    table = REGIME_SINCE
    revision = max(*table.values(), *(shape.since for shape in generate._SUITE_SHAPES)) + 1
    today = _seeds(generate._suite_cases())
    one = _seeds(generate._suite_cases({**table, "new": revision}))
    two = _seeds(generate._suite_cases({**table, "new": revision, "newer": revision + 1}))
    assert len(today) == len(generate._SUITE_SHAPES) * 2 * 2 * len(REGIMES)
    for before, after, added in ((today, one, "new"), (one, two, "newer")):
        assert {name: after[name] for name in before} == before
        grown = set(after) - set(before)
        assert all(name.endswith(f"-{added}.safetensors") for name in grown)
        assert len(grown) == len(generate._SUITE_SHAPES) * 4  # both gate and state modes
        assert min(after[name] for name in grown) == len(before)


def test_a_shape_appended_keeps_every_file_of_the_suite_its_name_and_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shapes = generate._SUITE_SHAPES
    revision = max(*REGIME_SINCE.values(), *(shape.since for shape in shapes)) + 1
    today = _seeds(generate._suite_cases())
    added = generate._Case("s2", 1, 2, 1, 4, since=revision)
    monkeypatch.setattr(generate, "_SUITE_SHAPES", (*shapes, added))
    grown = _seeds(generate._suite_cases())
    assert {name: grown[name] for name in today} == today
    new = set(grown) - set(today)
    assert len(new) == 4 * len(REGIMES)
    assert all(name.startswith("s2-") for name in new)


# -- the digest of the suite's definition (the key of the pytest plugin's cached suite) ---------


def test_the_suite_s_digest_follows_its_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    float32 = np.dtype(np.float32)
    today = generate.suite_digest(float32)
    assert generate.suite_digest(float32) == today  # the same definition, the same digest
    digests = {today}

    def changed() -> None:
        digest = generate.suite_digest(float32)
        assert digest not in digests
        digests.add(digest)
        monkeypatch.undo()
        assert generate.suite_digest(float32) == today

    shapes = generate._SUITE_SHAPES
    revision = max(*REGIME_SINCE.values(), *(shape.since for shape in shapes)) + 1
    monkeypatch.setattr(generate, "_SUITE_SHAPES", (*shapes, generate._Case("s2", 1, 2, 1, 4)))
    changed()  # a shape added
    monkeypatch.setattr(generate, "_SUITE_SHAPES", shapes[:-1])
    changed()  # a shape removed
    last = shapes[-1]
    monkeypatch.setattr(generate, "_SUITE_SHAPES", (*shapes[:-1], last._replace(seq=last.seq + 1)))
    changed()  # a shape changed
    monkeypatch.setattr(generate, "REGIME_SINCE", dict(list(REGIME_SINCE.items())[:-1]))
    changed()  # a regime fewer
    monkeypatch.setattr(generate, "REGIME_SINCE", {**REGIME_SINCE, REGIMES[-1]: revision})
    changed()  # a regime's revision, and so every seed after it
    draw = generate.draw_gate

    def drawn_otherwise(rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> Any:
        gate = draw(rng, shape, regime)
        return gate * 2 if regime == REGIMES[-1] else gate

    monkeypatch.setattr(generate, "draw_gate", drawn_otherwise)
    changed()  # one regime's gates drawn otherwise
    monkeypatch.setattr(generate, "FORMAT_VERSION", generate.FORMAT_VERSION + 1)
    changed()  # another file format
    assert generate.suite_digest(float32, seed=1) not in digests
    for dtype in DTYPES:
        if dtype != float32:
            assert generate.suite_digest(dtype) not in digests


# -- the floors' step-by-step form on a sample of rows and heads --------------------------------


def test_no_case_of_the_suite_samples_its_step_by_step_floors() -> None:
    assert all(generate.sampled_pairs(case.layout) is None for case in generate._suite_cases())


def test_a_sample_spreads_over_rows_and_heads_first_and_last_among_them() -> None:
    pairs = generate.sampled_pairs(GdnBackwardLayout(3, 4096, 5, 64))
    assert pairs is not None
    assert len(pairs) == generate.SAMPLED_PAIRS
    assert (pairs[0], pairs[-1]) == ((0, 0), (2, 4))
    assert generate.sampled_pairs(GdnBackwardLayout(1, 4096, 1, 4096)) is None  # one pair


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_sampled_step_by_step_form_gives_the_whole_run_s_values_on_its_pairs(
    monkeypatch: pytest.MonkeyPatch, per_channel: bool
) -> None:
    from gdn_layout._floors import _measure
    from gdn_layout.files import GdnInputs
    from gdn_layout.reference._fused import fused_backward
    from gdn_layout.reference._states import step_by_step

    layout = GdnBackwardLayout(2, 40, 3, 8, gate_per_channel=per_channel, carry_state=True)
    monkeypatch.setattr(generate, "_SAMPLED_WORK", 1)
    pairs = generate.sampled_pairs(layout)
    assert pairs is not None
    x = draw_inputs(layout, regime="mixed", seed=5)
    wide = GdnInputs._make(None if a is None else a.astype(np.float64) for a in x)
    truth = generate._named(backward(*wide), generate.reference_outputs(wide, 16), layout)
    whole = generate._named(*step_by_step(*x, chunk=16), layout)
    few = GdnInputs._make(
        None if a is None else generate._pick(a, pairs, 1 if name == "state" else 2)
        for name, a in zip(GdnInputs._fields, x, strict=True)
    )
    sub = GdnBackwardLayout.from_inputs(few.q, few.g, few.state)
    part = generate._named(*step_by_step(*few, chunk=16), sub)
    for name in truth:
        low = generate._picked(name, np.asarray(whole[name]), layout, pairs)
        assert same_bits(low, np.asarray(part[name]).reshape(-1)), name
    floors = generate.correct_forms_floors(x, truth, 16, ("float32",))["float32"]
    chunked = generate._named(*fused_backward(*x, chunk=16)[:2], layout)
    figures = _measure([(name, chunked[name], truth[name]) for name in truth], ("float32",))
    assert set(floors) == set(truth)
    for name, (rms, peak) in figures["float32"].items():  # the chunked form ran whole
        assert floors[name][:2] >= (rms, peak)
