"""Random inputs, the fixtures the reference computes for them, and the standard suite of
fixtures (docs/files.md). A fixture's floors are :mod:`gdn_layout._floors`', the memory it
needs :mod:`gdn_layout._limits`'.

>>> import gdn_layout as gl
>>> x = draw_inputs(gl.GdnBackwardLayout(1, 4, 2, 8), regime="mild", seed=1)
>>> x.g.shape, bool((x.g < 0).all())
((1, 4, 2), True)
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import IO, Any, Final, NamedTuple, SupportsIndex

import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import reference
from ._checks import integer, not_a_layout
from ._floors import _named
from ._floors import correct_forms_floors as correct_forms_floors
from ._floors import precisions_of as precisions_of
from ._limits import fixture_memory as fixture_memory
from ._version import __version__
from .files._atomic import atomic_write, write_folder
from .files._fixture import (
    FORMAT_VERSION,
    Fixture,
    GdnInputs,
    check_seed,
    resolve_dtype,
    save_fixture,
)
from .files._manifest import MANIFEST, NotASuite, manifest_entry, manifest_text, read_manifest
from .files._safetensors import dtype_code
from .layout import GdnBackwardLayout
from .regimes import REGIME_SINCE, REGIMES, draw_gate

__all__ = ["REGIMES", "draw_inputs", "make_fixture", "write_suite"]

#: The child of ``SeedSequence(seed).spawn(7)`` each tensor is drawn from, by name: a
#: tensor's stream never depends on the order of any tuple of names.
_STREAMS: Final = {"q": 0, "k": 1, "v": 2, "g": 3, "beta": 4, "state": 5, "dy": 6}
#: The longest chunk a fixture records (``states_chunk`` is read back as at most 18 digits).
_MAX_CHUNK: Final = 10**18 - 1


def draw_inputs(
    layout: GdnBackwardLayout,
    *,
    regime: str = "mixed",
    seed: int = 0,
    dtype: DTypeLike = np.float32,
) -> GdnInputs:
    """Random inputs for ``layout`` as the op expects them, in ``dtype``.

    ``q`` and ``k`` are L2-normalised over ``N``; ``v``, ``dy`` and ``state`` are standard
    normal; ``beta`` is uniform in ``[0.05, 0.95]``; ``g`` is drawn as ``regime`` says. Each
    tensor has its own random stream, so ``q`` is the same for every regime and gate mode of a
    seed, and a layout with ``carry_state`` shares all other inputs with the one without it.
    Values are drawn in float64 and normalised before the cast to ``dtype``.

    Parameters
    ----------
    layout : GdnBackwardLayout
        Gives every shape, the gate mode and whether a state is drawn.
    regime : str
        The gate regime, one of :data:`REGIMES`.
    seed : int
        A non-negative integer; NumPy integers work.
    dtype : dtype_like
        float64, float32, float16 or bfloat16.

    Returns
    -------
    GdnInputs
        ``q, k, v, g, beta, dy`` and ``state`` (None unless carried).

    Raises
    ------
    TypeError
        ``layout``, ``seed`` or ``dtype`` has the wrong type.
    ValueError
        ``regime`` is unknown or ``seed`` negative.

    See Also
    --------
    make_fixture : Inputs with their outputs and gradients.
    regimes.draw_gate : The gates alone.

    Examples
    --------
    >>> import gdn_layout as gl
    >>> x = draw_inputs(gl.GdnBackwardLayout(2, 5, 3, 8), regime="strong", seed=3)
    >>> x.q.shape, x.g.shape, x.state is None, x.q.dtype
    ((2, 5, 3, 8), (2, 5, 3), True, dtype('float32'))
    >>> bool(np.allclose(np.linalg.norm(x.k, axis=-1), 1.0)), float(x.g.max()) <= -3.0
    (True, True)
    """
    if not isinstance(layout, GdnBackwardLayout):
        raise not_a_layout(layout, "draw_inputs")
    if regime not in REGIMES:
        raise ValueError(f"draw_inputs: regime must be one of {REGIMES}, got {regime!r}")
    seed = check_seed(seed, "draw_inputs")
    target = resolve_dtype(dtype, "draw_inputs")
    children = np.random.SeedSequence(seed).spawn(len(_STREAMS))
    rng = {name: np.random.default_rng(children[i]) for name, i in _STREAMS.items()}
    qkv = layout.input_shape("q")

    def unit(name: str) -> NDArray[np.float64]:
        x = rng[name].standard_normal(qkv)
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        return x / np.where(norm > 0, norm, 1.0)

    drawn = (
        unit("q"),
        unit("k"),
        rng["v"].standard_normal(qkv),
        draw_gate(rng["g"], layout.input_shape("g"), regime),
        rng["beta"].uniform(0.05, 0.95, layout.input_shape("beta")),
        rng["dy"].standard_normal(layout.input_shape("dy")),
        rng["state"].standard_normal(layout.input_shape("state")) if layout.carry_state else None,
    )
    return GdnInputs._make(None if a is None else a.astype(target) for a in drawn)


def make_fixture(
    layout: GdnBackwardLayout,
    *,
    dtype: DTypeLike = np.float32,
    regime: str = "mixed",
    seed: int = 0,
    progress: Callable[[float], object] | None = None,
    calibrate: bool = True,
    states: SupportsIndex | None = None,
    workers: int | None = 1,
    precisions: tuple[str, ...] | str | None = None,
) -> Fixture:
    """Draw inputs with :func:`draw_inputs` and compute ``y`` and ``packed`` for them.

    The reference runs in float64 on the inputs as stored (already cast to ``dtype``), and its
    results are cast to ``dtype``: the fixture is exactly the reference's answer for its own
    inputs, up to that final rounding. Calibrated, the correct forms a kernel of each precision
    class computes run on the stored inputs, and the worst rounding of each gradient is kept
    in :attr:`Fixture.floors`, which :func:`~gdn_layout.compare` judges against
    (docs/criterion.md).

    Parameters
    ----------
    layout : GdnBackwardLayout
        The case.
    dtype : dtype_like
        The dtype of every stored tensor.
    regime, seed
        As for :func:`draw_inputs`.
    progress : callable, optional
        Called with the fraction of the backward done.
    calibrate : bool
        Whether to measure the precision floors.
    states : int, optional
        A chunk length: keep the state entering each chunk of that many steps and its
        cotangent (:attr:`Fixture.h`, :attr:`Fixture.dh`), and the final state (kept too
        whenever the state is carried); calibrated, their floors and ``y``'s are kept in
        :attr:`Fixture.state_floors`.
    workers : int or None
        Threads for the reference and the floors' forms: 1 computes in the calling thread,
        None on every core this process may use. The fixture is the same, bit for bit.
    precisions : tuple of str, optional
        The precision classes whose floors are measured: by default the class of ``dtype``'s
        buffers alone; ``"all"`` every class they can be judged in (for float32 and float64
        ``float32``, ``tf32`` and ``float16``, as the standard suite records).

    Returns
    -------
    Fixture
        With ``regime``, ``seed``, ``compute_dtype="float64"`` and the floors.

    Raises
    ------
    TypeError, ValueError
        As :func:`draw_inputs`.

    See Also
    --------
    draw_inputs : The inputs alone.
    save_fixture : Write it.
    write_suite : The standard set of them.
    reference.backward : The gradients alone.

    Examples
    --------
    >>> import gdn_layout as gl
    >>> fx = make_fixture(gl.GdnBackwardLayout(1, 4, 2, 8, carry_state=True), regime="zero")
    >>> fx.packed.shape, fx.grads.dstate.shape, fx.compute_dtype
    ((336,), (1, 2, 8, 8), 'float64')
    >>> fast = make_fixture(fx.layout, regime="zero", workers=2)
    >>> bool(np.array_equal(fast.packed, fx.packed)), fast.floors == fx.floors
    (True, True)
    """
    threads = reference.resolve_workers(workers, "make_fixture")
    x = draw_inputs(layout, regime=regime, seed=seed, dtype=dtype)
    if states is not None:
        states = integer(states, "make_fixture: states", least=1, most=_MAX_CHUNK, or_none=True)
    classes = precisions_of(x.q.dtype, precisions)
    return _fixture_of(layout, x, regime, int(seed), progress, calibrate, states, threads, classes)


def _fixture_of(
    layout: GdnBackwardLayout,
    x: GdnInputs,
    regime: str,
    seed: int,
    progress: Callable[[float], object] | None = None,
    calibrate: bool = True,
    states: int | None = None,
    workers: int = 1,
    precisions: tuple[str, ...] = ("float32",),
) -> Fixture:
    """:func:`make_fixture` after the draw."""
    truth = reference_outputs(x, states, workers)
    packed = reference.backward(*x, dtype=np.float64, progress=progress, workers=workers)
    floors = state_floors = None
    if calibrate:
        measured = correct_forms_floors(
            x, _named(packed, truth, layout), states, precisions, workers
        )
        floors = {
            c: {n: f for n, f in per.items() if n in layout.names} for c, per in measured.items()
        }
        if len(truth) > 1:  # the states are kept, and so are their floors and y's
            state_floors = {
                c: {n: f for n, f in per.items() if n in truth} for c, per in measured.items()
            }

    def kept(name: str) -> NDArray[Any] | None:
        return None if name not in truth else np.asarray(truth[name]).astype(x.q.dtype)

    return Fixture(
        *x,
        y=np.asarray(truth["y"]).astype(x.q.dtype),
        packed=np.asarray(packed).astype(x.q.dtype),
        regime=regime,
        seed=seed,
        compute_dtype="float64",
        floors=floors,
        final_state=kept("final_state"),
        h=kept("h"),
        dh=kept("dh"),
        states_chunk=states,
        state_floors=state_floors,
    )


def reference_outputs(
    x: GdnInputs, states: int | None, workers: int = 1
) -> dict[str, NDArray[Any]]:
    """The float64 truth of inputs ``x``: ``y``, and the states a fixture keeps (``final_state``
    when the state is carried or ``states`` given, ``h`` and ``dh`` with ``states``)."""
    result = reference.forward(*x[:5], state=x.state, dtype=np.float64, workers=workers)
    y, final = result if isinstance(result, tuple) else (result, None)
    outputs = {"y": y}
    if states is not None:
        h, dh, final = reference.chunk_states(*x, chunk=states, dtype=np.float64, workers=workers)
        outputs.update(h=h, dh=dh)
    if final is not None:
        outputs["final_state"] = final
    return outputs


class _Case(NamedTuple):
    tag: str
    batch: int
    seq: int
    heads: int
    state_size: int
    #: The revision of the suite it joined, counted with the regimes' (REGIME_SINCE): a new
    #: shape takes the next, so that its files follow every file of the suite so far.
    since: int = 0
    #: Every batch row gets the same inputs, so that a row that differs is the kernel's doing.
    identical_rows: bool = False


#: The chunk sizes a kernel is likely to use: the suite crosses at least two boundaries of
#: each, and ends a sequence one step past a boundary and one step before one.
CHUNK_SIZES: Final = (16, 32, 64, 128, 256)

#: Edge shapes of :func:`write_suite`: S=1, N=1, RLX's test shape (B, H > 1), S a multiple
#: of 64, not one, just past one, RLX's largest N; then one step short of a boundary of every
#: chunk size (255), past two (513), N = 128 over 300 steps, identical rows over 130.
_SUITE_SHAPES: Final = (
    _Case("s1", 1, 1, 1, 8),
    _Case("n1", 1, 7, 2, 1),
    _Case("rlx", 2, 5, 3, 8),
    _Case("s64", 1, 64, 2, 16),
    _Case("s65", 2, 65, 2, 16),
    _Case("s100", 1, 100, 3, 16),
    _Case("n128", 1, 3, 1, 128),
    _Case("s255", 1, 255, 2, 16, since=2),
    _Case("s300", 1, 300, 1, 128, since=2),
    _Case("s513", 1, 513, 2, 16, since=2),
    _Case("twin", 2, 130, 2, 8, since=2, identical_rows=True),
)


class _SuiteCase(NamedTuple):
    name: str
    layout: GdnBackwardLayout
    regime: str
    identical_rows: bool
    #: The suite's revision that added it: the later of its shape's and its regime's.
    since: int


def _suite_cases(regimes: Mapping[str, int] | None = None) -> Iterator[_SuiteCase]:
    """Every file of the suite, in file (and seed) order, for ``regimes`` (each one's revision;
    by default REGIME_SINCE): by revision, then shape, gate mode, state mode and regime."""
    if regimes is None:
        regimes = REGIME_SINCE
    cases = []
    for shape in _SUITE_SHAPES:
        b, s, h, n = shape[1:5]
        for per_channel in (False, True):
            for carry in (False, True):
                layout = GdnBackwardLayout(
                    b, s, h, n, gate_per_channel=per_channel, carry_state=carry
                )
                modes = (
                    f"{'channel' if per_channel else 'scalar'}-{'state' if carry else 'nostate'}"
                )
                for regime, since in regimes.items():
                    name = f"{shape.tag}-b{b}s{s}h{h}n{n}-{modes}-{regime}.safetensors"
                    added = max(shape.since, since)
                    cases.append(_SuiteCase(name, layout, regime, shape.identical_rows, added))
    return iter(sorted(cases, key=lambda case: case.since))  # stable: the rest in table order


def suite_size() -> int:
    """How many fixtures :func:`write_suite` writes: the standard suite's cases."""
    return sum(1 for _ in _suite_cases())


