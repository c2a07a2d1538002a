"""Files that change under a reader (docs/files.md, *Memory mapping*): truncated, rewritten
or replaced after they were loaded, a FIFO in place of a file. Each is a FixtureError naming the
file (or a problem ``verify`` lists), never a SIGBUS, a hang or a silent pass; what could
kill the process runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import gdn_layout.files._mapping
from gdn_layout import GdnBackwardLayout
from gdn_layout.files import FixtureError, load_fixture, save_fixture
from gdn_layout.generate import make_fixture
from gdn_layout.suites import MANIFEST, Case, load_suite, verify_suite
from support import deadline

#: Several pages of tensors, so that a truncation can cut whole pages out of a mapping.
LAYOUT = GdnBackwardLayout(1, 64, 2, 16, carry_state=True)
Suite = tuple[Path, list[Path]]

posix_only = pytest.mark.skipif(os.name != "posix", reason="SIGBUS, FIFOs and /proc are POSIX")


@pytest.fixture
def fixture_path(tmp_path: Path) -> Path:
    return save_fixture(tmp_path / "case.safetensors", make_fixture(LAYOUT, regime="mild", seed=1))


@pytest.fixture
def mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file is memory-mapped, however small (as files past the threshold are)."""
    monkeypatch.setattr(gdn_layout.files._mapping, "MAP_THRESHOLD", 0)


def _python(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter; a death by signal is reported, not suffered."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        pytest.fail(f"the process was killed by {name}:\n{done.stdout}\n{done.stderr}")
    return done


# -- a mapped fixture that changes ---------------------------------------------------------------

_TRUNCATE_THEN_CHECK = """
    import os, sys
    import numpy as np
    import gdn_layout.files._mapping
    from gdn_layout import FixtureError, load_fixture
    from gdn_layout.suites import Case

    path, keep = sys.argv[1], int(sys.argv[2])
    gdn_layout.files._mapping.MAP_THRESHOLD = 0  # mapped, as a file past the threshold is
    case = Case("case", load_fixture(path))
    actual = np.array(case.expected)  # a kernel that is exactly right
    os.truncate(path, keep)
    try:
        case.check(actual)
    except FixtureError as error:
        print("FixtureError:", error)
    else:
        print("passed")
"""


@pytest.mark.slow
@posix_only
@pytest.mark.parametrize("cut", [-4096, 8], ids=["pages", "within-the-last-page"])
def test_a_truncated_mapped_fixture_raises_naming_it(fixture_path: Path, cut: int) -> None:
    # Past the end of the file but inside its last page, a mapping reads zeros, no SIGBUS.
    keep = 4096 if cut < 0 else fixture_path.stat().st_size - cut
    done = _python(_TRUNCATE_THEN_CHECK, str(fixture_path), str(keep))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"FixtureError: {fixture_path}: changed since it was loaded")


@pytest.mark.slow
@posix_only
def test_the_command_line_refuses_a_fixture_truncated_after_it_was_opened(
    fixture_path: Path, tmp_path: Path
) -> None:
    actual = tmp_path / "actual.npy"
    np.save(actual, np.array(load_fixture(fixture_path).packed))
    script = """
        import os, sys
        import gdn_layout.files._mapping, gdn_layout.cli as cli

        gdn_layout.files._mapping.MAP_THRESHOLD = 0
        layout = cli._layout

        def truncating(args, sources=()):  # between opening the files and comparing them
            os.truncate(sys.argv[2], 4096)
            return layout(args, sources)

        cli._layout = truncating
        sys.exit(cli.main(["compare", sys.argv[1], sys.argv[2]]))
    """
    done = _python(script, str(actual), str(fixture_path))
    assert done.returncode == 2, done.stderr
    assert f"{fixture_path}: changed since it was loaded" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def _rewrite_packed(*paths: Path) -> None:
    """Flip bits of each file's packed gradient in place: the same size, the same inode."""
    time.sleep(0.02)  # a new modification time at any filesystem's timestamp granularity
    for path in paths:
        data = bytearray(path.read_bytes())
        length = int.from_bytes(data[:8], "little")
        begin, end = json.loads(data[8 : 8 + length])["packed"]["data_offsets"]
        packed = slice(8 + length + begin + 3, 8 + length + end, 4)  # each float's high byte
        data[packed] = bytes(b ^ 0x40 for b in data[packed])
        with open(path, "r+b") as file:
            file.write(data)


@pytest.mark.usefixtures("mapped")
def test_a_same_size_rewrite_after_load_raises_before_judging(fixture_path: Path) -> None:
    case = Case("case", load_fixture(fixture_path))
    actual = np.array(case.expected)
    _rewrite_packed(fixture_path)
    assert fixture_path.stat().st_size == len(fixture_path.read_bytes())
    with pytest.raises(FixtureError, match="changed since it was loaded") as info:
        case.check(actual)
    assert str(fixture_path) in str(info.value)
    with pytest.raises(FixtureError, match="changed since it was loaded"):
        case.compare(actual)
    with pytest.raises(FixtureError, match="changed since it was loaded"):
        case.fixture.check_unchanged()


