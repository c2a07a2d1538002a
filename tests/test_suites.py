"""Suites as test cases: load_suite, verify_suite, a Case's check and `gdn-layout verify` (the
pytest plugin that gives the cases to a kernel's tests is tested in test_pytest_plugin.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdn_layout import GdnBackwardLayout, write_suite
from gdn_layout.cli import main
from gdn_layout.files import FixtureError, load_fixture, save_fixture
from gdn_layout.generate import CHUNK_SIZES, boundaries_crossed
from gdn_layout.layout import layout_caption
from gdn_layout.reference import backward, chunk_states
from gdn_layout.regimes import REGIMES
from gdn_layout.suites import (
    DEFAULT_CHUNK,
    MANIFEST,
    Case,
    load_suite,
    make_case,
    suite_files,
    verify_suite,
)
from support import DeviceArray, Suite, run


def test_load_suite_gives_one_case_per_manifest_entry(suite: Suite) -> None:
    root, paths = suite
    cases = load_suite(root)
    entries = json.loads((root / MANIFEST).read_text())["fixtures"]
    assert [c.name + ".safetensors" for c in cases] == [e["file"] for e in entries]
    assert [c.path for c in cases] == paths
    for case, entry in zip(cases, entries, strict=True):
        assert case.layout == GdnBackwardLayout.from_dict(entry["layout"])
        assert (case.regime, case.seed) == (entry["regime"], entry["seed"])
        assert case.expected.shape == (case.layout.total_elems,)
        assert case.inputs.q.shape == case.layout.input_shape("q")
        assert case.fixture.floors is not None


@pytest.fixture
def copy(suite: Suite, tmp_path: Path) -> Path:
    root = tmp_path / "suite"
    shutil.copytree(suite[0], root)
    return root


def test_verify_lists_every_file_that_differs(copy: Path) -> None:
    assert verify_suite(copy) == []
    files = sorted(copy.glob("*.safetensors"))
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 1
    files[0].write_bytes(bytes(data))
    files[1].unlink()
    with open(files[2], "ab") as extended:
        extended.write(b"\0")
    shutil.copy(files[3], copy / "stray.safetensors")
    problems = verify_suite(copy)
    assert len(problems) == 4
    assert any(p.startswith(f"{files[0].name}: SHA-256 ") for p in problems)
    assert f"{files[1].name}: missing" in problems
    assert any(p.startswith(f"{files[2].name}: ") and "bytes" in p for p in problems)
    assert problems[-1] == "stray.safetensors: not in the manifest"
    with pytest.raises(FixtureError, match=r"4 file\(s\) differ"):
        load_suite(copy)
    document = json.loads((copy / MANIFEST).read_text())
    *_, wider, seeded = document["fixtures"]
    wider["layout"]["heads"] += 1
    seeded["seed"] += 1
    (copy / MANIFEST).write_text(json.dumps(document))
    problems = verify_suite(copy)
    assert any(p.startswith(f"{wider['file']}: has B=") and "manifest says" in p for p in problems)
    assert any(p.startswith(f"{seeded['file']}: seed ") for p in problems)
    with pytest.raises(FixtureError, match=r"not a suite: it has no manifest\.json"):
        verify_suite(copy.parent)


@pytest.mark.slow
def test_cli_verify_exit_codes(
    copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(copy)]) == 0
    count = len(list(copy.glob("*.safetensors")))
    assert capsys.readouterr().out == f"{copy}: {count} fixtures match manifest.json\n"
    victim = sorted(copy.glob("*.safetensors"))[5]
    victim.unlink()
    assert main(["verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert out == f"{copy}: 1 file(s) differ from manifest.json:\n  {victim.name}: missing\n"
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "gdn-layout verify: error:" in capsys.readouterr().err


def test_check_raises_with_the_table_and_the_coordinates() -> None:
    case = make_case(GdnBackwardLayout(1, 6, 2, 4), regime="mild", seed=2)
    assert isinstance(case, Case)
    good = backward(*case.inputs, dtype=np.float32)
    assert case.check(good).passed
    bad = good.copy()
    bad[case.layout.segment("dg").offset + 3] += 1.0
    with pytest.raises(AssertionError) as raised:
        case.check(bad)
    text = str(raised.value)
    assert text.startswith(f"case {case.name}: gradient(s) dg differ")
    assert "compare FAILED (dg)" in text
    assert "dg[0, 1, 1]: actual" in text
    assert case.compare(bad, rtol=1e-9, atol=10.0).passed


def test_check_and_check_states_say_the_device_a_failure_was_read_from() -> None:
    case = make_case(GdnBackwardLayout(1, 20, 2, 4, carry_state=True), regime="mild", seed=2)
    good = backward(*case.inputs, dtype=np.float32)
    assert case.check(DeviceArray(good)).passed  # one copy, read and judged
    bad = good.copy()
    bad[case.layout.segment("dv").offset] += 1.0
    with pytest.raises(AssertionError) as raised:
        case.check(DeviceArray(bad))
    lines = str(raised.value).splitlines()
    assert lines[0] == f"case {case.name}: gradient(s) dv differ"
    assert f"compare FAILED (dv): {layout_caption(case.layout)} (read from cuda:0)" in lines
    h, dh, _ = chunk_states(*case.inputs, chunk=8, dtype=np.float32)
    assert case.check_states(h=DeviceArray(h), dh=DeviceArray(dh), chunk=8)["h"].passed
    h[0, 1] += 1.0
    with pytest.raises(AssertionError, match=rf"^case {case.name}: h \(read from cuda:0\) differ"):
        case.check_states(h=DeviceArray(h), dh=dh, chunk=8)


def _failing(case: Case) -> np.ndarray:
    """A kernel's output for ``case`` with one element of dg off by 1."""
    out = backward(*case.inputs, dtype=np.float32).astype(case.fixture.dtype)
    out[case.layout.segment("dg").offset] += 1.0
    return out


