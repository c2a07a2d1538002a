"""The pytest plugin (``gdn_layout.pytest_plugin``), run by pytester on test files of its own:
``gdn_case`` over a suite, a layout or the standard suite it makes once in pytest's cache; its
options, on the command line and in the configuration; its usage errors, one line each, never
an INTERNALERROR; and under pytest-xdist, cases made in the workers only."""

from __future__ import annotations

import importlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from gdn_layout import load_fixture
from gdn_layout.check._findings import _IDENTIFIED
from gdn_layout.regimes import REGIMES
from gdn_layout.suites import suite_files
from support import Suite, run, suite_with_huge_integer


@pytest.fixture(scope="module")
def fixture_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fx") / "case.safetensors"
    assert run("fixture", "-B", "1", "-S", "5", "-H", "2", "-N", "4", "-o", path).returncode == 0
    return path


# -- cases from a suite, a layout or pytest's cache ----------------------------------------------


KERNEL_TESTS = """
import numpy as np
from gdn_layout import unpack
from gdn_layout.reference import backward

def test_correct(gdn_case):
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32))

def test_swapped_heads(gdn_case):
    out = backward(*gdn_case.inputs, dtype=np.float32)
    dv = unpack(out, gdn_case.layout).dv
    if gdn_case.layout.heads > 1:
        dv[:, :, [0, 1]] = dv[:, :, [1, 0]]
    gdn_case.check(out)
"""


@pytest.mark.slow
def test_plugin_runs_a_kernel_test_over_the_suite(suite: Suite, pytester: pytest.Pytester) -> None:
    root, paths = suite
    pytester.makepyfile(test_kernel=KERNEL_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-suite", str(root), "-rf")
    names = [p.stem for p in paths]
    multihead = {p.stem for p in paths if load_fixture(p).layout.heads > 1}
    outcomes = result.parseoutcomes()
    assert outcomes["passed"] == len(names) + len(names) - len(multihead)
    assert outcomes["failed"] == len(multihead)
    failed = {
        line.split("[", 1)[1].split("]", 1)[0]
        for line in result.outlines
        if line.startswith("FAILED test_kernel.py::test_swapped_heads[")
    }
    assert failed == multihead
    # Each failure names dv and only dv.
    # The assertion lines (the summary repeats them in full when CI is set, not otherwise).
    reports = [line for line in result.outlines if line.startswith("E ") and "gradient(s)" in line]
    assert len(reports) == len(multihead)
    assert all(line.endswith("gradient(s) dv differ") for line in reports)
    # And the line after each names the cause, once: the table below it does not repeat it.
    # A dv of fewer than _IDENTIFIED values is too few to identify a permutation by.
    lines = result.outlines
    leads = [lines[i + 1] for i, line in enumerate(lines) if line in reports]
    assert len(leads) == len(multihead)
    cause = "likely cause: dv's heads are permuted: heads 0 and 1 exchanged"
    identified = {
        p.stem
        for p in paths
        if p.stem in multihead and np.count_nonzero(load_fixture(p).grads.dv) >= _IDENTIFIED
    }
    named = [line for line in leads if line.startswith("E ") and line.endswith(cause)]
    assert len(named) == len(identified) < len(multihead), leads
    said = [line for line in lines if line.startswith("E ") and line.endswith(cause)]
    assert len(said) == len(identified)  # once per failure (the summary is off, CI unset)


@pytest.mark.slow
def test_plugin_builds_cases_from_a_layout(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernel=KERNEL_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-layout", "1,5,2,4,channel,state")
    result.assert_outcomes(passed=len(REGIMES), failed=len(REGIMES))  # one case per regime
    result.stdout.fnmatch_lines(["FAILED *test_swapped_heads?b1s5h2n4-channel-state-zero-seed0?*"])
    one = pytester.runpytest(
        "-p", "no:cacheprovider", "--gdn-layout", "1,5,1,4", "--gdn-regime", "strong", "-v"
    )
    one.assert_outcomes(passed=2)
    one.stdout.fnmatch_lines(["*test_correct?b1s5h1n4-scalar-nostate-strong-seed0? PASSED*"])
    # Every regime can be chosen, the ones added after the first four too.
    extreme = pytester.runpytest(
        "-p", "no:cacheprovider", "--gdn-layout", "1,5,1,4", "--gdn-regime", "extreme", "-v"
    )
    extreme.assert_outcomes(passed=2)


TF32_KERNEL = """
from gdn_layout.reference._fused import fused_backward

def test_tf32_kernel(gdn_case):
    # chunks of 32, products on TF32 operands: a correct tf32 kernel, not the floors own run
    gdn_case.check(fused_backward(*gdn_case.inputs, bits=10, length=32)[0])
"""


@pytest.mark.slow
def test_plugin_judges_in_the_precision_class_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernel=TF32_KERNEL)
    layout = ("-p", "no:cacheprovider", "--gdn-layout", "1,40,2,16,channel,state")
    # One case per regime.
    pytester.runpytest(*layout, "--gdn-precision", "TF32").assert_outcomes(passed=len(REGIMES))
    failed = pytester.runpytest(*layout)  # judged as float32 by default: its rounding is TF32's
    failed.assert_outcomes(failed=len(REGIMES))
    failed.stdout.fnmatch_lines(["*error/floor<=16 (float32)*"])


def test_plugin_skips_without_a_suite_only_when_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernel=KERNEL_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-skip", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*gdn_case is skipped without --gdn-suite DIR or --gdn-layout*"])
    pytester.makeini("[pytest]\ngdn_skip = true\n")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=2)
    # Without the cache to make the standard suite in, a run that asks for cases fails.
    pytester.makeini("[pytest]\n")
    failed = pytester.runpytest("-p", "no:cacheprovider")
    assert failed.ret != pytest.ExitCode.OK
    failed.stdout.fnmatch_lines(
        ["*gdn-layout: gdn_case makes the standard suite in pytest's cache, which is off*"]
    )
    # --gdn-dtype names the suite's dtype, or is a usage error.
    pytester.makeini("[pytest]\n")


