"""A pytest plugin: the cases of a fixture suite as the parameters of a ``gdn_case`` fixture.

Installed with gdn-layout (the ``pytest11`` entry point); its options and configuration keys
are in README.md, *Quickstart*. Without a suite or a layout, the standard suite is written
once into pytest's cache. A kernel test is::

    def test_my_kernel(gdn_case):
        gdn_case.check(my_backward(*gdn_case.inputs))

Under pytest-xdist the controller only checks the options (and the suite's manifest); each
worker makes the cases, and a problem it finds fails the collection of the tests that take
``gdn_case``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from ._cli_values import PRECISION_HELP, count_arg, dtype_arg, positive_arg, precision_arg
from .regimes import REGIMES
from .suites import Case

__all__ = ["gdn_case"]

_CASES = pytest.StashKey[list[Case]]()
#: What makes the cases of --gdn-suite or --gdn-layout, and the prefix of its errors.
_MAKE = pytest.StashKey[tuple[Callable[[], list[Case]], str]]()
#: A worker's usage error, reported when its tests are collected.
_ERROR = pytest.StashKey[str]()
#: A case's last comparison when its test starts.
_BEFORE = pytest.StashKey[object]()
#: Why a selection of no case fails (README.md: a gdn_case test never passes by being skipped).
_NONE_KEPT = "the selection keeps no case; a gdn_case test never passes by being skipped"
#: What a run that asks for cases and cannot make the standard suite is told to do instead.
_INSTEAD = "give --gdn-suite DIR or --gdn-layout B,S,H,N, or --gdn-skip to skip such tests"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gdn-layout", "kernel test cases of gdn-layout")
    add = group.addoption
    # fmt: off
    add("--gdn-suite", metavar="DIR",
        help="parametrize the gdn_case fixture over the cases of the fixture suite in DIR")
    add("--gdn-layout", metavar="B,S,H,N[,channel][,state]",
        help="parametrize gdn_case over cases computed now for this layout (no suite needed)")
    add("--gdn-regime", choices=REGIMES,
        help="only the cases of this gate regime (default: every one)")
    add("--gdn-min-seq", type=count_arg, metavar="S",
        help="only the suite's cases of at least S steps")
    add("--gdn-crossing", type=positive_arg, metavar="C",
        help="only the suite's cases that cross a boundary of a C-step chunk")
    add("--gdn-quick", action="store_true", default=None,
        help="only the suite's quick set: the fewest cases that still hold every shape, gate "
        "regime and pairing of gate and state modes (every chunk boundary to 256 steps)")
    add("--gdn-dtype", type=dtype_arg,
        help="the cases' dtype with --gdn-layout, and the cached standard suite's (float32)")
    add("--gdn-precision", type=precision_arg, metavar="CLASS",
        help=f"{PRECISION_HELP}; gdn_case.check judges in it")
    add("--gdn-seed", type=count_arg, default=0, help="with --gdn-layout: the inputs' seed (0)")
    add("--gdn-skip", action="store_true", default=None,
        help="skip the tests that take gdn_case when no suite or layout is given, instead of "
        "running them over the standard suite made in pytest's cache")
    add("--gdn-save", metavar="DIR",
        help="keep each failing case's kernel output (.npy) and its picture (.png) in DIR")
    parser.addini("gdn_suite", "as --gdn-suite, relative to this file")
    parser.addini("gdn_dtype", "as --gdn-dtype, and the cached suite's dtype", default="float32")
    parser.addini("gdn_precision", "as --gdn-precision")
    parser.addini("gdn_skip", "as --gdn-skip", type="bool", default=False)
    parser.addini("gdn_quick", "as --gdn-quick", type="bool", default=False)
    parser.addini("gdn_save", "as --gdn-save, relative to this file")
    # fmt: on


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Where ``--gdn-save`` keeps failures, and once, that it keeps no picture without
    matplotlib."""
    folder = _save_folder(config)
    if folder is None:
        return []
    from ._checks import PLOT_HINT, require_matplotlib

    try:
        require_matplotlib()
    except ImportError:
        return [
            f"gdn-layout: failing cases are kept in {folder}, without pictures: matplotlib "
            f"is not installed ({PLOT_HINT})"
        ]
    return [f"gdn-layout: failing cases are kept in {folder}"]


