"""Fixture files: the format, read and written as the official safetensors package does,
saved atomically, loaded strictly, memory-mapped when large."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

import gdn_layout
import gdn_layout.files
import gdn_layout.files._mapping
from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.files import Fixture, FixtureError, load_fixture, save_fixture
from gdn_layout.generate import draw_inputs
from support import DTYPES, FLAGS, assert_same_fixture, dtype_id, same_bits

BF16 = np.dtype(ml_dtypes.bfloat16)
SMALL = GdnBackwardLayout(batch=2, seq=5, heads=3, state_size=4, carry_state=True)


def _fixture(layout: GdnBackwardLayout = SMALL, dtype: Any = np.float32, **kw: Any) -> Fixture:
    """A fixture with distinct, cheap values: no reference run needed for format tests."""
    x = draw_inputs(layout, dtype=dtype, seed=7)
    rng = np.random.default_rng(1)
    y = rng.standard_normal(layout.shape("dq")).astype(x.q.dtype)
    packed = rng.standard_normal(layout.total_elems).astype(x.q.dtype)
    return Fixture(*x, y=y, packed=packed, **kw)


# -- raw safetensors, written independently of the module under test ---------------------------


def _split(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header: dict[str, Any] = json.loads(raw[8 : 8 + n])
    return header, raw[8 + n :]


def _assemble(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def _rewrite(path: Path, mutate: Callable[[dict[str, Any]], Any]) -> Path:
    header, data = _split(path)
    mutate(header)
    path.write_bytes(_assemble(header, data))
    return path


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    return save_fixture(tmp_path / "f.safetensors", _fixture(regime="mixed", seed=7))


# -- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(("per_channel", "carry"), FLAGS)
def test_round_trip(tmp_path: Path, dtype: np.dtype[Any], per_channel: bool, carry: bool) -> None:
    layout = GdnBackwardLayout(2, 5, 3, 4, gate_per_channel=per_channel, carry_state=carry)
    original = _fixture(layout, dtype, regime="strong", seed=3, compute_dtype="float64")
    path = save_fixture(tmp_path / "x.safetensors", original)
    for mmap in (True, False):
        loaded = load_fixture(path, mmap=mmap)
        assert_same_fixture(loaded, original)
        assert loaded.dtype == dtype
        assert loaded.path == path
        assert loaded.writer_version == gdn_layout.__version__
        assert loaded.metadata() == original.metadata()
        expected = unpack(loaded.packed, layout)
        for name, grad in zip(loaded.layout.names, loaded.grads, strict=False):
            assert np.shares_memory(grad, loaded.packed), name
            assert same_bits(grad, getattr(expected, name)), name
        assert all(not a.flags.writeable for a in loaded.tensors().values())


def test_round_trip_without_provenance(tmp_path: Path) -> None:
    path = save_fixture(tmp_path / "x.safetensors", _fixture())
    header, _ = _split(path)
    assert set(header["__metadata__"]) == {
        "format",
        "format_version",
        "gdn_layout_version",
        "layout",
    }
    loaded = load_fixture(path)
    assert (loaded.regime, loaded.seed, loaded.compute_dtype) == (None, None, None)


@pytest.mark.parametrize("shape", [(0, 3, 2, 4), (1, 0, 2, 4), (1, 3, 2, 0)])
def test_round_trip_of_empty_tensors(tmp_path: Path, shape: tuple[int, ...]) -> None:
    b, s, h, n = shape
    layout = GdnBackwardLayout(b, s, h, n, carry_state=True)
    original = _fixture(layout)
    assert_same_fixture(load_fixture(save_fixture(tmp_path / "e.safetensors", original)), original)


# -- memory mapping ------------------------------------------------------------------------------


def test_a_small_file_is_read_into_memory(saved: Path) -> None:
    assert saved.stat().st_size < gdn_layout.files.MAP_THRESHOLD
    for mmap in (True, False):
        fixture = load_fixture(saved, mmap=mmap)
        assert not fixture.mapped
        for name, array in fixture.tensors().items():
            assert not isinstance(array, np.memmap), name
            assert not array.flags.writeable, name
        assert all(np.shares_memory(g, fixture.packed) for g in fixture.grads if g is not None)


def test_load_memory_maps_a_large_file(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdn_layout.files._mapping, "MAP_THRESHOLD", saved.stat().st_size)
    fixture = load_fixture(saved)
    assert fixture.mapped
    fixture.check_unchanged()
    for name, array in fixture.tensors().items():
        assert isinstance(array, np.memmap), name
        assert not array.flags.writeable, name
        assert Path(array.filename or "").resolve() == saved.resolve(), name
    assert all(isinstance(g, np.memmap) for g in fixture.grads if g is not None)
    with pytest.raises(ValueError, match="read-only"):
        fixture.packed[0] = 1.0
    in_memory = load_fixture(saved, mmap=False)
    assert not isinstance(in_memory.q, np.memmap)
    assert not in_memory.q.flags.writeable


def test_unchanged_says_what_it_does_and_holds_no_writer_off(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gdn_layout.files._mapping, "MAP_THRESHOLD", 0)
    fixture = load_fixture(saved)
    held = fixture.unchanged()
    held.__enter__()
    start = time.monotonic()
    with open(saved, "r+b") as file:  # a writer is not held off...
        file.write(saved.read_bytes()[:8])
    os.utime(saved, ns=(0, 0))
    assert time.monotonic() - start < 1.0
    with pytest.raises(FixtureError, match="changed while it was judged"):
        held.__exit__(None, None, None)  # ...and what it did is found on the way out


def test_a_multi_gib_fixture_opens_without_being_read(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(1, 32768, 16, 128, carry_state=True)
    meta = _fixture(regime="zero", seed=0).metadata() | {
        "layout": json.dumps(layout.to_dict()),
    }
    entries: dict[str, Any] = {"__metadata__": meta}
    end = 0
    for name in ("q", "k", "v", "g", "beta", "state", "dy", "y", "packed"):
        shape = (layout.total_elems,) if name == "packed" else layout.input_shape(name)
        nbytes = 4 * int(np.prod(shape))
        entries[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [end, end + nbytes],
        }
        end += nbytes
    header = _assemble(entries, b"")
    path = tmp_path / "big.safetensors"
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + end)  # sparse: no data written
    assert path.stat().st_size > 2 * 2**30
    start = time.perf_counter()
    fixture = load_fixture(path)
    assert time.perf_counter() - start < 2.0
    assert fixture.layout == layout
    assert isinstance(fixture.packed, np.memmap)
    assert fixture.mapped
    assert fixture.grads.dstate is not None
    assert fixture.grads.dstate.shape == (1, 16, 128, 128)
    assert float(fixture.packed[-1]) == 0.0


# -- interop with the official safetensors package ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_we_read_the_official_writer(tmp_path: Path, dtype: np.dtype[Any]) -> None:
    original = _fixture(GdnBackwardLayout(1, 3, 2, 4, gate_per_channel=True), dtype, seed=5)
    path = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(original.tensors(), path, metadata=original.metadata())
    loaded = load_fixture(path)
    assert_same_fixture(loaded, original)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_same_bytes_as_the_official_writer(tmp_path: Path, dtype: np.dtype[Any]) -> None:
    original = _fixture(dtype=dtype, regime="zero", seed=1)
    ours = save_fixture(tmp_path / "ours.safetensors", original)
    theirs = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(original.tensors(), theirs, metadata=original.metadata())
    # Identical up to the order of the metadata keys, which the official writer does not fix.
    (ours_header, ours_data), (their_header, their_data) = _split(ours), _split(theirs)
    assert ours.stat().st_size == theirs.stat().st_size
    assert ours_header == their_header
    assert list(ours_header) == list(their_header)
    assert ours_data == their_data


# -- atomic saving -------------------------------------------------------------------------------


def test_save_into_a_missing_folder_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "x.safetensors"
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(path))}: the folder .* does not"):
        save_fixture(path, _fixture())
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failed_save_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException, overwrite: bool
) -> None:
    target = tmp_path / "x.safetensors"
    if overwrite:
        target.write_bytes(b"old")
    seen: list[int] = []

    def broken_fsync(fd: int) -> None:
        seen.append(fd)
        # Everything is written at this point: the temporary file is full-size.
        assert os.fstat(fd).st_size > 1000
        raise error

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(type(error)):
        save_fixture(target, _fixture(), overwrite=overwrite)
    assert seen
    assert [p.name for p in tmp_path.iterdir()] == (["x.safetensors"] if overwrite else [])
    if overwrite:
        assert target.read_bytes() == b"old"


def test_save_rejects_what_is_not_a_fixture(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="fixture must be a Fixture, got dict"):
        save_fixture(tmp_path / "x", {"q": np.zeros(3)})  # type: ignore[arg-type]


# -- corrupt files -------------------------------------------------------------------------------


def _fails(path: Path, pattern: str) -> FixtureError:
    with pytest.raises(FixtureError, match=pattern) as info:
        load_fixture(path)
    assert str(path) in str(info.value)
    return info.value


def test_every_truncation_is_refused(saved: Path, tmp_path: Path) -> None:
    raw = saved.read_bytes()
    cut = tmp_path / "cut.safetensors"
    for length in [*range(0, len(raw), len(raw) // 97), len(raw) - 1]:
        cut.write_bytes(raw[:length])
        with pytest.raises(FixtureError, match=re.escape(str(cut))):
            load_fixture(cut)


def test_file_shorter_than_the_header_length(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02")
    _fails(path, "truncated: 2 bytes, shorter than the 8-byte header length")


@pytest.mark.parametrize("length", [0, 1, 2**40, 2**64 - 1])
def test_bad_header_length(saved: Path, length: int) -> None:
    raw = saved.read_bytes()
    saved.write_bytes(length.to_bytes(8, "little") + raw[8:])
    _fails(saved, rf"bad header length {length}: expected 2 to \d+ for a file of {len(raw)} bytes")


@pytest.mark.parametrize(
    ("header", "pattern"),
    [
        (b"{not json at all}", "header is not UTF-8 JSON"),
        (b'{"a": "\xff\xfe"}   ', "header is not UTF-8 JSON"),
        (b"[1, 2, 3]", "header must be a JSON object, got list"),
        (b'{"q": 1, "q": 2}', r"duplicate keys \['q'\]"),
        (b"{}      ", "not a gdn-layout fixture: the header has no __metadata__"),
        (b"[" * 100_000, "header is not usable JSON: maximum recursion depth"),
    ],
)
def test_header_that_is_not_a_json_object(tmp_path: Path, header: bytes, pattern: str) -> None:
    path = tmp_path / "h.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    _fails(path, pattern)


def _meta(**changes: str | int | None) -> Callable[[dict[str, Any]], None]:
    """An edit of the metadata: each key set to its value, or removed for None."""

    def edit(h: dict[str, Any]) -> None:
        for key, value in changes.items():
            if value is None:
                h["__metadata__"].pop(key)
            else:
                h["__metadata__"][key] = value

    return edit


def _moved(h: dict[str, Any]) -> None:
    h["y"]["data_offsets"] = [o + 10**6 for o in h["y"]["data_offsets"]]


def _no_carry(h: dict[str, Any]) -> None:
    layout = json.loads(h["__metadata__"]["layout"]) | {"carry_state": False}
    h["__metadata__"]["layout"] = json.dumps(layout)


B, S, H, N = SMALL.shape("dq")
#: Edits of a valid header, and how the file is then refused.
EDITS: list[tuple[Callable[[dict[str, Any]], object], str]] = [
    (_moved, r"tensor 'y' occupies bytes .* \(truncated file\?\)"),
    (lambda h: h["k"].update(data_offsets=h["dy"]["data_offsets"]), "overlaps tensor"),
    *[
        (lambda h, n=n: h.pop(n), rf"missing tensor\(s\) {n} required by")
        for n in ("dy", "packed", "state", "q")
    ],
    (_no_carry, r"unexpected tensor\(s\) state for"),
    (_meta(layout="{not json"), "metadata layout '{not json' does not parse"),
    (_meta(layout='{"batch": 2, "seq": 5}'), "metadata layout .* does not parse: .*missing"),
    (_meta(layout='{"batch": -1, "seq": 5, "heads": 3, "state_size": 4}'), "parse: batch"),
    (_meta(layout="[2, 5, 3, 4]"), "does not parse: layout data must be a dict"),
    (_meta(layout=None), "metadata has no layout"),
    (_meta(format=None), "not a gdn-layout fixture: metadata format is None"),
    (_meta(format="other"), "metadata format is 'other'"),
    (_meta(format_version="2"), "unsupported format_version '2'; this gdn-layout .* reads '1'"),
    (_meta(seed="-3"), "metadata seed must be a non-negative integer, got '-3'"),
    (_meta(regime="wild"), "regime must be one of"),
    (_meta(seed=3), "__metadata__ must map strings to strings"),
    (lambda h: h["q"].update(dtype="F31"), "tensor 'q' has dtype 'F31'; a fixture holds F64"),
    (lambda h: h["q"].update(dtype="I32"), "'q' has dtype 'I32'; a fixture holds F64, F32, F16"),
    (lambda h: h["q"].update(dtype=32), "tensor 'q'.*dtype must be a string, got 32"),
    (
        lambda h: h["v"].update(shape=[B, S, H * N]),
        rf"tensor 'v' has shape \({B}, {S}, {H * N}\), expected \({B}, {S}, {H}, {N}\)",
    ),
    (
        lambda h: h["v"].update(shape=[B, S, H, N + 1]),
        r"tensor 'v': data_offsets \[\d+, \d+\] span \d+ bytes, but F32 .* needs \d+",
    ),
    *[
        (lambda h, e=e: h.update(beta=e), rf"tensor 'beta'.*{pattern}")
        for e, pattern in [
            ([1, 2], "must be an object with exactly dtype, shape and data_offsets"),
            ({"dtype": "F32", "shape": [1]}, "must be an object with exactly"),
            ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, "shape must be a list"),
            ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape must be a list"),
            ({"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}, "data_offsets must be"),
            ({"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}, "data_offsets must be"),
        ]
    ],
]


@pytest.mark.parametrize(("edit", "pattern"), EDITS)
def test_an_edited_header_is_refused_saying_why(
    saved: Path, edit: Callable[[dict[str, Any]], object], pattern: str
) -> None:
    _fails(_rewrite(saved, edit), pattern)


def test_gap_and_trailing_bytes(saved: Path, tmp_path: Path) -> None:
    header, data = _split(saved)
    path = tmp_path / "trailing.safetensors"
    path.write_bytes(_assemble(header, data + b"\0" * 8))
    _fails(path, "8 bytes after the last tensor")

    def shift(h: dict[str, Any]) -> None:
        for entry in h.values():
            if "data_offsets" in entry:
                entry["data_offsets"] = [o + 4 for o in entry["data_offsets"]]

    path.write_bytes(_assemble(header, data))
    _rewrite(path, shift)
    path.write_bytes(path.read_bytes() + b"\0" * 4)
    _fails(path, r"gap in the data section: bytes \[0, 4\)")


def test_wrong_packed_length(tmp_path: Path) -> None:
    fixture = _fixture()
    tensors = fixture.tensors() | {"packed": fixture.packed[:-1]}
    path = tmp_path / "short.safetensors"
    safetensors.numpy.save_file(tensors, path, metadata=fixture.metadata())
    _fails(
        path,
        rf"tensor 'packed' has shape \({SMALL.total_elems - 1},\), "
        rf"expected \({SMALL.total_elems},\) for GdnBackwardLayout\(",
    )


def test_mixed_dtypes(tmp_path: Path) -> None:
    fixture = _fixture()
    tensors = fixture.tensors() | {"y": fixture.y.astype(np.float64)}
    path = tmp_path / "mixed.safetensors"
    safetensors.numpy.save_file(tensors, path, metadata=fixture.metadata())
    _fails(path, "tensor 'y' has dtype float64, expected float32 like 'q'")


def test_bfloat16_without_ml_dtypes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_fixture(tmp_path / "bf16.safetensors", _fixture(dtype=BF16))
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` fail
    with pytest.raises(ImportError, match=r"'\w+' is BF16.*pip install 'gdn-layout\[bfloat16\]'"):
        load_fixture(path)
    with pytest.raises(ImportError, match=r"pip install 'gdn-layout\[bfloat16\]'"):
        draw_inputs(SMALL, dtype="bfloat16")
    assert load_fixture(save_fixture(tmp_path / "f32", _fixture())).dtype == np.float32


# -- the Fixture record --------------------------------------------------------------------------


def test_fixture_checks_its_tensors() -> None:
    x = draw_inputs(SMALL)
    y, packed = np.zeros_like(x.q), np.zeros(SMALL.total_elems, np.float32)
    with pytest.raises(TypeError, match="y has dtype float64, expected float32 like q"):
        Fixture(*x, y=y.astype(np.float64), packed=packed)
    with pytest.raises(TypeError, match="q: dtype must be float64, float32, float16 or bfloat16"):
        Fixture(*(a.astype(np.int32) for a in x[:6]), y=y, packed=packed)
    with pytest.raises(ValueError, match=r"dy has shape \(2, 5, 3\), expected \(2, 5, 3, 4\)"):
        Fixture(*x[:5], dy=x.dy[..., 0], state=x.state, y=y, packed=packed)
    assert x.state is not None
    with pytest.raises(ValueError, match=r"Fixture: state must have shape \[B, H, N, N\]"):
        Fixture(*x[:6], state=x.state[0], y=y, packed=packed)
    with pytest.raises(TypeError, match="beta must be a NumPy array, got list"):
        Fixture(*x[:4], [0.5], *x[5:], y=y, packed=packed)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="regime must be one of"):
        Fixture(*x, y=y, packed=packed, regime="wild")
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        Fixture(*x, y=y, packed=packed, seed=-1)
    with pytest.raises(
        TypeError, match="Fixture: seed must be a non-negative integer, got str '3'"
    ):
        Fixture(*x, y=y, packed=packed, seed="3")  # type: ignore[arg-type]
    numpy_seed = Fixture(*x, y=y, packed=packed, seed=np.int64(3))  # type: ignore[arg-type]
    assert type(numpy_seed.seed) is int
    assert numpy_seed.seed == 3
    fixture = Fixture(*x, y=y, packed=packed)
    assert fixture.layout == SMALL
    assert all(a is b for a, b in zip(fixture.inputs, x, strict=True))
    assert (
        repr(Fixture(*x, y=y, packed=packed, seed=3))
        == f"Fixture({SMALL!r}, dtype=float32, seed=3)"
    )