def _redraw_words(text: str) -> list[str]:
    """The arguments of the command the failure ``text`` gives, after ``gdn-layout``."""
    (line,) = [line for line in text.splitlines() if line.startswith("  redraw: gdn-layout ")]
    return shlex.split(line.removeprefix("  redraw: gdn-layout "))


def test_check_names_the_fixture_file_and_the_command_that_redraws_it(tmp_path: Path) -> None:
    made = make_case(GdnBackwardLayout(1, 6, 2, 4), regime="mild", seed=2)
    path = save_fixture(tmp_path / "case.safetensors", made.fixture)
    case = Case("case", load_fixture(path))
    with pytest.raises(AssertionError) as raised:
        case.check(_failing(case))
    text = str(raised.value)
    assert f"  fixture: {path}" in text.splitlines()
    words = _redraw_words(text)
    assert words == ["compare", "--plot", "PICTURE.png", "OUTPUT.npy", str(path)]
    assert "pytest --gdn-save DIR keeps it" in text
    # The command is the comparison's: with the output where the placeholder says, it fails
    # as the check did, and draws the picture.
    np.save(tmp_path / "OUTPUT.npy", _failing(case))
    drawn = run(*words, cwd=tmp_path)
    assert drawn.returncode == 1, drawn.stderr
    assert "compare FAILED (dg)" in drawn.stdout
    assert (tmp_path / "PICTURE.png").stat().st_size > 0
    # The judging asked of check is the command's too.
    with pytest.raises(AssertionError) as raised:
        case.check(_failing(case), rtol={"dg": 1e-3}, atol=0.5, precision="tf32")
    words = _redraw_words(str(raised.value))
    assert words[3:-2] == ["--precision", "tf32", "--rtol", "dg=0.001", "--atol", "0.5"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_keeps_the_output_the_fixture_and_the_picture_whole_in_save_as(
    tmp_path: Path, dtype: str
) -> None:
    made = make_case(GdnBackwardLayout(1, 6, 2, 4), regime="mild", seed=2, dtype=dtype)
    case = dataclasses.replace(made, save_as=tmp_path / "kept" / "test_one")
    out = _failing(case)
    with pytest.raises(AssertionError) as raised:
        case.check(out)
    text = str(raised.value)
    kept = sorted(p.name for p in (tmp_path / "kept").iterdir())  # nothing half-written beside
    assert kept.pop(0) == ".gdn-layout-kept"  # what it wrote, which only it replaces
    suffix = "npy" if dtype == "float32" else "safetensors"  # .npy cannot say bfloat16
    assert kept == ["test_one-fixture.safetensors", f"test_one-output.{suffix}", "test_one.png"]
    for name in kept:
        assert f"  kept: {tmp_path / 'kept' / name} (" in text
    assert "fixture: " not in text  # a case made now has no file of its own
    words = _redraw_words(text)
    picture, output, fixture = (str(tmp_path / "kept" / name) for name in reversed(kept))
    assert words == ["compare", "--plot", picture, "--force", output, fixture]
    assert "OUTPUT.npy" not in text
    # The kept files are the kernel's output and the case: the command judges them as check did.
    assert load_fixture(fixture).packed.tobytes() == case.expected.tobytes()
    drawn = run(*words)
    assert drawn.returncode == 1, drawn.stderr
    assert f"wrote {picture}" in drawn.stdout


def test_check_without_a_file_or_save_as_says_how_to_keep_one() -> None:
    case = make_case(GdnBackwardLayout(1, 6, 2, 4), regime="mild", seed=2)
    with pytest.raises(AssertionError) as raised:
        case.check(_failing(case))
    lines = str(raised.value).splitlines()
    assert lines[-2:] == [
        "",
        "  pytest --gdn-save DIR keeps the kernel's output, this case's fixture and a picture",
    ]


@pytest.mark.slow
def test_load_suite_and_verify_select_by_length_regime_and_boundary(
    suite: Suite, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = suite
    everything = load_suite(root)
    long = load_suite(root, min_seq=256)
    assert {c.layout.seq for c in long} == {c.layout.seq for c in everything if c.layout.seq >= 256}
    assert {c.layout.seq for c in long} == {300, 513}
    qwen = load_suite(root, regime="qwen")
    assert len(qwen) == len(everything) // len(REGIMES)
    assert {c.regime for c in qwen} == {"qwen"}
    crossing = load_suite(root, crossing=256, regime="zero")
    assert {c.layout.seq for c in crossing} == {300, 513}
    assert verify_suite(root, min_seq=256) == []
    assert main(["verify", str(root), "--crossing", "128", "--regime", "mild"]) == 0
    expected = sum(c.layout.seq > 128 for c in everything if c.regime == "mild")
    assert capsys.readouterr().out == f"{root}: {expected} selected fixtures match manifest.json\n"


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"regime": "hot"}, ValueError, "load_suite: regime must be one of"),
        (
            {"crossing": 0},
            ValueError,
            "load_suite: crossing must be a positive integer or None, got 0",
        ),
        (
            {"min_seq": 1.5},
            TypeError,
            "load_suite: min_seq must be a non-negative integer or None, got float 1.5",
        ),
        (
            {"min_seq": -1},
            ValueError,
            "load_suite: min_seq must be a non-negative integer or None, got -1",
        ),
        ({"quick": 1}, TypeError, "load_suite: quick must be a bool, got int 1"),
    ],
)
def test_load_suite_selection_errors(
    suite: Suite, options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        load_suite(suite[0], **options)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda p: os.mkfifo(p), r"its manifest\.json cannot be read \(.*a FIFO"),
        (lambda p: p.mkdir(), r"its manifest\.json cannot be read \(.*a folder"),
        (lambda p: p.write_bytes(b" " * ((64 << 20) + 1)), "its manifest.json is over 64 MiB"),
        (lambda p: p.write_text("[" * 100_000), "its manifest.json is not JSON"),
        (
            lambda p: p.write_text('{"format": "other", "fixtures": []}'),
            "its manifest.json is not one gdn-layout wrote",
        ),
        (
            lambda p: p.write_text(
                json.dumps(
                    {
                        "format": "gdn-layout-fixture-suite",
                        "fixtures": [{"file": "a", "sha256": ""}, {"file": "a", "sha256": ""}],
                    }
                )
            ),
            "its manifest.json is not one gdn-layout wrote",
        ),
    ],
    ids=["fifo", "folder", "huge", "deep", "format", "twice"],
)
def test_a_manifest_is_read_one_way_by_loading_and_by_replacing(
    tmp_path: Path, make: Callable[[Path], object], why: str
) -> None:
    """Loading a suite and deciding whether write_suite may replace a folder read a manifest
    the same way: never opening a FIFO, never reading past the bound."""
    root = tmp_path / "suite"
    root.mkdir()
    make(root / MANIFEST)
    with pytest.raises(FixtureError, match=rf"suite: not a suite: {why}"):
        load_suite(root)
    with pytest.raises(FixtureError, match=rf"suite: not a suite: {why}"):
        verify_suite(root)
    with pytest.raises(FileExistsError, match=rf"suite is not replaced: {why}"):
        write_suite(root, overwrite=True)