def _from_ini(config: pytest.Config, key: str) -> Path | None:
    """The path a configuration key names, relative to the configuration file."""
    setting = str(config.getini(key)).strip()
    if not setting:
        return None
    return (config.inipath.parent if config.inipath is not None else config.rootpath) / setting


def _save_folder(config: pytest.Config) -> Path | None:
    """The folder of ``--gdn-save`` (from where pytest was run), else of ``gdn_save``."""
    given = config.getoption("gdn_save", None)
    if given is not None:
        return Path(config.invocation_params.dir, given)
    return _from_ini(config, "gdn_save")


def _setting(config: pytest.Config, name: str) -> Any:
    """An option's value, else its configuration key's."""
    value = config.getoption(name)
    return config.getini(name) if value is None else value


def _selection(config: pytest.Config) -> dict[str, Any]:
    """The options that select a suite's cases, as :func:`~gdn_layout.suites.load_suite` takes
    them."""
    chosen = {k: config.getoption(f"gdn_{k}") for k in ("min_seq", "regime", "crossing")}
    return {**chosen, "quick": bool(_setting(config, "gdn_quick"))}


def pytest_configure(config: pytest.Config) -> None:
    suite = config.getoption("gdn_suite", None)
    setting = "--gdn-suite"
    if suite is None and (found := _from_ini(config, "gdn_suite")) is not None:
        suite = str(found)
        setting = f"gdn_suite = {str(config.getini('gdn_suite')).strip()}"
        if config.inipath is not None:
            setting += f" ({config.inipath})"
    spec = config.getoption("gdn_layout", None)
    if suite is None and spec is None:
        return
    if suite is not None and spec is not None:
        raise pytest.UsageError("--gdn-suite and --gdn-layout: give one of them")
    where = "" if suite is None else f"{setting}: "
    # Checked here, in every process; made when the session starts, where tests are run.
    make: Callable[[], list[Case]]
    with _usage_errors(where):
        if suite is not None:
            from .suites import suite_files

            if not suite_files(suite, **_selection(config)):  # its manifest, and the selection
                raise ValueError(f"{suite}: {_NONE_KEPT}")
            _precision(config, ())  # its spelling; its dtype's, once the suite is loaded
            make = functools.partial(_suite_cases, config, suite)
        else:
            if config.getoption("gdn_quick"):
                raise ValueError("--gdn-quick selects from a suite; drop it or --gdn-layout")
            make = _layout_cases(config, spec)
    config.stash[_MAKE] = (make, where)


@pytest.hookimpl(tryfirst=True)  # a usage error before the session's header
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    planned = config.stash.get(_MAKE, None)
    # pytest-xdist's controller (its "dsession" plugin) runs no test: the workers make them.
    if planned is None or config.pluginmanager.hasplugin("dsession"):
        return
    make, where = planned
    try:
        with _usage_errors(where):
            cases = make()
        config.stash[_CASES] = _judged_in(config, cases)
    except pytest.UsageError as error:
        if not hasattr(config, "workerinput"):
            raise
        # A worker that fails to start is a crash, restarted up to eight times: fail to collect.
        config.stash[_ERROR] = str(error)


@contextlib.contextmanager
def _usage_errors(where: str) -> Iterator[None]:
    """The user's problems as one usage error each, its message prefixed by ``where``."""
    from .files._fixture import FixtureError

    try:
        yield
    except (FixtureError, ValueError, TypeError, ImportError) as err:
        raise pytest.UsageError(f"gdn-layout: {where}{err}") from None
    except MemoryError as err:  # past the estimate: still the user's layout, not a crash
        raise pytest.UsageError(f"gdn-layout: out of memory: {err}") from None


def _suite_cases(config: pytest.Config, suite: str) -> list[Case]:
    from .suites import load_suite

    cases = load_suite(suite, **_selection(config))
    asked = config.getoption("gdn_dtype")
    dtypes = {c.fixture.dtype.name for c in cases}
    if asked is not None and dtypes - {asked}:
        raise ValueError(
            f"--gdn-dtype {asked}: the suite {suite} holds {', '.join(sorted(dtypes))}"
        )
    return cases


def _judged_in(config: pytest.Config, cases: list[Case]) -> list[Case]:
    """``cases`` judged in ``--gdn-precision``'s class."""
    precision = _precision(config, {c.fixture.dtype for c in cases})
    if precision is None:
        return cases
    return [dataclasses.replace(c, precision=precision) for c in cases]


