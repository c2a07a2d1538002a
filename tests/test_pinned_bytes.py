"""Fixture files are byte for byte what gdn-layout 0.1.0 wrote for the same arguments: ``y``
and the packed gradient are fixed patterns, so the hashes pin the file format and
:func:`draw_inputs`' random streams, not the reference's numerics."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from gdn_layout import GdnBackwardLayout
from gdn_layout.files import Fixture, save_fixture
from gdn_layout.generate import draw_inputs

#: ((B, S, H, N, per channel, carry state), dtype, regime, seed, SHA-256 of the file)
PINNED = [
    ((1, 3, 2, 4, False, False), "float32", "mixed", 0,
     "0454163256bbc7adc34944ad90f503401e3bb32a09b4781830f463080dadefaf"),
    ((2, 5, 3, 8, True, True), "float64", "strong", 11,
     "39b8935fdbc0664c799143d09b62103fc8ce340bf6cb25e9fd7ae8b343727a1a"),
    ((1, 7, 2, 1, False, True), "float16", "mild", 3,
     "9c8dba82170047487b239fd1d4b2bddf67814211f96133e14f4d14239f47b322"),
    ((2, 4, 2, 4, True, False), "bfloat16", "zero", 5,
     "9862d298e19e3f076ccaf3fa5a89f08ef3823b3dd1835feec54266927d24ad90"),
    ((1, 65, 2, 16, False, True), "float32", "mixed", 123,
     "27cc55d0f32cbfae690d1dd7e0c7284722b998a7736d4a5330e1e479e74fef39"),
]  # fmt: skip


@pytest.mark.parametrize(("dims", "dtype", "regime", "seed", "sha256"), PINNED)
def test_fixture_files_are_byte_identical(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dims: tuple[int, int, int, int, bool, bool],
    dtype: str,
    regime: str,
    seed: int,
    sha256: str,
) -> None:
    monkeypatch.setattr(Fixture, "metadata", _metadata_as_of_0_1_0(Fixture.metadata))
    b, s, h, n, per_channel, carry = dims
    layout = GdnBackwardLayout(b, s, h, n, gate_per_channel=per_channel, carry_state=carry)
    x = draw_inputs(layout, regime=regime, seed=seed, dtype=dtype)
    y = (np.arange(x.v.size, dtype=np.float64).reshape(x.v.shape) % 17 / 8 - 1).astype(x.q.dtype)
    packed = (np.arange(layout.total_elems, dtype=np.float64) % 29 / 16 - 0.9).astype(x.q.dtype)
    fixture = Fixture(*x, y=y, packed=packed, regime=regime, seed=seed, compute_dtype="float64")
    path = save_fixture(tmp_path / "pinned.safetensors", fixture)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256


def _metadata_as_of_0_1_0(
    metadata: Callable[[Fixture], dict[str, str]],
) -> Callable[[Fixture], dict[str, str]]:
    # The writer's version is part of the file: pin it to the one the hashes were taken with.
    def pinned(self: Fixture) -> dict[str, str]:
        return {**metadata(self), "gdn_layout_version": "0.1.0"}

    return pinned
