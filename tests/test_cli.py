"""The command line (docs/cli.md), judged by output and exit status: in-process through
``main(argv)``, in a subprocess where the process itself matters."""

from __future__ import annotations

import doctest
import importlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import gdn_layout.cli
import gdn_layout.plot
from gdn_layout import Comparison, GdnBackwardLayout, unpack
from gdn_layout._progress import LINE_STEP
from gdn_layout.cli import _NEXT_STEP, _parser
from gdn_layout.files import load_fixture, save_fixture
from gdn_layout.files._outputs import FILE_KINDS
from gdn_layout.regimes import REGIME_SUMMARIES
from support import assert_user_error, on_a_terminal, run, suite_with_huge_integer

README = Path(__file__).resolve().parents[1] / "README.md"
DIMS = ["-B", "2", "-S", "9", "-H", "3", "-N", "4", "--carry-state"]  # fixture_path's layout


def run_process(
    *args: str | bytes | Path, env: dict[str, str] | None = None, close_stderr: bool = False
) -> subprocess.CompletedProcess[bytes]:
    """``python -m gdn_layout ARGS`` in a subprocess, ``env`` added; fd 2 closed if told."""
    argv: list[str | bytes | Path] = [sys.executable, "-m", "gdn_layout", *args]
    if close_stderr:  # `2>&-`
        argv = ["sh", "-c", 'exec "$0" "$@" 2>&-', *argv]
    environment = {**os.environ, **(env or {})}
    return subprocess.run(argv, capture_output=True, env=environment, timeout=300, check=False)


