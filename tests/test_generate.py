"""``generate``: drawn inputs, fixtures, and the standard suite: written all or nothing, what it
covers, and how it grows."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from gdn_layout import GdnBackwardLayout, compare, reference, unpack
from gdn_layout.files import Fixture, load_fixture
from gdn_layout.generate import draw_inputs, make_fixture, write_suite
from gdn_layout.reference import backward
from gdn_layout.regimes import REGIME_SINCE, REGIMES
from gdn_layout.suites import Case
from support import DTYPES, FLAGS, assert_same_fixture, dtype_id, run, same_bits

generate = importlib.import_module("gdn_layout.generate")


@pytest.fixture
def small_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of the suite's shapes (32 fixtures) are enough to see how a suite is written."""
    monkeypatch.setattr(generate, "_SUITE_SHAPES", generate._SUITE_SHAPES[:2])


def _check_consistent(root: Path) -> dict[str, Any]:
    """The manifest lists exactly the files there, each with its size and SHA-256."""
    manifest: dict[str, Any] = json.loads((root / "manifest.json").read_text())
    listed = {entry["file"]: entry for entry in manifest["fixtures"]}
    assert {p.name for p in root.iterdir()} == {*listed, "manifest.json"}
    for name, entry in listed.items():
        data = (root / name).read_bytes()
        assert len(data) == entry["bytes"]
        assert hashlib.sha256(data).hexdigest() == entry["sha256"], name
    seeds = [entry["seed"] for entry in manifest["fixtures"]]
    assert seeds == [manifest["seed"] + i for i in range(len(seeds))]
    return manifest


def _siblings(root: Path) -> list[str]:
    return sorted(p.name for p in root.parent.iterdir())


def _fail_after(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    real = generate.make_fixture
    made: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        if len(made) == count:
            raise RuntimeError("stopped on purpose")
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(generate, "make_fixture", failing)


@pytest.mark.usefixtures("small_suite")
def test_a_folder_with_other_files_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    root.mkdir()
    (root / "rlx-b2s5h3n8-scalar-nostate-zero.safetensors").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="exists and is not empty; pass overwrite=True"):
        write_suite(root)
    assert [p.name for p in root.iterdir()] == ["rlx-b2s5h3n8-scalar-nostate-zero.safetensors"]
    assert _siblings(root) == ["suite"]


@pytest.mark.usefixtures("small_suite")
def test_a_failed_suite_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "suite"
    _fail_after(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="stopped on purpose"):
        write_suite(root)
    assert _siblings(root) == []


@pytest.mark.slow
def test_a_suite_does_not_depend_on_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A few of the standard shapes, so that the test stays short; the suite's own order.
    shapes = generate._SUITE_SHAPES
    monkeypatch.setattr(generate, "_SUITE_SHAPES", (*shapes[:3], shapes[-1]))
    folders = {}
    for workers in (1, 3):
        seen: list[float] = []
        root = tmp_path / f"w{workers}"
        write_suite(root, seed=100, workers=workers, progress=seen.append)
        assert seen == sorted(seen)
        assert seen[-1] == 1.0
        folders[workers] = {p.name: p.read_bytes() for p in sorted(root.iterdir())}
    assert folders[1] == folders[3]
    assert len(folders[1]) == 1 + 4 * 2 * 2 * len(generate.REGIMES)  # and manifest


