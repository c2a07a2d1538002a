"""Suites of fixtures as test cases: :class:`Case`, its states' references, and the suite's
manifest checked and selected (docs/files.md; README.md, *Quickstart*).

>>> import numpy as np
>>> from gdn_layout import GdnBackwardLayout
>>> from gdn_layout.reference import backward
>>> case = make_case(GdnBackwardLayout(1, 8, 2, 4, carry_state=True), regime="mild", seed=3)
>>> case.name, case.expected.shape
('b1s8h2n4-scalar-state-mild-seed3', (256,))
>>> case.check(backward(*case.inputs, dtype=np.float32)).passed
True
"""

from __future__ import annotations

import os
import shlex
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Unpack

import numpy as np
from numpy.typing import DTypeLike, NDArray

from ._arrays import as_framework, as_packed, device_of
from ._checks import flag, integer, require_matplotlib
from ._floors import Floors
from .check import compare, compare_tensor
from .check._compare import Judging
from .check._records import Comparison, GradComparison, failure_message, read_from
from .files._atomic import atomic_write
from .files._fixture import (
    Fixture,
    FixtureError,
    GdnInputs,
    load_checked,
    save_fixture,
    tensor_shape,
)
from .files._manifest import MANIFEST, NotASuite, read_manifest
from .files._safetensors import write as write_safetensors
from .generate import correct_forms_floors, make_fixture, precisions_of, reference_outputs
from .layout import GdnBackwardLayout, layout_caption
from .regimes import REGIMES

__all__ = [
    "MANIFEST",
    "STATE_TENSORS",
    "Case",
    "compare_states",
    "load_suite",
    "make_case",
    "suite_files",
    "verify_suite",
]

#: The parts of a kernel besides its gradient a case can judge, in bisection order.
STATE_TENSORS = ("y", "h", "dh", "final_state")
#: The chunk length of ``h`` and ``dh`` when a fixture keeps none: the usual kernels' 64.
DEFAULT_CHUNK = 64
#: Reference outputs and floors by chunk length (None: ``y`` and the final state alone).
_Outputs = dict[int | None, tuple[dict[str, NDArray[Any]], Floors]]