@pytest.fixture(scope="module")
def fixture_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fx") / "case.safetensors"
    result = run("fixture", *DIMS, "--gate-regime", "zero", "--seed", "7", "-o", path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {path} (")
    return path


def cli(line: object, **options: Any) -> subprocess.CompletedProcess[str]:
    """``gdn-layout LINE`` in this process (words split at spaces: paths hold none here)."""
    return run(*str(line).split(), **options)


def _saved(folder: Path, name: str, packed: Any) -> Path:
    np.save(folder / name, packed)
    return folder / name


def _packed(fixture_path: Path) -> Any:
    return np.array(load_fixture(fixture_path).packed)


def test_the_readme_and_docs_cli_md_show_every_command() -> None:
    # A command added to the parser and not to README.md's table or docs/cli.md fails here.
    commands = sorted(_parser().get_default("subcommands"))
    part = README.read_text().split("## The command line\n", 1)[1].split("\n## ", 1)[0]
    assert sorted(re.findall(r"^\| `([\w-]+)` \|", part, re.MULTILINE)) == commands
    page = (README.parent / "docs" / "cli.md").read_text()
    assert sorted(set(re.findall(r"^## (\S+)$", page, re.MULTILINE)) - {"Conventions"}) == commands


@pytest.mark.usefixtures("suite_copied")
def test_readme_console_sessions_print_what_the_readme_shows(tmp_path: Path) -> None:
    blocks = re.findall(r"```console\n(.*?)```", README.read_text(), re.DOTALL)
    commands = [entry for block in blocks for entry in re.split(r"^\$ ", block, flags=re.M)[1:]]
    assert len(commands) >= 5
    for entry in commands:
        command, _, shown = entry.partition("\n")
        argv = command.split()
        assert argv[0] == "gdn-layout"
        if argv[1] == "compare":  # kernel.npy: case.safetensors with one dk element off by 0.25
            packed = _packed(tmp_path / "case.safetensors")
            unpack(packed, load_fixture(tmp_path / "case.safetensors").layout).dk[0, 2, 1, 3] += (
                0.25
            )
            np.save(tmp_path / "kernel.npy", packed)
        result = run(*argv[1:], cwd=tmp_path)
        assert result.returncode in (0, 1), result.stderr
        if argv[1] == "demo":  # the float32 figures depend on the BLAS: the rest to the letter
            assert result.stdout.startswith(shown.split("3. a float32")[0]), command
            assert "compare passed" in result.stdout
            assert result.stdout.endswith("\n\n" + shown.rsplit("\n\n", 1)[1]), command
        else:  # "..." stands for what the suite's definitions make, a count or a size
            checker = doctest.OutputChecker()
            assert checker.check_output(shown, result.stdout, doctest.ELLIPSIS), result.stdout


def test_describe_json_has_the_layout_numbers() -> None:
    result = cli("describe -B 2 -S 3 -H 4 -N 8 --per-channel --dtype float16 --json")
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    layout = GdnBackwardLayout(2, 3, 4, 8, gate_per_channel=True)
    assert GdnBackwardLayout.from_dict(doc["layout"]) == layout
    assert doc["nbytes"] == 2 * doc["total_elems"] == 2 * (4 * 192 + 24)
    assert [g["name"] for g in doc["gradients"]] == ["dq", "dk", "dv", "dg", "dbeta"]
    assert [(g["offset"], g["length"]) for g in doc["gradients"]] == layout.slices()
    assert doc["gradients"][3]["shape"] == [2, 3, 4, 8]
    assert "B=1 S=2048 H=16 N=128" in run("describe").stdout  # its defaults


def test_the_help_names_every_regime_and_every_file_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens too
    fixture_help = " ".join(run("fixture", "--help").stdout.split())
    for name, text in REGIME_SUMMARIES.items():
        assert f"{name}: {text}" in fixture_help
    for command in ("inspect", "compare"):
        assert FILE_KINDS in " ".join(run(command, "--help").stdout.split())


def test_fixture_writes_a_loadable_file_and_replaces_one_only_if_forced(fixture_path: Path) -> None:
    fx = load_fixture(fixture_path)
    assert fx.layout == GdnBackwardLayout(2, 9, 3, 4, carry_state=True)
    assert (fx.regime, fx.seed) == ("zero", 7)
    assert fx.dtype == np.float32
    assert not np.asarray(fx.g).any()
    before = fixture_path.read_bytes()
    assert_user_error(cli(f"fixture -o {fixture_path}"), f"{fixture_path} exists; pass --force")
    assert fixture_path.read_bytes() == before
    forced = cli(f"fixture -S 2 -o {fixture_path} --force --dtype f64")
    assert forced.returncode == 0, forced.stderr
    assert load_fixture(fixture_path).dtype == np.float64
    fixture_path.write_bytes(before)


def test_fixture_suite_passes_its_flags_to_write_suite(
    suite: tuple[Path, list[Path]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The suite itself is tested in test_generate.py; here, that the command asks for it.
    calls: list[tuple[str, dict[str, object]]] = []

    def spy(folder: str, **options: object) -> list[Path]:
        calls.append((folder, options))
        return suite[1]

    monkeypatch.setattr(gdn_layout.cli, "write_suite", spy)
    result = cli(f"fixture --suite {tmp_path} --seed 100 --dtype float64 --force --quiet")
    assert result.returncode == 0, result.stderr
    [(folder, options)] = calls
    assert (folder, options["dtype"], options["seed"], options["overwrite"]) == (
        str(tmp_path), np.float64, 100, True
    )  # fmt: skip
    size = sum(path.stat().st_size for path in suite[1]) / 2**20
    assert result.stdout == (
        f"wrote {len(suite[1])} fixtures and manifest.json to {tmp_path} ({size:.1f} MiB)\n"
    )


def test_inspect_a_fixture_and_a_raw_file(fixture_path: Path, tmp_path: Path) -> None:
    result = run("inspect", fixture_path)
    assert result.returncode == 0, result.stderr
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dstate"):
        assert re.search(rf"^{name}\s", result.stdout, re.MULTILINE), name
    doc = json.loads(run("inspect", fixture_path, "--json").stdout)
    dk = next(g for g in doc["gradients"] if g["name"] == "dk")
    assert (dk["max"], dk["nan"]) == (np.max(load_fixture(fixture_path).grads.dk), 0)
    layout = GdnBackwardLayout(1, 3, 2, 4)
    flat = np.arange(layout.total_elems, dtype=np.float32)
    flat[layout.dbeta_offset + 1] = np.nan
    flat.tofile(tmp_path / "g.bin")
    result = cli(f"inspect {tmp_path / 'g.bin'} --dtype f32 -B 1 -S 3 -H 2 -N 4 --json")
    assert result.returncode == 0, result.stderr
    rows = {g["name"]: g for g in json.loads(result.stdout)["gradients"]}
    assert rows["dbeta"]["nan"] == 1
    assert rows["dq"]["max"] == float(unpack(flat, layout).dq.max())


def test_compare_exit_status_follows_the_verdict_and_names_the_cause(
    fixture_path: Path, tmp_path: Path
) -> None:
    fx = load_fixture(fixture_path)
    assert run("compare", _saved(tmp_path, "good.npy", fx.packed), fixture_path).returncode == 0
    bad = _packed(fixture_path)
    unpack(bad, fx.layout).dk[1, 4, 2, 3] += 1.0
    result = run("compare", _saved(tmp_path, "bad.npy", bad), fixture_path)
    assert result.returncode == 1
    assert "[1, 4, 2, 3]" in result.stdout
    doc = json.loads(run("compare", tmp_path / "bad.npy", fixture_path, "--json").stdout)
    assert doc["passed"] is False
    assert [g["name"] for g in doc["grads"] if not g["passed"]] == ["dk"]
    flipped = _packed(fixture_path)
    unpack(flipped, fx.layout).dq[...] *= -1
    result = run("compare", _saved(tmp_path, "flipped.npy", flipped), fixture_path)
    cause = "dq is -1.000 x expected (a sign flip?)"
    assert result.returncode == 1
    assert result.stdout.rstrip().splitlines()[-1] == f"likely cause: {cause}"
    doc = json.loads(run("compare", tmp_path / "flipped.npy", fixture_path, "--json").stdout)
    (finding,) = doc["findings"]
    assert (finding["kind"], finding["gradient"], finding["text"]) == ("scale", "dq", cause)
    assert finding["details"]["factor"] == -1.0
    noisy = _saved(tmp_path, "noisy.npy", _packed(fixture_path) * np.float32(1.001))
    assert run("compare", noisy, fixture_path).returncode == 1
    result = run("compare", noisy, fixture_path, "--max-rms-ratio", "0.01")
    assert result.returncode == 0, result.stderr
    assert "rms ratio<=0.01" in result.stdout


def test_compare_judges_in_the_precision_class_asked(fixture_path: Path, tmp_path: Path) -> None:
    coarse = _packed(fixture_path).astype(ml_dtypes.bfloat16).astype(np.float32)
    kernel = _saved(tmp_path, "bf16.npy", coarse)  # float32 buffers, bfloat16 figures
    assert cli(f"compare {kernel} {fixture_path}").returncode == 1
    passed = cli(f"compare {kernel} {fixture_path} --precision bf16")
    assert passed.returncode == 0, passed.stdout
    assert "(bfloat16)" in passed.stdout
    # A raw float32 output against the float64 fixture: judged in float64, a stray cast.
    flags = ["-B", "1", "-S", "6", "-H", "2", "-N", "4", "--per-channel", "--dtype", "float64"]
    assert run("fixture", *flags, "-o", tmp_path / "f64.safetensors").returncode == 0
    _packed(tmp_path / "f64.safetensors").astype(np.float32).tofile(tmp_path / "kernel.bin")
    files: list[str | Path] = [tmp_path / "kernel.bin", tmp_path / "f64.safetensors"]
    files += ["--dtype", "float32"]
    assert_user_error(run("compare", *files), "--precision float32 on the command line")
    result = run("compare", *files, "--precision", "float32")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "float32 against float64" in result.stdout


def test_compare_plot_refuses_before_the_work(
    fixture_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "old.png").write_bytes(b"precious")
    for picture, message in [
        (tmp_path / "nowhere" / "e.png", "e.png: the folder"),
        (tmp_path / "e.foo", "by its suffix"),
        (tmp_path, "by its suffix"),
        (tmp_path / "folder.png", "is a folder"),
        (tmp_path / "old.png", f"{tmp_path / 'old.png'} exists; pass --force to replace it"),
    ]:
        result = run("compare", fixture_path, fixture_path, "--plot", picture)
        assert_user_error(result, message)
        assert result.stdout == "", "the report waits until the picture can be written"
    assert (tmp_path / "old.png").read_bytes() == b"precious"
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
        result = run("compare", fixture_path, fixture_path, "--plot", tmp_path / "e.png")
    assert_user_error(
        result, "pip install 'gdn-layout[plot]' (from a clone: pip install '.[plot]')"
    )
    drawn: list[tuple[Comparison, object, object]] = []
    spy = lambda r, path, chunk=None: drawn.append((r, path, chunk))  # noqa: E731
    monkeypatch.setattr(gdn_layout.plot, "plot_errors", spy)
    result = cli(
        f"compare {fixture_path} {fixture_path} --plot {tmp_path / 'old.png'} --force --chunk 4"
    )
    assert result.returncode == 0, result.stderr
    [(comparison, path, chunk)] = drawn
    assert (comparison.passed, comparison.layout, path, chunk) == (
        True, load_fixture(fixture_path).layout, str(tmp_path / "old.png"), 4
    )  # fmt: skip
    assert result.stdout.endswith(f"wrote {tmp_path / 'old.png'}\n")


@pytest.mark.slow
def test_plot_errors_replaces_its_file_whole(fixture_path: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "errors.png"
    png.write_bytes(b"old")
    result = run("compare", fixture_path, fixture_path, "--plot", png, "--force")
    assert result.returncode == 0, result.stderr
    assert png.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["errors.png"]


@pytest.mark.slow  # imports torch: about a second, once per process
def test_compare_refuses_a_tensor_numpy_cannot_read(fixture_path: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    float8 = torch.from_numpy(_packed(fixture_path)).to(torch.float8_e4m3fn)
    torch.save({"packed": float8}, tmp_path / "k.pt")
    assert_user_error(
        run("compare", tmp_path / "k.pt", fixture_path),
        "k.pt['packed'] must be an array NumPy can read (a NumPy dtype or bfloat16, in memory "
        "it can be copied from), got a Tensor of dtype torch.float8_e4m3fn on device cpu",
    )


RAW = "--dtype float32 -B 1 -S 1 -H 1 -N 1"
ZEROS = f"compare {{tmp}}/z.bin {{tmp}}/z.bin {RAW}"  # judged by compare(): its flags named

# fmt: off
USER_ERRORS = [
    ("describe --seq -3", "expected a non-negative integer, got '-3'"),
    ("describe --dtype int8", "a floating dtype (bfloat16/bf16"),
    ("fixture --gate-regime wild -o x", "invalid choice: 'wild'"),
    (f"describe -N {2**64}", f"error: --state-size must fit in a 64-bit usize, got {2**64}"),
    (f"fixture -S 4 --states {10**20} -o {{tmp}}/x.safetensors",
     "error: --states must be an integer from 1"),
    ("fixture -o {tmp}/x.npy",
     "gdn-layout fixture: error: {tmp}/x.npy: a fixture is a safetensors file"),
    ("fixture -o {tmp}/nowhere/x.safetensors", "{tmp}/nowhere/x.safetensors: the folder"),
    ("fixture --suite {tmp}/s -S 3 --gate-regime zero",
     "--suite writes its own layouts and regimes; drop --seq, --gate-regime"),
    ("fixture -B 100000 -S 100000 -H 64 -N 128 -o {tmp}/x.safetensors", "PiB of memory"),
    ("fixture -S 10000000 -o {tmp}/x.safetensors",
     "B=2 S=10000000 H=3 N=16, per-head gate, no state needs about … GiB of memory, but "),
    ("demo -S 10000000", "needs about … is available"),
    ("inspect {tmp} -B 1 -S 1 -H 1 -N 1", "{tmp}: not a regular file: it is a folder"),
    ("inspect {tmp}/g.npy", "no fixture gives the layout"),
    ("inspect {tmp}/g.bin -B 1 -S 1 -H 1 -N 1", "needs --dtype"),
    ("inspect {tmp}/g.npy -B 1 -S 4 -H 2 -N 4",
     "g.npy: 10 elements, but GdnBackwardLayout(batch=1, seq=4"),
    (f"inspect {{tmp}}/damaged.npy {RAW}", "not a .npy file"),
    (f"inspect {{tmp}}/objects.npy {RAW}", "objects.npy: cannot be read as a packed"),
    (f"inspect {{tmp}}/g.bin --dtype f32 -B 0 -S {2**40} -H {2**40} -N 2",
     "which no array can have"),
    ("compare {tmp}/nope.npy {fx}", "nope.npy: no such file"),
    ("compare {tmp}/g.npy {fx}", "g.npy: 10 elements"),
    ("compare {tmp}/junk.safetensors {fx}", "junk.safetensors: truncated"),
    ("compare {fx} {fx} -B 1 -S 9 -H 3 -N 4", "but the flags give"),
    ("compare {fx} {fx} --rtol tight", "--rtol"),
    ("compare {fx} {fx} --atol dk=1,dk=2", "named twice"),
    ("compare {fx} {fx} --precision fp8",
     "--precision: the precision must be one of float64, float32, tf32, "),
    ("compare {tmp}/bf16.bin {fx} --dtype bf16 --precision float32",
     "--precision 'float32' judges float32 buffers, got bfloat16 ones, whose rounding alone "
     "exceeds its floors; pass --precision='bfloat16' or a coarser class"),
    ("inspect {tmp}/pipe.safetensors", "pipe.safetensors: not a regular file: it is a FIFO"),
    ("verify {tmp}/suite", "manifest.json is not JSON … digits"),
    (f"{ZEROS} --rtol -1", "error: --rtol must be a finite float >= 0, got -1.0"),
    (f"{ZEROS} --atol dq=nan", "error: --atol['dq'] must be a finite float >= 0, got nan"),
    (f"{ZEROS} --max-rms-ratio dz=1e-3",
     "error: --max-rms-ratio has unknown gradient names ['dz']; "
     "expected names among dq, dk, dv, dg, dbeta, dstate"),
]
# fmt: on


@pytest.mark.parametrize(("argv", "message"), USER_ERRORS, ids=[argv for argv, _ in USER_ERRORS])
def test_user_errors_are_one_line(
    argv: str, message: str, fixture_path: Path, tmp_path: Path
) -> None:
    np.save(tmp_path / "g.npy", np.zeros(10, np.float32))
    (tmp_path / "g.bin").write_bytes(b"")
    (tmp_path / "z.bin").write_bytes(b"\0" * 4 * 5)
    (tmp_path / "damaged.npy").write_bytes(b"\x93NUM")
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00")
    np.save(tmp_path / "objects.npy", np.array([{}], dtype=object), allow_pickle=True)
    _packed(fixture_path).astype(ml_dtypes.bfloat16).tofile(tmp_path / "bf16.bin")
    os.mkfifo(tmp_path / "pipe.safetensors")
    suite_with_huge_integer(tmp_path / "suite", fixture_path)  # more digits than Python reads
    before = sorted(tmp_path.iterdir())
    told = {"tmp": str(tmp_path), "fx": str(fixture_path)}
    assert_user_error(cli(argv.format(**told)), *message.format(**told).split(" … "))
    assert sorted(tmp_path.iterdir()) == before, "nothing written"


def test_bfloat16_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` fail
    result = cli(f"fixture --dtype bf16 -o {tmp_path / 'x.safetensors'}")
    assert_user_error(
        result, "pip install 'gdn-layout[bfloat16]' (from a clone: pip install '.[bfloat16]')"
    )
    assert cli("describe --dtype bfloat16").returncode == 0  # byte counts need no extra


@pytest.mark.parametrize("shape", [(2**64,), (2**32, 2**32)])
@pytest.mark.parametrize("command", ["inspect", "compare"])
def test_npy_header_claiming_an_impossible_shape_is_a_user_error(
    tmp_path: Path, shape: tuple[int, ...], command: str
) -> None:
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:
        np.lib.format.write_array_header_1_0(
            file, {"descr": "<f4", "fortran_order": False, "shape": shape}
        )
    args = [path, path] if command == "compare" else [path]
    result = run(command, *args, "-B", "1", "-S", "1", "-H", "1", "-N", "1")
    assert_user_error(result, str(path), f"shape {shape}", "float32")
    if command == "inspect" and len(shape) == 2:  # numpy's warnings add no line
        done = run_process("inspect", path)
        assert done.returncode == 2
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_a_bug_exits_1_with_a_traceback_from_the_entry_point() -> None:
    script = (
        "import sys, gdn_layout.cli as cli\n"
        "def broken(*args): raise ValueError('a bug inside the library')\n"
        "cli.layout_text = broken\n"
        "sys.exit(cli.main(['describe']))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 1
    assert b"Traceback" in done.stderr
    assert b"ValueError: a bug inside the library" in done.stderr


def test_demo_runs_the_main_job(tmp_path: Path) -> None:
    result = run("demo", "-S", "8", cwd=tmp_path, terminal=True)
    assert result.returncode == 0, result.stderr
    assert "float64 reference [" in result.stderr
    assert "float32 recomputation [" in result.stderr
    assert "compare passed" in result.stdout
    assert result.stdout.endswith(f"ok\n\n{_NEXT_STEP}\n"), "the next step, last"
    assert list(tmp_path.iterdir()) == [], "the demo cleans up after itself"
    assert run("demo", "-S", "4", "--quiet", terminal=True).stderr == ""


def test_the_demo_s_next_step_names_commands_that_exist() -> None:
    pytest_plugin = importlib.import_module("gdn_layout.pytest_plugin")
    command = re.search(r"gdn-layout (fixture [^;]*?) makes", _NEXT_STEP)
    assert command is not None
    assert _parser().parse_args(command.group(1).split()).suite == "suite"
    options = set(re.findall(r"--gdn-[\w-]+", _NEXT_STEP))
    assert options == {"--gdn-suite", "--gdn-quick"}
    assert all(f'"{option}"' in inspect.getsource(pytest_plugin) for option in options)


def test_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    flags = ["-B", "1", "-S", "40", "-H", "2", "-N", "4"]
    shown = run("fixture", *flags, "-o", tmp_path / "a.safetensors", terminal=True)
    assert shown.returncode == 0
    assert "reference backward [" in shown.stderr
    assert "100%" in shown.stderr
    assert shown.stderr.endswith("\r\x1b[K")  # the bar is cleared when done
    quiet = run("fixture", *flags, "-o", tmp_path / "b.safetensors", "-q", terminal=True)
    assert (quiet.returncode, quiet.stderr) == (0, "")
    piped = run("fixture", *flags, "-o", tmp_path / "c.safetensors")  # stderr is no terminal
    assert (piped.returncode, piped.stderr) == (0, "")


def test_a_suite_s_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    generate = importlib.import_module("gdn_layout.generate")
    monkeypatch.setattr(generate, "_SUITE_SHAPES", generate._SUITE_SHAPES[:1])
    count = len(list(generate._suite_cases()))
    logged = run("fixture", "--suite", tmp_path / "a", "--workers", "1")
    assert logged.returncode == 0, logged.stderr
    lines = logged.stderr.splitlines()
    assert all(re.fullmatch(r"suite: \d+% \(\d+ s\)", line) for line in lines), lines
    percents = [int(line.split()[1].rstrip("%")) for line in lines]
    assert percents == sorted(percents)
    assert percents[-1] == 100
    assert len(lines) >= min(count, round(1 / LINE_STEP))  # one at every tenth at least
    shown = run("fixture", "--suite", tmp_path / "b", "--workers", "1", terminal=True)
    assert shown.returncode == 0
    assert "\rsuite [" in shown.stderr
    assert "] 100%" in shown.stderr
    assert shown.stderr.endswith("\r\x1b[K")
    for terminal in (False, True):
        quiet = run("fixture", "--suite", tmp_path / f"q{terminal}", "-q", terminal=terminal)
        assert (quiet.returncode, quiet.stderr) == (0, "")


@pytest.mark.slow
def test_the_entry_point_runs_in_a_process_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "x.st"
    done = run_process(
        "fixture", "-B", "1", "-S", "3", "-H", "1", "-N", "2", "-o", out, "--any-suffix"
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == b""  # no progress bar into a pipe
    assert done.stdout.startswith(f"wrote {out} (".encode())
    assert load_fixture(out).layout == GdnBackwardLayout(1, 3, 1, 2)
    argv = ["fixture", "-B", "1", "-S", "8", "-H", "1", "-N", "2", "-o", "y.safetensors"]
    code, shown = on_a_terminal([sys.executable, "-m", "gdn_layout", *argv], tmp_path, stdout=False)
    assert code == 0
    assert "reference backward [" in shown  # a real terminal gets the bar


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="bytes file names are POSIX's")
@pytest.mark.parametrize("encoding", ["ascii:strict", "utf-8:strict"])
def test_names_that_cannot_be_encoded_are_printed_escaped(
    tmp_path: Path, fixture_path: Path, encoding: str
) -> None:
    undecodable = os.path.join(os.fsencode(tmp_path), b"\xff.safetensors")
    with open(undecodable, "wb") as file:
        file.write(fixture_path.read_bytes())
    env = {"PYTHONIOENCODING": encoding}
    done = run_process("inspect", undecodable, env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"\\udcff.safetensors: fixture, float32" in done.stdout
    done = run_process("inspect", os.path.join(os.fsencode(tmp_path), b"nope-\xff.npy"), env=env)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert b"\\udcff" in done.stderr
    assert b"no such file" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_a_closed_stderr_disables_progress_and_keeps_the_exit_status(tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    done = run_process("fixture", "-S", "4", "-o", out, close_stderr=True)
    assert done.returncode == 0
    assert done.stdout.startswith(f"wrote {out}".encode())
    assert run_process("demo", "-S", "4", close_stderr=True).returncode == 0
    # An error has nowhere to go, and does not go to stdout; the status still says it.
    for argv in (["inspect", str(tmp_path / "nowhere.npy")], ["describe", "--seq", "x"]):
        done = run_process(*argv, close_stderr=True)
        assert (done.returncode, done.stdout) == (2, b"")


def _interrupted(
    argv: list[str], folder: Path, sig: int, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``gdn-layout ARGV``, send it ``sig`` once it has made a temporary in ``folder``,
    and wait: its exit status and stderr."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gdn_layout", *argv],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(folder.iterdir()) and time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            time.sleep(0.05)
        assert any(folder.iterdir()), "no temporary was made"
        time.sleep(0.4)  # well into the work
        process.send_signal(sig)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, stderr


@pytest.mark.slow
def test_ctrl_c_during_a_suite_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    code, stderr = _interrupted(
        ["fixture", "--suite", str(tmp_path / "suite")], tmp_path, signal.SIGINT
    )
    assert code == 128 + signal.SIGINT, stderr
    *progress, last = stderr.splitlines()
    assert last == "gdn-layout: interrupted"
    assert all(line.startswith("suite: ") for line in progress)  # a log's progress lines
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX")
def test_sigterm_during_demo_removes_its_temporary_folder(tmp_path: Path) -> None:
    argv = ["demo", "-B", "2", "-S", "4096", "-H", "8", "-N", "64"]
    code, stderr = _interrupted(argv, tmp_path, signal.SIGTERM, env={"TMPDIR": str(tmp_path)})
    assert code == 128 + signal.SIGTERM, stderr
    assert list(tmp_path.iterdir()) == []


def test_main_restores_the_sigterm_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert run("describe", "-S", "2").returncode == 0
    assert signal.getsignal(signal.SIGTERM) is before


def _small_suite(root: Path) -> list[str]:
    """A suite of a few small cases, written as ``write_suite`` writes one: their names."""
    from gdn_layout.files._manifest import MANIFEST, manifest_entry, manifest_text
    from gdn_layout.generate import make_fixture

    root.mkdir()
    entries, names = [], []
    for seed, (seq, carry) in enumerate([(1, False), (3, False), (3, True), (5, True)]):
        layout = GdnBackwardLayout(1, seq, 2, 4, carry_state=carry)
        name = f"s{seq}-{'state' if carry else 'nostate'}"
        path = root / f"{name}.safetensors"
        save_fixture(path, make_fixture(layout, regime="mild", seed=seed, precisions="all"))
        entry = manifest_entry(
            path.name, path.read_bytes(), layout=layout.to_dict(), regime="mild", seed=seed
        )
        entries.append(entry)
        names.append(name)
    (root / MANIFEST).write_bytes(manifest_text(entries))
    return names


def _outputs(suite: Path, outputs: Path, names: list[str], bug: bool = False) -> None:
    """Each case's float32 output in ``outputs``; with ``bug``, dstate doubled."""
    from gdn_layout.reference import backward

    outputs.mkdir(exist_ok=True)
    for name in names:
        fixture = load_fixture(suite / f"{name}.safetensors")
        out = backward(*fixture.inputs, dtype=np.float32)
        dstate = unpack(out, fixture.layout).dstate
        if bug and dstate is not None:
            dstate[...] *= 2
        np.save(outputs / f"{name}.npy", out)


def test_compare_a_folder_of_outputs_with_a_suite(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    suite, outputs = tmp_path / "suite", tmp_path / "outputs"
    names = _small_suite(suite)
    _outputs(suite, outputs, names)
    (outputs / f"{names[2]}.npy.json").write_text("{}")  # a sidecar is no second output
    (outputs / "x\nall 4 cases passed").write_text("")  # nor can a name forge a summary line
    correct = run("compare", outputs, suite)
    assert (correct.returncode, correct.stderr) == (0, "")
    assert correct.stdout.splitlines()[0].startswith(f"all {len(names)} cases passed")
    assert "--dtype float64" in correct.stdout
    assert correct.stdout.splitlines()[-1] == "not a case of the suite: x\\nall 4 cases passed"
    assert correct.stdout.count("all 4 cases passed") == 2  # the summary's, and the name's
    (outputs / "x\nall 4 cases passed").unlink()
    # A bug only with a carried state; one output as a plain safetensors file, one missing.
    _outputs(suite, outputs, names, bug=True)
    save_file(
        {"packed": np.load(outputs / f"{names[0]}.npy")}, str(outputs / f"{names[0]}.safetensors")
    )
    (outputs / f"{names[0]}.npy").unlink()
    (outputs / f"{names[1]}.npy").unlink()
    (outputs / "notes.txt").write_text("")
    result = run("compare", outputs, suite)
    carried = sum("-state" in n for n in names)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stderr
    never = "dq, dk, dv, dg, dbeta never fail"
    assert lines[0] == f"{carried} of {len(names) - 1} cases failed: dstate {carried}; {never}"
    assert "  fails only with a carried state" in lines[1:3]
    assert lines[-2:] == [f"no output for case {names[1]}", "not a case of the suite: notes.txt"]
    # Every output there passes but some are missing: exit 1 all the same.
    (outputs / f"{names[0]}.safetensors").unlink()
    (outputs / f"{names[2]}.npy.json").unlink()
    _outputs(suite, outputs, names)
    for name in names[2:]:
        (outputs / f"{name}.npy").unlink()
    passed = run("compare", outputs, suite)
    assert passed.returncode == 1
    assert passed.stdout.splitlines()[0].startswith("all 2 cases passed")
    assert passed.stdout.count("no output for case") == 2


def test_compare_a_folder_user_errors(tmp_path: Path) -> None:
    from gdn_layout.files._manifest import MANIFEST, manifest_text

    suite, outputs = tmp_path / "suite", tmp_path / "outputs"
    names = _small_suite(suite)
    outputs.mkdir()
    assert_user_error(
        run("compare", outputs, suite / f"{names[0]}.safetensors"),
        "EXPECTED must be a suite's folder",
    )
    assert_user_error(run("compare", outputs, suite, "--rtol", "1e-3"), "drop --rtol")
    assert_user_error(run("compare", outputs, suite, "--tensor", "y"), "drop --tensor")
    np.save(outputs / f"{names[0]}.npy", np.zeros(3, np.float32))
    assert_user_error(run("compare", outputs, suite), "3 elements")
    np.save(outputs / f"{names[0]}.npz", np.zeros(3, np.float32))  # named s1-nostate.npz.npy
    assert_user_error(run("compare", outputs, suite), "has several outputs")
    assert_user_error(run("compare", outputs, tmp_path / "nowhere"), "nowhere")
    # Fixtures are no kernel's outputs, and a suite of no cases judges nothing.
    assert_user_error(run("compare", suite, suite), "a fixture, not a kernel's output")
    copy = shutil.copytree(suite, tmp_path / "copy")
    assert_user_error(run("compare", copy, suite), "a fixture, not a kernel's output")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / MANIFEST).write_bytes(manifest_text([]))
    assert_user_error(run("compare", outputs, tmp_path / "empty"), "lists no cases to judge")