def test_a_worker_process_ending_abruptly_is_a_runtime_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Killed:  # a pool whose processes die, as the system's OOM killer leaves it
        def __init__(self, *_: Any) -> None:
            pass

        def __enter__(self) -> Killed:
            return self

        def __exit__(self, *_: object) -> None:
            pass

        def map(self, *_: object) -> Iterator[Any]:
            raise BrokenProcessPool("A process in the pool was terminated")
            yield

    monkeypatch.setattr(generate, "ProcessPoolExecutor", Killed)
    root = tmp_path / "suite"
    with pytest.raises(RuntimeError, match=r"^write_suite: a worker process ended abruptly"):
        write_suite(root, workers=2)
    assert _siblings(root) == []


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux)."""
    found = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat_file.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signal_", [signal.SIGKILL, signal.SIGTERM], ids=["kill", "term"])
def test_the_workers_end_with_a_killed_parent(tmp_path: Path, signal_: int) -> None:
    code = "import sys; from gdn_layout import write_suite; write_suite(sys.argv[1], workers=2)"
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "suite")])
    try:
        end = time.monotonic() + 120
        while len(workers := _children(parent.pid)) < 3:  # two workers, the resource tracker
            assert parent.poll() is None
            assert time.monotonic() < end
            time.sleep(0.1)
        time.sleep(1)  # at work
    finally:
        parent.send_signal(signal_)
        parent.wait()
    end = time.monotonic() + 30
    while any(_alive(pid) for pid in workers) and time.monotonic() < end:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)


@pytest.mark.usefixtures("small_suite")
@pytest.mark.slow
def test_overwrite_replaces_the_whole_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "suite"
    write_suite(root, seed=1)
    # A failed replacement keeps the old suite as it was.
    with monkeypatch.context() as patch:
        _fail_after(patch, 3)
        with pytest.raises(RuntimeError):
            write_suite(root, seed=2, overwrite=True)
    assert _siblings(root) == ["suite"]
    assert _check_consistent(root)["seed"] == 1
    write_suite(root, seed=2, overwrite=True)
    assert _check_consistent(root)["seed"] == 2
    assert _siblings(root) == ["suite"]


@pytest.mark.usefixtures("small_suite")
@pytest.mark.slow
def test_overwrite_keeps_what_the_manifest_does_not_list_or_links(tmp_path: Path) -> None:
    root = tmp_path / "suite"
    name = write_suite(root, seed=1)[0].name
    (root / ".hidden").write_bytes(b"theirs")
    with pytest.raises(FileExistsError, match=r"it holds \.hidden, which its manifest"):
        write_suite(root, seed=2, overwrite=True)
    assert (root / ".hidden").read_bytes() == b"theirs"
    (root / ".hidden").unlink()
    assert _check_consistent(root)["seed"] == 1
    (tmp_path / "elsewhere").write_bytes((root / name).read_bytes())
    (root / name).unlink()
    (root / name).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError, match=rf"the files {re.escape(name)} it lists are not"):
        write_suite(root, seed=2, overwrite=True)
    assert (root / name).is_symlink()
    assert _siblings(root) == ["elsewhere", "suite"]


@pytest.mark.usefixtures("small_suite")
@pytest.mark.parametrize(
    ("manifest", "why"),
    [
        (None, "it has no manifest.json"),
        ('{"fixtures": []}', "its manifest.json is not one gdn-layout wrote"),
        (b"\xff", "its manifest.json is not JSON"),
    ],
)
def test_overwrite_refuses_a_folder_that_is_not_a_suite(
    tmp_path: Path, manifest: str | bytes | None, why: str
) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "weights.safetensors").write_bytes(b"keep me")
    if manifest is not None:
        raw = manifest if isinstance(manifest, bytes) else manifest.encode()
        (root / "manifest.json").write_bytes(raw)
    with pytest.raises(FileExistsError, match=f"models is not replaced: {why}"):
        write_suite(root, overwrite=True)
    assert (root / "weights.safetensors").read_bytes() == b"keep me"
    assert _siblings(root) == ["models"]


#: Writes a suite; with a folder as its third argument, pauses after 4 fixtures until the
#: file "go" appears there (after saying so with the file "paused").
_RUN = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import gdn_layout.generate as generate

    generate._SUITE_SHAPES = generate._SUITE_SHAPES[:2]
    if len(sys.argv) > 3:
        signals, real, made = Path(sys.argv[3]), generate.make_fixture, []

        def pausing(*args, **kwargs):
            if len(made) == 4:
                (signals / "paused").touch()
                while not (signals / "go").exists():
                    time.sleep(0.01)
            made.append(1)
            return real(*args, **kwargs)

        generate.make_fixture = pausing
    generate.write_suite(sys.argv[1], seed=int(sys.argv[2]), overwrite=True)
    """
)


@pytest.mark.usefixtures("small_suite")
@pytest.mark.slow
def test_concurrent_runs_end_with_one_complete_suite(tmp_path: Path) -> None:
    # The worst interleaving, made deterministic: one run starts, the other runs from start
    # to end while the first is paused, then the first finishes.
    root, signals = tmp_path / "out" / "suite", tmp_path / "signals"
    signals.mkdir()
    first = subprocess.Popen([sys.executable, "-c", _RUN, str(root), "20", str(signals)])
    try:
        while not (signals / "paused").exists():
            assert first.poll() is None, "the first run ended before its pause"
            time.sleep(0.01)
        second = subprocess.run([sys.executable, "-c", _RUN, str(root), "10"], timeout=300)
        assert second.returncode == 0
        assert _check_consistent(root)["seed"] == 10
    finally:
        (signals / "go").touch()
        assert first.wait(timeout=300) == 0
    assert _check_consistent(root)["seed"] == 20
    assert _siblings(root) == ["suite"]


