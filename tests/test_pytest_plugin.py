"""The pytest plugin (``gdn_layout.pytest_plugin``), run by pytester on test files of its own:
``gdn_case`` over a suite, a layout or the standard suite it makes once in pytest's cache; its
options, on the command line and in the configuration; its usage errors, one line each, never
an INTERNALERROR; and under pytest-xdist, cases made in the workers only."""

from __future__ import annotations

import importlib
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from gdn_layout import load_fixture
from gdn_layout.check._findings import _IDENTIFIED
from gdn_layout.pytest_plugin import _cache_key
from gdn_layout.regimes import REGIMES
from gdn_layout.suites import suite_files
from support import Suite, on_a_terminal, run, suite_with_huge_integer


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
    from gdn_layout.suites import suite_files

    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    selected = ("--gdn-regime", "zero")
    root = pytester.path / ".pytest_cache" / "d" / "gdn-layout"
    past = root / "suite-0.0.1-float32"  # an earlier version's suite, and its lock
    past.mkdir(parents=True)
    (past / "manifest.json").write_text("{}")
    (root / "suite-0.0.1-float32.lock").write_text("")
    first = pytester.runpytest(*selected)
    folder = root / _cache_key("float32")  # the version's and the definition's
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


#: A conftest that makes the standard suite of its first shape alone (a few seconds' work).
FIRST_SHAPE = """
import gdn_layout.generate as generate

generate._SUITE_SHAPES = generate._SUITE_SHAPES[:1]
"""

#: What the plugin says before it makes the suite, and as it goes.
MAKING = "gdn-layout: making the standard suite for gdn_case, once: "
PROGRESS = "gdn-layout: standard suite"


def _cached_folder(pytester: pytest.Pytester) -> Path:
    """The one suite in pytest's cache folder."""
    root = pytester.path / ".pytest_cache" / "d" / "gdn-layout"
    (folder,) = [p for p in root.iterdir() if p.is_dir()]
    return folder


def _said(folder: Path, count: int) -> str:
    return f"{MAKING}{count} fixtures in float32, in {folder} (later runs reuse it)"


def test_plugin_says_what_it_makes_and_how_far_in_a_log(pytester: pytest.Pytester) -> None:
    from gdn_layout._progress import LINE_STEP

    pytester.makeconftest(FIRST_SHAPE)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    first = pytester.runpytest_subprocess()  # stderr is a pipe, as in CI
    folder = _cached_folder(pytester)
    count = len(suite_files(folder))
    first.assert_outcomes(passed=count)
    err = first.stderr.lines
    assert err.count(_said(folder, count)) == 1, err
    start = err.index(_said(folder, count))
    lines = [line for line in err if line.startswith(f"{PROGRESS}: ")]
    assert lines
    assert err.index(lines[0]) > start
    percents = [int(line.split(": ")[2].split("%")[0]) for line in lines]
    assert percents == sorted(percents)
    assert percents[-1] == 100
    assert len(percents) >= round(1 / LINE_STEP)  # a line at every tenth: more files than ten
    assert "\r" not in first.stderr.str()  # no bar into a log
    again = pytester.runpytest_subprocess()  # made once: nothing said after
    again.assert_outcomes(passed=count)
    assert "gdn-layout" not in again.stderr.str()


