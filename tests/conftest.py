"""Shared test strategies and fixtures.

``st.from_type(GdnBackwardLayout)`` draws small layouts of every gate and state mode, zero
sizes included; registered here so that every test module draws from the same one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout
from gdn_layout.generate import write_suite
from support import shared_folder

# One BLAS thread per process: pytest-xdist's workers already use every core, and more threads
# than cores slow each product down. It takes effect in the workers, started after this runs
# with this environment; not in this process (-n 0), whose NumPy the plugin has loaded.
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

#: pytester runs the gdn-layout pytest plugin on test files of its own (test_pytest_plugin.py).
pytest_plugins = ["pytester"]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs the standard suite is slow: writing it takes 6 to 10 s, once in
    a session."""
    for item in items:
        if {"suite", "suite_bf16"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """The standard suite, written once with seed 100 for every worker: its folder and its
    fixture paths."""

    def make(root: Path) -> list[Path]:
        fractions: list[float] = []
        paths = write_suite(root, seed=100, progress=fractions.append)
        assert fractions == [(i + 1) / len(paths) for i in range(len(paths))]
        return paths

    paths = shared_folder(tmp_path_factory, "suite", make)
    return paths[0].parent, paths


@pytest.fixture
def suite_copied(suite: tuple[Path, list[Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line's ``fixture --suite suite`` copies the session's suite (seed 100, not 0:
    the seeds change a few header bytes, not the size shown) rather than compute all of it a
    second time; a ``verify suite`` after it checks the copy against its manifest."""
    import gdn_layout.cli

    def write_suite(directory: str, **options: object) -> list[Path]:
        assert (directory, options["seed"], options["dtype"]) == ("suite", 0, np.float32)
        shutil.copytree(suite[0], directory)
        return [Path(directory) / path.name for path in suite[1]]

    monkeypatch.setattr(gdn_layout.cli, "write_suite", write_suite)


st.register_type_strategy(
    GdnBackwardLayout,
    st.builds(
        GdnBackwardLayout,
        batch=st.integers(0, 3),
        seq=st.integers(0, 17),
        heads=st.integers(0, 4),
        state_size=st.integers(0, 9),
        gate_per_channel=st.booleans(),
        carry_state=st.booleans(),
    ),
)


@pytest.fixture(scope="session")
def suite_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """The standard suite in bfloat16, written once for every worker."""
    import ml_dtypes

    paths = shared_folder(
        tmp_path_factory, "suite-bf16", lambda root: write_suite(root, dtype=ml_dtypes.bfloat16)
    )
    return paths[0].parent, paths