def suite_digest(dtype: np.dtype[Any], seed: int = 0) -> str:
    """The SHA-256, in hex, of the definition of the suite :func:`write_suite` writes in
    ``dtype`` from ``seed``: every file's name, layout, regime, revision and seed, the classes
    recorded, the chunk sizes, the format, and each regime's inputs on a small probe. A suite
    of one digest holds what the code of that digest writes.

    >>> suite_digest(np.dtype(np.float32)) == suite_digest(np.dtype(np.float32))
    True
    >>> suite_digest(np.dtype(np.float32)) == suite_digest(np.dtype(np.float64))
    False
    """
    cases = list(_suite_cases())
    definition = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype_code(dtype, "write_suite"),
        "seed": seed,
        "precisions": precisions_of(dtype, "all"),
        "chunk_sizes": CHUNK_SIZES,
        "cases": [
            [case.name, case.layout.to_dict(), case.regime, case.identical_rows, case.since]
            for case in cases
        ],
    }
    digest = hashlib.sha256(json.dumps(definition, sort_keys=True).encode())
    probe = GdnBackwardLayout(1, 3, 2, 2, gate_per_channel=True, carry_state=True)
    for regime in dict.fromkeys(case.regime for case in cases):
        for array in draw_inputs(probe, regime=regime, seed=seed, dtype=np.float64):
            digest.update(b"" if array is None else array.tobytes())
    return digest.hexdigest()


