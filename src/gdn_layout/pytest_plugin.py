"""A pytest plugin: the cases of a fixture suite as the parameters of a ``gdn_case`` fixture.

Installed with gdn-layout (through the ``pytest11`` entry point) and idle until asked:

``pytest --gdn-suite DIR``
    every test that takes ``gdn_case`` runs once per case of the suite in ``DIR``
    (:func:`gdn_layout.suites.load_suite`, which checks the manifest first), with the case's
    name as the test id; ``--gdn-min-seq S``, ``--gdn-regime R`` and ``--gdn-crossing C``
    keep the cases of at least ``S`` steps, of regime ``R``, that cross a ``C``-step chunk's
    boundary (``-k`` selects by name as usual);
``pytest --gdn-layout B,S,H,N[,channel][,state]``
    the same without a suite: one case per gate regime (or the one ``--gdn-regime`` names),
    computed by the reference when the tests are collected, in ``--gdn-dtype``
    (float32 by default) with ``--gdn-seed``.
``--gdn-precision CLASS``
    ``gdn_case.check`` judges in that precision class (``tf32`` for a kernel whose float32
    matrix products take TF32 operands); by default the class of the buffers' dtype.

Without either option a test that takes ``gdn_case`` is skipped. A kernel test is then::

    def test_my_kernel(gdn_case):
        gdn_case.check(my_backward(*gdn_case.inputs))

:meth:`~gdn_layout.suites.Case.check` fails with the comparison table, naming the gradient
and the coordinates of its worst element; the criterion is the calibrated one unless
tolerances are passed to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ._cli_values import PRECISION_HELP, count_arg, positive_arg, precision_arg
from .regimes import REGIMES
from .suites import Case

__all__ = ["gdn_case"]

_CASES = pytest.StashKey[list[Case]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gdn-layout", "kernel test cases of gdn-layout")
    group.addoption(
        "--gdn-suite",
        metavar="DIR",
        help="parametrize the gdn_case fixture over the cases of the fixture suite in DIR",
    )
    group.addoption(
        "--gdn-layout",
        metavar="B,S,H,N[,channel][,state]",
        help="parametrize gdn_case over cases computed now for this layout (no suite needed)",
    )
    group.addoption(
        "--gdn-regime",
        choices=REGIMES,
        help="only the cases of this gate regime (default: every one)",
    )
    group.addoption(
        "--gdn-min-seq",
        type=count_arg,
        metavar="S",
        help="with --gdn-suite: only the cases of at least S steps",
    )
    group.addoption(
        "--gdn-crossing",
        type=positive_arg,
        metavar="C",
        help="with --gdn-suite: only the cases that cross a boundary of a C-step chunk",
    )
    group.addoption(
        "--gdn-dtype", default="float32", help="with --gdn-layout: the cases' dtype (float32)"
    )
    group.addoption(
        "--gdn-precision",
        type=precision_arg,
        metavar="CLASS",
        help=f"{PRECISION_HELP}; gdn_case.check judges in it",
    )
    group.addoption(
        "--gdn-seed", type=count_arg, default=0, help="with --gdn-layout: the inputs' seed (0)"
    )


def pytest_configure(config: pytest.Config) -> None:
    suite = config.getoption("gdn_suite", None)
    spec = config.getoption("gdn_layout", None)
    if suite is None and spec is None:
        return
    if suite is not None and spec is not None:
        raise pytest.UsageError("--gdn-suite and --gdn-layout: give one of them")
    from .files._fixture import FixtureError

    try:
        if suite is not None:
            from .suites import load_suite

            cases = load_suite(
                suite,
                min_seq=config.getoption("gdn_min_seq"),
                regime=config.getoption("gdn_regime"),
                crossing=config.getoption("gdn_crossing"),
            )
        else:
            cases = _layout_cases(config, spec)
    except (FixtureError, ValueError, TypeError, ImportError) as err:
        raise pytest.UsageError(f"gdn-layout: {err}") from None
    except MemoryError as err:  # past the estimate: still the user's layout, not a crash
        raise pytest.UsageError(f"gdn-layout: out of memory: {err}") from None
    precision = config.getoption("gdn_precision")
    if precision is not None:  # a class finer than a case's dtype, refused once
        from .check._criterion import judged_precision

        for case in cases:
            try:
                judged_precision(precision, "--gdn-precision", case.fixture.dtype)
            except ValueError as err:
                raise pytest.UsageError(f"gdn-layout: {case.name}: {err}") from None
    config.stash[_CASES] = [dataclasses.replace(c, precision=precision) for c in cases]


def _layout_cases(config: pytest.Config, spec: str) -> list[Case]:
    from ._limits import impossible_arrays, memory_refusal
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
    batch, seq, heads, state_size = dims
    layout = GdnBackwardLayout(
        batch,
        seq,
        heads,
        state_size,
        gate_per_channel="channel" in flags,
        carry_state="state" in flags,
    )
    # Refused up front, as the command line refuses it, rather than after the work.
    why = impossible_arrays(layout) or memory_refusal(layout)
    if why is not None:
        raise ValueError(why)
    regime = config.getoption("gdn_regime")
    regimes = REGIMES if regime is None else (regime,)
    dtype = config.getoption("gdn_dtype")
    seed = config.getoption("gdn_seed")
    return [make_case(layout, dtype=dtype, regime=r, seed=seed) for r in regimes]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "gdn_case" not in metafunc.fixturenames:
        return
    cases = metafunc.config.stash.get(_CASES, None)
    if cases is not None:
        metafunc.parametrize("gdn_case", cases, ids=[c.name for c in cases], indirect=True)


@pytest.fixture
def gdn_case(request: pytest.FixtureRequest) -> Any:
    """One case of the suite given by ``--gdn-suite`` (or of ``--gdn-layout``): a
    :class:`gdn_layout.suites.Case` with ``inputs``, ``expected``, ``layout`` and ``check``."""
    if not hasattr(request, "param"):
        pytest.skip("gdn_case needs --gdn-suite DIR or --gdn-layout B,S,H,N")
    return request.param
