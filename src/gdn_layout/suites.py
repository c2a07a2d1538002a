"""Suites of fixtures as test cases: read a suite's manifest, check it, and judge a kernel.

A suite is a folder written by :func:`gdn_layout.generate.write_suite` (``gdn-layout fixture
--suite DIR``): fixture files and a ``manifest.json`` listing each with its layout, regime,
seed, size and SHA-256. :func:`load_suite` checks every file against the manifest and returns
one :class:`Case` per fixture; :meth:`Case.check` compares a kernel's packed output with the
case's expected gradient and raises an AssertionError with the comparison table when it
differs. :func:`make_case` builds a case without a suite, from a layout.

>>> import numpy as np
>>> from gdn_layout import GdnBackwardLayout
>>> from gdn_layout.reference import backward
>>> case = make_case(GdnBackwardLayout(1, 8, 2, 4, carry_state=True), regime="mild", seed=3)
>>> case.name, case.expected.shape
('b1s8h2n4-scalar-state-mild-seed3', (256,))
>>> result = case.check(backward(*case.inputs, dtype=np.float32))
>>> result.passed
True
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import DTypeLike, NDArray

from ._arrays import as_framework, as_packed
from ._comparison import Comparison
from ._criteria import Tolerance
from ._fixture import REGIMES, Fixture, FixtureError, GdnInputs, load_checked
from .compare import compare
from .generate import make_fixture
from .layout import GdnBackwardLayout, layout_caption
from .packing import unpack

__all__ = ["MANIFEST", "Case", "load_suite", "make_case", "suite_files", "verify_suite"]

#: The name of a suite's manifest, in the suite's folder.
MANIFEST = "manifest.json"


@dataclass(frozen=True, eq=False)
class Case:
    """One test case of a suite: a fixture and the name a test runner shows for it.

    ``inputs`` are ``q, k, v, g, beta, dy, state`` in the reference's argument order (so
    ``backward(*case.inputs)`` works); :attr:`rlx_inputs` puts ``state`` before ``dy``, as RLX's
    op takes them, and :meth:`inputs_as` gives them as torch or JAX tensors. ``expected`` is
    the packed float64-reference gradient, in the fixture's dtype.
    """

    name: str
    fixture: Fixture = field(repr=False)

    @property
    def layout(self) -> GdnBackwardLayout:
        return self.fixture.layout

    @property
    def inputs(self) -> GdnInputs:
        return self.fixture.inputs

    @property
    def expected(self) -> NDArray[Any]:
        return self.fixture.packed

    @property
    def rlx_inputs(self) -> tuple[NDArray[Any], ...]:
        """``q, k, v, g, beta, state, dy`` in the order RLX's ``GatedDeltaNetBackward`` takes
        them (``state`` is left out when it is not carried)."""
        x = self.fixture.inputs
        state = () if x.state is None else (x.state,)
        return (x.q, x.k, x.v, x.g, x.beta, *state, x.dy)

    def inputs_as(
        self, framework: str, *, dtype: object = None, requires_grad: bool = False
    ) -> Any:
        """:attr:`inputs` as new tensors of ``framework``, ``"torch"`` or ``"jax"``, in the
        framework's ``dtype`` (or its name; default: the fixture's own, bfloat16 included): a
        :class:`~gdn_layout.fixtures.GdnInputs` of tensors (``state`` None when not carried).

        Each is a copy, since a fixture's arrays are read-only; ``requires_grad`` is torch's.

        Raises
        ------
        ValueError
            ``framework`` is unknown, ``dtype`` names no dtype of it, or ``requires_grad``
            is asked of JAX.
        ImportError
            ``framework`` is not installed.
        """
        return GdnInputs._make(
            None
            if a is None
            else as_framework(a, framework, dtype=dtype, requires_grad=requires_grad)
            for a in self.inputs
        )

    @property
    def regime(self) -> str | None:
        return self.fixture.regime

    @property
    def seed(self) -> int | None:
        return self.fixture.seed

    @property
    def path(self) -> Path | None:
        return self.fixture.path

    def compare(
        self,
        actual: object,
        *,
        rtol: Tolerance | None = None,
        atol: Tolerance | None = None,
        max_rms_ratio: Tolerance | None = None,
    ) -> Comparison:
        """:func:`~gdn_layout.compare` of ``actual`` (any array: NumPy, torch, anything with
        ``__dlpack__`` or ``__array__``) with the expected gradient, against the fixture's
        floors unless tolerances are given.

        A fixture memory-mapped from a large file is held unchanged during the comparison
        (:meth:`Fixture.unchanged`), so that a file truncated or rewritten under the mapping
        raises :class:`FixtureError` naming it instead of being judged or crashing the process.

        Raises
        ------
        FixtureError
            The fixture is memory-mapped and its file changed since it was loaded.
        """
        with self.fixture.unchanged():
            return compare(
                actual,  # type: ignore[arg-type]
                self.expected,
                self.layout,
                rtol=rtol,
                atol=atol,
                max_rms_ratio=max_rms_ratio,
                floors=self.fixture.floors,
                scales=self.fixture.scales,
            )

    def check(
        self,
        actual: object,
        *,
        rtol: Tolerance | None = None,
        atol: Tolerance | None = None,
        max_rms_ratio: Tolerance | None = None,
    ) -> Comparison:
        """:meth:`compare`, raising AssertionError with the table and the worst element of
        each failing gradient; returns the comparison when every gradient passes.

        Raises
        ------
        AssertionError
            A gradient differs.
        FixtureError
            The fixture is memory-mapped and its file changed since it was loaded.
        """
        __tracebackhide__ = True  # pytest shows the caller's line, not this one
        result = self.compare(actual, rtol=rtol, atol=atol, max_rms_ratio=max_rms_ratio)
        if not result.passed:
            lines = [f"case {self.name}: gradient(s) {', '.join(result.failed)} differ", ""]
            lines.append(str(result))
            lines.append("")
            lines.extend(f"  {g.summary()}" for g in result.grads if not g.passed)
            if (rows := _rows_unlike_the_first(self, actual)) is not None:
                lines.append(rows)
            raise AssertionError("\n".join(lines))
        return result


def _rows_unlike_the_first(case: Case, actual: object) -> str | None:
    """Where every batch row of ``case`` holds the same inputs, the line that names the rows
    of ``actual`` whose gradients differ from the first row's (a kernel wrong only past the
    first row); None for any other case, or when all rows agree."""
    x = case.inputs
    if case.layout.batch < 2 or not all(
        a is None or all(np.array_equal(a[0], a[b]) for b in range(1, len(a))) for a in x
    ):
        return None
    grads = unpack(as_packed(actual, "actual", "check"), case.layout)
    differ = sorted(
        {
            b
            for g in grads
            if g is not None
            for b in range(1, case.layout.batch)
            if not np.array_equal(g[b], g[0], equal_nan=True)
        }
    )
    if not differ:
        return None
    return (
        f"  batch rows hold identical inputs, but the gradients of row(s) "
        f"{', '.join(map(str, differ))} differ from row 0's: a bug in the rows after the first?"
    )


def make_case(
    layout: GdnBackwardLayout,
    *,
    dtype: DTypeLike = np.float32,
    regime: str = "mixed",
    seed: int = 0,
    name: str | None = None,
) -> Case:
    """A case computed now by the reference (:func:`~gdn_layout.generate.make_fixture`),
    without a suite; its name says its layout, regime and seed unless ``name`` is given."""
    fixture = make_fixture(layout, dtype=dtype, regime=regime, seed=seed)
    if name is None:
        gate = "channel" if layout.gate_per_channel else "scalar"
        state = "state" if layout.carry_state else "nostate"
        name = (
            f"b{layout.batch}s{layout.seq}h{layout.heads}n{layout.state_size}"
            f"-{gate}-{state}-{regime}-seed{seed}"
        )
    return Case(name, fixture)


def verify_suite(
    directory: str | os.PathLike[str],
    *,
    min_seq: int | None = None,
    regime: str | None = None,
    crossing: int | None = None,
) -> list[str]:
    """Check a suite's files against its manifest; return one line per problem (none: intact).

    ``min_seq``, ``regime`` and ``crossing`` check only the cases they select, as
    :func:`load_suite` does.

    Each listed file must be a regular file with the size and SHA-256 the manifest gives, and
    its header must state the manifest's layout, regime and seed; a fixture file in the folder
    that the manifest does not list is a problem too. The size is checked first, so that a
    file of the wrong size is never read; each file is opened once, as :func:`load_fixture`
    opens it (a FIFO or a device is refused, not opened), read into memory when smaller than
    :data:`~gdn_layout.fixtures.MAP_THRESHOLD`, hashed, and checked from the bytes hashed.
    No file stays open.

    Raises
    ------
    FixtureError
        The manifest is missing or cannot be read.
    """
    select = _selection(min_seq, regime, crossing, "verify_suite")
    return _examine(Path(directory), keep=False, select=select)[0]


def suite_files(
    directory: str | os.PathLike[str],
    *,
    min_seq: int | None = None,
    regime: str | None = None,
    crossing: int | None = None,
) -> list[str]:
    """The names of the fixture files that the manifest of the suite in ``directory`` lists,
    in its order, those selected as by :func:`load_suite` (nothing is checked against them:
    :func:`verify_suite` does that).

    Raises
    ------
    FixtureError
        The manifest is missing or cannot be read.
    """
    select = _selection(min_seq, regime, crossing, "suite_files")
    return [entry["file"] for entry in _manifest_entries(Path(directory)) if select(entry)]


def load_suite(
    directory: str | os.PathLike[str],
    *,
    min_seq: int | None = None,
    regime: str | None = None,
    crossing: int | None = None,
) -> list[Case]:
    """The cases of the suite in ``directory``, in the manifest's order, after checking every
    file against the manifest as :func:`verify_suite` does.

    Only the cases of at least ``min_seq`` steps, of gate regime ``regime`` and that cross a
    boundary of a ``crossing``-step chunk (a step ``c * crossing`` inside the sequence) are
    loaded, when these are given; a file of the folder that the manifest does not list is
    still a problem.

    Each file is read once: the fixture of a case holds the very bytes whose SHA-256 matched
    the manifest. Files smaller than :data:`~gdn_layout.fixtures.MAP_THRESHOLD` are held in
    memory (no descriptor stays open per case, and nothing done to the files later changes
    the cases); larger ones are memory-mapped, and :meth:`Case.compare` refuses to judge
    against one whose file changed since (see :meth:`Fixture.check_unchanged`).

    Raises
    ------
    FixtureError
        The manifest is missing or unreadable, or a file differs from it (the message lists
        every one).
    """
    root = Path(directory)
    select = _selection(min_seq, regime, crossing, "load_suite")
    problems, cases = _examine(root, keep=True, select=select)
    if problems:
        raise FixtureError(
            f"{root}: {len(problems)} file(s) differ from {MANIFEST}:\n  " + "\n  ".join(problems)
        )
    return cases


def _selection(
    min_seq: int | None, regime: str | None, crossing: int | None, func: str
) -> Callable[[Mapping[str, Any]], bool]:
    """Whether a manifest entry is selected; an entry whose layout cannot be read is, so that
    checking it reports the problem."""
    for name, value in (("min_seq", min_seq), ("crossing", crossing)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{func}: {name} must be an int, got {type(value).__name__}")
    if crossing is not None and crossing < 1:
        raise ValueError(f"{func}: crossing must be a chunk size >= 1, got {crossing}")
    if regime is not None and regime not in REGIMES:
        raise ValueError(f"{func}: regime must be one of {REGIMES}, got {regime!r}")

    def selected(entry: Mapping[str, Any]) -> bool:
        seq = entry.get("layout", {}).get("seq") if isinstance(entry.get("layout"), dict) else None
        if not isinstance(seq, int):
            return True
        return (
            (min_seq is None or seq >= min_seq)
            and (regime is None or entry.get("regime") == regime)
            and (crossing is None or seq > crossing)
        )

    return selected


def _examine(
    root: Path, *, keep: bool, select: Callable[[Mapping[str, Any]], bool]
) -> tuple[list[str], list[Case]]:
    """The problems of the selected cases of the suite at ``root``, and those cases when
    ``keep`` (else none)."""
    entries = _manifest_entries(root)
    problems: list[str] = []
    cases: list[Case] = []
    listed = set()
    for entry in entries:
        name = entry["file"]
        listed.add(name)
        if not select(entry):
            continue
        fixture, problem = _check_entry(root, entry)
        if problem is not None:
            problems.append(f"{name}: {problem}")
        elif keep and fixture is not None:
            cases.append(Case(name.removesuffix(".safetensors"), fixture))
    strays = sorted(
        p.name for p in root.glob("*.safetensors") if p.name not in listed and p.is_file()
    )
    problems.extend(f"{name}: not in the manifest" for name in strays)
    return problems, cases


def _manifest_entries(root: Path) -> list[dict[str, Any]]:
    path = root / MANIFEST
    if not path.is_file():
        raise FixtureError(f"{root}: not a suite: no {MANIFEST}")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # of JSON, UTF-8, or an integer's digits
        raise FixtureError(f"{path}: not JSON: {err}") from None
    entries = document.get("fixtures") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict)
        and isinstance(e.get("file"), str)
        and Path(e["file"]).name == e["file"]
        and isinstance(e.get("sha256"), str)
        for e in entries
    ):
        raise FixtureError(f"{path}: not a suite manifest: no list of fixtures with sha256")
    return entries


def _check_entry(root: Path, entry: Mapping[str, Any]) -> tuple[Fixture | None, str | None]:
    """The fixture a manifest entry lists, once it matches the entry; else what differs."""
    path = root / entry["file"]
    size = entry.get("bytes")
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return None, "missing"
    except OSError as err:
        return None, f"cannot be read: {err.strerror or err}"
    if stat.S_ISREG(status.st_mode) and size is not None and size != status.st_size:
        return None, f"{status.st_size} bytes, the manifest says {size}"  # before any read
    try:
        fixture = load_checked(
            path,
            size=size if isinstance(size, int) else None,
            sha256=entry["sha256"],
            said="the manifest says",
        )
        stated = GdnBackwardLayout.from_dict(entry.get("layout"))
    except FileNotFoundError:
        return None, "missing"
    except (FixtureError, ValueError, TypeError) as err:
        return None, str(err).removeprefix(f"{path}: ")
    if fixture.layout != stated:
        caption = f"has {layout_caption(fixture.layout)}"
        return None, f"{caption}, the manifest says {layout_caption(stated)}"
    for key in ("regime", "seed"):
        if key in entry and entry[key] != getattr(fixture, key):
            return None, f"{key} {getattr(fixture, key)!r}, the manifest says {entry[key]!r}"
    return fixture, None
