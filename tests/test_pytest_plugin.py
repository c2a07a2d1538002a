"""The pytest plugin through pytester, as a user runs it: ``gdn_case`` over a suite, a layout or
the standard suite it makes once in pytest's cache; its options, on the command line and in the
configuration; its usage errors, one line each; under pytest-xdist; and its summary."""

from __future__ import annotations

import importlib
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest

from gdn_layout import __version__, load_fixture
from gdn_layout.pytest_plugin import _cache_key
from gdn_layout.regimes import REGIMES
from gdn_layout.suites import suite_files, verify_suite
from support import Suite, on_a_terminal, run, suite_with_huge_integer

NO_CACHE = ("-p", "no:cacheprovider")

KERNEL_TESTS = """
import numpy as np
from gdn_layout import unpack
from gdn_layout.reference import backward, chunk_states

def test_correct(gdn_case):
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32))

def test_swapped_heads(gdn_case):
    out = backward(*gdn_case.inputs, dtype=np.float32)
    dv = unpack(out, gdn_case.layout).dv
    if gdn_case.layout.heads > 1:
        dv[:, :, [0, 1]] = dv[:, :, [1, 0]]
    gdn_case.check(out)
"""

CORRECT_KERNEL = """
import numpy as np
from gdn_layout.reference import backward

def test_correct(gdn_case):
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32))
"""

#: A conftest that makes the standard suite of its first shape alone (a few seconds' work).
FIRST_SHAPE = """
import gdn_layout.generate as generate

generate._SUITE_SHAPES = generate._SUITE_SHAPES[:1]
"""

#: What the plugin says before it makes the suite, and as it goes.
MAKING = "gdn-layout: making the standard suite for gdn_case, once: "
PROGRESS = "gdn-layout: standard suite"


def _cache_root(pytester: pytest.Pytester) -> Path:
    return pytester.path / ".pytest_cache" / "d" / "gdn-layout"


def _cached_folder(pytester: pytest.Pytester) -> Path:
    """The one suite in pytest's cache folder."""
    (folder,) = [p for p in _cache_root(pytester).iterdir() if p.is_dir()]
    return folder


def _said(folder: Path) -> str:
    return (
        f"{MAKING}{len(suite_files(folder))} fixtures in float32, in {folder} (later runs reuse it)"
    )


@pytest.mark.slow
def test_a_suite_s_cases_each_a_test_failing_with_its_cause(
    suite: Suite, pytester: pytest.Pytester
) -> None:
    root, paths = suite
    pytester.makepyfile(test_kernel=KERNEL_TESTS)
    result = pytester.runpytest(*NO_CACHE, "--gdn-suite", str(root), "-rf")
    multihead = {p.stem for p in paths if load_fixture(p).layout.heads > 1}
    result.assert_outcomes(passed=2 * len(paths) - len(multihead), failed=len(multihead))
    failed = {
        line.split("[", 1)[1].split("]", 1)[0]
        for line in result.outlines
        if line.startswith("FAILED test_kernel.py::test_swapped_heads[")
    }
    assert failed == multihead
    lines = result.outlines
    heads = [i for i, line in enumerate(lines) if line.startswith("E ") and "gradient(s)" in line]
    assert len(heads) == len(multihead)
    assert all(lines[i].endswith("gradient(s) dv differ") for i in heads)
    # The cause leads, once: the table below it does not repeat it. (A dv of too few values
    # to tell a permutation from rounding has none.)
    cause = "likely cause: dv's heads are permuted: heads 0 and 1 exchanged"
    named = [i for i in heads if lines[i + 1].endswith(cause)]
    assert 0 < len(named) < len(heads)
    assert sum(line.startswith("E ") and line.endswith(cause) for line in lines) == len(named)