@pytest.mark.usefixtures("small_suite")
@pytest.mark.slow
@pytest.mark.parametrize("given", [".", "..", "here"])
def test_the_current_folder_or_one_holding_it_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    # A suite takes its folder's place: the current folder would be left deleted.
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    where = {"here": str(here)}.get(given, given)
    with pytest.raises(ValueError, match=r"is the current folder or holds it.*such as '"):
        write_suite(where, overwrite=True)
    if given == ".":  # the command line says it in one line, naming its flag
        assert run("fixture", "--suite", ".", "--force").stderr == (
            "gdn-layout fixture: error: --suite '.' is the current folder or holds it: a suite "
            "takes the place of its folder, which would leave the current one deleted; give a "
            "folder inside it, such as 'suite'\n"
        )
    assert os.path.samefile(os.getcwd(), here)
    assert list(here.iterdir()) == []
    assert write_suite("suite")[0].parent == Path("suite")
    _check_consistent(here / "suite")


CASES = list(generate._suite_cases())


@pytest.mark.parametrize("chunk", generate.CHUNK_SIZES)
def test_the_suite_reaches_every_chunk_boundary_in_every_mode(chunk: int) -> None:
    for regime in REGIMES:
        for per_channel in (False, True):
            for carry in (False, True):
                assert any(  # two boundaries crossed
                    (c.layout.seq - 1) // chunk >= 2
                    and (c.regime, c.layout.gate_per_channel, c.layout.carry_state)
                    == (regime, per_channel, carry)
                    for c in CASES
                )
    seqs = {c.layout.seq for c in CASES}
    assert any(seq % chunk == 1 for seq in seqs if seq > chunk)  # a last chunk of one step
    assert any(seq % chunk == chunk - 1 for seq in seqs)  # and one short of full
    assert any(c.layout.state_size == 128 and c.layout.seq >= 256 for c in CASES)
    shapes = {(c.layout.batch, c.layout.seq, c.layout.heads, c.layout.state_size) for c in CASES}
    assert any(s == 1 for _, s, _, _ in shapes)
    assert any(n == 1 for *_, n in shapes)
    assert any(b > 1 and h > 1 for b, _, h, _ in shapes)
    twins = [c for c in CASES if c.identical_rows]
    assert {c.regime for c in twins} == set(REGIMES)


def test_identical_rows_hold_the_same_inputs_and_gradients() -> None:
    case = next(c for c in CASES if c.identical_rows and c.layout.carry_state)
    fixture = generate._identical_rows_fixture(case.layout, np.dtype(np.float32), "mixed", 5)
    for name, array in fixture.tensors().items():
        rows = unpack(array, case.layout) if name == "packed" else [array]
        for part in rows:
            if part is not None:
                assert all(np.array_equal(part[0], part[b]) for b in range(1, len(part))), name
    row_bug = backward(*fixture.inputs, dtype=np.float32)
    unpack(row_bug, case.layout).dv[1] *= 1.5  # only the second row is wrong
    with pytest.raises(AssertionError, match=r"row\(s\) 1 fail where the others pass"):
        Case(case.name, fixture).check(row_bug)


def _dropped_state(fixture: Fixture, t: int, dtype: Any) -> NDArray[Any]:
    """A chunked kernel that forgets the state at step ``t``: two independent scans."""
    x, layout = fixture.inputs, fixture.layout
    q, k, v, g, beta, dy = x[:6]
    head = backward(
        q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], dy[:, :t], x.state, dtype=dtype
    )
    tail = backward(q[:, t:], k[:, t:], v[:, t:], g[:, t:], beta[:, t:], dy[:, t:], dtype=dtype)
    first = unpack(head, GdnBackwardLayout.from_inputs(x.q[:, :t], x.g[:, :t], x.state))
    second = unpack(tail, GdnBackwardLayout.from_inputs(x.q[:, t:], x.g[:, t:]))
    out = np.empty(layout.total_elems, dtype)
    grads = unpack(out, layout)
    for name in ("dq", "dk", "dv", "dg", "dbeta"):
        getattr(grads, name)[:, :t] = getattr(first, name)
        getattr(grads, name)[:, t:] = getattr(second, name)
    if grads.dstate is not None:
        grads.dstate[...] = first.dstate
    return out