def _precision(config: pytest.Config, dtypes: Iterable[Any]) -> str | None:
    """``--gdn-precision``'s class (None: each case's own); a class finer than one of
    ``dtypes`` is one usage error."""
    precision = _setting(config, "gdn_precision") or None
    if precision is None:
        return None
    from .check._criterion import judged_precision

    try:
        precision = precision_arg(str(precision))
        for dtype in dtypes:
            judged_precision(precision, "--gdn-precision", dtype)
    except (ValueError, argparse.ArgumentTypeError) as err:
        raise pytest.UsageError(f"gdn-layout: {err}") from None
    return precision


def _dtype(config: pytest.Config) -> str:
    """``--gdn-dtype``, else ``gdn_dtype``, as its NumPy name."""
    try:
        return dtype_arg(str(_setting(config, "gdn_dtype") or "float32"))
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"gdn_dtype: {err}") from None


# -- the standard suite in pytest's cache ----------------------------------------------------------


def _cached_cases(config: pytest.Config) -> list[Case]:
    """The standard suite in pytest's cache folder, under :func:`_cache_key`: written by the
    first process that needs it, under a lock, saying so on stderr; verified on reuse, and
    written again, whole, when it is not intact (the folder is the plugin's own). Writing it
    removes the suites of other keys."""
    cache = getattr(config, "cache", None)
    if cache is None:
        pytest.fail(
            "gdn-layout: gdn_case makes the standard suite in pytest's cache, which is off "
            f"(-p no:cacheprovider): {_INSTEAD}",
            pytrace=False,
        )
    from .files._fixture import FixtureError
    from .suites import load_suite, verify_suite

    with _usage_errors(""):
        dtype = _dtype(config)
    with _usage_errors("gdn_dtype: "):  # bfloat16 without its extra
        name = _cache_key(dtype)
    try:
        root = Path(cache.mkdir("gdn-layout"))
        folder = root / name
        with open(root / f"{name}.lock", "w") as lock:
            _lock(lock)  # one writer; the others wait, then read it
            try:
                intact = (folder / "manifest.json").exists() and not verify_suite(folder)
            except FixtureError:  # a manifest cut short, say
                intact = False
            if not intact:
                shutil.rmtree(folder, ignore_errors=True)
                _write_cached_suite(config, folder, dtype)
                for old in root.iterdir():  # the suites of other keys: tens of MiB each
                    if _stale(old.name, name, dtype):
                        if old.is_dir():
                            shutil.rmtree(old, ignore_errors=True)
                        else:
                            old.unlink()
            cases = load_suite(folder, **_selection(config))
    except OSError as err:  # a read-only project, a full disk
        pytest.fail(
            f"gdn-layout: cannot make the standard suite in pytest's cache: {err}; {_INSTEAD}",
            pytrace=False,
        )
    return _judged_in(config, cases)


def _lock(file: IO[str]) -> None:
    """Hold an exclusive lock on ``file`` until it is closed. Imported here, not at the top: a
    plugin that fails to import breaks every pytest run of the environment."""
    if sys.platform == "win32":
        import msvcrt

        while True:
            try:
                msvcrt.locking(file.fileno(), msvcrt.LK_LOCK, 1)
                return
            except OSError:  # LK_LOCK gives up after 10 s: the writer is still at work
                pass
    else:
        import fcntl

        fcntl.flock(file, fcntl.LOCK_EX)


def _cache_key(dtype: str) -> str:
    """The name of the cached standard suite's folder in ``dtype``: gdn-layout's version, the
    dtype, and the start of the digest of the suite's definition
    (:func:`~gdn_layout.generate.suite_digest`)."""
    from ._dtypes import resolve
    from ._version import __version__
    from .generate import suite_digest

    return f"suite-{__version__}-{dtype}-{suite_digest(resolve(dtype, 'gdn_dtype'))[:16]}"


def _stale(entry: str, current: str, dtype: str) -> bool:
    """Whether ``entry`` of the cache folder is a suite (or its lock) of the past: of another
    version, or of ``dtype`` but not ``current``; this version's suites of other dtypes stay."""
    from ._version import __version__

    suite = entry.removesuffix(".lock")
    if not suite.startswith("suite-") or suite == current:
        return False
    other = suite.removeprefix(f"suite-{__version__}-").split("-")
    return not suite.startswith(f"suite-{__version__}-") or len(other) != 2 or other[0] == dtype