@dataclass(frozen=True, eq=False)
class Case:
    """One test case of a suite: a fixture and the name a test runner shows for it.

    ``inputs`` are in the reference's argument order, :attr:`rlx_inputs` in RLX's;
    ``expected`` is the packed reference gradient, in the fixture's dtype. ``precision`` is
    the class :meth:`compare` judges in when not told (``pytest --gdn-precision``);
    ``save_as`` is where :meth:`check` keeps a failure's files, a path without suffix
    (``pytest --gdn-save DIR``).

    See Also
    --------
    load_suite : A suite's cases.
    suites.make_case : One case, computed now.
    """

    name: str
    fixture: Fixture = field(repr=False)
    precision: str | None = None
    save_as: Path | None = None
    #: The reference outputs computed for this case's states, by chunk length.
    _states: _Outputs = field(default_factory=dict, repr=False, init=False)
    #: The comparison :meth:`compare` made last, for the pytest plugin's summary.
    _last: list[Comparison] = field(default_factory=list, repr=False, init=False)

    @property
    def last_comparison(self) -> Comparison | None:
        """The :class:`~gdn_layout.check.Comparison` :meth:`compare` made last, or None."""
        return self._last[-1] if self._last else None

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
    def regime(self) -> str | None:
        return self.fixture.regime

    @property
    def seed(self) -> int | None:
        return self.fixture.seed

    @property
    def path(self) -> Path | None:
        return self.fixture.path

    @property
    def rlx_inputs(self) -> tuple[NDArray[Any], ...]:
        """``q, k, v, g, beta, state, dy`` in the order RLX's ``GatedDeltaNetBackward`` takes
        them (``state`` is left out when it is not carried)."""
        x = self.fixture.inputs
        return (x.q, x.k, x.v, x.g, x.beta, *(() if x.state is None else (x.state,)), x.dy)

    def inputs_as(
        self,
        framework: str,
        *,
        dtype: object = None,
        device: object = None,
        requires_grad: bool = False,
    ) -> Any:
        """:attr:`inputs` as new writable tensors of ``framework`` (``"torch"``, ``"jax"`` or
        ``"numpy"``), in ``dtype`` (default: the fixture's) on ``device`` (default: the
        framework's); ``requires_grad`` is torch's.

        >>> from gdn_layout import GdnBackwardLayout
        >>> case = make_case(GdnBackwardLayout(1, 4, 2, 4), regime="mild")
        >>> case.inputs_as("numpy", device="cpu").q.flags.writeable
        True
        >>> case.inputs_as("numpy", device="cuda")
        Traceback (most recent call last):
        ...
        ValueError: inputs_as: device must be None or 'cpu' for NumPy, got 'cuda'

        Raises
        ------
        ValueError
            ``framework``, ``dtype`` or ``device`` is not one it has here (the message lists
            those it has), or ``requires_grad`` is asked of JAX or NumPy.
        TypeError
            ``device`` is not of a type the framework names devices with.
        ImportError
            ``framework`` is not installed.
        """
        return GdnInputs._make(
            None
            if a is None
            else as_framework(a, framework, dtype=dtype, device=device, requires_grad=requires_grad)
            for a in self.inputs
        )

    def compare(self, actual: object, **judging: Unpack[Judging]) -> Comparison:
        """:func:`~gdn_layout.compare` of ``actual`` (any array) with the fixture, in
        :attr:`precision` unless ``precision=`` or tolerances are given; ``judging`` takes
        compare's judging keywords. A mapped fixture is held unchanged meanwhile.

        Raises
        ------
        FixtureError
            The fixture is memory-mapped and its file changed since it was loaded.
        """
        if judging.get("precision") is None:
            judging["precision"] = self.precision
        with self.fixture.unchanged():  # held from before the comparison reads a page
            result = compare(actual, self.fixture, **judging)  # type: ignore[arg-type]
        self._last[:] = [result]
        return result

    def check(self, actual: object, **judging: Unpack[Judging]) -> Comparison:
        """:meth:`compare`, raising AssertionError with the table, the worst elements and the
        ``gdn-layout compare --plot`` command that redraws it; returns the comparison.

        Raises
        ------
        AssertionError
            A gradient differs.
        FixtureError
            The fixture is memory-mapped and its file changed since it was loaded.
        """
        __tracebackhide__ = True  # pytest shows the caller's line, not this one
        result = self.compare(actual, **judging)
        if not result.passed:
            heading = f"case {self.name}: gradient(s) {', '.join(result.failed)} differ"
            notes = ["", *_redraw(self, actual, result, judging)]
            raise AssertionError(failure_message(heading, result, table=True, notes=notes))
        return result

    def check_states(
        self,
        *,
        y: object = None,
        h: object = None,
        dh: object = None,
        final_state: object = None,
        chunk: int | None = None,
        precision: str | None = None,
    ) -> dict[str, GradComparison]:
        """:func:`compare_states` of each part given, raising AssertionError naming each that
        differs and its worst element; returns the comparisons when all pass.

        Raises
        ------
        AssertionError
            A part differs.
        ValueError
            No part is given, ``chunk`` is not a positive integer, or a part has another shape.
        """
        __tracebackhide__ = True
        given = {"y": y, "h": h, "dh": dh, "final_state": final_state}
        given = {name: value for name, value in given.items() if value is not None}
        if not given:
            raise ValueError("check_states: give at least one of y, h, dh, final_state")
        results = {}
        for name, actual in given.items():
            with self.fixture.unchanged():
                expected, floors = _state_reference(self.fixture, name, chunk, self._states)
                results[name] = compare_tensor(
                    actual,
                    expected,
                    name,
                    floors=floors,
                    precision=self.precision if precision is None else precision,
                    func="check_states",
                )
        judged = Comparison(self.layout, tuple(results.values()))
        if not judged.passed:
            named = (f"{n}{read_from(device_of(given[n]))}" for n in judged.failed)
            heading = f"case {self.name}: {', '.join(named)} differ"
            raise AssertionError(failure_message(heading, judged, located=True))
        return results


def make_case(
    layout: GdnBackwardLayout,
    *,
    dtype: DTypeLike = np.float32,
    regime: str = "mixed",
    seed: int = 0,
    name: str | None = None,
) -> Case:
    """A case computed now by the reference, named by its layout, regime and seed.

    See Also
    --------
    load_suite : Cases from files.
    make_fixture : The fixture alone.
    """
    fixture = make_fixture(layout, dtype=dtype, regime=regime, seed=seed, precisions="all")
    if name is None:
        gate = "channel" if layout.gate_per_channel else "scalar"
        state = "state" if layout.carry_state else "nostate"
        dims = f"b{layout.batch}s{layout.seq}h{layout.heads}n{layout.state_size}"
        name = f"{dims}-{gate}-{state}-{regime}-seed{seed}"
    return Case(name, fixture)


