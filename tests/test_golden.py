"""Parity with rlx-ir: every layout quantity equals the Rust seed's, case for case, in the
table ``tests/golden/regenerate.py`` makes by running the seed; the table still is the seed's and
still covers the cases that matter."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gdn_layout import GdnBackwardLayout

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
TABLE_PATH = GOLDEN_DIR / "layout_golden.json"

DIMS = ("batch", "seq", "heads", "state_size")
FLAGS = ("gate_per_channel", "carry_state")
QUANTITIES = [f"{name}_elems" for name in ("qkv", "beta", "gate", "state", "total")] + [
    f"{name}_offset" for name in ("dq", "dk", "dv", "dg", "dbeta", "dstate")
]
USIZE_LIMIT = 1 << 64


def _load_regenerate() -> Any:
    # Loaded by path: tests/golden is deliberately not a package pytest would collect.
    spec = importlib.util.spec_from_file_location("golden_regenerate", GOLDEN_DIR / "regenerate.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REGENERATE = _load_regenerate()
TABLE: dict[str, Any] = json.loads(TABLE_PATH.read_text(encoding="utf-8"))
CASES: list[dict[str, Any]] = TABLE["cases"]


def _case_id(index: int, case: dict[str, Any]) -> str:
    gate = "per-channel" if case["gate_per_channel"] else "per-head"
    carry = "carry" if case["carry_state"] else "no-carry"
    dims = "x".join(str(case[name]) for name in DIMS)
    return f"{index:03d}-{case['label']}-{dims}-{gate}-{carry}"


def _dims(case: dict[str, Any]) -> tuple[int, int, int, int]:
    return (case["batch"], case["seq"], case["heads"], case["state_size"])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(i, case) for i, case in enumerate(CASES)])
def test_layout_matches_rust_seed(case: dict[str, Any]) -> None:
    args = {name: case[name] for name in DIMS + FLAGS}
    if case.get("overflow"):
        with pytest.raises(ValueError, match=r"usize|overflow"):
            GdnBackwardLayout(**args)
        return
    layout = GdnBackwardLayout(**args)
    mismatches = {
        name: (getattr(layout, name), case[name])
        for name in QUANTITIES
        if getattr(layout, name) != case[name]
    }
    assert not mismatches, f"python != rust as (python, rust) for {args}: {mismatches}"
    expected_slices = [tuple(pair) for pair in case["slices"]]
    assert layout.slices() == expected_slices, f"slices differ from rust for {args}"


@pytest.mark.slow
def test_committed_table_matches_seed(tmp_path: Path) -> None:
    seed: Path = REGENERATE.default_seed_path()
    missing = []
    if shutil.which("rustc") is None:
        missing.append("rustc is not on PATH")
    if not seed.is_file():
        missing.append(f"the seed is not found: {REGENERATE.HOW_TO_GET_THE_SEED}")
    if missing:
        pytest.skip("; ".join(missing))
    build_table: Callable[[Path, Path], dict[str, Any]] = REGENERATE.build_table
    regenerated = build_table(seed, tmp_path)
    header = {key: value for key, value in TABLE.items() if key != "cases"}
    assert {k: v for k, v in regenerated.items() if k != "cases"} == header
    assert len(regenerated["cases"]) == len(CASES), "regenerated table has a different size"
    for index, (new, old) in enumerate(zip(regenerated["cases"], CASES, strict=True)):
        assert new == old, f"case {_case_id(index, old)} drifted: seed now gives {new}"


def test_table_covers_the_edge_cases() -> None:
    fitting = [case for case in CASES if not case.get("overflow")]
    overflowing = [case for case in CASES if case.get("overflow")]

    for name in DIMS:
        assert any(case[name] == 0 for case in fitting), f"no fitting case with {name} == 0"

    # Every configuration is recorded under all four flag combinations.
    flags_by_dims: defaultdict[tuple[int, ...], set[tuple[bool, bool]]] = defaultdict(set)
    for case in CASES:
        flags_by_dims[_dims(case)].add((case["gate_per_channel"], case["carry_state"]))
    full = {(False, False), (False, True), (True, False), (True, True)}
    incomplete = [dims for dims, flags in flags_by_dims.items() if flags != full]
    assert not incomplete, f"configurations missing a flag combination: {incomplete[:5]}"

    # The seed's own unit-test config, with the total its test asserts.
    rlx = [c for c in fitting if _dims(c) == (2, 3, 4, 8) and not any(c[f] for f in FLAGS)]
    assert [c["total_elems"] for c in rlx] == [624]
    assert any(_dims(c) == (2, 5, 3, 8) for c in fitting)
    assert any(c["state_size"] >= 128 for c in fitting), "no large-N case"

    totals = [case["total_elems"] for case in fitting]  # past float and int64, to usize::MAX
    assert any(total > 1 << 63 for total in totals), "no total above 2**63"
    assert max(totals) == USIZE_LIMIT - 1, "no total at exactly usize::MAX"

    assert len(overflowing) >= 100, "too few overflow cases"
    # Overflow in a partial product although the full product is small (e.g. a zero dim).
    assert any(
        case["batch"] * case["seq"] * case["heads"] * case["state_size"] < USIZE_LIMIT
        for case in overflowing
    ), "no intermediate-only overflow case"
    # Some configurations fit or overflow depending on the flags alone.
    outcomes: defaultdict[tuple[int, ...], set[bool]] = defaultdict(set)
    for case in CASES:
        outcomes[_dims(case)].add(bool(case.get("overflow")))
    assert sum(len(seen) == 2 for seen in outcomes.values()) >= 5, "no flag-dependent overflow"

    random_cases = [case for case in CASES if case["label"] == "random"]
    assert len(random_cases) == 4 * TABLE["random_configs"] >= 400, "too few random cases"


def test_without_the_seed_the_message_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GDN_SEED", str(tmp_path / "gdn.rs"))
    assert REGENERATE.main() == 1
    said = capsys.readouterr().err
    assert said == f"the seed is not found: {REGENERATE.HOW_TO_GET_THE_SEED}\n"
    assert "GDN_SEED" in said
    assert str(tmp_path) not in said