CORRECT_KERNEL = """
import numpy as np
from gdn_layout.reference import backward

def test_correct(gdn_case):
    gdn_case.check(backward(*gdn_case.inputs, dtype=np.float32))
"""


@pytest.mark.slow
def test_plugin_makes_the_standard_suite_once_in_pytest_s_cache(
    pytester: pytest.Pytester,
) -> None:
    # The whole first run: a test file and pytest. The suite is made once, verified on reuse,
    # and made again when it is damaged.
    from gdn_layout import __version__
    from gdn_layout.suites import suite_files

    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    selected = ("--gdn-regime", "zero")
    root = pytester.path / ".pytest_cache" / "d" / "gdn-layout"
    past = root / "suite-0.0.1-float32"  # an earlier version's suite, and its lock
    past.mkdir(parents=True)
    (past / "manifest.json").write_text("{}")
    (root / "suite-0.0.1-float32.lock").write_text("")
    first = pytester.runpytest(*selected)
    folder = root / f"suite-{__version__}-float32"
    assert sorted(p.name for p in root.iterdir()) == [folder.name, f"{folder.name}.lock"]
    cases = suite_files(folder, regime="zero")
    first.assert_outcomes(passed=len(cases))
    stamps = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    pytester.runpytest(*selected).assert_outcomes(passed=len(cases))
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps  # reused
    victim = folder / cases[0]
    victim.write_bytes(victim.read_bytes()[:-8] + bytes(8))  # damaged: made again
    pytester.runpytest(*selected).assert_outcomes(passed=len(cases))
    assert victim.stat().st_mtime_ns != stamps[victim]
    manifest = folder / "manifest.json"
    manifest.write_text(manifest.read_text()[:100])  # cut short: made again too
    pytester.runpytest(*selected).assert_outcomes(passed=len(cases))


