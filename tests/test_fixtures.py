"""Fixture files: the safetensors format, atomic saving, strict loading, and generation."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

import gdn_layout
import gdn_layout.files
import gdn_layout.files._fixture
import gdn_layout.files._mapping
import gdn_layout.files._safetensors
from gdn_layout import GdnBackwardLayout, unpack
from gdn_layout.files import Fixture, FixtureError, GdnInputs, load_fixture, save_fixture
from gdn_layout.generate import draw_inputs, make_fixture, write_suite
from gdn_layout.regimes import REGIME_SINCE, REGIMES

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BF16]
CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
FLAGS = [(False, False), (True, False), (False, True), (True, True)]
generate = importlib.import_module("gdn_layout.generate")
SMALL = GdnBackwardLayout(batch=2, seq=5, heads=3, state_size=4, carry_state=True)


def _dtype_id(dtype: np.dtype[Any]) -> str:
    return dtype.name


def _bits(a: NDArray[Any]) -> NDArray[Any]:
    # Bitwise comparison: works for bfloat16 and tells -0.0 from 0.0.
    return np.ascontiguousarray(a).view(np.uint8)


def _same(a: NDArray[Any] | None, b: NDArray[Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _fixture(layout: GdnBackwardLayout = SMALL, dtype: Any = np.float32, **kw: Any) -> Fixture:
    """A fixture with distinct, cheap values: no reference run needed for format tests."""
    x = draw_inputs(layout, dtype=dtype, seed=7)
    rng = np.random.default_rng(1)
    y = rng.standard_normal(layout.shape("dq")).astype(x.q.dtype)
    packed = rng.standard_normal(layout.total_elems).astype(x.q.dtype)
    return Fixture(*x, y=y, packed=packed, **kw)


def _assert_same_fixture(a: Fixture, b: Fixture) -> None:
    assert a.layout == b.layout
    for name in ("q", "k", "v", "g", "beta", "state", "dy", "y", "packed"):
        assert _same(getattr(a, name), getattr(b, name)), name
    assert (a.regime, a.seed, a.compute_dtype) == (b.regime, b.seed, b.compute_dtype)


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


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize(("per_channel", "carry"), FLAGS)
def test_round_trip(tmp_path: Path, dtype: np.dtype[Any], per_channel: bool, carry: bool) -> None:
    layout = GdnBackwardLayout(2, 5, 3, 4, gate_per_channel=per_channel, carry_state=carry)
    original = _fixture(layout, dtype, regime="strong", seed=3, compute_dtype="float64")
    path = save_fixture(tmp_path / "x.safetensors", original)
    for mmap in (True, False):
        loaded = load_fixture(path, mmap=mmap)
        _assert_same_fixture(loaded, original)
        assert loaded.dtype == dtype
        assert loaded.path == path
        assert loaded.writer_version == gdn_layout.__version__
        assert loaded.metadata() == original.metadata()
        expected = unpack(loaded.packed, layout)
        for name, grad in zip(loaded.layout.names, loaded.grads, strict=False):
            assert np.shares_memory(grad, loaded.packed), name
            assert _same(grad, getattr(expected, name)), name
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
    _assert_same_fixture(load_fixture(save_fixture(tmp_path / "e.safetensors", original)), original)


def test_the_file_layout(saved: Path) -> None:
    raw = saved.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0
    assert raw[8 : 8 + n].rstrip(b" ").endswith(b"}")
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__")
    assert meta["format"] == "gdn-layout-fixture"
    assert meta["format_version"] == "1"
    assert GdnBackwardLayout.from_dict(json.loads(meta["layout"])) == SMALL
    assert (meta["seed"], meta["regime"], meta["gdn_layout_version"]) == (
        "7",
        "mixed",
        gdn_layout.__version__,
    )
    # Sorted by name (one dtype), contiguous from 0 to the end of the file.
    assert list(header) == sorted(header)
    end = 0
    for entry in header.values():
        assert entry["dtype"] == "F32"
        assert entry["data_offsets"][0] == end
        end = entry["data_offsets"][1]
    assert 8 + n + end == len(raw)


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


def test_a_multi_gib_fixture_opens_without_being_read(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(1, 32768, 16, 128, carry_state=True)
    meta = _fixture(regime="zero", seed=0).metadata() | {
        "layout": json.dumps(layout.to_dict()),
    }
    entries: dict[str, Any] = {"__metadata__": meta}
    end = 0
    for name in ("q", "k", "v", "g", "beta", "state", "dy", "y", "packed"):
        shape = (layout.total_elems,) if name == "packed" else _input_shape(layout, name)
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


def _input_shape(layout: GdnBackwardLayout, name: str) -> tuple[int, ...]:
    return layout.shape({"g": "dg", "beta": "dbeta", "state": "dstate"}.get(name, "dq"))


# -- interop with the official safetensors package ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_official_reader_reads_ours(tmp_path: Path, dtype: np.dtype[Any]) -> None:
    original = _fixture(dtype=dtype, regime="mild", seed=2, compute_dtype="float64")
    path = save_fixture(tmp_path / "ours.safetensors", original)
    tensors = safetensors.numpy.load_file(path)
    assert tensors.keys() == original.tensors().keys()
    for name, array in original.tensors().items():
        assert _same(tensors[name], array), name
    with safetensors.safe_open(path, framework="np") as f:
        assert f.metadata() == original.metadata()
        assert _same(f.get_tensor("packed"), original.packed)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_we_read_the_official_writer(tmp_path: Path, dtype: np.dtype[Any]) -> None:
    original = _fixture(GdnBackwardLayout(1, 3, 2, 4, gate_per_channel=True), dtype, seed=5)
    path = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(original.tensors(), path, metadata=original.metadata())
    loaded = load_fixture(path)
    _assert_same_fixture(loaded, original)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
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


def test_save_refuses_an_existing_file(saved: Path) -> None:
    before = saved.read_bytes()
    with pytest.raises(FileExistsError, match=rf"{re.escape(str(saved))} exists.*overwrite=True"):
        save_fixture(saved, _fixture(dtype=np.float64))
    assert saved.read_bytes() == before
    save_fixture(saved, _fixture(dtype=np.float64), overwrite=True)
    assert load_fixture(saved).dtype == np.float64
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]


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


def test_a_failed_tensor_write_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixture = _fixture()
    # Three tensors are written, then the fourth name is one the fixture does not have.
    monkeypatch.setattr(
        gdn_layout.files._safetensors, "data_order", lambda codes: [*sorted(codes)[:3], "nope"]
    )
    with pytest.raises(KeyError, match="nope"):
        save_fixture(tmp_path / "x.safetensors", fixture)
    assert list(tmp_path.iterdir()) == []


def test_save_never_replaces_a_file_that_appears_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "x.safetensors"
    real_fsync = os.fsync

    def racing_fsync(fd: int) -> None:
        real_fsync(fd)
        if not target.exists():
            target.write_bytes(b"theirs")

    monkeypatch.setattr(os, "fsync", racing_fsync)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_fixture(target, _fixture())
    assert target.read_bytes() == b"theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]


def test_save_rejects_what_is_not_a_fixture(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="fixture must be a Fixture, got dict"):
        save_fixture(tmp_path / "x", {"q": np.zeros(3)})  # type: ignore[arg-type]


# -- corrupt files -------------------------------------------------------------------------------


def _fails(path: Path, pattern: str) -> FixtureError:
    with pytest.raises(FixtureError, match=pattern) as info:
        load_fixture(path)
    assert str(path) in str(info.value)
    return info.value


def test_truncated_file(saved: Path) -> None:
    saved.write_bytes(saved.read_bytes()[:-10])
    _fails(saved, r"tensor 'y' occupies bytes \[\d+, \d+\) of the data section, which has only")


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


def test_tensor_byte_range_outside_the_file(saved: Path) -> None:
    def move(h: dict[str, Any]) -> None:
        begin, end = h["y"]["data_offsets"]
        h["y"]["data_offsets"] = [begin + 10**6, end + 10**6]

    _fails(_rewrite(saved, move), r"tensor 'y' occupies bytes .* \(truncated file\?\)")


def test_overlapping_tensors(saved: Path) -> None:
    def alias(h: dict[str, Any]) -> None:
        h["k"]["data_offsets"] = h["dy"]["data_offsets"]

    _fails(_rewrite(saved, alias), "overlaps tensor")


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


@pytest.mark.parametrize("name", ["dy", "packed", "state", "q"])
def test_missing_tensor(saved: Path, name: str) -> None:
    _fails(_rewrite(saved, lambda h: h.pop(name)), rf"missing tensor\(s\) {name} required by")


def test_state_without_carry_state(saved: Path) -> None:
    def no_carry(h: dict[str, Any]) -> None:
        meta = h["__metadata__"]
        meta["layout"] = json.dumps(json.loads(meta["layout"]) | {"carry_state": False})

    _fails(_rewrite(saved, no_carry), r"unexpected tensor\(s\) state for")


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


@pytest.mark.parametrize(
    ("layout", "pattern"),
    [
        ("{not json", "metadata layout '{not json' does not parse"),
        ('{"batch": 2, "seq": 5}', "metadata layout .* does not parse: .*missing"),
        ('{"batch": -1, "seq": 5, "heads": 3, "state_size": 4}', "does not parse: batch"),
        ("[2, 5, 3, 4]", "does not parse: layout data must be a dict"),
    ],
)
def test_layout_metadata_that_does_not_parse(saved: Path, layout: str, pattern: str) -> None:
    _fails(_rewrite(saved, lambda h: h["__metadata__"].update(layout=layout)), pattern)


@pytest.mark.parametrize(
    ("meta", "pattern"),
    [
        ({"layout": None}, "metadata has no layout"),
        ({"format": None}, "not a gdn-layout fixture: metadata format is None"),
        ({"format": "other"}, "metadata format is 'other'"),
        ({"format_version": "2"}, "unsupported format_version '2'; this gdn-layout .* reads '1'"),
        ({"seed": "-3"}, "metadata seed must be a non-negative integer, got '-3'"),
        ({"regime": "wild"}, "regime must be one of"),
        ({"seed": 3}, "__metadata__ must map strings to strings"),
    ],
)
def test_bad_metadata(saved: Path, meta: dict[str, Any], pattern: str) -> None:
    def edit(h: dict[str, Any]) -> None:
        for key, value in meta.items():
            if value is None:
                h["__metadata__"].pop(key)
            else:
                h["__metadata__"][key] = value

    _fails(_rewrite(saved, edit), pattern)


@pytest.mark.parametrize(
    ("code", "pattern"),
    [
        ("F31", "tensor 'q' has unknown dtype 'F31'"),
        ("I32", "tensor 'q' has dtype I32; a fixture holds F64, F32, F16 or BF16"),
        (32, "tensor 'q'.*dtype must be a string, got 32"),
    ],
)
def test_wrong_dtype_string(saved: Path, code: Any, pattern: str) -> None:
    _fails(_rewrite(saved, lambda h: h["q"].update(dtype=code)), pattern)


def test_mixed_dtypes(tmp_path: Path) -> None:
    fixture = _fixture()
    tensors = fixture.tensors() | {"y": fixture.y.astype(np.float64)}
    path = tmp_path / "mixed.safetensors"
    safetensors.numpy.save_file(tensors, path, metadata=fixture.metadata())
    _fails(path, "tensor 'y' has dtype float64, expected float32 like 'q'")


def test_shape_mismatch(saved: Path) -> None:
    b, s, h, n = SMALL.shape("dq")
    _fails(
        _rewrite(saved, lambda hd: hd["v"].update(shape=[b, s, h * n])),
        rf"tensor 'v' has shape \({b}, {s}, {h * n}\), expected \({b}, {s}, {h}, {n}\)",
    )
    _fails(
        _rewrite(saved, lambda hd: hd["v"].update(shape=[b, s, h, n + 1])),
        r"tensor 'v': data_offsets \[\d+, \d+\] span \d+ bytes, but F32 .* needs \d+",
    )


@pytest.mark.parametrize(
    ("entry", "pattern"),
    [
        ([1, 2], "must be an object with exactly dtype, shape and data_offsets"),
        ({"dtype": "F32", "shape": [1]}, "must be an object with exactly"),
        ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, "shape must be a list of"),
        ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, "shape must be a list of"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape must be a list of"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}, "data_offsets must be"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets must be"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0.0, 4]}, "data_offsets must be"),
    ],
)
def test_malformed_entry(saved: Path, entry: Any, pattern: str) -> None:
    _fails(_rewrite(saved, lambda h: h.update(beta=entry)), rf"tensor 'beta'.*{pattern}")


@pytest.mark.slow
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_corrupt_headers_give_a_fixture_error_or_a_consistent_fixture(
    saved: Path, tmp_path: Path, data: st.DataObject
) -> None:
    raw = bytearray(saved.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, 8 + n - 1))
        raw[at] = data.draw(st.integers(0, 255))
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(bytes(raw))
    try:
        loaded = load_fixture(path)
    except FixtureError as err:
        message = str(err)
    else:  # a change the format cannot see (e.g. in the seed): the official reader agrees
        official = safetensors.numpy.load_file(str(path))
        tensors = loaded.tensors()
        assert set(official) == set(tensors)
        for name, array in tensors.items():
            assert _same(official[name], np.asarray(array)), name
        return
    assert message.startswith(f"{path}: ")


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


# -- generation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize(("per_channel", "carry"), FLAGS)
def test_make_fixture_stores_the_answer_for_its_stored_inputs(
    dtype: np.dtype[Any], per_channel: bool, carry: bool
) -> None:
    # One step has a closed form (gated-delta-net.md: c = 1/sqrt(N), S_1 = A*S_0 + outer(k, u) with
    # u = beta * (v - k @ (A*S_0))), computed here from the stored inputs in float64: the
    # fixture must hold it up to the final rounding to its dtype.
    layout = GdnBackwardLayout(2, 1, 3, 4, gate_per_channel=per_channel, carry_state=carry)
    fixture = make_fixture(layout, dtype=dtype, regime="strong", seed=11)
    assert fixture.dtype == dtype
    assert fixture.compute_dtype == "float64"
    assert (fixture.regime, fixture.seed) == ("strong", 11)
    assert all(a.dtype == dtype for a in fixture.tensors().values())
    q, k, v, g, beta, dy = (np.asarray(a, dtype=np.float64) for a in fixture.inputs[:6])
    c, b = 1 / np.sqrt(layout.state_size), beta[..., None]
    decay = np.exp(g)[..., None] if per_channel else np.exp(g)[..., None, None]
    if carry:
        assert fixture.state is not None
        prior = decay[:, 0] * np.asarray(fixture.state, dtype=np.float64)  # [B, H, N, N]
        m = np.einsum("bhi,bhij->bhj", k[:, 0], prior)
        u = (v[:, 0] - m) * b[:, 0]
        state = prior + k[:, 0, :, :, None] * u[:, :, None, :]
        y = c * np.einsum("bhi,bhij->bhj", q[:, 0], state)[:, None]
    else:
        y = c * b * v * (k * q).sum(-1, keepdims=True)
    eps = float(ml_dtypes.finfo(dtype).eps)  # type: ignore[no-untyped-call]
    np.testing.assert_allclose(np.asarray(fixture.y, np.float64), y, rtol=eps, atol=eps)
    if not carry:  # and the gradients of sum(y * dy), by hand
        kq, dyv = (k * q).sum(-1, keepdims=True), (dy * v).sum(-1, keepdims=True)
        expected = {
            "dq": c * b * dyv * k,
            "dk": c * b * dyv * q,
            "dv": c * b * kq * dy,
            "dg": np.zeros(layout.shape("dg")),  # no state before the one step to decay
            "dbeta": c * (dyv * kq)[..., 0],
        }
        for name, value in expected.items():
            got = np.asarray(getattr(fixture.grads, name), np.float64)
            np.testing.assert_allclose(got, value, rtol=eps, atol=eps, err_msg=name)


def test_make_fixture_is_deterministic(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(1, 4, 2, 4, carry_state=True)
    a, b = make_fixture(layout, seed=3), make_fixture(layout, seed=3)
    _assert_same_fixture(a, b)
    assert not _same(make_fixture(layout, seed=4).q, a.q)
    path = save_fixture(tmp_path / "a.safetensors", a)
    _assert_same_fixture(load_fixture(path), a)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("per_channel", [False, True])
def test_draw_inputs_regimes(dtype: np.dtype[Any], per_channel: bool) -> None:
    layout = GdnBackwardLayout(2, 64, 3, 16, gate_per_channel=per_channel, carry_state=True)
    tol = {8: 1e-12, 4: 1e-6, 2: 2e-2}[dtype.itemsize]
    gates = {}
    for regime in REGIMES:
        x = draw_inputs(layout, regime=regime, seed=5, dtype=dtype)
        assert all(a is not None and a.dtype == dtype for a in x)
        assert x.g.shape == layout.shape("dg")
        assert x.state is not None
        for name in ("q", "k"):
            norms = np.linalg.norm(getattr(x, name).astype(np.float64), axis=-1)
            np.testing.assert_allclose(norms, 1.0, atol=tol, err_msg=name)
        beta = x.beta.astype(np.float64)
        assert beta.min() > 0.0
        assert beta.max() < 1.0
        for name in ("v", "dy", "state"):
            values = getattr(x, name).astype(np.float64)
            assert abs(values.mean()) < 0.1, name
            assert 0.9 < values.std() < 1.1, name
        gates[regime] = x.g.astype(np.float64)
    assert not gates["zero"].any()
    assert gates["mild"].max() < 0.0
    assert gates["mild"].min() >= -0.1 - tol
    assert np.exp(gates["mild"]).min() > 0.9
    assert gates["strong"].max() <= -3.0 + tol * 8
    assert gates["strong"].min() >= -8.0 - tol * 8
    assert np.exp(gates["strong"]).max() < 0.051
    mixed = gates["mixed"]
    fractions = [np.mean(mixed == 0), np.mean((mixed < 0) & (mixed > -1)), np.mean(mixed <= -3)]
    assert sum(fractions) == pytest.approx(1.0)
    assert all(0.25 < f < 0.42 for f in fractions), fractions
    extreme = gates["extreme"]
    assert extreme.max() <= -10.0 + tol * 30
    assert extreme.min() >= -30.0 - tol * 30
    assert extreme.std() > 5.0  # spread over the range, not stuck at one end
    # qwen: g = -exp(A_log) * softplus(a + dt_bias), exp(A_log) in [1, 16] per head, so
    # g / -softplus is one constant per head; with a ~ N(0, 1) and |dt_bias| <= 1, softplus
    # lies in (0, 7) and the gates in (-112, 0).
    qwen = gates["qwen"]
    assert qwen.max() < 0.0
    assert qwen.min() > -112.0
    if dtype.itemsize == 8:
        heads = np.moveaxis(qwen, 2, 0).reshape(layout.heads, -1)
        ranges = heads.max(axis=1) - heads.min(axis=1)
        assert (ranges > 0.5).all()  # a varies per step (and per channel)


def test_qwen_gates_decay_at_a_rate_per_head() -> None:
    # -g = exp(A_log) * softplus(a + dt_bias): positive, below 16 * softplus(max a + 1), and
    # with exp(A_log) and dt_bias drawn per head, the heads' typical rates differ.
    for per_channel in (False, True):
        layout = GdnBackwardLayout(3, 40, 4, 4, gate_per_channel=per_channel)
        g = draw_inputs(layout, regime="qwen", seed=2, dtype=np.float64).g
        rates = -np.moveaxis(g, 2, 0).reshape(layout.heads, -1)
        assert (rates > 0).all()
        assert (rates < 16 * 7).all()
        medians = np.median(rates, axis=1)
        assert medians.max() / medians.min() > 1.5


def test_the_suite_s_manifest_lists_its_cases_in_order(suite: tuple[Path, list[Path]]) -> None:
    root, _ = suite
    entries = json.loads((root / "manifest.json").read_text())["fixtures"]
    listed = [(e["file"], e["regime"], e["seed"] - 100) for e in entries]  # written with seed 100
    assert listed == [(c.name, c.regime, i) for i, c in enumerate(generate._suite_cases())]


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
        assert _same(getattr(a, name), getattr(b, name)), name
    assert _same(draw_inputs(base, seed=9).q, a.q)
    assert not _same(draw_inputs(base, seed=10).q, a.q)


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


def test_suite_manifest_lists_every_file(suite: tuple[Path, list[Path]]) -> None:
    root, paths = suite
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["format"] == "gdn-layout-fixture-suite"
    assert manifest["dtype"] == "F32"
    entries = manifest["fixtures"]
    assert sorted(e["file"] for e in entries) == sorted(p.name for p in root.glob("*.safetensors"))
    assert [root / e["file"] for e in entries] == paths
    assert sorted(e["seed"] for e in entries) == list(range(100, 100 + len(entries)))
    for entry in entries:
        path = root / entry["file"]
        fixture = load_fixture(path)
        assert fixture.layout.to_dict() == entry["layout"]
        assert (fixture.regime, fixture.seed) == (entry["regime"], entry["seed"])
        assert CODES[fixture.dtype.name] == entry["dtype"]
        assert entry["bytes"] == path.stat().st_size
        assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_suite_coverage_and_size(suite: tuple[Path, list[Path]]) -> None:
    _root, paths = suite
    fixtures = [load_fixture(p) for p in paths]
    layouts = {f.layout for f in fixtures}
    combos = {(f.layout.gate_per_channel, f.layout.carry_state, f.regime) for f in fixtures}
    assert combos == {(pc, cs, r) for pc in (False, True) for cs in (False, True) for r in REGIMES}
    shapes = {(lay.batch, lay.seq, lay.heads, lay.state_size) for lay in layouts}
    for flags in FLAGS:
        same_flags = {
            (lay.batch, lay.seq, lay.heads, lay.state_size)
            for lay in layouts
            if (lay.gate_per_channel, lay.carry_state) == flags
        }
        assert same_flags == shapes  # every shape in every mode
    assert any(s == 1 for _, s, _, _ in shapes)
    assert any(n == 1 for *_, n in shapes)
    assert any(b > 1 and h > 1 for b, _, h, _ in shapes)
    assert any(s % 64 != 0 and s > 64 for _, s, _, _ in shapes)
    assert any(s % 64 == 1 and s > 64 for _, s, _, _ in shapes)
    total = sum(p.stat().st_size for p in paths)
    assert total < 128 * 2**20
    # The same set in float64 stays within twice that: every tensor byte doubles.
    tensor_bytes = sum(sum(a.nbytes for a in f.tensors().values()) for f in fixtures)
    assert total + tensor_bytes < 256 * 2**20


def test_suite_refuses_to_overwrite(suite: tuple[Path, list[Path]]) -> None:
    root, _ = suite
    with pytest.raises(FileExistsError, match=r"exists and is not empty; pass overwrite=True"):
        write_suite(root)


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
        _assert_same_fixture(stored, again)


def test_a_fixture_opens_with_the_fields_of_its_inputs() -> None:
    """Fixture spells out GdnInputs' fields so that ``fixture.q`` is typed; they stay one list,
    in one order, which ``Fixture.inputs`` and the positional constructor rely on."""
    names = [f.name for f in dataclasses.fields(Fixture)]
    assert names[: len(GdnInputs._fields)] == list(GdnInputs._fields)
    fixture = make_fixture(GdnBackwardLayout(1, 2, 1, 2, carry_state=True), seed=1)
    held = [getattr(fixture, name) for name in GdnInputs._fields]
    assert all(a is b for a, b in zip(fixture.inputs, held, strict=True))


def _seeds(cases: Iterable[Any]) -> dict[str, int]:
    """Each suite case's file name and its seed's offset: file i has seed ``seed + i``."""
    return {case.name: i for i, case in enumerate(cases)}


def test_a_regime_appended_keeps_every_file_of_the_suite_its_name_and_seed() -> None:
    """Adding a gate regime is a change to gdn_layout.regimes alone: one more entry in its
    table, with a revision of its own. The suite gains every shape in it, after all of
    today's files, which keep their names and seeds (and so their bytes); a second regime
    appended after it moves none of the first one's."""
    table = REGIME_SINCE
    revision = max(*table.values(), *(shape.since for shape in generate._SUITE_SHAPES)) + 1
    today = _seeds(generate._suite_cases())
    one = _seeds(generate._suite_cases({**table, "new": revision}))
    two = _seeds(generate._suite_cases({**table, "new": revision, "newer": revision + 1}))
    assert len(today) == len(generate._SUITE_SHAPES) * 2 * 2 * len(REGIMES)
    for before, after, added in ((today, one, "new"), (one, two, "newer")):
        assert {name: after[name] for name in before} == before
        grown = set(after) - set(before)
        assert all(name.endswith(f"-{added}.safetensors") for name in grown)
        assert len(grown) == len(generate._SUITE_SHAPES) * 4  # both gate and state modes
        assert min(after[name] for name in grown) == len(before)


def test_a_shape_appended_keeps_every_file_of_the_suite_its_name_and_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shapes = generate._SUITE_SHAPES
    revision = max(*REGIME_SINCE.values(), *(shape.since for shape in shapes)) + 1
    today = _seeds(generate._suite_cases())
    added = generate._Case("s2", 1, 2, 1, 4, since=revision)
    monkeypatch.setattr(generate, "_SUITE_SHAPES", (*shapes, added))
    grown = _seeds(generate._suite_cases())
    assert {name: grown[name] for name in today} == today
    new = set(grown) - set(today)
    assert len(new) == 4 * len(REGIMES)
    assert all(name.startswith("s2-") for name in new)