def _write_cached_suite(config: pytest.Config, folder: Path, dtype: str) -> None:
    """Write the standard suite into ``folder``, saying on stderr, past pytest's capture, what
    is made, where, and how far it is: a bar on a terminal, a line at every tenth and every
    few seconds in a log."""
    from ._progress import Progress, stderr_is_terminal
    from .generate import suite_size, write_suite

    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        terminal = stderr_is_terminal()
        start = time.monotonic()
        _say(
            ("\n" if terminal else "")  # past pytest's "collecting ..."
            + f"gdn-layout: making the standard suite for gdn_case, once: {suite_size()} "
            f"fixtures in {dtype}, in {folder} (later runs reuse it)"
        )
        progress = Progress(enabled=True, label="gdn-layout: standard suite", lines=not terminal)
        write_suite(folder, dtype=dtype, progress=progress.update, workers=None)  # every core
        progress.done()
        _say(f"gdn-layout: made the standard suite in {time.monotonic() - start:.0f} s")


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # no stderr: the work goes on, unsaid
        pass


# -- cases computed now for --gdn-layout -----------------------------------------------------------


def _layout_cases(config: pytest.Config, spec: str) -> Callable[[], list[Case]]:
    """What makes the cases of ``--gdn-layout spec``, once the options are checked."""
    from ._dtypes import resolve
    from ._limits import impossible_arrays, memory_refusal
    from .generate import fixture_memory
    from .layout import GdnBackwardLayout
    from .suites import make_case

    parts = [p.strip().lower() for p in spec.split(",")]
    flags = set(parts[4:])
    if len(parts) < 4 or not flags <= {"channel", "state"}:
        raise ValueError(f"--gdn-layout expects B,S,H,N[,channel][,state], got {spec!r}")
    try:
        dims = [int(p) for p in parts[:4]]
    except ValueError:
        raise ValueError(f"--gdn-layout expects four integers first, got {spec!r}") from None
    batch, seq, heads, n = dims
    channel, state = "channel" in flags, "state" in flags
    layout = GdnBackwardLayout(batch, seq, heads, n, gate_per_channel=channel, carry_state=state)
    regime = config.getoption("gdn_regime")
    regimes = REGIMES if regime is None else (regime,)
    dtype = _dtype(config)
    # Refused up front, as the command line refuses it, rather than after the work: the
    # making of one case, beside the cases made before it, which stay.
    size = resolve(dtype, "--gdn-dtype").itemsize
    arrays = layout.total_elems + 5 * layout.qkv_elems + layout.gate_elems + layout.beta_elems
    kept = (len(regimes) - 1) * size * (arrays + layout.state_elems)
    needed = fixture_memory(layout, dtype=dtype, precisions="all") + kept
    why = impossible_arrays(layout) or memory_refusal(layout, needed)
    if why is not None:
        raise ValueError(why)
    _precision(config, [resolve(dtype, "--gdn-dtype")])
    seed = config.getoption("gdn_seed")
    return lambda: [make_case(layout, dtype=dtype, regime=r, seed=seed) for r in regimes]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "gdn_case" not in metafunc.fixturenames:
        return
    config = metafunc.config
    if (error := config.stash.get(_ERROR, None)) is not None:
        pytest.fail(error, pytrace=False)
    cases = config.stash.get(_CASES, None)
    if cases is None and not _setting(config, "gdn_skip"):
        # Made here, when a test first asks: pytest-xdist's controller collects nothing.
        cases = config.stash[_CASES] = _cached_cases(config)
    if cases == []:  # a test parametrized by nothing is skipped: it must not pass so
        pytest.fail(f"gdn-layout: the standard suite: {_NONE_KEPT}", pytrace=False)
    if cases is not None:
        metafunc.parametrize("gdn_case", cases, ids=[c.name for c in cases], indirect=True)


@pytest.fixture
def gdn_case(request: pytest.FixtureRequest) -> Any:
    """One case of the suite given by ``--gdn-suite`` (or of ``--gdn-layout``, or of the
    standard suite in pytest's cache): a :class:`gdn_layout.suites.Case` with ``inputs``,
    ``expected``, ``layout`` and ``check``."""
    if not hasattr(request, "param"):
        pytest.skip("gdn_case is skipped without --gdn-suite DIR or --gdn-layout (--gdn-skip)")
    case: Case = request.param
    request.node.stash[_BEFORE] = case.last_comparison
    folder = _save_folder(request.config)
    if folder is None:
        return case
    # A failure's files are named after the test, which a case can serve more than once.
    stem = re.sub(r"[^\w.-]+", "-", request.node.nodeid.replace(".py::", "-")).strip("-")
    return dataclasses.replace(case, save_as=folder / stem)


