"""The examples in README.md and in every docs/*.md page run and print what they say they
print: the Python examples as doctests, and the pages' console sessions through the command
line (README.md's sessions are run by tests/test_cli.py)."""

from __future__ import annotations

import contextlib
import doctest
import io
import re
from pathlib import Path

import numpy as np
import pytest

from gdn_layout import load_fixture, unpack
from gdn_layout.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
CONSOLE = re.compile(r"```console\n(.*?)```", re.DOTALL)


def test_the_pages_the_readme_links_exist() -> None:
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)(?:#[\w-]+)?\)", README.read_text()))
    assert linked == {f"docs/{page.name}" for page in PAGES}


@pytest.mark.parametrize(
    "path",
    [
        # memory.md's examples compare buffers of hundreds of MiB.
        pytest.param(path, marks=pytest.mark.slow) if path.name == "memory.md" else path
        for path in [README, *PAGES]
    ],
    ids=lambda path: path.name,
)
def test_examples(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # an example that writes a file in the current folder
    result = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


def _run(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``gdn-layout ARGV`` in this process, in ``cwd``: its exit status and its stdout."""
    out = io.StringIO()
    err = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue()


def _make_kernel_npy(folder: Path) -> None:
    """What the pages say kernel.npy is: case.safetensors with one dk element off by 0.25."""
    fx = load_fixture(folder / "case.safetensors")
    packed = np.array(fx.packed)
    unpack(packed, fx.layout).dk[0, 2, 1, 3] += np.float32(0.25)
    np.save(folder / "kernel.npy", packed)


@pytest.mark.parametrize(
    "path", [page for page in PAGES if CONSOLE.search(page.read_text())], ids=lambda p: p.name
)
@pytest.mark.usefixtures("suite_copied")
def test_console_sessions(path: Path, tmp_path: Path) -> None:
    sessions = [
        re.split(r"^\$ ", block, flags=re.MULTILINE)[1:]
        for block in CONSOLE.findall(path.read_text())
    ]
    commands = [entry for session in sessions for entry in session]
    assert commands
    for entry in commands:
        command, _, shown = entry.partition("\n")
        argv = command.split()
        assert argv[0] == "gdn-layout"
        if argv[1] == "compare":
            _make_kernel_npy(tmp_path)
        code, stdout = _run(argv[1:], tmp_path)
        assert code in (0, 1), command
        if argv[1] == "demo":
            # The float32 recomputation's last digits depend on the BLAS: its report is
            # checked for the verdict, everything before it to the letter.
            assert stdout.startswith(shown.split("3. a float32")[0]), command
            assert "compare passed" in stdout
        else:
            assert stdout == shown, command


SWAPPED_HEADS = """
import numpy as np
from gdn_layout import unpack
from gdn_layout.reference import backward

def test_my_kernel(gdn_case):
    out = backward(*gdn_case.inputs, dtype=np.float32, method="recurrent")
    dv = unpack(out, gdn_case.layout).dv
    dv[:, :, [0, 1]] = dv[:, :, [1, 0]]  # heads 0 and 1 swapped
    gdn_case.check(out)
"""


@pytest.mark.slow
def test_the_failure_the_readme_shows_is_pytest_s(pytester: pytest.Pytester) -> None:
    text = README.read_text()
    part = text[text.index("**What a failure looks like.**") :]
    command = re.search(r"`pytest (--gdn-layout [^`]*) test_my_kernel\.py`", part)
    shown = re.search(r"```text\n(.*?)```", part, re.DOTALL)
    assert command is not None
    assert shown is not None
    pytester.makepyfile(test_my_kernel=SWAPPED_HEADS)
    result = pytester.runpytest("-p", "no:cacheprovider", *command.group(1).split())
    result.assert_outcomes(failed=1)
    printed = [line.rstrip() for line in result.outlines if line.startswith("E ")]
    expected = shown.group(1).splitlines()
    assert len(printed) == len(expected)
    for got, want in zip(printed, expected, strict=True):
        if want.endswith(" ok"):  # float32 figures of a passing row: by machine
            got_fields, want_fields = re.split(r"\s{2,}", got), re.split(r"\s{2,}", want)
            assert got_fields[:3] + got_fields[-1:] == want_fields[:3] + want_fields[-1:]
        else:
            assert got == want
