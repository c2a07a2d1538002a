"""Hostile files (docs/files.md, *Loading*): not regular files, headers built to be slow or
large, shapes that cannot exist, mutated fixtures. Each is refused fast with one FixtureError
naming it, in bounded memory, or loads as the official reader reads it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout
from gdn_layout._floors import FLOOR_CLASSES
from gdn_layout.files import (
    FORMAT,
    FORMAT_VERSION,
    FixtureError,
    load_fixture,
    open_packed,
    save_fixture,
)
from gdn_layout.files._safetensors import MAX_HEADER
from gdn_layout.generate import make_fixture
from gdn_layout.regimes import REGIMES
from support import deadline


def _refused(path: Path, pattern: str, seconds: float = 10.0) -> FixtureError:
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
    with deadline(10.0), pytest.raises(FixtureError, match="not a regular file: it is a FIFO"):
        load_fixture(fifo, mmap=mmap)
    with deadline(10.0), pytest.raises(FixtureError, match="it is a FIFO"):
        open_packed(str(fifo))


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        (os.devnull, "not a regular file: it is a character device"),
        (".", "not a regular file: it is a folder"),
        ("loop.safetensors", "cannot be read: "),
    ],
)
def test_what_is_not_a_regular_file_is_refused(tmp_path: Path, name: str, pattern: str) -> None:
    path = tmp_path / name
    if name == "loop.safetensors":
        path.symlink_to(path)
    _refused(path, pattern)


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


def test_a_header_over_the_cap_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = _with_header(tmp_path / "lists.safetensors", b"[" + b"[]," * 3_000_000 + b"[]]")
    tracemalloc.start()
    try:
        start = time.perf_counter()
        _refused(path, r"header is 9000008 bytes, over the 1048576-byte \(1 MiB\) cap")
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # Parsing it would take some 250 MB of Python objects; loading reads the file's bytes alone.
    assert peak < path.stat().st_size + (1 << 20)
    assert elapsed < 1.0


def _fill(head: bytes, piece: bytes, tail: bytes) -> bytes:
    """``head``, then ``piece`` repeated, then ``tail``: a header of at most MAX_HEADER bytes."""
    return head + piece * ((MAX_HEADER - len(head) - len(tail)) // len(piece)) + tail


#: Headers that fill the cap with what is slowest or largest to parse, and how each is refused.
AT_THE_CAP = {
    "deep lists": (b"[" * MAX_HEADER, "header is not usable JSON"),
    "deep objects": (_fill(b"", b'{"a":', b""), "header is not usable JSON"),
    "many lists": (_fill(b"[", b"[],", b"[]]"), "header must be a JSON object, got list"),
    "many commas": (_fill(b"[", b"0,", b"0]"), "header must be a JSON object, got list"),
    "many strings": (_fill(b"[", b'"\\"",', b'""]'), "header must be a JSON object, got list"),
    "many tensors": (_fill(b'{"a":{}', b',"a":{}', b"}"), r"duplicate keys \['a'\]"),
    "many objects": (_fill(b'{"a":[', b"{},", b"{}]}"), "tensor 'a' must be an object"),
}
#: What parsing a header of MAX_HEADER bytes may allocate, whatever it holds (some 25 MiB of
#: Python objects for a million bytes of empty lists or objects).
PARSE_BOUND = 48 * MAX_HEADER


@pytest.mark.slow
@pytest.mark.parametrize("name", AT_THE_CAP)
def test_a_header_at_the_cap_is_parsed_in_bounded_time_and_memory(
    tmp_path: Path, name: str
) -> None:
    header, pattern = AT_THE_CAP[name]
    path = _with_header(tmp_path / "full.safetensors", header)
    assert MAX_HEADER - 8 <= path.stat().st_size - 8 <= MAX_HEADER
    # Refused in what one parse of its bytes costs, give or take: json.loads with a Python
    # hook for every object, as finding duplicate keys takes; measured in the same run and in
    # CPU time (the machine may be shared).
    start = time.process_time()
    _refused(path, pattern)
    refusing = time.process_time() - start
    start = time.process_time()
    with contextlib.suppress(ValueError, RecursionError):
        json.loads(header, object_pairs_hook=lambda pairs: pairs)
    assert refusing < 4 * (time.process_time() - start) + 0.25
    tracemalloc.start()
    try:
        _refused(path, pattern, seconds=10.0)  # tracing slows it down
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PARSE_BOUND


@pytest.mark.parametrize(
    ("header", "pattern"),
    [
        (b'{"a": [[1]]}', "tensor 'a' must be an object"),
        (b'{"a": {"b": [[1]]}}', "tensor 'a' must be an object with exactly dtype, shape and"),
        (
            b'{"q": {"dtype": "F32", "shape": [[[[1]]]], "data_offsets": [0, 4]}}',
            r"tensor 'q': shape must be a list of non-negative integers, got \[\[\[\[1\]",
        ),
        (
            b'{"q": {"dtype": "F32", "shape": [1], "data_offsets": [0, [[4]]]}}',
            r"tensor 'q': data_offsets must be \[begin, end\]",
        ),
        (b'{"__metadata__": {"format": [[[1]]]}}', "__metadata__ must map strings to strings"),
    ],
)
def test_nesting_beyond_a_header_s_is_refused_by_its_schema(
    tmp_path: Path, header: bytes, pattern: str
) -> None:
    # An object of tensors, each an object with two lists of numbers; __metadata__ maps
    # strings to strings.
    _refused(_with_header(tmp_path / "deep.safetensors", header), pattern)


def test_an_integer_of_thousands_of_digits(tmp_path: Path) -> None:
    header = b'{"q": {"dtype": "F32", "shape": [' + b"7" * 5000 + b'], "data_offsets": [0, 4]}}'
    _refused(_with_header(tmp_path / "digits.safetensors", header), "not usable JSON|digits")


# -- what this package writes stays far under the cap ------------------------------------------


def test_the_largest_header_this_package_writes_is_far_under_the_cap(tmp_path: Path) -> None:
    # Every metadata key, at its longest: floors and state floors of every class, the longest
    # regime's name, a 20-digit seed (a layout's numbers add at most some 100 bytes more).
    layout = GdnBackwardLayout(2, 9, 3, 4, gate_per_channel=True, carry_state=True)
    regime = max(REGIMES, key=len)
    made = make_fixture(layout, seed=2**64 - 1, states=4, precisions="all", regime=regime)
    assert made.floors is not None
    assert made.state_floors is not None
    fixture = dataclasses.replace(
        made,
        floors={c: made.floors["float32"] for c in FLOOR_CLASSES},
        state_floors={c: made.state_floors["float32"] for c in FLOOR_CLASSES},
    )
    path = save_fixture(tmp_path / "full.safetensors", fixture)
    assert int.from_bytes(path.read_bytes()[:8], "little") < 4 << 10  # 2.6 KiB
    assert load_fixture(path).floors == fixture.floors


def test_a_header_over_the_cap_is_never_written(tmp_path: Path) -> None:
    small = make_fixture(GdnBackwardLayout(1, 3, 2, 4), calibrate=False)
    fixture = dataclasses.replace(small, compute_dtype="x" * MAX_HEADER)
    with pytest.raises(
        ValueError,
        match=r"^the header would be \d+ bytes, over the 1048576-byte \(1 MiB\) cap; the "
        r"longest metadata value, 'compute_dtype', has 1048576 characters$",
    ):
        save_fixture(tmp_path / "big.safetensors", fixture)
    assert list(tmp_path.iterdir()) == []


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


#: What loading may allocate beyond the file's size (traced by tracemalloc: Python objects
#: and NumPy buffers).
BOUND = 1 << 20
#: Seconds one load may take before it counts as a hang.
HANG = 2.0


def _valid_file() -> bytes:
    layout = GdnBackwardLayout(1, 3, 2, 4, gate_per_channel=True, carry_state=True)
    with tempfile.TemporaryDirectory() as folder:
        path = save_fixture(Path(folder) / "f.safetensors", make_fixture(layout, seed=3))
        return path.read_bytes()


VALID = _valid_file()
HEADER_END = 8 + int.from_bytes(VALID[:8], "little")
#: Pieces that make headers hostile: nesting, strings, escapes, long numbers, other dtypes.
TOKENS = [
    b"[", b"]", b"{", b"}", b'"', b"\\", b",", b":", b"-1", b"1e999", b"null", b"true",
    b"7" * 25, b"7" * 4400, b'"F32"', b'"BF16"', b'"I8"', b'"q":', b"[[[[[[[[", b"0",
    b'"__metadata__":', b'"shape":[4294967296,4294967296,0]', b"\xff\xfe", b" " * 9,
]  # fmt: skip


#: Where the header's numbers are (shapes, offsets, and those inside the metadata strings).
NUMBERS = [m.span() for m in re.finditer(rb"[0-9]+", VALID[8:HEADER_END])]
#: What a number may become.
NUMBER_TOKENS = [b"0", b"-1", b"1.5", b"1e3", b"7" * 25, b"7" * 4400, b"18446744073709551616"]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(VALID)
    if draw(st.booleans()):  # a number of the header replaced, the header's length kept right
        start, stop = draw(st.sampled_from(NUMBERS))
        data[8 + start : 8 + stop] = number = draw(st.sampled_from(NUMBER_TOKENS))
        length = HEADER_END - 8 + len(number) - (stop - start)
        data[:8] = length.to_bytes(8, "little")
    for _ in range(draw(st.integers(0, 4))):
        if not data:
            break
        # Mostly in the header, where a change alters what the file claims.
        end = max(1, min(len(data), HEADER_END) if draw(st.integers(0, 3)) else len(data))
        at = draw(st.integers(0, end - 1))
        kind = draw(st.sampled_from(["flip", "token", "cut", "drop", "length", "repeat"]))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "token":
            data[at:at] = draw(st.sampled_from(TOKENS))
        elif kind == "cut":
            del data[at:]
        elif kind == "drop":
            del data[at : at + draw(st.integers(1, 64))]
        elif kind == "length":
            length = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, len(data))))
            data[:8] = length.to_bytes(8, "little")
        else:  # a stretch of the header repeated, as a writer gone wrong would
            piece = bytes(data[at : at + draw(st.integers(1, 40))])
            data[at:at] = piece * draw(st.integers(2, 200))
    return bytes(data)


@pytest.fixture(scope="module")
def folder() -> object:
    with tempfile.TemporaryDirectory() as name:
        yield Path(name)


def _expire(signum: int, frame: object) -> None:
    raise TimeoutError(f"loading took more than {HANG} s")


@pytest.mark.slow
@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=mutated(), mmap=st.booleans())
def test_loading_a_mutated_fixture(folder: Path, data: bytes, mmap: bool) -> None:
    path = folder / "mutated.safetensors"
    path.write_bytes(data)
    previous = signal.signal(signal.SIGALRM, _expire)
    refusal: FixtureError | None = None
    tracemalloc.start()
    signal.setitimer(signal.ITIMER_REAL, HANG)
    try:
        fixture = load_fixture(path, mmap=mmap)
        assert fixture.packed.shape == (fixture.layout.total_elems,)
        np.asarray(fixture.packed).sum()  # every byte it claims is there
    except FixtureError as error:  # anything else fails the test
        refusal = error
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert refusal is None or str(path) in str(refusal)
    if refusal is None:  # a change the format cannot see (e.g. in the seed): the official agrees
        official = safetensors.numpy.load_file(str(path))
        assert official.keys() == fixture.tensors().keys()
        for name, array in fixture.tensors().items():
            assert official[name].tobytes() == np.asarray(array).tobytes(), name
    assert peak <= len(data) + BOUND, f"{peak} bytes traced for a file of {len(data)}"