@pytest.mark.slow
@pytest.mark.parametrize("t", [48, 128, 256])
@pytest.mark.parametrize("regime", REGIMES)
def test_a_state_dropped_past_the_first_suites_sequences_fails(t: int, regime: str) -> None:
    # The first suite's longest sequence was 100: a state dropped at 128 or 256 passed it.
    # The chunk-boundary shapes, in two of their gate and state modes.
    cases = [
        c
        for c in CASES
        if c.regime == regime
        and c.layout.seq > t
        and c.name.startswith(("s255", "s513"))
        and c.layout.gate_per_channel != c.layout.carry_state
    ]
    assert cases
    caught = above_rounding = 0
    for case in cases:
        fixture = generate.make_fixture(case.layout, regime=regime, seed=7)
        truth = np.asarray(fixture.packed, np.float64)
        change = np.abs(_dropped_state(fixture, t, np.float64) - truth).max()
        if change <= 1e-5 * np.sqrt(np.mean(np.square(truth))):
            continue  # the decay erased the state before t: nothing to catch in float32
        above_rounding += 1
        result = compare(
            _dropped_state(fixture, t, np.float32),
            fixture.packed,
            fixture.layout,
            floors=fixture.floors,
        )
        caught += not result.passed
    assert caught == above_rounding
    if regime in ("zero", "mild", "mixed"):  # the state lives past t: the change is there
        assert above_rounding > 0


SMALL = GdnBackwardLayout(batch=2, seq=5, heads=3, state_size=4, carry_state=True)


# -- generation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_draw_inputs_regimes(dtype: np.dtype[Any]) -> None:
    layout = GdnBackwardLayout(2, 64, 3, 16, gate_per_channel=True, carry_state=True)
    tol = {8: 1e-12, 4: 1e-6, 2: 2e-2}[dtype.itemsize]
    gates = {}
    for regime in REGIMES:
        x = draw_inputs(layout, regime=regime, seed=5, dtype=dtype)
        assert all(a is not None and a.dtype == dtype for a in x)
        for name in ("q", "k"):
            norms = np.linalg.norm(getattr(x, name).astype(np.float64), axis=-1)
            np.testing.assert_allclose(norms, 1.0, atol=tol, err_msg=name)
        assert 0.05 - tol <= x.beta.astype(np.float64).min() <= x.beta.max() <= 0.95 + tol
        for name in ("v", "dy", "state"):
            values = getattr(x, name).astype(np.float64)
            assert abs(values.mean()) < 0.1, name
            assert 0.9 < values.std() < 1.1, name
        gates[regime] = x.g.astype(np.float64)
    assert not gates["zero"].any()
    assert -0.1 - tol <= gates["mild"].min() <= gates["mild"].max() < 0.0
    assert -8.0 - 8 * tol <= gates["strong"].min() <= gates["strong"].max() <= -3.0 + 8 * tol
    assert -30.0 - 30 * tol <= gates["extreme"].min() <= gates["extreme"].max() <= -10 + 30 * tol
    mixed = gates["mixed"]
    fractions = [np.mean(mixed == 0), np.mean((mixed < 0) & (mixed > -1)), np.mean(mixed <= -3)]
    assert sum(fractions) == pytest.approx(1.0)
    assert all(0.25 < f < 0.42 for f in fractions), fractions
    # qwen: -exp(A_log) * softplus(a + dt_bias), exp(A_log) in [1, 16] and dt_bias per head:
    # the heads' typical rates differ.
    g = draw_inputs(GdnBackwardLayout(3, 40, 4, 4), regime="qwen", seed=2, dtype=dtype).g
    rates = -np.moveaxis(g.astype(np.float64), 2, 0).reshape(4, -1)
    assert 0 < rates.min() <= rates.max() < 16 * 7
    assert np.median(rates, axis=1).max() / np.median(rates, axis=1).min() > 1.5


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("per_channel", "carry"), FLAGS)
def test_make_fixture_stores_the_reference_s_answer_for_its_stored_inputs(
    dtype: np.dtype[Any], per_channel: bool, carry: bool
) -> None:
    layout = GdnBackwardLayout(2, 9, 3, 4, gate_per_channel=per_channel, carry_state=carry)
    fixture = make_fixture(layout, dtype=dtype, regime="strong", seed=11, states=4)
    assert (fixture.dtype, fixture.compute_dtype) == (dtype, "float64")
    assert (fixture.regime, fixture.seed, fixture.states_chunk) == ("strong", 11, 4)
    assert all(a.dtype == dtype for a in fixture.tensors().values())
    x = draw_inputs(layout, regime="strong", seed=11, dtype=dtype)
    assert all(same_bits(a, b) for a, b in zip(x, fixture.inputs, strict=True) if a is not None)
    packed = backward(*x, dtype=np.float64).astype(dtype)
    y = reference.forward(*x[:5], state=x.state, dtype=np.float64)
    y = y[0] if isinstance(y, tuple) else y
    assert same_bits(fixture.packed, packed)
    assert same_bits(fixture.y, y.astype(dtype))
    h = reference.chunk_states(*x, chunk=4, dtype=np.float64)[0]
    assert same_bits(fixture.h, h.astype(dtype))