@pytest.mark.slow
def test_plugin_reads_its_settings_from_the_configuration(
    suite: Suite, pytester: pytest.Pytester
) -> None:
    root, _ = suite
    pytester.makepyfile(test_kernel=TF32_KERNEL)
    pytester.makeini(f"[pytest]\ngdn_suite = {root}\ngdn_precision = tf32\n")
    args = ("-p", "no:cacheprovider", "--gdn-regime", "mild")
    passed = pytester.runpytest(*args)
    assert passed.ret == pytest.ExitCode.OK
    assert passed.parseoutcomes()["passed"] > 0
    # The command line wins over the file: judged as float32, the TF32 kernel fails.
    failed = pytester.runpytest(*args, "--gdn-precision", "float32")
    assert failed.parseoutcomes()["failed"] == passed.parseoutcomes()["passed"]
    pytester.makeini("[pytest]\ngdn_suite = nowhere\n")
    missing = pytester.runpytest(*args)
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*gdn-layout: gdn_suite = nowhere (*tox.ini): *nowhere*"])
    other = pytester.runpytest("-p", "no:cacheprovider", "--gdn-suite", str(root), "--gdn-dtype",
                               "bf16")  # fmt: skip
    assert other.ret == pytest.ExitCode.USAGE_ERROR
    other.stderr.fnmatch_lines([f"*--gdn-dtype bfloat16: the suite {root} holds float32*"])


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
    ],
)
def test_plugin_usage_errors(pytester: pytest.Pytester, args: list[str], message: str) -> None:
    pytester.makepyfile(test_kernel=KERNEL_TESTS)
    result = pytester.runpytest("-p", "no:cacheprovider", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_plugin_selects_suite_cases(suite: Suite, pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_kernel="def test_seen(gdn_case):\n    assert gdn_case.layout.seq > 256\n"
    )
    result = pytester.runpytest(
        "-p",
        "no:cacheprovider",
        "--gdn-suite",
        str(suite[0]),
        "--gdn-crossing",
        "256",
        "--gdn-regime",
        "extreme",
    )
    result.assert_outcomes(passed=8)  # S = 300 and 513, in four gate and state modes


@pytest.mark.parametrize("given", ["option", "configuration"])
def test_plugin_runs_the_quick_set(suite: Suite, pytester: pytest.Pytester, given: str) -> None:
    root, _ = suite
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    args = ["-p", "no:cacheprovider", f"--gdn-suite={root}", "-v"]  # not a path: the ini's
    if given == "option":
        args.append("--gdn-quick")
    else:
        pytester.makeini("[pytest]\ngdn_quick = true\n")
    result = pytester.runpytest(*args)
    quick = [name.removesuffix(".safetensors") for name in suite_files(root, quick=True)]
    result.assert_outcomes(passed=len(quick))
    result.stdout.fnmatch_lines([f"*test_correct?{name}? PASSED*" for name in quick])


def test_plugin_runs_the_quick_set_of_the_suite_in_its_cache(
    suite: Suite, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    generate = importlib.import_module("gdn_layout.generate")
    made: list[Path] = []

    def write_suite(folder: Path, **_: object) -> None:  # the session's suite, not made again
        made.append(folder)
        shutil.copytree(suite[0], folder)

    monkeypatch.setattr(generate, "write_suite", write_suite)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    result = pytester.runpytest_inprocess("--gdn-quick", "--gdn-regime", "qwen")
    assert len(made) == 1
    result.assert_outcomes(passed=len(suite_files(suite[0], quick=True, regime="qwen")))


# -- what the plugin refuses: one line, exit 4 (a usage error), no INTERNALERROR ---------------


def test_plugin_refuses_a_manifest_with_a_5000_digit_integer(
    tmp_path: Path, fixture_path: Path, pytester: pytest.Pytester
) -> None:
    root = suite_with_huge_integer(tmp_path / "suite", fixture_path)
    pytester.makepyfile(test_kernel="def test_one(gdn_case):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-suite", str(root))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["*gdn-layout: *manifest.json is not JSON*digits*"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("64,100000,64,128", "*gdn-layout: B=64 S=100000 H=64 N=128*needs about*available*"),
        ("0,1099511627776,1099511627776,2", "*which no array can have*"),
    ],
)
def test_plugin_refuses_a_layout_beyond_memory(
    pytester: pytest.Pytester, spec: str, message: str
) -> None:
    pytester.makepyfile(test_kernel="def test_one(gdn_case):\n    pass\n")
    start = time.perf_counter()
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-layout", spec)
    assert time.perf_counter() - start < 20
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines([message])
    assert len([line for line in result.stderr.lines if "gdn-layout" in line]) == 1


def test_plugin_turns_memory_error_into_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suites = importlib.import_module("gdn_layout.suites")

    def exhausted(*args: object, **kwargs: object) -> None:
        raise MemoryError("Unable to allocate 1.00 TiB")

    monkeypatch.setattr(suites, "make_case", exhausted)
    pytester.makepyfile(test_kernel="def test_one(gdn_case):\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--gdn-layout", "1,4,1,2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines(["*gdn-layout: out of memory: Unable to allocate 1.00 TiB*"])


# -- under pytest-xdist -------------------------------------------------------------------------


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
def test_plugin_under_xdist_makes_cases_in_the_workers_only(
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
        args, calls = ["--gdn-layout", "1,5,2,4,channel,state"], len(REGIMES)  # one per regime
        passed = calls
    else:
        root, _ = request.getfixturevalue("suite")
        mild = len(suite_files(root, regime="mild"))
        args, calls, passed = ["--gdn-suite", str(root), "--gdn-regime", "mild"], 1, mild
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", *args)
    result.assert_outcomes(passed=passed)
    made = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    workers = {worker for _, worker in made}
    assert workers == {"gw0", "gw1"}, made  # the controller (no worker) made none
    assert len(made) == 2 * calls
    assert len({pid for pid, _ in made}) == 2


@pytest.mark.slow
def test_plugin_under_xdist_reports_a_worker_s_problem_once_per_worker(
    suite: Suite, pytester: pytest.Pytester
) -> None:
    pytest.importorskip("xdist")
    root, _ = suite
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    args = ("-p", "no:cacheprovider", "-n", "2", "--gdn-suite", str(root), "--gdn-dtype", "bf16")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(errors=2)  # a failed collection in each worker, not a crash
    result.stdout.fnmatch_lines([f"*--gdn-dtype bfloat16: the suite {root} holds float32*"])
    assert "crashed" not in result.stdout.str() + result.stderr.str()