@pytest.mark.slow
def test_a_layout_s_cases_one_per_regime_judged_in_the_class_asked(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_kernel=KERNEL_TESTS)
    result = pytester.runpytest(*NO_CACHE, "--gdn-layout", "1,5,2,4,channel,state")
    result.assert_outcomes(passed=len(REGIMES), failed=len(REGIMES))
    result.stdout.fnmatch_lines(["FAILED *test_swapped_heads?b1s5h2n4-channel-state-zero-seed0?*"])
    for regime in ("strong", REGIMES[-1]):  # any regime, the ones added later too
        one = pytester.runpytest(*NO_CACHE, "--gdn-layout", "1,5,1,4", "--gdn-regime", regime, "-v")
        one.assert_outcomes(passed=2)
    one.stdout.fnmatch_lines([f"*test_correct?b1s5h1n4-scalar-nostate-{regime}-seed0? PASSED*"])
    # A TF32 kernel: passes when judged as tf32, fails as float32 (the fixture's dtype).
    pytester.makepyfile(
        test_kernel="from gdn_layout.reference._fused import fused_backward\n\n"
        "def test_tf32_kernel(gdn_case):\n"
        "    gdn_case.check(fused_backward(*gdn_case.inputs, bits=10, length=32)[0])\n"
    )
    layout = (*NO_CACHE, "--gdn-layout", "1,40,2,16,channel,state")
    pytester.runpytest(*layout, "--gdn-precision", "TF32").assert_outcomes(passed=len(REGIMES))
    failed = pytester.runpytest(*layout)
    failed.assert_outcomes(failed=len(REGIMES))
    failed.stdout.fnmatch_lines(["*error/floor<=16 (float32)*"])


STATES_TEST = """
import numpy as np
from gdn_layout.reference import chunk_states

def test_states(gdn_case):
    h, dh, final = chunk_states(*gdn_case.inputs, chunk=16, dtype=np.float32)
    h[:, -1] *= BUG
    gdn_case.check_states(h=h, dh=dh, final_state=final, chunk=16)
"""


@pytest.mark.slow
@pytest.mark.parametrize("bug", [1, 0])
def test_gdn_case_checks_states(pytester: pytest.Pytester, bug: int) -> None:
    pytester.makepyfile(test_states=STATES_TEST.replace("BUG", str(bug)))
    result = pytester.runpytest(*NO_CACHE, "--gdn-layout", "1,40,2,4,state")
    if bug:
        result.assert_outcomes(passed=len(REGIMES))
    else:
        result.assert_outcomes(failed=len(REGIMES))
        result.stdout.fnmatch_lines(["*: h differ*", "*worst at b=0, c=2, h=*"])


def test_gdn_case_is_skipped_only_when_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernel=KERNEL_TESTS)
    result = pytester.runpytest(*NO_CACHE, "--gdn-skip", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*gdn_case is skipped without --gdn-suite DIR or --gdn-layout*"])
    pytester.makeini("[pytest]\ngdn_skip = true\n")
    pytester.runpytest(*NO_CACHE).assert_outcomes(skipped=2)
    # Without the cache to make the standard suite in, a run that asks for cases fails.
    pytester.makeini("[pytest]\n")
    failed = pytester.runpytest(*NO_CACHE)
    assert failed.ret != pytest.ExitCode.OK
    failed.stdout.fnmatch_lines(
        ["*gdn-layout: gdn_case makes the standard suite in pytest's cache, which is off*"]
    )


def test_the_standard_suite_is_made_once_in_pytest_s_cache_saying_how_far(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gdn_layout._progress import LINE_STEP

    pytester.makeconftest(FIRST_SHAPE)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    root = _cache_root(pytester)
    past = ["suite-0.0.1-float32", f"suite-{__version__}-float32-0123456789abcdef"]
    other = f"suite-{__version__}-float64-0123456789abcdef"  # another dtype's: kept
    for name in [*past, other]:
        (root / name).mkdir(parents=True)
    (root / f"{past[0]}.lock").write_text("")
    first = pytester.runpytest_subprocess()  # stderr is a pipe, as in CI
    (folder,) = [p for p in root.iterdir() if p.is_dir() and p.name != other]
    generate = importlib.import_module("gdn_layout.generate")
    monkeypatch.setattr(generate, "_SUITE_SHAPES", generate._SUITE_SHAPES[:1])  # the conftest's
    assert folder.name == _cache_key("float32")  # the version's, the dtype's, the definition's
    assert sorted(p.name for p in root.iterdir()) == [folder.name, f"{folder.name}.lock", other]
    count = len(suite_files(folder))
    first.assert_outcomes(passed=count)
    err = first.stderr.lines
    assert err.count(_said(folder)) == 1, err
    lines = [line for line in err if line.startswith(f"{PROGRESS}: ")]
    assert err.index(lines[0]) > err.index(_said(folder))
    percents = [int(line.split(": ")[2].split("%")[0]) for line in lines]
    assert percents == sorted(percents)
    assert percents[-1] == 100
    assert len(percents) >= round(1 / LINE_STEP)  # a line at every tenth: more files than ten
    assert "\r" not in first.stderr.str()  # no bar into a log
    stamps = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    again = pytester.runpytest_subprocess()  # reused: nothing said, nothing written
    again.assert_outcomes(passed=count)
    assert "gdn-layout" not in again.stderr.str()
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    victim = next(p for p in folder.iterdir() if p.suffix == ".safetensors")
    victim.write_bytes(victim.read_bytes()[:-8] + bytes(8))  # damaged: made again
    pytester.runpytest_subprocess().assert_outcomes(passed=count)
    assert victim.stat().st_mtime_ns != stamps[victim]
    manifest = folder / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])  # cut short: made again too
    pytester.runpytest_subprocess().assert_outcomes(passed=count)
    assert verify_suite(folder) == []


