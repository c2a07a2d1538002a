"""Kernel outputs in every file kind ``open_packed`` reads, and the report the command line
prints of them."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from gdn_layout import GdnBackwardLayout, __version__, compare, load_fixture, unpack
from gdn_layout.cli import _parser
from gdn_layout.files import FixtureError, open_packed, save_fixture
from gdn_layout.generate import make_fixture
from support import assert_user_error, run

LAYOUT = GdnBackwardLayout(1, 5, 2, 4, carry_state=True)


FLAGS = ["-B", "1", "-S", "5", "-H", "2", "-N", "4", "--carry-state"]


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("out") / "case.safetensors"
    save_fixture(path, make_fixture(LAYOUT, regime="mild", seed=4))
    return path


def _kernel(case: Path) -> np.ndarray:
    out = np.array(load_fixture(case).packed)
    unpack(out, LAYOUT).dk[0, 3, 1, 2] += np.float32(0.5)
    return out


@pytest.mark.parametrize("name", ["packed", "grad"])
def test_a_one_tensor_safetensors_file(case: Path, tmp_path: Path, name: str) -> None:
    out = tmp_path / "kernel.safetensors"
    save_file({name: _kernel(case)}, str(out))  # what a Rust test writes with the crate
    source = open_packed(str(out))
    assert source.kind == "safetensors"
    assert source.layout is None
    against_fixture = run("compare", out, case)
    assert against_fixture.returncode == 1, against_fixture.stderr
    assert re.search(r"^dk\s.*\[0, 3, 1, 2\]\s+FAIL$", against_fixture.stdout, re.MULTILINE)
    with_flags = run("inspect", out, *FLAGS)
    assert with_flags.returncode == 0, with_flags.stderr
    assert with_flags.stdout.startswith(f"{out}: safetensors, float32, B=1 S=5 H=2 N=4")
    assert_user_error(run("inspect", out), "no fixture gives the layout")


def test_packed_is_chosen_among_several_tensors(case: Path, tmp_path: Path) -> None:
    out = tmp_path / "two.safetensors"
    kernel = _kernel(case)
    save_file({"packed": kernel.reshape(1, -1), "other": np.zeros(3, np.float32)}, str(out))
    assert np.array_equal(open_packed(str(out)).packed, kernel)
    save_file({"a": kernel, "b": kernel}, str(out))
    with pytest.raises(FixtureError, match="tensors a, b: name the packed gradient 'packed'"):
        open_packed(str(out))


def test_npy_and_raw_files(case: Path, tmp_path: Path) -> None:
    kernel = _kernel(case)
    np.save(tmp_path / "kernel.npy", kernel)
    kernel.tofile(tmp_path / "kernel.bin")
    for args in (
        ["kernel.npy"],
        ["kernel.bin", "--dtype", "F32"],
        ["kernel.bin", "--dtype", "f32"],
        ["kernel.bin", "--dtype", "single"],
    ):
        result = run("compare", *args, case, cwd=tmp_path)
        assert result.returncode == 1, result.stderr
        assert "compare FAILED (dk)" in result.stdout


def _gradients(case: Path) -> dict[str, np.ndarray]:
    grads = unpack(_kernel(case), LAYOUT)
    return {n: np.array(getattr(grads, n)) for n in LAYOUT.names}


def _read_and_judged(path: Path, kind: str, kernel: np.ndarray, case: Path) -> None:
    """``path`` reads as ``kernel``, of ``kind``, and the command line fails it in dk."""
    source = open_packed(str(path))
    assert source.kind == kind
    assert np.array_equal(source.packed, kernel)
    result = run("compare", path.name, case, cwd=path.parent)
    assert result.returncode == 1, result.stderr
    assert "compare FAILED (dk)" in result.stdout


def test_npz_files(case: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _kernel(case)
    np.savez(tmp_path / "one.npz", kernel)
    np.savez_compressed(tmp_path / "packed.npz", packed=kernel, other=np.zeros(3))
    np.savez(tmp_path / "grads.npz", **_gradients(case))  # type: ignore[arg-type]
    for name in ("one.npz", "packed.npz", "grads.npz"):
        _read_and_judged(tmp_path / name, ".npz", kernel, case)
    # Gradients by name give the layout themselves.
    assert open_packed(str(tmp_path / "grads.npz")).layout == LAYOUT
    named = run("inspect", "grads.npz", cwd=tmp_path)
    assert named.returncode == 0, named.stderr
    np.savez(tmp_path / "bad.npz", a=kernel, b=kernel)
    assert_user_error(
        run("compare", "bad.npz", case, cwd=tmp_path),
        "bad.npz: holds a, b; expected one array, one named 'packed', or the gradients dq, dk, "
        "dv, dg, dbeta (and dstate)",
    )
    grads = _gradients(case)
    grads["dq"] = grads["dq"][:, :2]
    np.savez(tmp_path / "short.npz", **grads)  # type: ignore[arg-type]
    assert_user_error(run("compare", "short.npz", case, cwd=tmp_path), "its gradients do not pack")
    # Members that say they hold more than the memory left are refused before they are read.
    monkeypatch.setattr("gdn_layout.files._outputs.available_memory", lambda: (64, "a test"))
    assert_user_error(
        run("compare", "packed.npz", case, cwd=tmp_path),
        "packed.npz: its 2 members say they hold",
        "in all, more than the 64 B available (a test)",
    )
    monkeypatch.undo()
    grads = _gradients(case)
    del grads["dq"]
    np.savez(tmp_path / "no_dq.npz", **grads)  # type: ignore[arg-type]
    assert_user_error(run("compare", "no_dq.npz", case, cwd=tmp_path), "no_dq.npz: holds dbeta, dg")
    import zipfile

    with zipfile.ZipFile(tmp_path / "text.npz", "w") as archive:
        archive.writestr("readme.txt", "hello")
    assert_user_error(
        run("compare", "text.npz", case, cwd=tmp_path),
        "a zip archive that is neither a .npz (members all .npy) nor a torch.save file; it "
        "holds readme.txt",
    )
    save_file({"packed": kernel}, str(tmp_path / "named.pt"))  # its content, not its name
    assert open_packed(str(tmp_path / "named.pt")).kind == "safetensors"
    (tmp_path / "broken.npz").write_bytes(b"PK\x03\x04 not a zip")
    assert_user_error(run("compare", "broken.npz", case, cwd=tmp_path), "not a .npz or torch.save")


def test_npz_members_are_refused_by_their_sum_before_inflating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "two.npz"
    np.savez_compressed(path, a=np.zeros(1 << 18), b=np.zeros(1 << 18))  # 2 MiB each, inflated
    assert path.stat().st_size < 1 << 16
    monkeypatch.setattr("gdn_layout.files._outputs.available_memory", lambda: (3 << 20, "a test"))
    monkeypatch.setattr(np, "load", lambda *args, **kwargs: pytest.fail("inflated"))
    with pytest.raises(
        ValueError, match=r"two\.npz: its 2 members say they hold 4\.0 MiB in all, more"
    ):
        open_packed(str(path))


class _Payload:
    """A pickled call, which a weights-only load refuses."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.mark.slow  # imports torch: about a second, once per process