# -- the quick set ------------------------------------------------------------------------------


def _quick(entries: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The quick set of a suite of ``entries``, as suite_files selects it from its manifest."""
    with tempfile.TemporaryDirectory() as folder:
        manifest = {"format": "gdn-layout-fixture-suite", "fixtures": list(entries)}
        (Path(folder) / MANIFEST).write_text(json.dumps(manifest))
        chosen = suite_files(folder, quick=True)
    return [e for e in entries if e["file"] in chosen]


def _covered(entries: Sequence[Mapping[str, Any]]) -> set[tuple[Any, ...]]:
    """What the quick set must keep (README.md, *The quick set*): each shape, gate mode, state
    mode and regime, the modes' pairings within and across a DEFAULT_CHUNK boundary, and per
    chunk size of CHUNK_SIZES its first and second boundary crossed and a sequence ending one
    step past one and one step short of one."""
    found: set[tuple[Any, ...]] = set()
    for entry in entries:
        layout = GdnBackwardLayout.from_dict(entry["layout"])
        seq, gate, state = layout.seq, layout.gate_per_channel, layout.carry_state
        rows = entry.get("identical_rows", False)
        shape = (layout.batch, seq, layout.heads, layout.state_size, rows)
        found |= {("shape", shape), ("gate", gate), ("state", state), ("regime", entry["regime"])}
        found.add(("modes", gate, state, seq > DEFAULT_CHUNK))
        for size in CHUNK_SIZES:
            found |= {("crosses", size, n) for n in (1, 2) if boundaries_crossed(seq)[size] >= n}
            if seq > size and seq % size == 1:
                found.add(("one past", size))
            if seq % size == size - 1:
                found.add(("one short", size))
    return found


def _entries(suite: Suite) -> list[dict[str, Any]]:
    return json.loads((suite[0] / MANIFEST).read_text())["fixtures"]  # type: ignore[no-any-return]


def test_the_quick_set_covers_everything_with_the_fewest_cases(suite: Suite) -> None:
    full = _entries(suite)
    quick = _quick(full)
    assert _covered(quick) == _covered(full)
    assert {e["regime"] for e in quick} == set(REGIMES)
    # Each case has one shape, one regime and one pairing of modes: no cover has fewer cases
    # than there are of any of them; and no case of it can be left out.
    bound = max(
        len({p for p in _covered(full) if p[0] == kind}) for kind in ("shape", "regime", "modes")
    )
    assert len(quick) == bound < len(full)
    for i in range(len(quick)):
        assert _covered(quick[:i] + quick[i + 1 :]) < _covered(full), quick[i]["file"]


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_the_quick_set_of_any_part_of_the_suite_covers_that_part(
    suite: Suite, data: st.DataObject
) -> None:
    full = _entries(suite)
    part = data.draw(st.lists(st.sampled_from(full), min_size=1, unique_by=lambda e: e["file"]))
    part.sort(key=full.index)
    quick = _quick(part)
    assert _covered(quick) == _covered(part)
    for i in range(len(quick)):
        assert _covered(quick[:i] + quick[i + 1 :]) < _covered(part)


def test_the_quick_set_keeps_identical_rows_and_unreadable_entries(suite: Suite) -> None:
    one = _entries(suite)[0]
    twin = {**one, "file": "twin", "identical_rows": True}  # a shape of its own
    assert _quick([one, twin]) == [one, twin]
    broken: list[dict[str, Any]] = [
        {"file": "a", "sha256": "", "layout": {"seq": "x"}},
        {"file": "b", "sha256": "", "regime": ["zero"]},
    ]
    assert _quick([one, *broken]) == [one, *broken]  # kept, so that checking them says so


def test_load_suite_verify_and_the_command_line_select_the_quick_set(
    suite: Suite, capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = suite
    entries = _entries(suite)
    names = [e["file"] for e in _quick(entries)]
    assert [c.name + ".safetensors" for c in load_suite(root, quick=True)] == names
    assert verify_suite(root, quick=True) == []
    assert main(["verify", str(root), "--quick"]) == 0
    assert (
        capsys.readouterr().out == f"{root}: {len(names)} selected fixtures match manifest.json\n"
    )
    # After the other selections: the fewest of the mild cases that hold what they hold.
    mild = load_suite(root, quick=True, regime="mild")
    kept = [e for e in entries if e["regime"] == "mild"]
    assert [c.name + ".safetensors" for c in mild] == [e["file"] for e in _quick(kept)]
    assert len(mild) < len(kept)