def test_each_revision_of_the_suite_keeps_its_files_names_and_seeds() -> None:
    # Each revision's (seed, name, regime), pinned: later revisions add files after them, so
    # their files keep their seeds and bytes. Revision 0 is gdn-layout 0.1.0's suite; 1 added
    # the qwen and extreme regimes, 2 the chunk-boundary shapes.
    cases = list(generate._suite_cases())
    assert len(cases) == len(generate._SUITE_SHAPES) * 2 * 2 * len(REGIMES)
    pinned = {
        0: "8a3b5453f5f9c13efff53ab232b766e2de1e84e3047a76435c8fd5996b2f1b6a",
        2: "6ad52ccdcb27c350cb9a787eb021f62254dd56f2c900119fb13a87ca3d92048c",
    }
    for revision, digest in pinned.items():
        lines = [f"{i} {c.name} {c.regime}" for i, c in enumerate(cases) if c.since <= revision]
        assert hashlib.sha256("\n".join(lines).encode()).hexdigest() == digest, revision
    assert {c.regime for c in cases if c.since == 1} == {"qwen", "extreme"}


def test_draw_inputs_streams_are_independent() -> None:
    base = GdnBackwardLayout(1, 6, 2, 4)
    a = draw_inputs(base, regime="zero", seed=9)
    b = draw_inputs(
        GdnBackwardLayout(1, 6, 2, 4, gate_per_channel=True, carry_state=True),
        regime="strong",
        seed=9,
    )
    for name in ("q", "k", "v", "beta", "dy"):
        assert same_bits(getattr(a, name), getattr(b, name)), name
    assert same_bits(draw_inputs(base, seed=9).q, a.q)
    assert not same_bits(draw_inputs(base, seed=10).q, a.q)


