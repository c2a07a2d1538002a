"""Mutated valid fixtures: loading raises only FixtureError, never hangs, and never allocates
more than the file's size plus a fixed bound."""

from __future__ import annotations

import re
import signal
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout
from gdn_layout.files import FixtureError, load_fixture, save_fixture
from gdn_layout.generate import make_fixture

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
    max_examples=400,
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
    assert peak <= len(data) + BOUND, f"{peak} bytes traced for a file of {len(data)}"
