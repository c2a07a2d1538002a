"""Files as a hostile user makes them: not regular files, headers built to be slow or large,
numbers and shapes that cannot exist. Each is refused fast, with a FixtureError naming it."""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout
from gdn_layout.files import FORMAT, FORMAT_VERSION, FixtureError, load_fixture, open_packed
from support import deadline


def _refused(path: Path, pattern: str, seconds: float = 2.0) -> FixtureError:
    with deadline(seconds), pytest.raises(FixtureError, match=pattern) as info:
        load_fixture(path)
    assert str(path) in str(info.value)
    return info.value


def _with_header(path: Path, header: bytes) -> Path:
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return path


# -- not a regular file ------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("mmap", [True, False])
def test_a_fifo_is_refused_without_opening_it(tmp_path: Path, mmap: bool) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    with deadline(2.0), pytest.raises(FixtureError, match="not a regular file: it is a FIFO"):
        load_fixture(fifo, mmap=mmap)
    with deadline(2.0), pytest.raises(FixtureError, match="it is a FIFO"):
        open_packed(str(fifo))


def test_a_device_is_refused(tmp_path: Path) -> None:
    if not os.path.exists(os.devnull) or os.name != "posix":
        pytest.skip("no character device to try")
    _refused(Path(os.devnull), "not a regular file: it is a character device")


def test_a_folder_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, "not a regular file: it is a folder")


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    _refused(loop, "cannot be read: ")


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.safetensors"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_fixture(missing)


# -- headers made to be slow or large ----------------------------------------------------------


@pytest.mark.slow
def test_duplicate_keys_are_found_in_linear_time(tmp_path: Path) -> None:
    # 60,000 keys took 46 s with a quadratic check.
    keys = {f"k{i}": "v" for i in range(60_000)}
    text = json.dumps({"__metadata__": keys}).encode()
    start = time.perf_counter()
    _refused(_with_header(tmp_path / "many.safetensors", text), "not a gdn-layout fixture")
    duplicated = text[:-2] + b',"k7":"w"}}'
    _refused(_with_header(tmp_path / "dup.safetensors", duplicated), r"duplicate keys \['k7'\]")
    assert time.perf_counter() - start < 2.0


def test_a_header_of_millions_of_lists_is_refused_before_parsing(tmp_path: Path) -> None:
    path = _with_header(tmp_path / "lists.safetensors", b"[" + b"[]," * 3_000_000 + b"[]]")
    tracemalloc.start()
    try:
        start = time.perf_counter()
        _refused(path, "too large to be read: 3000002 lists and objects")
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Parsing it would take some 250 MB of Python objects; the check takes copies of the bytes.
    assert peak < 3 * path.stat().st_size + (1 << 20)
    assert elapsed < 1.0


@pytest.mark.parametrize(
    ("header", "pattern"),
    [
        (b'{"a": [[1]]}', "tensor 'a' must be an object"),  # 3 deep: on to the entries
        (b'{"a": {"b": [[1]]}}', "nested 4 deep; a safetensors header is at most 3"),
        (b'{"a": "[[[[[[", "b": [1]}', "tensor 'a'"),  # brackets in strings do not count
        (b'{"a": "\\\\\\"[[[[", "b": [1]}', "tensor 'a'"),  # nor after escaped quotes
    ],
)
def test_nesting_is_bounded(tmp_path: Path, header: bytes, pattern: str) -> None:
    _refused(_with_header(tmp_path / "deep.safetensors", header), pattern)


def test_an_integer_of_thousands_of_digits(tmp_path: Path) -> None:
    header = b'{"q": {"dtype": "F32", "shape": [' + b"7" * 5000 + b'], "data_offsets": [0, 4]}}'
    _refused(_with_header(tmp_path / "digits.safetensors", header), "not usable JSON|digits")


# -- shapes that cannot exist -------------------------------------------------------------------


def _empty_fixture_header(layout: GdnBackwardLayout) -> bytes:
    """The header of a fixture of ``layout`` with B=0: every tensor has no bytes."""
    names = ["q", "k", "v", "g", "beta", "dy", "y", "packed"] + ["state"] * layout.carry_state
    shapes = {
        name: (layout.total_elems,) if name == "packed" else layout.input_shape(name)
        for name in names
    }
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "layout": json.dumps(layout.to_dict()),
    }
    entries = {
        name: {"dtype": "F32", "shape": list(shape), "data_offsets": [0, 0]}
        for name, shape in shapes.items()
    }
    return json.dumps({"__metadata__": meta, **entries}).encode()


def test_a_layout_whose_arrays_cannot_exist(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(0, 2**40, 2**40, 2)  # no elements, yet no array has this shape
    path = _with_header(tmp_path / "huge.safetensors", _empty_fixture_header(layout))
    _refused(path, r"tensor '\w+': shape \(0, 1099511627776, 1099511627776(, 2)?\) of F32 cannot")


def test_a_layout_at_the_edge_of_existing_loads(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(0, 2**32, 2**20, 16)  # 2**56 x 4 bytes: can exist
    path = _with_header(tmp_path / "edge.safetensors", _empty_fixture_header(layout))
    fixture = load_fixture(path)
    assert fixture.layout == layout
    assert fixture.grads.dq.shape == (0, 2**32, 2**20, 16)
    assert fixture.packed.dtype == np.float32