# -- the states' references ----------------------------------------------------------------------


def compare_states(
    actual: object,
    fixture: Fixture,
    tensor: str = "h",
    *,
    chunk: int | None = None,
    precision: str | None = None,
) -> GradComparison:
    """A kernel's ``y``, ``h``, ``dh`` or ``final_state`` (``tensor``) judged against
    ``fixture``'s as its gradients are (README.md, *Bisect*), in ``precision`` as
    :func:`~gdn_layout.compare` takes it; computed from the inputs when the fixture keeps
    none. ``chunk`` is the chunk length of ``h`` and ``dh``: the fixture's ``states_chunk``,
    else 64. ``str()`` of the result is one line with the verdict.

    Raises
    ------
    ValueError
        ``tensor`` is unknown, ``chunk`` is not a positive integer, or ``actual`` has another
        shape.
    TypeError
        ``actual`` is not a float array.
    FixtureError
        The fixture is memory-mapped and its file changed.

    See Also
    --------
    check.compare_tensor : The same, with floors given.
    reference.chunk_states : The reference's states.

    Examples
    --------
    >>> import numpy as np
    >>> from gdn_layout import GdnBackwardLayout
    >>> from gdn_layout.generate import make_fixture
    >>> from gdn_layout.reference import chunk_states
    >>> fx = make_fixture(GdnBackwardLayout(1, 40, 2, 4, carry_state=True), states=16)
    >>> h, dh, final = chunk_states(*fx.inputs, chunk=16, dtype=np.float32)
    >>> compare_states(h, fx, "h").passed, compare_states(final, fx, "final_state").passed
    (True, True)
    >>> h[0, 2, 1] = 0  # the state entering chunk 2 lost, in head 1
    >>> result = compare_states(h, fx, "h")
    >>> result.passed, result.worst[:3]  # batch 0, chunk 2, head 1
    (False, (0, 2, 1))
    """
    with fixture.unchanged():  # the inputs the reference reads are mapped too
        expected, floors = _state_reference(fixture, tensor, chunk)
        return compare_tensor(actual, expected, tensor, floors=floors, precision=precision)


def state_shape(fixture: Fixture, tensor: str, chunk: int | None = None) -> tuple[int, ...]:
    """The shape of ``tensor`` (one of :data:`STATE_TENSORS`) for ``fixture``'s layout and the
    chunk length :func:`compare_states` takes for ``chunk``."""
    return tensor_shape(fixture.layout, tensor, _chunk_for(fixture, tensor, chunk))


def _chunk_for(fixture: Fixture, tensor: str, chunk: object) -> int:
    if tensor not in STATE_TENSORS:
        raise ValueError(f"compare_states: tensor must be one of {STATE_TENSORS}, got {tensor!r}")
    if chunk is None:
        return fixture.states_chunk or DEFAULT_CHUNK
    return integer(chunk, "compare_states: chunk", least=1, or_none=True)


def _state_reference(
    fixture: Fixture, tensor: str, chunk: object, cache: _Outputs | None = None
) -> tuple[NDArray[Any], Floors]:
    """The expected ``tensor`` and its floors: the fixture's, else computed (cached by chunk)."""
    size = _chunk_for(fixture, tensor, chunk)
    stored = getattr(fixture, tensor)
    if tensor in ("h", "dh") and size != fixture.states_chunk:
        stored = None
    floors = fixture.state_floors
    if stored is not None and floors is not None and any(tensor in per for per in floors.values()):
        return stored, floors
    chunked = tensor in ("h", "dh") or (tensor == "final_state" and not fixture.layout.carry_state)
    states = size if chunked else None
    cache = {} if cache is None else cache
    if states not in cache:
        x = fixture.inputs
        wide = GdnInputs._make(None if a is None else np.asarray(a, np.float64) for a in x)
        truth = reference_outputs(wide, states)
        precisions = tuple(fixture.floors or ()) or precisions_of(fixture.dtype)
        cache[states] = (truth, correct_forms_floors(x, truth, states, precisions))
    truth, measured = cache[states]
    expected = (stored if stored is not None else truth[tensor].astype(fixture.dtype)).view()
    expected.flags.writeable = False  # a view: the fixture's own array is left as it is
    return expected, measured


