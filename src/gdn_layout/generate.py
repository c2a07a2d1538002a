"""Random inputs, the fixtures the reference computes for them, and the standard suite
(docs/files.md)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import IO, Any, Final, NamedTuple, SupportsIndex

import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import reference
from ._checks import integer, not_a_layout
from ._floors import correct_forms_floors as correct_forms_floors
from ._floors import precisions_of as precisions_of
from ._floors import tensors_by_name
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

#: The child of ``SeedSequence(seed).spawn(7)`` each tensor is drawn from: a tensor's stream
#: never depends on the order of any tuple of names.
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
    """Random inputs for ``layout`` in ``dtype`` (float64, float32, float16 or bfloat16).

    ``q`` and ``k`` are L2-normalised over ``N``; ``v``, ``dy`` and ``state`` standard normal;
    ``beta`` uniform in ``[0.05, 0.95]``; ``g`` drawn as ``regime`` (one of :data:`REGIMES`)
    says. Each tensor has its own stream of ``seed``, so ``q`` is the same for every regime
    and gate mode of a seed. Values are drawn in float64 and cast to ``dtype``.

    Raises
    ------
    TypeError
        ``layout``, ``seed`` or ``dtype`` has the wrong type.
    ValueError
        ``regime`` is unknown or ``seed`` negative.

    Examples
    --------
    >>> import gdn_layout as gl
    >>> x = draw_inputs(gl.GdnBackwardLayout(2, 5, 3, 8), regime="strong", seed=3)
    >>> x.q.shape, x.g.shape, x.state is None, x.q.dtype
    ((2, 5, 3, 8), (2, 5, 3), True, dtype('float32'))
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

    The reference runs in float64 on the inputs as stored and its results are cast to
    ``dtype``. With ``calibrate``, the precision floors are measured (docs/criterion.md).

    Parameters
    ----------
    layout, dtype, regime, seed
        As for :func:`draw_inputs`.
    progress : callable, optional
        Called with the fraction of the backward done.
    calibrate : bool
        Whether to measure the precision floors.
    states : int, optional
        A chunk length: keep the state entering each chunk and its cotangent (``h``, ``dh``)
        and the final state, with their floors.
    workers : int or None
        Threads (None: every core this process may use); the fixture is the same bit for bit.
    precisions : tuple of str, optional
        The precision classes whose floors are measured: by default ``dtype``'s class;
        ``"all"`` every class its buffers can be judged in.

    Raises
    ------
    TypeError, ValueError
        As :func:`draw_inputs`.

    Examples
    --------
    >>> import gdn_layout as gl
    >>> fx = make_fixture(gl.GdnBackwardLayout(1, 4, 2, 8, carry_state=True), regime="zero")
    >>> fx.packed.shape, fx.grads.dstate.shape, fx.compute_dtype
    ((336,), (1, 2, 8, 8), 'float64')
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
    truth = reference_outputs(x, states, workers)
    packed = reference.backward(*x, dtype=np.float64, progress=progress, workers=workers)
    floors = state_floors = None
    if calibrate:
        measured = correct_forms_floors(
            x, tensors_by_name(packed, truth, layout), states, precisions, workers
        )
        floors = {c: {n: f for n, f in p.items() if n in layout.names} for c, p in measured.items()}
        if len(truth) > 1:  # the states are kept, and so are their floors and y's
            state_floors = {
                c: {n: f for n, f in p.items() if n in truth} for c, p in measured.items()
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
    """The float64 ``y`` of inputs ``x`` and the states a fixture keeps (``final_state``,
    ``h`` and ``dh`` with ``states``)."""
    result = reference.forward(*x[:5], state=x.state, dtype=np.float64, workers=workers)
    y, final = result if isinstance(result, tuple) else (result, None)
    outputs = {"y": y}
    if states is not None:
        h, dh, final = reference.chunk_states(*x, chunk=states, dtype=np.float64, workers=workers)
        outputs.update(h=h, dh=dh)
    if final is not None:
        outputs["final_state"] = final
    return outputs


class _Shape(NamedTuple):
    tag: str
    batch: int
    seq: int
    heads: int
    state_size: int
    #: The suite's revision it joined, counted with REGIME_SINCE: a new shape takes the next.
    since: int = 0
    #: Every batch row gets the same inputs, so that a row that differs is the kernel's doing.
    identical_rows: bool = False


#: The chunk sizes a kernel is likely to use: the suite crosses at least two boundaries of
#: each, and ends a sequence one step past a boundary and one step before one.
CHUNK_SIZES: Final = (16, 32, 64, 128, 256)

#: S=1, N=1, RLX's test shape, S around 64, RLX's largest N; then one step short of every
#: chunk size's boundary (255), past two (513), N = 128 over 300 steps, identical rows.
_SUITE_SHAPES: Final = (
    _Shape("s1", 1, 1, 1, 8),
    _Shape("n1", 1, 7, 2, 1),
    _Shape("rlx", 2, 5, 3, 8),
    _Shape("s64", 1, 64, 2, 16),
    _Shape("s65", 2, 65, 2, 16),
    _Shape("s100", 1, 100, 3, 16),
    _Shape("n128", 1, 3, 1, 128),
    _Shape("s255", 1, 255, 2, 16, since=2),
    _Shape("s300", 1, 300, 1, 128, since=2),
    _Shape("s513", 1, 513, 2, 16, since=2),
    _Shape("twin", 2, 130, 2, 8, since=2, identical_rows=True),
)


class _SuiteCase(NamedTuple):
    name: str
    layout: GdnBackwardLayout
    regime: str
    identical_rows: bool
    since: int  # the later of its shape's and its regime's


def _suite_cases(regimes: Mapping[str, int] | None = None) -> Iterator[_SuiteCase]:
    """Every file of the suite in file (and seed) order, for ``regimes`` and their revisions
    (REGIME_SINCE): by revision, then shape, gate mode, state mode and regime."""
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
                for regime, since in (REGIME_SINCE if regimes is None else regimes).items():
                    name = f"{shape.tag}-b{b}s{s}h{h}n{n}-{modes}-{regime}.safetensors"
                    added = max(shape.since, since)
                    cases.append(_SuiteCase(name, layout, regime, shape.identical_rows, added))
    return iter(sorted(cases, key=lambda case: case.since))  # stable: the rest in table order


def suite_size() -> int:
    """How many fixtures :func:`write_suite` writes."""
    return sum(1 for _ in _suite_cases())


def suite_digest(dtype: np.dtype[Any], seed: int = 0) -> str:
    """The SHA-256 (hex) of the definition of the suite :func:`write_suite` writes in ``dtype``
    from ``seed``: every file's name, layout, regime, revision and seed, the classes, chunk
    sizes, format, and each regime's inputs on a small probe.

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
    """How many boundaries (``c * C`` for ``0 < c * C < seq``) of each of :data:`CHUNK_SIZES`
    ``seq`` steps cross.

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

    One file for every gate mode, state mode, gate regime (:data:`REGIMES`) and edge shape
    (those that reach every chunk boundary of :data:`CHUNK_SIZES` among them), and
    ``manifest.json`` listing each. File ``i`` uses seed ``seed + i``, in the order the
    shapes and regimes joined the suite. The suite is all or nothing (docs/files.md).

    Parameters
    ----------
    directory : str or os.PathLike
        The suite's folder; created, with its parents, when missing.
    dtype, seed
        Every fixture's dtype; the first file's seed.
    overwrite : bool
        Replace an existing, non-empty folder that holds only a suite and its listed files.
    progress : callable, optional
        Called with the fraction of the files written.
    workers : int or None
        Processes (None: one per core); the files are the same byte for byte. Above 1 they
        are spawned: a script guards its call with ``if __name__ == "__main__":``.

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
    OSError, RuntimeError
        A file cannot be written, or a worker process ended abruptly: nothing is left then.
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
    """The fixture of each case, in order, made in ``workers`` spawned processes (threads
    would queue on the GIL between NumPy's short calls; spawn is the start method every
    system has). Windows' pools take at most 61 processes."""
    workers = min(workers, len(cases), 61 if os.name == "nt" else workers)
    seeds = range(seed, seed + len(cases))
    if workers <= 1:
        yield from map(_suite_fixture, cases, [target] * len(cases), seeds)
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, context, _die_with, (os.getpid(),)) as pool:
        try:
            yield from pool.map(_suite_fixture, cases, [target] * len(cases), seeds)
        except BrokenProcessPool as err:
            raise RuntimeError(
                "write_suite: a worker process ended abruptly (killed, out of memory, or "
                "started from a script that calls write_suite at its top level: guard the call "
                'with if __name__ == "__main__":); its own error, if any, is on stderr'
            ) from err