@pytest.mark.slow
def test_the_standard_suite_is_made_with_a_bar_on_a_terminal(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FIRST_SHAPE)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    code, shown = on_a_terminal([sys.executable, "-m", "pytest"], pytester.path)
    assert code == 0, shown
    assert _said(_cached_folder(pytester)) in shown
    assert f"\r{PROGRESS} [" in shown
    assert "] 100%" in shown
    assert f"{PROGRESS}: " not in shown  # no log lines on a terminal


@pytest.mark.slow
def test_under_xdist_the_standard_suite_is_made_and_said_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("xdist")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makeconftest(FIRST_SHAPE)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    result = pytester.runpytest_subprocess("-n", "2")
    folder = _cached_folder(pytester)
    result.assert_outcomes(passed=len(suite_files(folder)))
    err = result.stderr.lines
    assert [line for line in err if line.startswith(MAKING)] == [_said(folder)]
    assert len([line for line in err if line.startswith(f"{PROGRESS}: 100%")]) == 1


def test_the_cached_suite_s_quick_set_made_with_every_core(
    suite: Suite, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    generate = importlib.import_module("gdn_layout.generate")
    asked: list[object] = []

    def write_suite(folder: Path, **options: object) -> None:  # the session's suite, copied
        asked.append(options.get("workers", 1))
        shutil.copytree(suite[0], folder)

    monkeypatch.setattr(generate, "write_suite", write_suite)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    result = pytester.runpytest_inprocess("--gdn-quick", "--gdn-regime", "qwen")
    assert asked == [None]  # None: every core this process may use
    result.assert_outcomes(passed=len(suite_files(suite[0], quick=True, regime="qwen")))


#: A kernel wrong in one element of dg, for the cases of a per-channel gate and a state.
ONE_WRONG = """
import numpy as np
from gdn_layout.reference import backward

def test_off(gdn_case):
    out = backward(*gdn_case.inputs, dtype=np.float32)
    if gdn_case.layout.gate_per_channel and gdn_case.layout.carry_state:
        out[gdn_case.layout.segment("dg").offset] += 1.0
    gdn_case.check(out)
"""


def _redraw(result: pytest.RunResult) -> list[list[str]]:
    """The arguments after ``gdn-layout`` of the command each failure gives."""
    prefix = "E         redraw: gdn-layout "
    return [shlex.split(line.removeprefix(prefix)) for line in result.outlines if
            line.startswith(prefix)]  # fmt: skip


@pytest.mark.slow
def test_gdn_save_keeps_a_failure_s_output_and_picture(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FIRST_SHAPE)
    pytester.makepyfile(test_kernel=ONE_WRONG)
    selected = ("--gdn-regime", "zero")
    plain = pytester.runpytest_subprocess(*selected)
    folder = _cached_folder(pytester)
    names = suite_files(folder, regime="zero")
    (wrong,) = [n for n in names if "-channel-state-" in n]
    plain.assert_outcomes(passed=len(names) - 1, failed=1)
    plain.stdout.fnmatch_lines([f"E         fixture: {folder / wrong}"])
    assert _redraw(plain) == [
        ["compare", "--plot", "PICTURE.png", "OUTPUT.npy", str(folder / wrong)]
    ]
    plain.stdout.fnmatch_lines(["E         (OUTPUT.npy: *pytest --gdn-save DIR keeps it*"])
    kept = pytester.runpytest_subprocess(*selected, "--gdn-save", "kept")
    kept.assert_outcomes(passed=len(names) - 1, failed=1)
    kept.stdout.fnmatch_lines([f"gdn-layout: failing cases are kept in {pytester.path / 'kept'}"])
    stem = f"test_kernel-test_off-{wrong.removesuffix('.safetensors')}"
    files = sorted(p.name for p in (pytester.path / "kept").iterdir())
    assert files == [".gdn-layout-kept", f"{stem}-output.npy", f"{stem}.png"]  # and what it kept
    picture, output = (str(pytester.path / "kept" / name) for name in reversed(files[1:]))
    (words,) = _redraw(kept)
    assert words == ["compare", "--plot", picture, "--force", output, str(folder / wrong)]
    drawn = run(*words)
    assert drawn.returncode == 1, drawn.stderr
    assert "compare FAILED (dg)" in drawn.stdout


def test_gdn_save_says_once_that_it_keeps_no_picture_without_matplotlib(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    pytester.makepyfile(test_kernel=ONE_WRONG)
    pytester.makeini("[pytest]\ngdn_save = kept\n")  # relative to the file
    result = pytester.runpytest_inprocess(*NO_CACHE, "--gdn-layout", "1,3,2,2,channel,state")
    result.assert_outcomes(failed=len(REGIMES))
    said = "without pictures: matplotlib is not installed (pip install 'gdn-layout[plot]'"
    assert result.stdout.str().count(said) == 1
    kept = sorted(p.name for p in (pytester.path / "kept").iterdir() if p.name[0] != ".")
    assert len(kept) == 2 * len(REGIMES)
    assert all(name.endswith(("-output.npy", "-fixture.safetensors")) for name in kept)
    assert all(words[2] == "PICTURE.png" for words in _redraw(result))


CASE = "b1s3h2n2-channel-state-zero-seed0"


def test_gdn_save_never_replaces_a_file_it_did_not_write(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no pictures: quicker
    pytester.makepyfile(test_kernel=ONE_WRONG)
    layout = ("--gdn-layout", "1,3,2,2,channel,state", "--gdn-regime", "zero")
    args = (*NO_CACHE, *layout, "--gdn-save", "kept")
    mine = (
        pytester.path / "kept" / "test_kernel-test_off-b1s3h2n2-channel-state-zero-seed0-output.npy"
    )
    mine.parent.mkdir()
    mine.write_bytes(b"mine")
    refused = pytester.runpytest_inprocess(*args)
    refused.assert_outcomes(failed=1)
    said = f"*nothing more kept in *: {mine} is there already, and gdn-layout did not write it"
    refused.stdout.fnmatch_lines([said])
    assert mine.read_bytes() == b"mine"
    mine.unlink()
    for _ in range(2):  # its own files: replaced on the next run
        again = pytester.runpytest_inprocess(*args)
        again.assert_outcomes(failed=1)
        assert "nothing more kept" not in again.stdout.str()
    assert mine.read_bytes() != b"mine"


@pytest.mark.slow
def test_the_settings_come_from_the_configuration_and_the_command_line_wins(
    suite: Suite, pytester: pytest.Pytester
) -> None:
    root, _ = suite
    pytester.makepyfile(
        test_kernel="from gdn_layout.reference._fused import fused_backward\n\n"
        "def test_tf32_kernel(gdn_case):\n"
        "    gdn_case.check(fused_backward(*gdn_case.inputs, bits=10, length=32)[0])\n"
    )
    pytester.makeini(f"[pytest]\ngdn_suite = {root}\ngdn_precision = tf32\n")
    args = (*NO_CACHE, "--gdn-regime", "mild")
    passed = pytester.runpytest(*args)
    assert passed.ret == pytest.ExitCode.OK
    count = len(suite_files(root, regime="mild"))
    passed.assert_outcomes(passed=count)
    pytester.runpytest(*args, "--gdn-precision", "float32").assert_outcomes(failed=count)
    pytester.makeini("[pytest]\ngdn_suite = nowhere\n")
    missing = pytester.runpytest(*args)
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*gdn-layout: gdn_suite = nowhere (*tox.ini): *nowhere*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gdn-suite", "nowhere"], "*gdn-layout: --gdn-suite: nowhere: not a suite*"),
        (["--gdn-layout", "1,2,3"], "*--gdn-layout expects B,S,H,N*"),
        (["--gdn-layout", "1,2,x,4"], "*four integers*"),
        (["--gdn-layout", "1,2,1,2", "--gdn-suite", "x"], "*give one of them*"),
        (["--gdn-layout", "1,2,1,2", "--gdn-quick"], "*--gdn-quick selects from a suite*"),
        (["--gdn-crossing", "0"], "*--gdn-crossing: expected a positive integer, got '0'*"),
        (["--gdn-min-seq", "-1"], "*--gdn-min-seq: expected a non-negative integer, got '-1'*"),
        (["--gdn-seed", "x"], "*--gdn-seed: expected a non-negative integer, got 'x'*"),
        (
            ["--gdn-layout", "1,2,1,4", "--gdn-dtype", "bf16", "--gdn-precision", "float32"],
            "*--gdn-precision: precision 'float32' judges float32 buffers, got bfloat16 ones*",
        ),
        (
            ["--gdn-precision", "fp8"],
            "*--gdn-precision: the precision must be one of float64, float32, tf32, bfloat16, "
            "float16, got 'fp8'*",
        ),
        (
            ["--gdn-layout", "64,100000,64,128"],
            "*gdn-layout: B=64 S=100000 H=64 N=128*needs about*available*",
        ),
        (["--gdn-layout", "0,1099511627776,1099511627776,2"], "*which no array can have*"),
        (["--gdn-suite", "SUITE", "--gdn-dtype", "bf16"], "*--gdn-dtype bfloat16: the suite *"),
        (["--gdn-suite", "HUGE"], "*gdn-layout: *manifest.json is not JSON*digits*"),
        (
            ["--gdn-suite", "EMPTY"],  # a manifest listing no case, as a selection of none
            "*gdn-layout: --gdn-suite: *: the selection keeps no case; a gdn_case test never "
            "passes by being skipped",
        ),
    ],
)
def test_a_usage_error_is_one_line(
    pytester: pytest.Pytester,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    args: list[str],
    message: str,
) -> None:
    if "SUITE" in args:
        args = [str(request.getfixturevalue("suite")[0]) if a == "SUITE" else a for a in args]
    if "HUGE" in args:
        fixture = tmp_path / "case.safetensors"
        assert (
            run("fixture", "-B", "1", "-S", "5", "-H", "2", "-N", "4", "-o", fixture).returncode
            == 0
        )
        huge = str(suite_with_huge_integer(tmp_path / "suite", fixture))
        args = [huge if a == "HUGE" else a for a in args]
    if "EMPTY" in args:
        manifest = {"format": "gdn-layout-fixture-suite", "fixtures": []}
        (tmp_path / "manifest.json").write_text(json.dumps(manifest))
        args = [str(tmp_path) if a == "EMPTY" else a for a in args]
    pytester.makepyfile(test_kernel=KERNEL_TESTS)
    start = time.perf_counter()
    result = pytester.runpytest(*NO_CACHE, *args)
    assert time.perf_counter() - start < 20  # refused before any work
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines([message])
    assert len([line for line in result.stderr.lines if "gdn" in line]) == 1


def test_a_memory_error_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError("Unable to allocate 1.00 TiB")

    monkeypatch.setattr(importlib.import_module("gdn_layout.suites"), "make_case", exhausted)
    pytester.makepyfile(test_kernel="def test_one(gdn_case):\n    pass\n")
    result = pytester.runpytest_inprocess(*NO_CACHE, "--gdn-layout", "1,4,1,2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["*gdn-layout: out of memory: Unable to allocate 1.00 TiB*"])


@pytest.mark.parametrize("given", ["option", "configuration"])
def test_the_quick_set_and_the_other_selections(
    suite: Suite, pytester: pytest.Pytester, given: str
) -> None:
    root, _ = suite
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    args = [*NO_CACHE, f"--gdn-suite={root}", "-v"]  # not a path: the ini's
    if given == "option":
        args.append("--gdn-quick")
    else:
        pytester.makeini("[pytest]\ngdn_quick = true\n")
    result = pytester.runpytest(*args)
    quick = [name.removesuffix(".safetensors") for name in suite_files(root, quick=True)]
    result.assert_outcomes(passed=len(quick))
    result.stdout.fnmatch_lines([f"*test_correct?{name}? PASSED*" for name in quick])
    pytester.makeini("[pytest]\n")
    pytester.makepyfile(
        test_kernel="def test_seen(gdn_case):\n    assert gdn_case.layout.seq > 256\n"
    )
    selected = ("--gdn-suite", str(root), "--gdn-crossing", "256", "--gdn-regime", "extreme")
    pytester.runpytest(*NO_CACHE, *selected).assert_outcomes(passed=8)  # S = 300, 513: 4 modes


#: A conftest that records each call that makes cases: its process, and its xdist worker.
RECORDING = """
import json, os
import gdn_layout.suites as suites

def _recorded(make):
    def recorded(*args, **kwargs):
        with open({log!r}, "a") as log:
            print(json.dumps([os.getpid(), os.environ.get("PYTEST_XDIST_WORKER")]), file=log)
        return make(*args, **kwargs)
    return recorded

suites.make_case = _recorded(suites.make_case)
suites.load_suite = _recorded(suites.load_suite)
"""


@pytest.mark.slow
@pytest.mark.parametrize("given", ["layout", "suite"])
def test_under_xdist_cases_are_made_in_the_workers_only(
    pytester: pytest.Pytester,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    given: str,
) -> None:
    pytest.importorskip("xdist")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # this run's own, if any
    log = pytester.path / "made.jsonl"
    pytester.makeconftest(RECORDING.format(log=str(log)))
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    if given == "layout":
        args, calls, passed = ["--gdn-layout", "1,5,2,4,channel,state"], len(REGIMES), len(REGIMES)
    else:
        root, _ = request.getfixturevalue("suite")
        args, calls = ["--gdn-suite", str(root), "--gdn-regime", "mild"], 1
        passed = len(suite_files(root, regime="mild"))
    result = pytester.runpytest_subprocess(*NO_CACHE, "-n", "2", *args)
    result.assert_outcomes(passed=passed)
    made = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    assert {worker for _, worker in made} == {"gw0", "gw1"}, made  # none in the controller
    assert len(made) == 2 * calls
    assert len({pid for pid, _ in made}) == 2
    if given == "suite":  # a worker's problem: a failed collection in each, not a crash
        again = pytester.runpytest_subprocess(*NO_CACHE, "-n", "2", *args, "--gdn-dtype", "bf16")
        again.assert_outcomes(errors=2)
        again.stdout.fnmatch_lines([f"*--gdn-dtype bfloat16: the suite {root} holds float32*"])
        assert "crashed" not in again.stdout.str() + again.stderr.str()


#: A correct kernel, and one whose dstate is doubled except under the zero regime.
SUMMARY_TESTS = """
import numpy as np
from gdn_layout import unpack
from gdn_layout.reference import backward

def test_correct(gdn_case):
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32))

def test_dstate(gdn_case):
    out = backward(*gdn_case.inputs, dtype=np.float32)
    if gdn_case.regime != "zero":
        unpack(out, gdn_case.layout).dstate[...] *= 2
    gdn_case.check(out)

def test_no_comparison(gdn_case):
    pass

def test_partly(gdn_case):
    if gdn_case.regime == "zero":
        raise RuntimeError("before the comparison")
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32))

def test_cast(gdn_case):
    out = backward(*gdn_case.inputs, dtype=np.float32)
    gdn_case.check(out.astype(np.float16))  # a stray cast: refused before any comparison
"""


@pytest.mark.parametrize("workers", [[], pytest.param(["-n", "2"], marks=pytest.mark.slow)])
def test_the_summary_says_what_failed_across_each_test_s_cases(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    if workers:
        pytest.importorskip("xdist")
    pytester.makepyfile(test_kernel=SUMMARY_TESTS)
    result = pytester.runpytest_subprocess(*NO_CACHE, *workers, "--gdn-layout", "1,5,2,4,state")
    n = len(REGIMES)
    result.assert_outcomes(passed=3 * n, failed=2 * n)
    lines = result.outlines
    start = lines.index(next(line for line in lines if "what failed across the cases" in line))
    block = lines[start + 1 :]

    def at(prefix: str) -> int:
        return next(i for i, line in enumerate(block) if line.startswith(prefix))

    cast = at("test_kernel.py::test_cast: ")  # refused in every case: what each raised
    assert block[cast] == f"test_kernel.py::test_cast: no comparison was made in {n} case(s)"
    assert block[cast + 1].startswith(
        f"  {n} case(s) raised ValueError: compare: the fixture is float32, so the kernel is "
        "judged as float32, but its output is float16, coarser: a stray cast?"
    )
    correct = at("test_kernel.py::test_correct: ")
    assert block[correct].startswith(f"test_kernel.py::test_correct: all {n} cases passed; ")
    assert "--gdn-dtype float64" in block[correct]
    assert block[correct + 1] == (
        f"test_kernel.py::test_dstate: {n - 1} of {n} cases failed: dstate {n - 1}; "
        "dq, dk, dv, dg, dbeta never fail"
    )
    assert block[correct + 2].startswith("  never fails under the zero regime")
    assert block[correct + 3].startswith(f"  likely cause in {n - 1} cases (dstate, scale): ")
    assert not any("test_no_comparison" in line for line in block)  # it compared nothing
    partly = at(f"test_kernel.py::test_partly: all {n - 1} cases passed")
    assert block[partly + 1] == (
        "  1 more case(s) raised RuntimeError: before the comparison, not counted: "
        "b1s5h2n4-scalar-state-zero-seed0"
    )
    # A session that compared nothing prints no summary.
    pytester.makepyfile(test_kernel="def test_nothing(gdn_case):\n    pass\n")
    quiet = pytester.runpytest(*NO_CACHE, "--gdn-layout", "1,2,1,2")
    quiet.assert_outcomes(passed=n)
    assert "what failed across the cases" not in quiet.stdout.str()


def test_a_selection_of_no_case_of_the_cached_suite_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FIRST_SHAPE)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    result = pytester.runpytest_subprocess("--gdn-min-seq", "100000")
    assert result.ret == pytest.ExitCode.INTERRUPTED  # an error in collection, not a skip
    result.stdout.fnmatch_lines(["*the standard suite: the selection keeps no case*"])
    result.assert_outcomes(errors=1)  # not "1 skipped"


def test_the_plugin_loads_where_fcntl_does_not_exist(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernel="def test_one(gdn_case):\n    assert gdn_case.layout.seq == 2")
    (pytester.path / "blocked.py").write_text(
        "import sys\nsys.modules['fcntl'] = None  # as on Windows\n"
        "import pytest\nsys.exit(pytest.main(sys.argv[1:]))\n"
    )
    args = ("blocked.py", *NO_CACHE, "--gdn-layout", "1,2,1,2", "test_kernel.py")
    result = pytester.run(sys.executable, *args)
    assert result.ret == pytest.ExitCode.OK, result.stderr.str()
    result.assert_outcomes(passed=len(REGIMES))


#: Tests that no comparison decides: each counted as what pytest made of it, a case once.
VERDICTS = """
import numpy as np
import pytest
from gdn_layout.reference import backward

def test_then_fails(gdn_case):
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32))
    assert False, "after the check"

def test_skipped(gdn_case):
    pytest.skip("not this one")

@pytest.mark.xfail(reason="known")
def test_xfailed(gdn_case):
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32) * 2)

@pytest.mark.parametrize("twice", [1, 2])
def test_twice(gdn_case, twice):
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32))
"""


def test_the_summary_agrees_with_pytest_s_verdict_of_each_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernel=VERDICTS)
    result = pytester.runpytest(*NO_CACHE, "--gdn-layout", "1,3,1,2")
    n = len(REGIMES)
    result.assert_outcomes(failed=n, skipped=n, xfailed=n, passed=2 * n)
    lines = result.outlines
    block = lines[next(i for i, line in enumerate(lines) if "what failed across" in line) :]

    def after(head: str) -> str:
        return block[block.index(head) + 1]

    assert after(
        f"test_kernel.py::test_then_fails: no comparison failed in {n} case(s)"
    ).startswith(
        f"  {n} case(s) raised AssertionError: after the check, after its comparison passed: "
    )
    for what in ("skipped", "xfailed"):
        head = f"test_kernel.py::test_{what}: no comparison was made in {n} case(s)"
        assert after(head).startswith(f"  {n} case(s) {what}: ")
    assert any(
        line.startswith(f"test_kernel.py::test_twice: all {n} cases passed") for line in block
    )