def _identical_rows_fixture(
    layout: GdnBackwardLayout, dtype: np.dtype[Any], regime: str, seed: int
) -> Fixture:
    """A fixture of ``layout`` whose batch rows all hold the inputs drawn for the first."""
    one = GdnBackwardLayout.from_dict({**layout.to_dict(), "batch": 1})
    x = draw_inputs(one, regime=regime, seed=seed, dtype=dtype)
    inputs = GdnInputs._make(None if a is None else np.repeat(a, layout.batch, axis=0) for a in x)
    return _fixture_of(layout, inputs, regime, seed, precisions=precisions_of(dtype, "all"))


def boundaries_crossed(seq: int) -> dict[int, int]:
    """How many boundaries of each chunk size of :data:`CHUNK_SIZES` a sequence of ``seq``
    steps crosses (a boundary at ``c * C`` for ``0 < c * C < seq``).

    >>> boundaries_crossed(65)
    {16: 4, 32: 2, 64: 1, 128: 0, 256: 0}
    """
    return {size: max(seq - 1, 0) // size for size in CHUNK_SIZES}


def write_suite(
    directory: str | os.PathLike[str],
    *,
    dtype: DTypeLike = np.float32,
    seed: int = 0,
    overwrite: bool = False,
    progress: Callable[[float], object] | None = None,
    workers: int | None = 1,
) -> list[Path]:
    """Write the standard fixture set for a kernel test-suite into ``directory``.

    One file for every combination of gate mode, state mode, gate regime (:data:`REGIMES`)
    and edge shape (S = 1, N = 1, B and H above 1, S = 64, 65, 100, N = 128, and those that
    reach every chunk boundary of :data:`CHUNK_SIZES`), and ``manifest.json`` listing each
    with its layout, regime, seed, dtype, size, SHA-256, the boundaries it crosses and whether
    its batch rows are identical. File ``i`` uses seed ``seed + i``, in the order the shapes
    and regimes joined the suite, so that one added later never changes an existing file.
    The suite is all or nothing (docs/files.md): built aside and moved into place; an
    existing, non-empty ``directory`` is replaced only with ``overwrite=True`` and only when
    it holds a suite written here and nothing its manifest does not list.

    Parameters
    ----------
    directory : str or os.PathLike
        The suite's folder; created, with its parents, when missing.
    dtype : dtype_like
        The dtype of every fixture.
    seed : int
        The first file's seed.
    overwrite : bool
        Replace an existing, non-empty folder that holds only a suite and its listed files.
    progress : callable, optional
        Called with the fraction of the files written.
    workers : int or None
        Processes that make the fixtures: 1 makes them in the calling thread, None one per
        core this process may use; the files are the same, byte for byte. Above 1 they are
        spawned: a script calling ``write_suite`` at its top level guards the call with
        ``if __name__ == "__main__":``.

    Returns
    -------
    list of pathlib.Path
        The fixture files, in manifest order, spelled from ``directory`` as given.

    Raises
    ------
    FileExistsError
        ``directory`` is not empty and ``overwrite`` false, is not a folder, or holds
        something its manifest does not list or no manifest written here.
    TypeError, ValueError
        ``dtype`` or ``seed`` is not usable; ValueError too when ``directory`` is the current
        folder or holds it.
    OSError
        A file cannot be written; nothing is left in ``directory`` then.
    RuntimeError
        A worker process ended abruptly; nothing is left in ``directory`` then.

    See Also
    --------
    load_suite : Read it back.
    verify_suite : Check it against its manifest.
    make_fixture : One fixture.
    """
    given = Path(directory)
    target = resolve_dtype(dtype, "write_suite")
    seed = check_seed(seed, "write_suite")
    processes = reference.resolve_workers(workers, "write_suite")
    root = Path(os.path.realpath(given))  # a named folder with a parent, even for "."
    try:
        here = os.path.realpath(os.getcwd())
    except FileNotFoundError:  # the current folder was removed: it cannot be replaced
        here = None
    if here is not None and os.path.commonpath([root, here]) == os.fspath(root):
        raise ValueError(
            f"write_suite: directory {os.fspath(given)!r} is the current folder or holds it: a "
            "suite takes the place of its folder, which would leave the current one deleted; "
            f"give a folder inside it, such as {os.fspath(given / 'suite')!r}"
        )
    if _non_empty_folder(root):  # refused now, not after the work (and again when moved in)
        if not overwrite:
            raise FileExistsError(
                f"{root} exists and is not empty; pass overwrite=True to replace it"
            )
        if (why := _not_a_suite(root)) is not None:
            raise FileExistsError(f"{root} is not replaced: {why}")
    root.parent.mkdir(parents=True, exist_ok=True)
    names = write_folder(
        root,
        lambda built: _write_suite_files(built, target, seed, progress, processes),
        overwrite=overwrite,
        replaceable=_not_a_suite,
        own=_of_a_suite,
    )
    return [given / name for name in names]


def _in_order(
    cases: list[_SuiteCase], target: np.dtype[Any], seed: int, workers: int
) -> Iterator[Fixture]:
    """The fixture of each case, in order, made in ``workers`` processes at most ``2 * workers``
    ahead of the one handed out. Processes: threads would queue on the GIL between NumPy's
    short calls; spawned, the one start method every system has, copying no lock held."""
    workers = min(workers, len(cases), _MOST_PROCESSES if os.name == "nt" else workers)
    if workers <= 1:
        yield from (_suite_fixture(case, target, seed + i) for i, case in enumerate(cases))
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=context, initializer=_die_with, initargs=(os.getpid(),)
    ) as pool:
        pending: deque[Future[Fixture]] = deque()
        try:
            for index, case in enumerate(cases):
                pending.append(pool.submit(_suite_fixture, case, target, seed + index))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool as err:
            raise RuntimeError(
                "write_suite: a worker process ended abruptly (killed, out of memory, or "
                "started from a script that calls write_suite at its top level: guard the call "
                'with if __name__ == "__main__":); its own error, if any, is on stderr'
            ) from err
        finally:
            for future in pending:
                future.cancel()