def _die_with(parent: int) -> None:
    """In a worker: end when ``parent`` does (a killed parent cannot stop its pool)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _suite_fixture(case: _SuiteCase, target: np.dtype[Any], seed: int) -> Fixture:
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
    advice = "move it away yourself or choose another folder"
    try:
        listed = {entry["file"] for entry in read_manifest(folder)}
    except NotASuite as err:
        return f"{err.why}; {advice}"
    with os.scandir(folder) as entries:
        found = [(entry.name, entry.is_file(follow_symlinks=False)) for entry in entries]

    def some(names: list[str]) -> str:
        return ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")

    if odd := [name for name, regular in found if name in listed and not regular]:
        why = "are not regular files (a symbolic link, a folder, ...)"
        return f"the files {some(odd)} it lists {why}; {advice}"
    if foreign := [name for name, _ in found if name != MANIFEST and name not in listed]:
        return f"it holds {some(foreign)}, which its manifest does not list; {advice}"
    return None


def _of_a_suite(folder: Path) -> list[str] | None:
    """The suite's own files in ``folder``; None without a manifest (unfinished work)."""
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
    code = dtype_code(target, "write_suite")
    for index, fixture in enumerate(_in_order(cases, target, seed, workers)):
        name, layout = cases[index].name, cases[index].layout
        path = save_fixture(root / name, fixture)
        if progress is not None:
            progress((index + 1) / len(cases))
        crosses = {str(c): n for c, n in boundaries_crossed(layout.seq).items()}
        entries.append(
            manifest_entry(
                name,
                path.read_bytes(),
                layout=layout.to_dict(),
                regime=cases[index].regime,
                seed=seed + index,
                crosses=crosses,
                identical_rows=cases[index].identical_rows,
                dtype=code,
            )
        )
    text = manifest_text(entries, gdn_layout_version=__version__, dtype=code, seed=seed)

    def write(out: IO[bytes]) -> None:
        out.write(text)

    atomic_write(root / MANIFEST, write, overwrite=False)
    return [entry["file"] for entry in entries]