# -- a failure's files and the command that redraws it ---------------------------------------------


def _redraw(case: Case, actual: object, result: Comparison, judging: Judging) -> list[str]:
    """A failure's lines that lead to its picture: the files kept and the redraw command."""
    fixture = None if case.path is None else str(case.path)
    kept: list[str] = []
    output = picture = None
    if case.save_as is not None:
        stem = Path(case.save_as)
        try:
            stem.parent.mkdir(parents=True, exist_ok=True)
            output, fixture, picture = _keep(case, stem, actual, result, kept)
        except OSError as err:  # a full disk, say: the failure still shows
            kept.append(f"  nothing more kept in {stem.parent}: {err}")
    if fixture is None:  # nothing on disk to draw from
        return kept or [
            "  pytest --gdn-save DIR keeps the kernel's output, this case's fixture and a picture"
        ]
    words = ["gdn-layout", "compare", "--plot", picture or "PICTURE.png"]
    if picture is not None:
        words.append("--force")  # the picture is there: the command draws it again
    if (precision := judging.get("precision") or case.precision) is not None:
        words += ["--precision", precision]
    for option, key in (
        ("--rtol", "rtol"),
        ("--atol", "atol"),
        ("--max-rms-ratio", "max_rms_ratio"),
    ):
        if (value := judging.get(key)) is not None:
            if isinstance(value, Mapping):
                words += [option, ",".join(f"{k}={float(v)!r}" for k, v in value.items())]
            else:
                words += [option, repr(float(value))]  # type: ignore[arg-type]
    words += [output or "OUTPUT.npy", str(fixture)]
    lines = [] if case.path is None else [f"  fixture: {case.path}"]
    lines += [*kept, f"  redraw: {shlex.join(words)}"]
    if output is None and case.save_as is None:
        lines.append(
            "  (OUTPUT.npy: the kernel's packed output, numpy.save'd; "
            "pytest --gdn-save DIR keeps it and its picture)"
        )
    return lines


def _keep(
    case: Case, stem: Path, actual: object, result: Comparison, kept: list[str]
) -> tuple[str, str, str | None]:
    """Write the output, the fixture (when it has no file) and the picture next to ``stem``;
    their paths, each also named in ``kept``. A file of the same name is replaced only if
    gdn-layout wrote it there and it is unchanged (:data:`_WRITTEN`): FileExistsError
    otherwise."""
    ours = _written(stem.parent)
    packed = as_packed(actual, "actual", "check")
    if packed.dtype.kind == "V" or packed.dtype.name == "bfloat16":  # .npy loses bfloat16
        output = _free(stem.with_name(f"{stem.name}-output.safetensors"), ours)
        atomic_write(output, lambda out: write_safetensors(out, {"packed": packed}, {}),
                     overwrite=True)  # fmt: skip
    else:
        output = _free(stem.with_name(f"{stem.name}-output.npy"), ours)
        atomic_write(output, lambda out: np.save(out, packed), overwrite=True)
    _record(output)
    kept.append(f"  kept: {output} (the kernel's packed output)")
    fixture = case.path
    if fixture is None:
        fixture = _free(stem.with_name(f"{stem.name}-fixture.safetensors"), ours)
        save_fixture(fixture, case.fixture, overwrite=True)
        _record(fixture)
        kept.append(f"  kept: {fixture} (the case's fixture)")
    picture = None
    try:
        require_matplotlib()
    except ImportError:
        pass  # said once by whoever set save_as (the pytest plugin, in its header)
    else:
        picture = _free(stem.with_name(f"{stem.name}.png"), ours)
        result.plot(path=picture)
        _record(picture)
        kept.append(f"  kept: {picture} (its picture)")
    return str(output), str(fixture), None if picture is None else str(picture)


#: The file of a ``--gdn-save`` folder that names the files gdn-layout kept there, each with
#: its identity as written (inode and modification time), one a line.
_WRITTEN = ".gdn-layout-kept"


def _written(folder: Path) -> dict[str, str]:
    try:
        lines = (folder / _WRITTEN).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return {}
    return dict(line.rsplit("\t", 1) for line in lines if "\t" in line)


def _identity_of(path: Path) -> str:
    status = os.stat(path)
    return f"{status.st_ino}:{status.st_mtime_ns}"