# -- the summary across cases, at the end of the session -----------------------------------------

#: The user property that carries a case's result, as JSON, from the process that ran the test
#: (a pytest-xdist worker) to the one that prints the summary.
_RESULT = "gdn_case_result"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A test's report, with a record of its case in ``user_properties`` (which pytest-xdist
    sends on): what pytest made of the test, and the result of its last comparison when that
    is what decided it."""
    report = yield
    case = getattr(item, "funcargs", {}).get("gdn_case")
    if call.when == "call" and isinstance(case, Case):
        record = _record(case, item.stash.get(_BEFORE, None), call, report)
        report.user_properties.append((_RESULT, json.dumps(record, allow_nan=False)))
    return report


def _record(
    case: Case, before: object, call: pytest.CallInfo[None], report: pytest.TestReport
) -> dict[str, Any]:
    """A case's record: its :class:`~gdn_layout.summary.CaseResult` when its comparison
    decided the test; else its name and what became of it (skipped, xfailed, raised)."""
    from .summary import case_result

    after = case.last_comparison
    compared = after is not None and after is not before
    if hasattr(report, "wasxfail"):
        return {"name": case.name, "outcome": "xfailed" if report.skipped else "xpassed"}
    if report.skipped:
        return {"name": case.name, "outcome": "skipped"}
    if compared and (report.passed or not after.passed):  # type: ignore[union-attr]
        return case_result(case, after).to_dict()  # type: ignore[arg-type]
    if call.excinfo is None:
        return {"name": case.name}
    error = call.excinfo.value
    lines = str(error).strip().splitlines()
    raised = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    return {"name": case.name, "raised": raised + _AFTER * compared}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One block per test function that judged ``gdn_case``: what failed across its cases
    (:func:`gdn_layout.summary.summarize`; a case once, however many tests it served), and
    the cases no comparison decided, by what became of them."""
    from .summary import CaseResult, summarize

    by_test: dict[str, tuple[dict[str, CaseResult], dict[str, set[str]]]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key != _RESULT or getattr(report, "when", None) != "call":
                    continue
                results, others = by_test.setdefault(report.nodeid.split("[", 1)[0], ({}, {}))
                record = json.loads(value)
                name = record["name"]
                if "grads" in record:  # failed if it failed once
                    if name not in results or results[name].passed:
                        results[name] = CaseResult.from_dict(record)
                    continue
                what = record.get("outcome", "made no comparison")
                others.setdefault(f"raised {record['raised']}" if "raised" in record else what,
                                  set()).add(name)  # fmt: skip
    # A test that compared nothing is summarised only where something became of a case: a
    # comparison refused (an output of a coarser class, say) is a verdict on every case.
    blocks = {t: found for t, found in by_test.items() if found[0] or set(found[1]) - {_NONE}}
    if not blocks:
        return
    terminalreporter.write_sep("=", "gdn-layout: what failed across the cases")
    for test, (results, others) in sorted(blocks.items()):
        for what in (_NONE, "skipped"):  # a case judged in another of its tests
            others.get(what, set()).difference_update(results)
        judged = sorted(results.values(), key=lambda r: r.name)  # xdist: in no fixed order
        lines = summarize(judged, command="pytest").lines() if judged else []
        count = len(set().union(*others.values()))
        after = any(what.endswith(_AFTER) for what in others)
        head = f"no comparison {'failed' if after else 'was made'} in {count} case(s)"
        terminalreporter.write_line(f"{test}: {lines[0] if lines else head}")
        more, tail = ("more ", ", not counted") if judged else ("", "")
        for what, names in sorted(others.items(), key=lambda item: -len(item[1])):
            if names:
                shown = ", ".join(sorted(names)[:6]) + (
                    f", and {len(names) - 6} more" * (len(names) > 6)
                )
                terminalreporter.write_line(f"  {len(names)} {more}case(s) {what}{tail}: {shown}")
        for line in lines[1:]:
            terminalreporter.write_line(line)


#: What became of a case whose test made no comparison and raised nothing.
_NONE = "made no comparison"
#: What a case's record adds when its test raised after its comparison passed.
_AFTER = ", after its comparison passed"