def test_a_pickled_payload_in_a_pt_is_refused_in_one_line_and_never_run(
    case: Path, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    marker = tmp_path / "ran"
    torch.save({"packed": _Payload(marker)}, tmp_path / "evil.pt")
    assert_user_error(
        run("compare", "evil.pt", case, cwd=tmp_path),
        "evil.pt: cannot be read by torch.load(weights_only=True), which runs no code from",
        "posix.system",
    )
    assert not marker.exists()


@pytest.mark.slow  # imports torch: about a second, once per process
def test_torch_save_files(case: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    kernel = _kernel(case)
    tensor = torch.from_numpy(kernel.copy()).requires_grad_(True) * 1  # as a backward gives it
    torch.save(tensor, tmp_path / "one.pt")
    torch.save({n: torch.from_numpy(a) for n, a in _gradients(case).items()}, tmp_path / "g.pt")
    torch.save(tensor.detach().to(torch.bfloat16), tmp_path / "half.pt")
    for name in ("one.pt", "g.pt"):
        _read_and_judged(tmp_path / name, ".pt", kernel, case)
    assert open_packed(str(tmp_path / "half.pt")).packed.dtype == ml_dtypes.bfloat16
    torch.save(tensor.detach().to_sparse(), tmp_path / "sparse.pt")
    assert_user_error(
        run("compare", "sparse.pt", case, cwd=tmp_path),
        "sparse.pt: holds torch.sparse_coo under ''; expected a dense tensor",
    )
    torch.save({"packed": [1, 2]}, tmp_path / "list.pt")
    assert_user_error(
        run("compare", "list.pt", case, cwd=tmp_path),
        "list.pt: holds list under 'packed'; expected a dense tensor or a dict of dense",
    )


# -- report clarity ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spellings", "nbytes"),
    [
        (["bfloat16", "bf16", "BF16"], "1248"),
        (["float16", "f16", "F16", "half"], "1248"),
        (["float32", "f32", "F32", "single"], "2496"),
        (["float64", "f64", "F64", "double"], "4992"),
    ],
)
def test_dtype_spellings_everywhere(
    spellings: list[str], nbytes: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # byte counts need no ml_dtypes
    layout = GdnBackwardLayout(2, 3, 4, 8)
    assert [str(layout.nbytes(name)) for name in spellings] == [nbytes] * len(spellings)
    result = run("describe", "-B", "2", "-S", "3", "-H", "4", "-N", "8", "--dtype", spellings[-1])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].split()[-1] == nbytes


def test_dtype_spellings_make_fixtures(tmp_path: Path) -> None:
    result = run("fixture", "-B", "1", "-S", "2", "-H", "1", "-N", "2", "--dtype", "BF16",
                 "-o", tmp_path / "x.safetensors")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "bfloat16" in result.stdout
    assert load_fixture(tmp_path / "x.safetensors").dtype == ml_dtypes.bfloat16


def test_version_and_errors_that_name_the_command(case: Path) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--version"])
    result = run("--version")
    assert result.stdout == f"gdn-layout {__version__}\n"
    assert_user_error(
        run("compare", case, case, "extra"),
        "gdn-layout compare: error: unrecognized arguments: extra",
    )


def test_every_flag_has_help() -> None:
    parser = _parser()
    commands = parser.parse_args(["describe"]).subcommands
    for name, command in [("", parser), *commands.items()]:
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


@pytest.mark.slow
def test_tables_fit_100_columns_unless_wide() -> None:
    # A model-sized layout: the widest coordinates a report shows.
    layout = GdnBackwardLayout(12, 1000, 16, 128, gate_per_channel=True, carry_state=True)
    expected = np.zeros(layout.total_elems, np.float32)
    actual = expected.copy()
    grads = unpack(actual, layout)
    grads.dq[11, 999, 15, 127] = np.nan
    grads.dk[11, 998, 15, 127] = np.inf
    result = compare(actual, expected, layout)
    text = str(result)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "[11, 999, 15, 127]" in text
    assert re.search(r"^dq\s+nan\s", text, re.MULTILINE)
    assert re.search(r"^dk\s+inf\s", text, re.MULTILINE)
    assert "nan a/e" in text.splitlines()[2]
    # The table's note on what it left out, then the findings to the end.
    note = next(i for i, line in enumerate(text.splitlines()) if "left out to fit 100" in line)
    assert text.splitlines()[note + 1].startswith("likely cause: ")
    wide = result.table(wide=True)
    assert max(len(line) for line in wide.splitlines()) > 100
    for header in ("shape", "dtypes", "max rel", "criterion", "error/floor"):
        assert header in wide.splitlines()[1]


def test_the_command_line_prints_the_same_tables(tmp_path: Path) -> None:
    expected = np.zeros(LAYOUT.total_elems, np.float32)
    actual = expected.copy()
    unpack(actual, LAYOUT).dq[0, 4, 1, 3] = np.nan
    result = compare(actual, expected, LAYOUT)
    np.save(tmp_path / "a.npy", actual)
    np.save(tmp_path / "e.npy", expected)
    files = (tmp_path / "a.npy", tmp_path / "e.npy")
    assert run("compare", *files, *FLAGS).stdout == str(result) + "\n"
    assert run("compare", *files, *FLAGS, "--wide").stdout == result.table(wide=True) + "\n"
    data = json.loads(run("compare", *files, *FLAGS, "--json").stdout)
    assert data["grads"][0]["max_abs_error"] == "nan"


def test_a_gradient_prints_as_one_line() -> None:
    expected = np.linspace(-1, 1, LAYOUT.total_elems)
    actual = expected.copy()
    unpack(actual, LAYOUT).dv[0, 1, 1, 2] += 0.5
    grad = compare(actual, expected, LAYOUT)["dv"]
    assert "\n" not in str(grad)
    assert str(grad).startswith("FAIL dv[0, 1, 1, 2]: actual")
    assert str(compare(actual, expected, LAYOUT)["dq"]).startswith("ok dq[")


def test_a_fixture_under_another_name_is_still_read_as_one(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    written = run("fixture", "-B", "1", "-S", "2", "-H", "1", "-N", "2", "-o", path, "--any-suffix")
    assert written.returncode == 0, written.stderr
    shown = run("inspect", path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"{path}: fixture, float32, B=1 S=2 H=1 N=2")


@pytest.mark.parametrize(
    ("dtype", "hint"),
    [(np.int32, ""), (np.complex64, ""), (ml_dtypes.bfloat16, "save the raw bytes")],
    ids=["int32", "complex64", "bfloat16-as-void"],
)
def test_a_npy_that_is_not_floating_is_the_users_error(
    case: Path, tmp_path: Path, dtype: type[np.generic], hint: str
) -> None:
    # np.save writes bfloat16 as void bytes ('|V2'); none of these is a packed gradient.
    path = tmp_path / "kernel.npy"
    np.save(path, np.zeros(LAYOUT.total_elems, dtype=dtype))
    for result in (run("compare", path, case), run("inspect", path, *FLAGS)):
        assert_user_error(result, "a packed gradient has a floating dtype, got")
        assert hint in result.stderr