def _die_with(parent: int) -> None:
    """In a worker: end when ``parent`` does. A parent killed (SIGKILL, SIGTERM) cannot stop
    its pool, whose workers would otherwise go on making fixtures nobody reads."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


#: The most processes a pool may have on Windows (``ProcessPoolExecutor`` refuses more).
_MOST_PROCESSES: Final = 61


def _suite_fixture(case: _SuiteCase, target: np.dtype[Any], seed: int) -> Fixture:
    """The fixture of one file of the standard suite."""
    if case.identical_rows:
        return _identical_rows_fixture(case.layout, target, case.regime, seed)
    return make_fixture(case.layout, dtype=target, regime=case.regime, seed=seed, precisions="all")


def _non_empty_folder(path: Path) -> bool:
    try:
        return any(True for _ in os.scandir(path))
    except NotADirectoryError:
        raise FileExistsError(f"{path} exists and is not a folder") from None
    except FileNotFoundError:
        return False


def _not_a_suite(folder: Path) -> str | None:
    """Why ``folder`` may not be replaced by a suite; None when it holds only a suite written
    here and the regular files its manifest lists."""
    try:
        listed = {entry["file"] for entry in read_manifest(folder)}
    except NotASuite as err:
        return f"{err.why}; {_ADVICE}"
    with os.scandir(folder) as entries:
        found = [(entry.name, entry.is_file(follow_symlinks=False)) for entry in entries]
    odd = sorted(name for name, regular in found if name in listed and not regular)
    if odd:
        return (
            f"the files {', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''} it lists are "
            f"not regular files (a symbolic link, a folder, ...); {_ADVICE}"
        )
    foreign = sorted(name for name, _ in found if name != MANIFEST and name not in listed)
    if foreign:
        return (
            f"it holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}, which its "
            f"manifest does not list; {_ADVICE}"
        )
    return None


_ADVICE: Final = "move it away yourself or choose another folder"


def _of_a_suite(folder: Path) -> list[str] | None:
    """The suite's own files in ``folder``, to remove when it is replaced; None without a
    manifest (unfinished work)."""
    try:
        return [*(entry["file"] for entry in read_manifest(folder)), MANIFEST]
    except NotASuite:
        return None


def _write_suite_files(
    root: Path,
    target: np.dtype[Any],
    seed: int,
    progress: Callable[[float], object] | None,
    workers: int = 1,
) -> list[str]:
    """Write every fixture and the manifest into the empty folder ``root``; their names."""
    entries: list[dict[str, Any]] = []
    cases = list(_suite_cases())
    for index, fixture in enumerate(_in_order(cases, target, seed, workers)):
        name, layout, regime, identical_rows, _since = cases[index]
        path = save_fixture(root / name, fixture)
        if progress is not None:
            progress((index + 1) / len(cases))
        entries.append(
            manifest_entry(
                name,
                path.read_bytes(),
                layout=layout.to_dict(),
                regime=regime,
                seed=seed + index,
                crosses={str(c): n for c, n in boundaries_crossed(layout.seq).items()},
                identical_rows=identical_rows,
                dtype=dtype_code(target, "write_suite"),
            )
        )
    text = manifest_text(
        entries,
        gdn_layout_version=__version__,
        dtype=dtype_code(target, "write_suite"),
        seed=seed,
    )

    def write(out: IO[bytes]) -> None:
        out.write(text)

    atomic_write(root / MANIFEST, write, overwrite=False)
    return [entry["file"] for entry in entries]