@pytest.mark.usefixtures("mapped")
def test_a_fixture_replaced_after_load_raises(fixture_path: Path) -> None:
    case = Case("case", load_fixture(fixture_path))
    actual = np.array(case.expected)
    save_fixture(fixture_path, make_fixture(LAYOUT, regime="mild", seed=2), overwrite=True)
    with pytest.raises(FixtureError, match=f"{fixture_path}: changed since it was loaded"):
        case.check(actual)


def test_a_small_fixture_is_a_copy_that_nothing_changes(fixture_path: Path) -> None:
    # Below the threshold the file is read at load: the values judged are the values loaded.
    fixture = load_fixture(fixture_path)
    assert not isinstance(fixture.packed, np.memmap)
    assert not fixture.packed.flags.writeable
    case = Case("case", fixture)
    actual = np.array(case.expected)
    _rewrite_packed(fixture_path)
    assert case.check(actual).passed
    fixture.check_unchanged()  # nothing to check: nothing is mapped
    os.truncate(fixture_path, 0)
    assert case.check(actual).passed


# -- verify and load_suite -----------------------------------------------------------------------


@pytest.fixture
def copy(suite: Suite, tmp_path: Path) -> Path:
    root = tmp_path / "suite"
    shutil.copytree(suite[0], root)
    return root


def _manifest(root: Path) -> dict[str, list[dict[str, object]]]:
    document: dict[str, list[dict[str, object]]] = json.loads((root / MANIFEST).read_text())
    return document


@pytest.mark.slow
@posix_only
def test_a_fifo_in_place_of_a_listed_file_is_reported(copy: Path) -> None:
    name = str(_manifest(copy)["fixtures"][0]["file"])
    (copy / name).unlink()
    os.mkfifo(copy / name)
    with deadline(5.0):
        problems = verify_suite(copy)
    assert problems == [f"{name}: not a regular file: it is a FIFO (named pipe)"]


@posix_only
def test_a_huge_sparse_file_is_refused_without_being_read(copy: Path) -> None:
    manifest = _manifest(copy)
    entry = manifest["fixtures"][0]
    path = copy / str(entry["file"])
    huge = 200 * 2**30
    os.truncate(path, huge)  # sparse: its header, then 200 GiB of zeros never written
    # The manifest names it with its size (and some digest): only reading could match that.
    entry["bytes"] = huge
    (copy / MANIFEST).write_text(json.dumps(manifest))
    start = time.perf_counter()
    with deadline(10.0):
        problems = verify_suite(copy)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{elapsed:.1f} s"
    assert len(problems) == 1
    assert problems[0].startswith(f"{path.name}: ")
    assert "bytes after the last tensor" in problems[0]
    # A size that is not the manifest's is refused before the file is opened.
    entry["bytes"] = 1234
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with deadline(10.0):
        assert verify_suite(copy) == [f"{path.name}: {huge} bytes, the manifest says 1234"]


@pytest.mark.slow
def test_load_suite_judges_the_bytes_it_hashed(copy: Path) -> None:
    cases = load_suite(copy)
    assert all(case.path is not None for case in cases)
    # After the check: the cases keep what was checked.
    _rewrite_packed(*(case.path for case in cases if case.path is not None))
    for case in cases:
        assert not isinstance(case.expected, np.memmap)
        assert case.check(np.array(case.expected)).passed


# -- descriptors ---------------------------------------------------------------------------------

_LOAD_MANY = """
    import json, os, resource, sys
    from pathlib import Path
    from gdn_layout import load_fixture
    from gdn_layout.suites import load_suite

    root, count = Path(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    before = len(os.listdir("/proc/self/fd"))
    cases = load_suite(root)
    fixtures = [load_fixture(root / f"f{i}.safetensors") for i in range(count)]
    after = len(os.listdir("/proc/self/fd"))
    print(json.dumps({"cases": len(cases), "fixtures": len(fixtures), "fds": after - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/fd")
def test_many_loaded_fixtures_hold_no_descriptors(suite: Suite, tmp_path: Path) -> None:
    # More fixtures than the process may open files: loaded, they keep none of them open.
    count = 300
    source = suite[1][0]
    entry = next(e for e in _manifest(suite[0])["fixtures"] if e["file"] == source.name)
    entries = []
    for i in range(count):
        shutil.copyfile(source, tmp_path / f"f{i}.safetensors")
        entries.append(entry | {"file": f"f{i}.safetensors"})
    manifest = {"format": "gdn-layout-fixture-suite", "fixtures": entries}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    done = _python(_LOAD_MANY, str(tmp_path), str(count))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"cases": count, "fixtures": count, "fds": 0}