def _free(path: Path, ours: Mapping[str, str]) -> Path:
    """``path``, if it may be written: absent, or the file gdn-layout kept there, unchanged."""
    if os.path.lexists(path) and ours.get(path.name) != _identity_of(path):
        raise FileExistsError(f"{path} is there already, and gdn-layout did not write it")
    return path


def _record(path: Path) -> None:
    with open(path.parent / _WRITTEN, "a", encoding="utf-8") as record:
        record.write(f"{path.name}\t{_identity_of(path)}\n")  # one short append: whole


# -- a suite's files, checked against its manifest and selected -----------------------------------


def verify_suite(
    directory: str | os.PathLike[str],
    *,
    min_seq: int | None = None,
    regime: str | None = None,
    crossing: int | None = None,
    quick: bool = False,
) -> list[str]:
    """Check a suite's files against its manifest (size, SHA-256, layout, regime and seed, of
    the cases selected as by :func:`load_suite`; an unlisted fixture is a problem too); one
    line per problem, none when it is intact.

    Raises
    ------
    FixtureError
        The manifest is missing or cannot be read.

    See Also
    --------
    load_suite : The cases, checked as they load.
    suites.suite_files : The files listed.
    write_suite : The writer.
    """
    options = _selection(min_seq, regime, crossing, quick, "verify_suite")
    return _examine(Path(directory), False, options)[0]


def suite_files(
    directory: str | os.PathLike[str],
    *,
    min_seq: int | None = None,
    regime: str | None = None,
    crossing: int | None = None,
    quick: bool = False,
) -> list[str]:
    """The fixture files the manifest in ``directory`` lists, selected as by
    :func:`load_suite`, unchecked.

    See Also
    --------
    load_suite : The cases those files hold.
    verify_suite : Check them.
    """
    options = _selection(min_seq, regime, crossing, quick, "suite_files")
    entries = read_manifest(Path(directory))
    chosen = _chosen(entries, *options)
    return [entry["file"] for entry in entries if entry["file"] in chosen]


def load_suite(
    directory: str | os.PathLike[str],
    *,
    min_seq: int | None = None,
    regime: str | None = None,
    crossing: int | None = None,
    quick: bool = False,
) -> list[Case]:
    """The cases of the suite in ``directory``, in the manifest's order, each file checked as
    :func:`verify_suite` checks it and read once.

    Only the cases of at least ``min_seq`` steps, of ``regime``, and crossing a boundary of a
    ``crossing``-step chunk are loaded when given; with ``quick``, the quick set of those
    (README.md, *The quick set*).

    Raises
    ------
    FixtureError
        The manifest is missing or unreadable, or a file differs from it (the message lists
        every one).

    See Also
    --------
    write_suite : The writer.
    verify_suite : Check its files without loading them.
    Case : One case.
    """
    root = Path(directory)
    options = _selection(min_seq, regime, crossing, quick, "load_suite")
    problems, cases = _examine(root, True, options)
    if problems:
        raise FixtureError(
            f"{root}: {len(problems)} file(s) differ from {MANIFEST}:\n  " + "\n  ".join(problems)
        )
    return cases


#: A selection, checked: min_seq, regime, crossing, quick.
_Options = tuple[int | None, str | None, int | None, bool]


def _selection(
    min_seq: object, regime: object, crossing: object, quick: object, func: str
) -> _Options:
    """The selection's arguments, checked, or an error naming ``func`` and the argument."""
    if min_seq is not None:
        min_seq = integer(min_seq, f"{func}: min_seq", or_none=True)
    if crossing is not None:
        crossing = integer(crossing, f"{func}: crossing", least=1, or_none=True)
    if regime is not None and regime not in REGIMES:
        raise ValueError(f"{func}: regime must be one of {REGIMES}, got {regime!r}")
    return min_seq, regime, crossing, flag(f"{func}: quick", quick)


def _chosen(
    entries: Sequence[Mapping[str, Any]],
    min_seq: int | None,
    regime: str | None,
    crossing: int | None,
    quick: bool,
) -> set[str]:
    """The files of the entries selected; an entry whose layout cannot be read is selected, so
    that checking it reports the problem."""

    def selected(entry: Mapping[str, Any]) -> bool:
        layout = entry.get("layout")
        seq = layout.get("seq") if isinstance(layout, dict) else None
        return not isinstance(seq, int) or (
            (min_seq is None or seq >= min_seq)
            and (regime is None or entry.get("regime") == regime)
            and (crossing is None or seq > crossing)
        )

    kept = [entry for entry in entries if selected(entry)]
    return {entry["file"] for entry in (_quick_cover(kept) if quick else kept)}