def test_draw_inputs_rejects_bad_arguments() -> None:
    regimes = re.escape(str(REGIMES))
    with pytest.raises(
        ValueError, match=rf"draw_inputs: regime must be one of {regimes}, got 'hot'"
    ):
        draw_inputs(SMALL, regime="hot")
    dtypes = "float64, float32, float16 or bfloat16"
    with pytest.raises(TypeError, match=f"draw_inputs: dtype must be {dtypes}, got int32"):
        draw_inputs(SMALL, dtype=np.int32)
    with pytest.raises(TypeError, match="got 'float17'"):
        draw_inputs(SMALL, dtype="float17")
    with pytest.raises(ValueError, match="seed must be a non-negative integer, got -1"):
        draw_inputs(SMALL, seed=-1)
    with pytest.raises(
        TypeError, match=r"draw_inputs: seed must be a non-negative integer, got float 1\.5"
    ):
        draw_inputs(SMALL, seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layout must be a GdnBackwardLayout, got tuple"):
        draw_inputs((1, 2, 3, 4))  # type: ignore[arg-type]


# -- the suite -----------------------------------------------------------------------------------


def test_suite_manifest_lists_every_file_in_order(suite: tuple[Path, list[Path]]) -> None:
    root, paths = suite
    manifest = _check_consistent(root)  # written with seed 100
    assert (manifest["format"], manifest["dtype"], manifest["seed"]) == (
        "gdn-layout-fixture-suite", "F32", 100
    )  # fmt: skip
    entries = manifest["fixtures"]
    assert [root / e["file"] for e in entries] == paths
    listed = [(e["file"], e["regime"], e["seed"] - 100) for e in entries]
    assert listed == [(c.name, c.regime, i) for i, c in enumerate(generate._suite_cases())]
    for entry in entries:
        fixture = load_fixture(root / entry["file"])
        assert fixture.layout.to_dict() == entry["layout"]
        assert (fixture.regime, fixture.seed, entry["dtype"]) == (
            entry["regime"],
            entry["seed"],
            "F32",
        )


@pytest.mark.slow
def test_suite_is_reproducible(suite: tuple[Path, list[Path]]) -> None:
    _, paths = suite
    for path in paths[-30:-20]:  # the last of S = 513 and the first identical rows
        stored = load_fixture(path)
        assert stored.regime is not None
        assert stored.seed is not None
        if path.name.startswith("twin-"):
            again = generate._identical_rows_fixture(
                stored.layout, stored.dtype, stored.regime, stored.seed
            )
        else:
            again = make_fixture(stored.layout, regime=stored.regime, seed=stored.seed)
        assert_same_fixture(stored, again)


def _seeds(cases: Iterable[Any]) -> dict[str, int]:
    """Each suite case's file name and its seed's offset: file i has seed ``seed + i``."""
    return {case.name: i for i, case in enumerate(cases)}


def test_a_regime_or_shape_appended_keeps_every_file_its_name_and_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A new regime is one entry in gdn_layout.regimes' table, a new shape one in the suite's,
    # each with the next revision: the suite gains its files after all of today's, which keep
    # their names and seeds (and so their bytes).
    shapes = generate._SUITE_SHAPES
    revision = max(*REGIME_SINCE.values(), *(shape.since for shape in shapes)) + 1
    today = _seeds(generate._suite_cases())
    one = _seeds(generate._suite_cases({**REGIME_SINCE, "new": revision}))
    two = _seeds(generate._suite_cases({**REGIME_SINCE, "new": revision, "newer": revision + 1}))
    monkeypatch.setattr(
        generate, "_SUITE_SHAPES", (*shapes, generate._Shape("s2", 1, 2, 1, 4, since=revision))
    )
    shaped = _seeds(generate._suite_cases())
    for before, after, added, count in (
        (today, one, "-new.safetensors", len(shapes) * 4),
        (one, two, "-newer.safetensors", len(shapes) * 4),
        (today, shaped, "s2-", 4 * len(REGIMES)),
    ):
        assert {name: after[name] for name in before} == before
        grown = set(after) - set(before)
        assert len(grown) == count
        assert all(added in name for name in grown)
        assert min(after[name] for name in grown) == len(before)


def test_the_suite_s_digest_follows_its_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    float32 = np.dtype(np.float32)
    today = generate.suite_digest(float32)
    assert generate.suite_digest(float32) == today  # the same definition, the same digest
    digests = {today}

    def changed() -> None:
        digest = generate.suite_digest(float32)
        assert digest not in digests
        digests.add(digest)
        monkeypatch.undo()
        assert generate.suite_digest(float32) == today

    shapes = generate._SUITE_SHAPES
    revision = max(*REGIME_SINCE.values(), *(shape.since for shape in shapes)) + 1
    monkeypatch.setattr(generate, "_SUITE_SHAPES", (*shapes, generate._Shape("s2", 1, 2, 1, 4)))
    changed()  # a shape added
    monkeypatch.setattr(generate, "_SUITE_SHAPES", shapes[:-1])
    changed()  # a shape removed
    last = shapes[-1]
    monkeypatch.setattr(generate, "_SUITE_SHAPES", (*shapes[:-1], last._replace(seq=last.seq + 1)))
    changed()  # a shape changed
    monkeypatch.setattr(generate, "REGIME_SINCE", dict(list(REGIME_SINCE.items())[:-1]))
    changed()  # a regime fewer
    monkeypatch.setattr(generate, "REGIME_SINCE", {**REGIME_SINCE, REGIMES[-1]: revision})
    changed()  # a regime's revision, and so every seed after it
    draw = generate.draw_gate

    def drawn_otherwise(rng: np.random.Generator, shape: tuple[int, ...], regime: str) -> Any:
        gate = draw(rng, shape, regime)
        return gate * 2 if regime == REGIMES[-1] else gate

    monkeypatch.setattr(generate, "draw_gate", drawn_otherwise)
    changed()  # one regime's gates drawn otherwise
    monkeypatch.setattr(generate, "FORMAT_VERSION", generate.FORMAT_VERSION + 1)
    changed()  # another file format
    assert generate.suite_digest(float32, seed=1) not in digests
    for dtype in DTYPES:
        if dtype != float32:
            assert generate.suite_digest(dtype) not in digests