@pytest.mark.slow
def test_plugin_draws_a_bar_on_a_terminal(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(FIRST_SHAPE)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    code, shown = on_a_terminal([sys.executable, "-m", "pytest"], pytester.path)
    assert code == 0, shown
    folder = _cached_folder(pytester)
    assert _said(folder, len(suite_files(folder))) in shown
    assert f"\r{PROGRESS} [" in shown
    assert "] 100%" in shown
    assert f"{PROGRESS}: " not in shown  # no log lines on a terminal


@pytest.mark.slow
def test_plugin_under_xdist_says_it_from_one_worker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("xdist")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makeconftest(FIRST_SHAPE)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    result = pytester.runpytest_subprocess("-n", "2")
    folder = _cached_folder(pytester)
    count = len(suite_files(folder))
    result.assert_outcomes(passed=count)
    err = result.stderr.lines
    assert [line for line in err if line.startswith(MAKING)] == [_said(folder, count)]
    assert len([line for line in err if line.startswith(f"{PROGRESS}: 100%")]) == 1


def test_plugin_keys_the_cached_suite_by_its_definition(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    generate = importlib.import_module("gdn_layout.generate")
    from gdn_layout import __version__

    monkeypatch.setattr(generate, "_SUITE_SHAPES", generate._SUITE_SHAPES[:1])
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    root = pytester.path / ".pytest_cache" / "d" / "gdn-layout"
    past = root / f"suite-{__version__}-float32"  # as this version named it before the digest
    past.mkdir(parents=True)
    other = root / f"suite-{__version__}-float64-0123456789abcdef"  # another dtype's: kept
    other.mkdir()
    first = pytester.runpytest_inprocess("--gdn-regime", "zero")
    made = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert len(made) == 2
    assert other.name in made
    assert past.name not in made
    (name,) = set(made) - {other.name}
    count = len(suite_files(root / name, regime="zero"))
    first.assert_outcomes(passed=count)
    stamps = {p: p.stat().st_mtime_ns for p in (root / name).iterdir()}
    pytester.runpytest_inprocess("--gdn-regime", "zero").assert_outcomes(passed=count)
    assert {p: p.stat().st_mtime_ns for p in (root / name).iterdir()} == stamps  # reused
    # A regime drawn otherwise is another suite, in another folder; the old one goes.
    draw = generate.draw_gate

    def drawn_otherwise(rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> object:
        return draw(rng, shape, regime) * (2 if regime == REGIMES[-1] else 1)

    monkeypatch.setattr(generate, "draw_gate", drawn_otherwise)
    pytester.runpytest_inprocess("--gdn-regime", "zero").assert_outcomes(passed=count)
    remade = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert other.name in remade
    assert name not in remade
    assert len(remade) == 2
    assert not (root / f"{name}.lock").exists()


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
def test_plugin_keeps_a_failure_s_output_and_picture_with_gdn_save(
    pytester: pytest.Pytester,
) -> None:
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
    assert files == [f"{stem}-output.npy", f"{stem}.png"]
    picture, output = (str(pytester.path / "kept" / name) for name in reversed(files))
    (words,) = _redraw(kept)
    assert words == ["compare", "--plot", picture, "--force", output, str(folder / wrong)]
    drawn = run(*words)
    assert drawn.returncode == 1, drawn.stderr
    assert "compare FAILED (dg)" in drawn.stdout


def test_plugin_says_once_that_it_keeps_no_picture_without_matplotlib(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    pytester.makepyfile(test_kernel=ONE_WRONG)
    pytester.makeini("[pytest]\ngdn_save = kept\n")  # relative to the file
    layout = ("-p", "no:cacheprovider", "--gdn-layout", "1,3,2,2,channel,state")
    result = pytester.runpytest_inprocess(*layout)
    result.assert_outcomes(failed=len(REGIMES))
    said = "without pictures: matplotlib is not installed (pip install 'gdn-layout[plot]'"
    assert result.stdout.str().count(said) == 1
    kept = sorted(p.name for p in (pytester.path / "kept").iterdir())
    assert len(kept) == 2 * len(REGIMES)
    assert all(name.endswith(("-output.npy", "-fixture.safetensors")) for name in kept)
    assert all(words[2] == "PICTURE.png" for words in _redraw(result))


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


def test_plugin_makes_the_suite_with_every_core(
    suite: Suite, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first run's suite is what a user waits for: it is made in a process per core."""
    generate = importlib.import_module("gdn_layout.generate")
    asked: list[object] = []

    def write_suite(folder: Path, **options: object) -> None:
        asked.append(options.get("workers", 1))
        shutil.copytree(suite[0], folder)

    monkeypatch.setattr(generate, "write_suite", write_suite)
    pytester.makepyfile(test_kernel=CORRECT_KERNEL)
    pytester.runpytest_inprocess("--gdn-quick")
    assert asked == [None]  # None: every core this process may use


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


# -- the summary across cases --------------------------------------------------------------------


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
def test_plugin_summarises_each_test_function_across_its_cases(
    pytester: pytest.Pytester, workers: list[str]
) -> None:
    if workers:
        pytest.importorskip("xdist")
    pytester.makepyfile(test_kernel=SUMMARY_TESTS)
    args = ["-p", "no:cacheprovider", *workers, "--gdn-layout", "1,5,2,4,state"]
    result = pytester.runpytest_subprocess(*args)
    n = len(REGIMES)
    result.assert_outcomes(passed=3 * n, failed=2 * n)
    lines = result.outlines
    start = lines.index(next(line for line in lines if "what failed across the cases" in line))
    block = lines[start + 1 :]

    def at(prefix: str) -> int:
        return next(i for i, line in enumerate(block) if line.startswith(prefix))

    # A stray cast is refused in every case: the block says what each raised.
    cast = at("test_kernel.py::test_cast: ")
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
    assert block[correct + 3].startswith(
        f"  likely cause in {n - 1} cases (dstate, scale): dstate is 2.000"
    )
    assert not any("test_no_comparison" in line for line in block)  # it compared nothing
    partly = at(f"test_kernel.py::test_partly: all {n - 1} cases passed")
    assert block[partly + 1] == (
        "  1 more case(s) raised RuntimeError: before the comparison, not counted: "
        "b1s5h2n4-scalar-state-zero-seed0"
    )


def test_plugin_prints_no_summary_without_a_comparison(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernel="def test_nothing(gdn_case):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "--gdn-layout", "1,2,1,2")
    result.assert_outcomes(passed=len(REGIMES))
    assert "what failed across the cases" not in result.stdout.str()
