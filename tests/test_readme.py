"""The examples in README.md and in every docs/*.md page run and print what they say they
print: the Python examples as doctests, and the pages' console sessions through the command
line (README.md's sessions are run by tests/test_cli.py)."""

from __future__ import annotations

import doctest
import importlib.util
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from gdn_layout import load_fixture, unpack
from gdn_layout.regimes import REGIMES
from gdn_layout.suites import suite_files
from support import Suite, run

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
        result = run(*argv[1:], cwd=tmp_path)
        stdout = result.stdout
        assert result.returncode in (0, 1), command
        if argv[1] == "demo":
            # The float32 recomputation's last digits depend on the BLAS: its report is
            # checked for the verdict, everything before it to the letter.
            assert stdout.startswith(shown.split("3. a float32")[0]), command
            assert "compare passed" in stdout
            assert stdout.endswith("\n\n" + shown.rsplit("\n\n", 1)[1]), command  # next step
        else:  # "..." stands for what the suite's definitions make, a count or a size
            assert doctest.OutputChecker().check_output(shown, stdout, doctest.ELLIPSIS), (
                command,
                stdout,
            )


@pytest.mark.slow
def test_the_quick_set_the_readme_shows_is_pytest_s(
    suite: Suite, pytester: pytest.Pytester
) -> None:
    text = README.read_text()
    part = text[text.index("**The quick set.**") :]
    block = re.search(r"```text\n\$ pytest (.*?) test_my_kernel\.py\n(.*?)```", part, re.DOTALL)
    counts = re.search(r"keeps (\d+) cases of (\d+)", part)
    assert block is not None
    assert counts is not None
    root, paths = suite
    quick = suite_files(root, quick=True)
    assert (int(counts.group(1)), int(counts.group(2))) == (len(quick), len(paths))
    shutil.copytree(root, pytester.path / "suite")  # the README's folder
    pytester.makepyfile(test_my_kernel="def test_my_kernel(gdn_case):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", *block.group(1).split())
    printed = "\n".join(result.outlines) + "\n"
    assert doctest.OutputChecker().check_output(block.group(2), printed, doctest.ELLIPSIS), printed


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
        got_fields, want_fields = re.split(r"\s{2,}", got), re.split(r"\s{2,}", want)
        if want.endswith(" ok"):  # float32 figures of a passing row: by machine
            assert got_fields[:3] + got_fields[-1:] == want_fields[:3] + want_fields[-1:]
        elif want.endswith(" FAIL"):  # all but the floors' figure and which tie is the worst
            mine, theirs = (f[:6] + f[7:8] + f[9:] for f in (got_fields, want_fields))
            assert mine == theirs, (got, want)
        elif want.startswith("E         dv["):  # the worst element's line: its floors by machine
            head, tail = "> 16 (floors for float32: rms ratio ", "; 160 of 240 over the max error"
            assert head in got
            assert got[got.index(tail) :] == want[want.index(tail) :]
        else:
            assert got == want


#: A kernel for the README's first example: the op step by step in torch, its backward by
#: autograd, in float32 inside whatever the inputs' dtype (as a bfloat16 kernel computes).
MY_BACKWARD = """
import torch

def my_backward(q, k, v, g, beta, state, dy):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, g, beta)]
    s = None if state is None else state.detach().float().requires_grad_()
    q_, k_, v_, g_, b_ = leaves
    batch, steps, heads, n = q_.shape
    h = q_.new_zeros(batch, heads, n, n) if s is None else s
    ys = []
    for t in range(steps):
        decay = g_[:, t].exp()
        h = h * (decay[..., None] if g_.dim() == 4 else decay[..., None, None])
        write = (v_[:, t] - (k_[:, t, :, None, :] @ h)[..., 0, :]) * b_[:, t, :, None]
        h = h + k_[:, t, :, :, None] * write[..., None, :]
        ys.append(n**-0.5 * (q_[:, t, :, None, :] @ h)[..., 0, :])
    (torch.stack(ys, 1) * dy.float()).sum().backward()
    grads = [t.grad.reshape(-1) for t in leaves] + ([] if s is None else [s.grad.reshape(-1)])
    return torch.cat(grads).to(q.dtype)
"""

#: The device the README's first example runs on: CUDA where it is here.
DEVICE = """
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_readme_s_torch_example_runs_as_written(pytester: pytest.Pytester, dtype: str) -> None:
    # Found, not imported: pytester drops what this process imports while it runs, and torch
    # cannot be imported twice.
    for needed in ("torch", "ml_dtypes"):
        if importlib.util.find_spec(needed) is None:
            pytest.skip(f"needs {needed}")
    text = README.read_text()
    example = re.search(r"```python\n(# test_my_kernel\.py\n.*?)```", text, re.DOTALL)
    assert example is not None
    # The README's GPU user's test, on the CPU where no CUDA device is here.
    assert 'device="cuda"' in example.group(1)
    test = example.group(1).replace('device="cuda"', "device=DEVICE")
    pytester.makepyfile(kernel=MY_BACKWARD + DEVICE)
    pytester.makepyfile(test_my_kernel="from kernel import DEVICE, my_backward\n" + test)
    layout = "2,9,2,4,channel,state"
    # In a process of its own: torch cannot be imported again in this one.
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--gdn-layout", layout, "--gdn-dtype", dtype
    )
    result.assert_outcomes(passed=len(REGIMES))


def test_the_summary_the_readme_shows_is_pytest_s(
    suite: tuple[Path, list[Path]], pytester: pytest.Pytester
) -> None:
    text = README.read_text()
    part = text[text.index("At the end of the session, pytest reads the cases together") :]
    shown = re.search(r"```text\n(.*?)```", part, re.DOTALL)
    assert shown is not None
    # The kernel above, over every case: a case of one head has no heads to swap.
    kernel = SWAPPED_HEADS.replace("    dv[:", "    if gdn_case.layout.heads > 1:\n        dv[:")
    assert kernel != SWAPPED_HEADS
    pytester.makepyfile(test_my_kernel=kernel)
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-suite", str(suite[0]))
    lines = result.outlines
    start = next(i for i, line in enumerate(lines) if "what failed across the cases" in line)
    expected = shown.group(1).splitlines()
    got = lines[start : start + len(expected)]
    assert got[0].strip("= ") == expected[0].strip("= ")  # the rule's width is the terminal's
    # The test's id is from pytest's root folder: here, that of the suite's folder too.
    assert got[1].endswith(expected[1])
    assert got[1].split("/")[-1] == expected[1]
    assert got[2:] == expected[2:]