def _quick_cover(entries: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The quick set of manifest entries, in order: a greedy set cover of what each holds
    (:func:`_holds`), then every entry the others cover dropped (within ``H(3) = 11/6`` of the
    fewest). An unreadable entry is kept, so that checking it reports it."""
    holds = [_holds(entry) for entry in entries]
    unread = [i for i, held in enumerate(holds) if held is None]
    read = {i: held for i, held in enumerate(holds) if held is not None}
    left = set().union(*read.values())
    chosen: list[int] = []
    while left:
        best = max(read, key=lambda i: len(read[i] & left))  # the first of the best
        chosen.append(best)
        left -= read[best]
    for i in reversed(list(chosen)):  # the earliest picks are the likeliest to be redundant
        if read[i] <= set().union(*(read[j] for j in chosen if j != i)):
            chosen.remove(i)
    return [entries[i] for i in sorted(chosen + unread)]


def _holds(entry: Mapping[str, Any]) -> frozenset[tuple[Any, ...]] | None:
    """An entry's shape, its pair of modes within or across a chunk (paths of their own), its
    regime; None when its layout cannot be read."""
    try:
        layout = GdnBackwardLayout.from_dict(entry.get("layout"))
    except (ValueError, TypeError):
        return None
    regime = entry.get("regime")
    if regime is not None and not isinstance(regime, str):
        return None
    seq, rows = layout.seq, entry.get("identical_rows", False) is True
    return frozenset(
        {
            ("shape", layout.batch, seq, layout.heads, layout.state_size, rows),
            ("modes", layout.gate_per_channel, layout.carry_state, seq > DEFAULT_CHUNK),
            ("regime", regime),
        }
    )


def _examine(root: Path, keep: bool, options: _Options) -> tuple[list[str], list[Case]]:
    """The problems of the selected cases at ``root``, and the cases when ``keep``; read
    through one open folder, so that a suite replaced meanwhile is read old or new, whole
    (read again, up to three times, when the folder was replaced while it was read)."""
    for attempt in (1, 2, 3):
        try:
            fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            raise NotASuite(root, f"it has no {MANIFEST}") from None
        except OSError as err:
            raise NotASuite(root, f"it cannot be opened ({err.strerror})") from None
        try:
            opened = _identity(os.fstat(fd))
            try:
                found = _examine_in(root, fd, keep, options)
            except NotASuite:  # its manifest gone with the old folder: read the new one
                if attempt < 3 and opened != _identity(root):
                    continue
                raise
            if not found[0] or attempt == 3 or opened == _identity(root):
                return found
        finally:
            os.close(fd)
    raise AssertionError("unreachable")  # pragma: no cover


def _identity(what: Path | os.stat_result) -> tuple[int, int] | None:
    """The device and inode of a status, or of what ``what`` names now (None: nothing)."""
    try:
        status = what if isinstance(what, os.stat_result) else os.stat(what)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _examine_in(root: Path, fd: int, keep: bool, options: _Options) -> tuple[list[str], list[Case]]:
    """:func:`_examine` of the suite in the open folder ``fd``, named ``root``."""
    entries = read_manifest(root, dir_fd=fd)
    chosen = _chosen(entries, *options)
    problems: list[str] = []
    cases: list[Case] = []
    for entry in entries:
        name = entry["file"]
        if name not in chosen:
            continue
        fixture, problem = _check_entry(root, entry, fd)
        if problem is not None:
            problems.append(f"{name}: {problem}")
        elif keep and fixture is not None:
            cases.append(Case(name.removesuffix(".safetensors"), fixture))
    listed = {entry["file"] for entry in entries}
    with os.scandir(fd) as found:
        strays = sorted(
            e.name
            for e in found
            if e.name.endswith(".safetensors") and e.name not in listed and e.is_file()
        )
    problems.extend(f"{name}: not in the manifest" for name in strays)
    return problems, cases


def _check_entry(
    root: Path, entry: Mapping[str, Any], fd: int
) -> tuple[Fixture | None, str | None]:
    """The fixture a manifest entry lists (in the open folder ``fd``, named ``root``), once
    it matches the entry; else what differs."""
    path = root / entry["file"]
    size = entry.get("bytes")
    try:
        status = os.stat(entry["file"], dir_fd=fd)
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
            dir_fd=fd,
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
