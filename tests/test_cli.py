"""The command line (``gdn_layout.cli``), judged by output and exit status: run in-process
through ``main(argv)``, and end to end in a subprocess where the process itself matters (the
entry point, a terminal, a closed stderr, a signal, a missing optional dependency).

A user's error is one line and exit status 2, the command line's own bug a traceback and exit
status 1. At its edges (hostile manifests, file names no encoding can print, headers that claim
impossible shapes, a run beyond memory, an existing ``--plot`` file) it is still one line and
exit status 2; a ``SIGTERM`` mid-run, 143 with nothing left behind."""

from __future__ import annotations

import doctest
import importlib
import inspect
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import ml_dtypes
import numpy as np
import pytest

import gdn_layout.cli
import gdn_layout.plot
from gdn_layout import Comparison, GdnBackwardLayout, unpack
from gdn_layout.cli import _NEXT_STEP, _parser, main
from gdn_layout.files import load_fixture, save_fixture
from gdn_layout.files._outputs import FILE_KINDS
from gdn_layout.regimes import REGIME_SUMMARIES
from support import assert_user_error, on_a_terminal, run, suite_with_huge_integer

README = Path(__file__).resolve().parents[1] / "README.md"
limits = importlib.import_module("gdn_layout._limits")


def run_process(
    *args: str | bytes | Path,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    close_stderr: bool = False,
    text: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """``python -m gdn_layout ARGS`` in a subprocess (in ``cwd``, with ``env`` added to this
    process's environment; with ``close_stderr``, fd 2 closed: ``2>&-``): its output as bytes,
    or with ``text`` as text."""
    argv: list[str | bytes | Path] = [sys.executable, "-m", "gdn_layout", *args]
    if close_stderr:
        argv = ["sh", "-c", 'exec "$0" "$@" 2>&-', *argv]
    return subprocess.run(
        argv,
        capture_output=not close_stderr,
        stdout=subprocess.PIPE if close_stderr else None,
        text=text,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def fixture_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fx") / "case.safetensors"
    result = run(
        "fixture", "-B", "2", "-S", "9", "-H", "3", "-N", "4", "--carry-state",
        "--gate-regime", "zero", "--seed", "7", "-o", path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert str(path) in result.stdout
    return path


def test_describe_prints_the_table_the_readme_shows() -> None:
    result = run("describe", "--batch", "2", "--seq", "5", "--heads", "3", "--state-size", "8",
                 "--carry-state")  # fmt: skip
    assert result.returncode == 0
    readme = README.read_text()
    block = readme.split("--state-size 8 --carry-state\n", 1)[1].split("```", 1)[0]
    assert result.stdout == block


def test_the_readme_and_docs_cli_md_show_every_command() -> None:
    # A command added to the parser and not to README.md's table or docs/cli.md fails here.
    commands = sorted(_parser().get_default("subcommands"))
    part = README.read_text().split("## The command line\n", 1)[1].split("\n## ", 1)[0]
    assert sorted(re.findall(r"^\| `([\w-]+)` \|", part, re.MULTILINE)) == commands
    page = (README.parent / "docs" / "cli.md").read_text()
    sections = set(re.findall(r"^## (\S+)$", page, re.MULTILINE)) - {"Conventions"}
    assert sorted(sections) == commands


@pytest.mark.usefixtures("suite_copied")
def test_readme_console_sessions_print_what_the_readme_shows(tmp_path: Path) -> None:
    blocks = re.findall(r"```console\n(.*?)```", README.read_text(), re.DOTALL)
    sessions = [re.split(r"^\$ ", block, flags=re.MULTILINE)[1:] for block in blocks]
    commands = [entry for session in sessions for entry in session]
    assert len(commands) >= 5
    for entry in commands:
        command, _, shown = entry.partition("\n")
        argv = command.split()
        assert argv[0] == "gdn-layout"
        if argv[1] == "compare":
            _make_kernel_npy(tmp_path)
        result = run(*argv[1:], cwd=tmp_path)
        assert result.returncode in (0, 1), result.stderr
        if argv[1] == "demo":
            # The float32 recomputation's last digits depend on the BLAS: its report is
            # checked for the verdict, everything before it to the letter.
            head = shown.split("3. a float32")[0]
            assert result.stdout.startswith(head), command
            assert "compare passed" in result.stdout
            assert result.stdout.endswith("\n\n" + shown.rsplit("\n\n", 1)[1]), command
        else:  # "..." stands for what the suite's definitions make, a count or a size
            assert doctest.OutputChecker().check_output(shown, result.stdout, doctest.ELLIPSIS), (
                command,
                result.stdout,
            )


def _make_kernel_npy(folder: Path) -> None:
    """What README.md says kernel.npy is: case.safetensors with one dk element off by 0.25."""
    fx = load_fixture(folder / "case.safetensors")
    packed = np.array(fx.packed)
    unpack(packed, fx.layout).dk[0, 2, 1, 3] += np.float32(0.25)
    np.save(folder / "kernel.npy", packed)


def test_describe_json_has_the_layout_numbers() -> None:
    result = run("describe", "-B", "2", "-S", "3", "-H", "4", "-N", "8", "--per-channel",
                 "--dtype", "float16", "--json")  # fmt: skip
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    layout = GdnBackwardLayout(2, 3, 4, 8, gate_per_channel=True)
    assert GdnBackwardLayout.from_dict(doc["layout"]) == layout
    assert doc["nbytes"] == 2 * doc["total_elems"] == 2 * (4 * 192 + 24)
    assert [g["name"] for g in doc["gradients"]] == ["dq", "dk", "dv", "dg", "dbeta"]
    assert [(g["offset"], g["length"]) for g in doc["gradients"]] == layout.slices()
    assert doc["gradients"][3]["shape"] == [2, 3, 4, 8]


def test_describe_defaults_work() -> None:
    result = run("describe")
    assert result.returncode == 0
    assert "dbeta" in result.stdout
    assert "total" in result.stdout


def test_fixture_writes_a_loadable_file(fixture_path: Path) -> None:
    fx = load_fixture(fixture_path)
    assert fx.layout == GdnBackwardLayout(2, 9, 3, 4, carry_state=True)
    assert fx.regime == "zero"
    assert fx.seed == 7
    assert fx.dtype == np.float32
    assert not np.asarray(fx.g).any()


def test_fixture_refuses_to_replace_a_file_unless_forced(fixture_path: Path) -> None:
    before = fixture_path.read_bytes()
    result = run("fixture", "-o", fixture_path)
    assert_user_error(result, f"{fixture_path} exists; pass --force to replace it")
    assert fixture_path.read_bytes() == before
    forced = run("fixture", "-B", "1", "-S", "2", "-H", "1", "-N", "2", "-o", fixture_path,
                 "--force", "--dtype", "float64")  # fmt: skip
    assert forced.returncode == 0, forced.stderr
    assert load_fixture(fixture_path).dtype == np.float64
    fixture_path.write_bytes(before)


def test_fixture_suite_passes_its_flags_to_write_suite(
    suite: tuple[Path, list[Path]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The suite itself is tested in test_generate.py (written once, in conftest.py); here,
    # that the command asks for it as told and reports what was written.
    calls: list[tuple[str, dict[str, object]]] = []

    def write_suite(directory: str, **options: object) -> list[Path]:
        calls.append((directory, options))
        return suite[1]

    monkeypatch.setattr(gdn_layout.cli, "write_suite", write_suite)
    result = run("fixture", "--suite", tmp_path, "--seed", "100", "--dtype", "float64",
                 "--force", "--quiet")  # fmt: skip
    assert result.returncode == 0, result.stderr
    [(directory, options)] = calls
    assert directory == str(tmp_path)
    assert options["dtype"] == np.float64
    assert (options["seed"], options["overwrite"]) == (100, True)
    size = sum(path.stat().st_size for path in suite[1]) / 2**20
    assert result.stdout == (
        f"wrote {len(suite[1])} fixtures and manifest.json to {tmp_path} ({size:.1f} MiB)\n"
    )


def test_inspect_a_fixture(fixture_path: Path) -> None:
    result = run("inspect", fixture_path)
    assert result.returncode == 0, result.stderr
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dstate"):
        assert re.search(rf"^{name}\s", result.stdout, re.MULTILINE), name
    doc = json.loads(run("inspect", fixture_path, "--json").stdout)
    fx = load_fixture(fixture_path)
    dk = next(g for g in doc["gradients"] if g["name"] == "dk")
    assert dk["max"] == pytest.approx(float(np.max(fx.grads.dk)))
    assert dk["nan"] == 0


def test_inspect_npy_and_raw_need_and_check_the_layout(tmp_path: Path) -> None:
    layout = GdnBackwardLayout(1, 3, 2, 4)
    flat = np.arange(layout.total_elems, dtype=np.float32)
    flat[layout.dbeta_offset + 1] = np.nan
    np.save(tmp_path / "g.npy", flat)
    flat.tofile(tmp_path / "g.bin")
    dims = ["-B", "1", "-S", "3", "-H", "2", "-N", "4"]
    for path, extra in ((tmp_path / "g.npy", []), (tmp_path / "g.bin", ["--dtype", "float32"])):
        result = run("inspect", path, *dims, *extra, "--json")
        assert result.returncode == 0, result.stderr
        rows = {g["name"]: g for g in json.loads(result.stdout)["gradients"]}
        assert rows["dbeta"]["nan"] == 1
        assert rows["dq"]["max"] == float(unpack(flat, layout).dq.max())
    assert_user_error(run("inspect", tmp_path / "g.npy"), "no fixture gives the layout")
    assert_user_error(run("inspect", tmp_path / "g.bin", *dims), "needs --dtype")
    assert_user_error(
        run("inspect", tmp_path / "g.npy", "-B", "1", "-S", "4", "-H", "2", "-N", "4"),
        "g.npy: 84 elements, but GdnBackwardLayout(batch=1, seq=4",
    )


def test_compare_exit_status_follows_the_verdict(fixture_path: Path, tmp_path: Path) -> None:
    fx = load_fixture(fixture_path)
    good = np.array(fx.packed)
    np.save(tmp_path / "good.npy", good)
    assert run("compare", tmp_path / "good.npy", fixture_path).returncode == 0

    bad = good.copy()
    unpack(bad, fx.layout).dk[1, 4, 2, 3] += 1.0
    np.save(tmp_path / "bad.npy", bad)
    result = run("compare", tmp_path / "bad.npy", fixture_path)
    assert result.returncode == 1
    assert "dk" in result.stdout
    assert "[1, 4, 2, 3]" in result.stdout

    doc = json.loads(run("compare", tmp_path / "bad.npy", fixture_path, "--json").stdout)
    assert doc["passed"] is False
    failing = [g for g in doc["grads"] if not g["passed"]]
    assert [g["name"] for g in failing] == ["dk"]


def test_compare_names_the_cause_in_text_and_json(fixture_path: Path, tmp_path: Path) -> None:
    fx = load_fixture(fixture_path)
    bad = np.array(fx.packed)
    unpack(bad, fx.layout).dq[...] *= -1
    np.save(tmp_path / "flipped.npy", bad)
    result = run("compare", tmp_path / "flipped.npy", fixture_path)
    assert result.returncode == 1
    assert result.stdout.rstrip().splitlines()[-1] == (
        "likely cause: dq is -1.000 x expected (a sign flip?)"
    )
    doc = json.loads(run("compare", tmp_path / "flipped.npy", fixture_path, "--json").stdout)
    (finding,) = doc["findings"]
    assert finding["kind"] == "scale"
    assert finding["gradient"] == "dq"
    assert finding["details"]["factor"] == -1.0
    assert finding["text"] == "dq is -1.000 x expected (a sign flip?)"


def test_compare_rms_ratio(fixture_path: Path, tmp_path: Path) -> None:
    fx = load_fixture(fixture_path)
    noisy = np.array(fx.packed) * np.float32(1.001)
    np.save(tmp_path / "noisy.npy", noisy)
    assert run("compare", tmp_path / "noisy.npy", fixture_path).returncode == 1
    result = run("compare", tmp_path / "noisy.npy", fixture_path, "--max-rms-ratio", "0.01")
    assert result.returncode == 0, result.stderr
    assert "rms ratio<=0.01" in result.stdout


def test_files_are_known_by_their_content_not_their_name(
    fixture_path: Path, tmp_path: Path
) -> None:
    disguised = tmp_path / "CASE.ST"
    disguised.write_bytes(fixture_path.read_bytes())
    assert run("inspect", disguised).returncode == 0
    npy = tmp_path / "packed.bin"
    with open(npy, "wb") as file:
        np.save(file, np.array(load_fixture(fixture_path).packed))
    assert run("compare", npy, disguised).returncode == 0


def test_a_raw_buffer_that_starts_like_a_fixture_is_still_raw(
    fixture_path: Path, tmp_path: Path
) -> None:
    packed = np.array(load_fixture(fixture_path).packed)
    raw = bytearray(packed.tobytes())
    raw[8] = ord("{")  # the first byte of a safetensors header, by chance
    (tmp_path / "kernel.bin").write_bytes(bytes(raw))
    dims = ["-B", "2", "-S", "9", "-H", "3", "-N", "4", "--carry-state", "--dtype", "float32"]
    result = run("inspect", tmp_path / "kernel.bin", *dims)
    assert result.returncode == 0, result.stderr
    assert "kernel.bin: raw, float32" in result.stdout
    (tmp_path / "damaged.npy").write_bytes(b"\x93NUM")
    assert_user_error(run("inspect", tmp_path / "damaged.npy", *dims), "not a .npy file")


def test_compare_a_raw_kernel_buffer_against_a_wider_fixture(tmp_path: Path) -> None:
    reference = tmp_path / "f64.safetensors"
    flags = ["-B", "1", "-S", "6", "-H", "2", "-N", "4", "--per-channel"]
    assert run("fixture", *flags, "--dtype", "float64", "-o", reference).returncode == 0
    kernel = np.array(load_fixture(reference).packed).astype(np.float32)
    kernel.tofile(tmp_path / "kernel.bin")
    result = run("compare", tmp_path / "kernel.bin", reference, "--dtype", "float32")
    # judged in the fixture's class, a float32 output is coarser: a stray cast, unless asked
    assert_user_error(result, "--precision float32 on the command line")
    asked = ("--dtype", "float32", "--precision", "float32")
    result = run("compare", tmp_path / "kernel.bin", reference, *asked)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "float32 against float64" in result.stdout


def test_compare_plot_problems_are_found_before_the_work(
    fixture_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_user_error(
        run("compare", fixture_path, fixture_path, "--plot", tmp_path / "nowhere" / "e.png"),
        "e.png: the folder",
    )
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
        result = run("compare", fixture_path, fixture_path, "--plot", tmp_path / "e.png")
    assert_user_error(
        result, "pip install 'gdn-layout[plot]' (from a clone: pip install '.[plot]')"
    )
    assert result.stdout == ""
    for bad, message in ((tmp_path / "e.foo", "by its suffix"), (tmp_path, "by its suffix")):
        result = run("compare", fixture_path, fixture_path, "--plot", bad)
        assert_user_error(result, message)
        assert result.stdout == "", "the report waits until the picture can be written"
    (tmp_path / "folder.png").mkdir()
    assert_user_error(
        run("compare", fixture_path, fixture_path, "--plot", tmp_path / "folder.png"), "is a folder"
    )
    # The picture itself is tested in test_plot.py: here, that the report asks for it.
    drawn: list[tuple[Comparison, object]] = []
    chunks: list[object] = []

    def spy(result: Comparison, path: object, chunk: object = None) -> None:
        drawn.append((result, path))
        chunks.append(chunk)

    monkeypatch.setattr(gdn_layout.plot, "plot_errors", spy)
    png = tmp_path / "errors.png"
    result = run("compare", fixture_path, fixture_path, "--plot", png)
    assert result.returncode == 0, result.stderr
    result = run("compare", fixture_path, fixture_path, "--plot", png, "--force", "--chunk", "4")
    assert result.returncode == 0, result.stderr
    assert chunks == [None, 4]  # --chunk draws a line every 4 steps
    drawn.pop()
    [(comparison, path)] = drawn
    assert (comparison.passed, comparison.layout, path) == (
        True,
        load_fixture(fixture_path).layout,
        str(png),
    )
    assert "compare passed" in result.stdout
    assert result.stdout.endswith(f"wrote {png}\n")


def test_compare_user_errors(fixture_path: Path, tmp_path: Path) -> None:
    assert_user_error(run("compare", tmp_path / "nope.npy", fixture_path), "nope.npy: no such file")
    np.save(tmp_path / "short.npy", np.zeros(10, np.float32))
    assert_user_error(
        run("compare", tmp_path / "short.npy", fixture_path), "short.npy: 10 elements"
    )
    assert_user_error(
        run("compare", fixture_path, fixture_path, "-B", "1", "-S", "9", "-H", "3", "-N", "4"),
        "but the flags give",
    )
    assert_user_error(run("compare", fixture_path, fixture_path, "--rtol", "tight"), "--rtol")
    assert_user_error(
        run("compare", fixture_path, fixture_path, "--atol", "dk=1,dk=2"), "named twice"
    )
    (tmp_path / "junk.safetensors").write_bytes(b"\x05\x00")
    assert_user_error(
        run("compare", tmp_path / "junk.safetensors", fixture_path), "junk.safetensors: truncated"
    )


@pytest.mark.slow  # imports torch: about a second, once per process
def test_compare_refuses_a_tensor_numpy_cannot_read(fixture_path: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    float8 = torch.from_numpy(np.array(load_fixture(fixture_path).packed)).to(torch.float8_e4m3fn)
    torch.save({"packed": float8}, tmp_path / "k.pt")
    assert_user_error(
        run("compare", tmp_path / "k.pt", fixture_path),
        "k.pt['packed'] must be an array NumPy can read (a NumPy dtype or bfloat16, in memory "
        "it can be copied from), got a Tensor of dtype torch.float8_e4m3fn on device cpu",
    )


def test_fixture_user_errors(tmp_path: Path) -> None:
    assert_user_error(
        run("fixture", "--suite", tmp_path / "s", "-S", "3", "--gate-regime", "zero"),
        "--suite writes its own layouts and regimes; drop --seq, --gate-regime",
    )
    assert not (tmp_path / "s").exists()
    missing = tmp_path / "nowhere" / "x.safetensors"
    assert_user_error(run("fixture", "-o", missing), f"{missing}: the folder")
    huge = ["-B", "100000", "-S", "100000", "-H", "64", "-N", "128"]
    huge_path = tmp_path / "x.safetensors"
    assert_user_error(run("fixture", *huge, "-o", huge_path), "needs about", "PiB of memory")
    assert list(tmp_path.iterdir()) == []
    # A fixture is written under a .safetensors name, unless told otherwise.
    assert_user_error(
        run("fixture", "-o", tmp_path / "x.npy"),
        f"gdn-layout fixture: error: {tmp_path / 'x.npy'}: a fixture is a safetensors file",
    )
    assert list(tmp_path.iterdir()) == []


def test_inspect_user_errors(tmp_path: Path) -> None:
    dims = ["-B", "1", "-S", "1", "-H", "1", "-N", "1"]
    assert_user_error(
        run("inspect", tmp_path, *dims), f"{tmp_path}: not a regular file: it is a folder"
    )
    np.save(tmp_path / "objects.npy", np.array([{}], dtype=object), allow_pickle=True)
    assert_user_error(
        run("inspect", tmp_path / "objects.npy", *dims), "objects.npy: cannot be read as a packed"
    )


def test_bad_flag_values_are_one_line_errors() -> None:
    assert_user_error(run("describe", "--seq", "-3"), "expected a non-negative integer, got '-3'")
    assert_user_error(run("describe", "--dtype", "int8"), "a floating dtype (bfloat16/bf16")
    assert_user_error(run("fixture", "--gate-regime", "wild", "-o", "x"), "invalid choice: 'wild'")
    assert_user_error(run("frobnicate"), "invalid choice")


def test_demo_runs_the_main_job(tmp_path: Path) -> None:
    result = run("demo", "-S", "8", cwd=tmp_path, terminal=True)
    assert result.returncode == 0, result.stderr
    assert "float64 reference [" in result.stderr
    assert "float32 recomputation [" in result.stderr
    assert "reloaded into memory (a file under 64 MiB is read)" in result.stdout
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
    assert "gdn_case" in _NEXT_STEP


def test_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    flags = ["-B", "1", "-S", "40", "-H", "2", "-N", "4"]
    shown = run("fixture", *flags, "-o", tmp_path / "a.safetensors", terminal=True)
    assert shown.returncode == 0
    assert "reference backward [" in shown.stderr
    assert "100%" in shown.stderr
    assert shown.stderr.endswith("\r\x1b[K")  # the bar is cleared when done
    quiet = run("fixture", *flags, "-o", tmp_path / "b.safetensors", "-q", terminal=True)
    assert quiet.returncode == 0
    assert quiet.stderr == ""
    piped = run("fixture", *flags, "-o", tmp_path / "c.safetensors")  # stderr is no terminal
    assert piped.returncode == 0
    assert piped.stderr == ""


def test_a_suite_s_progress_is_a_bar_on_a_terminal_and_lines_in_a_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gdn_layout._progress import LINE_STEP

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
    assert shown.stderr.endswith("\r\x1b[K")  # the bar is cleared when done
    for terminal in (False, True):
        quiet = run("fixture", "--suite", tmp_path / f"q{terminal}", "-q", terminal=terminal)
        assert (quiet.returncode, quiet.stderr) == (0, "")


@pytest.mark.slow
def test_a_real_terminal_gets_the_progress_bar(tmp_path: Path) -> None:
    # End to end, once: stderr on a pseudo-terminal, as in an interactive shell.
    argv = ["fixture", "-B", "1", "-S", "8", "-H", "1", "-N", "2", "-o", "x.safetensors"]
    code, shown = on_a_terminal([sys.executable, "-m", "gdn_layout", *argv], tmp_path, stdout=False)
    assert code == 0
    assert "reference backward [" in shown


def _await_temporary(process: subprocess.Popen[Any], folder: Path, why: str) -> None:
    """Wait (up to 60 s) until ``process``, still running, has made something in ``folder``."""
    deadline = time.monotonic() + 60
    while not any(folder.iterdir()) and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        time.sleep(0.05)
    assert any(folder.iterdir()), why


@pytest.mark.slow
def test_ctrl_c_during_a_suite_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    # SIGINT, as Ctrl-C sends it, well into `fixture --suite`: its temporaries are on disk.
    parent = tmp_path / "work"
    parent.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "gdn_layout", "fixture", "--suite", parent / "suite"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _await_temporary(process, parent, "the suite's writer made no temporary")
        time.sleep(0.5)  # well into the work
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGINT, stderr
    *progress, last = stderr.splitlines()
    assert last == "gdn-layout: interrupted"
    assert all(line.startswith("suite: ") for line in progress)  # a log's progress lines
    assert list(parent.iterdir()) == []


def test_bfloat16_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # makes `import ml_dtypes` fail
    result = run("fixture", "--dtype", "bf16", "-o", tmp_path / "x.safetensors")
    assert_user_error(
        result, "pip install 'gdn-layout[bfloat16]' (from a clone: pip install '.[bfloat16]')"
    )
    assert run("describe", "--dtype", "bfloat16").returncode == 0  # byte counts need no extra


@pytest.mark.slow
def test_the_entry_point_runs_in_a_process_of_its_own(tmp_path: Path) -> None:
    # End to end: `python -m gdn_layout`, exit statuses and streams as a shell sees them.
    result = run_process("fixture", "-B", "1", "-S", "3", "-H", "1", "-N", "2", "-o", "x.st",
                         "--any-suffix", cwd=tmp_path, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar into a pipe
    assert result.stdout.startswith("wrote x.st (")
    assert load_fixture(tmp_path / "x.st").layout == GdnBackwardLayout(1, 3, 1, 2)


def test_the_help_names_every_regime_and_every_file_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The help texts come from the regimes and the file readers, so a new one shows up."""
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens too
    fixture_help = " ".join(run("fixture", "--help").stdout.split())
    for name, text in REGIME_SUMMARIES.items():
        assert f"{name}: {text}" in fixture_help
    for command in ("inspect", "compare"):
        assert FILE_KINDS in " ".join(run(command, "--help").stdout.split())


def test_compare_judges_in_the_precision_class_asked(tmp_path: Path) -> None:
    from gdn_layout.generate import make_fixture
    from gdn_layout.reference._fused import fused_backward

    fx = make_fixture(GdnBackwardLayout(1, 40, 2, 16), regime="mixed", seed=2)
    save_fixture(tmp_path / "case.safetensors", fx)
    np.save(tmp_path / "tf32.npy", fused_backward(*fx.inputs, bits=10, length=32)[0])
    files = (str(tmp_path / "tf32.npy"), str(tmp_path / "case.safetensors"))
    passed = run("compare", *files, "--precision", "tf32")
    assert passed.returncode == 0, passed.stdout
    assert "error/floor<=16 (tf32)" in passed.stdout
    assert run("compare", *files).returncode == 1  # float32's floors: TF32 rounds more
    bad = run("compare", *files, "--precision", "fp8")
    assert bad.returncode == 2
    assert "--precision: the precision must be one of float64, float32, tf32, " in bad.stderr
    fx.packed.astype(ml_dtypes.bfloat16).tofile(tmp_path / "bf16.bin")
    finer = run(
        "compare", tmp_path / "bf16.bin", files[1], "--dtype", "bf16", "--precision", "float32"
    )
    assert finer.returncode == 2
    assert "--precision 'float32' judges float32 buffers, got bfloat16 ones" in finer.stderr
    assert "pass --precision='bfloat16' or a coarser class" in finer.stderr


# -- the user's errors and the command line's own bugs; runs beyond memory ---------------------


def test_huge_dimensions_are_refused_up_front(tmp_path: Path) -> None:
    # Made and then refused for want of memory after 42 s; now refused before any work.
    start = time.perf_counter()
    result = run("fixture", "-S", "10000000", "-o", tmp_path / "x.safetensors")
    assert time.perf_counter() - start < 2.0
    assert_user_error(result, "B=2 S=10000000 H=3 N=16, per-head gate, no state needs about ")
    assert re.search(
        r"needs about [\d.]+ GiB of memory, but [\d.]+ \w+ is available", result.stderr
    )
    assert list(tmp_path.iterdir()) == []


def test_the_estimate_is_checked_against_what_is_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "available_memory", lambda: (1000, "a test's figure"))
    assert_user_error(
        run("fixture", "-S", "4", "-o", tmp_path / "x.safetensors"),
        "of memory, but 1000 B is available (a test's figure)",
    )
    assert_user_error(run("demo", "-S", "4"), "but 1000 B is available")
    # A system that does not say how much is available runs anything.
    monkeypatch.setattr(limits, "available_memory", lambda: None)
    assert run("fixture", "-S", "4", "-o", tmp_path / "x.safetensors").returncode == 0


def test_a_bug_shows_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> str:
        raise TypeError("a bug inside the library")

    monkeypatch.setattr(gdn_layout.cli, "layout_text", broken)
    with pytest.raises(TypeError, match="a bug inside the library"):
        main(["describe"])


@pytest.mark.slow
def test_a_bug_exits_1_with_a_traceback_from_the_entry_point() -> None:
    script = textwrap.dedent(
        """
        import sys
        import gdn_layout.cli as cli

        def broken(*args):
            raise ValueError("a bug inside the library")

        cli.layout_text = broken
        sys.argv = ["gdn-layout", "describe"]
        sys.exit(cli.main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "Traceback" in done.stderr
    assert "ValueError: a bug inside the library" in done.stderr


def test_flags_whose_arrays_cannot_exist_are_a_user_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    flags = ["--dtype", "float32", "-B", "0", "-S", str(2**40), "-H", str(2**40), "-N", "2"]
    assert_user_error(run("inspect", empty, *flags), "which no array can have")


def test_bad_tolerances_are_user_errors(tmp_path: Path) -> None:
    raw = tmp_path / "zeros.bin"
    raw.write_bytes(b"\0" * 4 * 5)
    flags = ["--dtype", "float32", "-B", "1", "-S", "1", "-H", "1", "-N", "1"]
    # Judged by compare(), its messages naming the flag.
    for tolerance, message in [
        ("-1", "error: --rtol must be a finite float >= 0, got -1.0"),
        ("inf", "error: --rtol must be a finite float >= 0, got inf"),
        ("dq=nan", "error: --rtol['dq'] must be a finite float >= 0, got nan"),
        (
            "dz=1e-3",
            "error: --rtol has unknown gradient names ['dz']; "
            "expected names among dq, dk, dv, dg, dbeta, dstate",
        ),
    ]:
        assert_user_error(run("compare", raw, raw, *flags, "--rtol", tolerance), message)


def test_the_librarys_refusals_name_the_flag(tmp_path: Path) -> None:
    too_big = str(2**64)
    assert_user_error(
        run("describe", "-N", too_big),
        f"error: --state-size must fit in a 64-bit usize, got {too_big}",
    )
    states = ["--states", str(10**20), "-o", str(tmp_path / "x.safetensors")]
    assert_user_error(
        run("fixture", "-S", "4", *states), "error: --states must be an integer from 1"
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_a_user_error(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    assert_user_error(run("inspect", fifo), f"{fifo}: not a regular file: it is a FIFO")


# -- a manifest holding an integer of more digits than Python converts -------------------------


def test_verify_refuses_a_manifest_with_a_5000_digit_integer(
    tmp_path: Path, fixture_path: Path
) -> None:
    root = suite_with_huge_integer(tmp_path / "suite", fixture_path)
    assert_user_error(run("verify", root), "manifest.json is not JSON", "digits")


def test_verify_counts_the_fixtures_through_the_suite_module(
    tmp_path: Path, fixture_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The count does not come from a second json.loads of its own: a manifest that changed
    # after the check is reported by the suite module, in one line.
    root = suite_with_huge_integer(tmp_path / "suite", fixture_path)
    monkeypatch.setattr(
        importlib.import_module("gdn_layout.cli"), "verify_suite", lambda d, **selection: []
    )
    assert_user_error(run("verify", root), "manifest.json is not JSON", "digits")
    manifest = {"format": "gdn-layout-fixture-suite", "fixtures": [{"file": "a", "sha256": "0"}]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert run("verify", root).stdout == f"{root}: 1 fixtures match manifest.json\n"


# -- names that the output's encoding cannot print ---------------------------------------------


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
    # The same name in an error message: one line on stderr, exit 2.
    missing = os.path.join(os.fsencode(tmp_path), b"nope-\xff.npy")
    done = run_process("inspect", missing, env=env)
    assert done.returncode == 2, done.stderr
    assert b"Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert b"\\udcff" in done.stderr
    assert b"no such file" in done.stderr
    # A name that is valid UTF-8 but not ASCII.
    accented = tmp_path / "caf\u00e9.safetensors"
    shutil.copy(fixture_path, accented)
    done = run_process("inspect", accented, env=env)
    assert done.returncode == 0, done.stderr
    expected = "caf\\xe9" if encoding.startswith("ascii") else "caf\u00e9"
    assert f"{expected}.safetensors: fixture".encode() in done.stdout


# -- a .npy header that claims more elements than any array can have ---------------------------


@pytest.mark.parametrize("shape", [(2**64,), (2**32, 2**32), (2**62,)])
@pytest.mark.parametrize("command", ["inspect", "compare"])
def test_npy_header_claiming_an_impossible_shape_is_a_user_error(
    tmp_path: Path, shape: tuple[int, ...], command: str
) -> None:
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:
        header = {"descr": "<f4", "fortran_order": False, "shape": shape}
        np.lib.format.write_array_header_1_0(file, header)
    args = [path, path] if command == "compare" else [path]
    result = run(command, *args, "-B", "1", "-S", "1", "-H", "1", "-N", "1")
    assert_user_error(result, str(path), f"shape {shape}", "float32")


@pytest.mark.slow
def test_npy_header_warnings_do_not_add_lines(tmp_path: Path) -> None:
    path = tmp_path / "huge.npy"
    with open(path, "wb") as file:
        header = {"descr": "<f4", "fortran_order": False, "shape": (2**32, 2**32)}
        np.lib.format.write_array_header_1_0(file, header)
    done = run_process("inspect", path)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# -- stderr closed -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_a_closed_stderr_disables_progress_and_keeps_the_exit_status(tmp_path: Path) -> None:
    out = tmp_path / "x.safetensors"
    done = run_process("fixture", "-S", "4", "-o", out, close_stderr=True)
    assert done.returncode == 0
    assert out.is_file()
    assert done.stdout.startswith(f"wrote {out}".encode())
    done = run_process("demo", "-S", "4", close_stderr=True)
    assert done.returncode == 0
    # An error has nowhere to go, and does not go to stdout; the status still says it.
    done = run_process("inspect", tmp_path / "nowhere.npy", close_stderr=True)
    assert (done.returncode, done.stdout) == (2, b"")
    done = run_process("describe", "--seq", "x", close_stderr=True)
    assert (done.returncode, done.stdout) == (2, b"")


def test_progress_survives_a_stderr_that_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from gdn_layout._progress import Progress, stderr_is_terminal

    monkeypatch.setattr(sys, "stderr", None)
    assert stderr_is_terminal() is False
    bar = Progress(enabled=True)
    bar.update(0.5)
    bar.done()

    class Broken(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(9, "Bad file descriptor")

    monkeypatch.setattr(sys, "stderr", Broken())
    bar = Progress(enabled=True)
    bar.update(0.5)
    assert not bar.enabled
    bar.done()


# -- SIGTERM cleans up the demo's temporary folder ---------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX")
def test_sigterm_during_demo_removes_its_temporary_folder(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gdn_layout",
            "demo",
            *("-B", "2", "-S", "4096", "-H", "8", "-N", "64"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        _await_temporary(process, tmp, "the demo made no temporary folder")
        time.sleep(0.3)  # well into the work
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 128 + signal.SIGTERM, process.stderr.read() if process.stderr else ""
    assert list(tmp.iterdir()) == []


def test_main_restores_the_sigterm_handler() -> None:
    before = signal.getsignal(signal.SIGTERM)
    assert run("describe", "-S", "2").returncode == 0
    assert signal.getsignal(signal.SIGTERM) is before


# -- --plot does not replace a file unless told to ---------------------------------------------


def test_compare_plot_refuses_an_existing_file_without_force(
    fixture_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "errors.png"
    png.write_bytes(b"precious")
    drawn: list[object] = []
    monkeypatch.setattr(
        gdn_layout.plot, "plot_errors", lambda result, path, chunk=None: drawn.append(path)
    )
    result = run("compare", fixture_path, fixture_path, "--plot", png)
    assert_user_error(result, str(png), "exists", "--force")
    assert result.stdout == "", "refused before the work"
    assert (png.read_bytes(), drawn) == (b"precious", [])
    result = run("compare", fixture_path, fixture_path, "--plot", png, "--force")
    assert result.returncode == 0, result.stderr
    assert drawn == [str(png)]


@pytest.mark.slow
def test_plot_errors_writes_its_file_atomically(
    fixture_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    files = importlib.import_module("gdn_layout.files._atomic")
    written: list[Path] = []
    real: Callable[..., Path] = files.atomic_write

    def spy(path: Path, write: Callable[[IO[bytes]], None], *, overwrite: bool) -> Path:
        written.append(path)
        return real(path, write, overwrite=overwrite)

    monkeypatch.setattr(files, "atomic_write", spy)
    png = tmp_path / "errors.png"
    png.write_bytes(b"old")
    result = run("compare", fixture_path, fixture_path, "--plot", png, "--force")
    assert result.returncode == 0, result.stderr
    assert written == [png]
    assert png.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["errors.png"]


# -- compare OUTPUTS/ SUITE/ ----------------------------------------------------------------------


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
        entries.append(
            manifest_entry(
                path.name, path.read_bytes(), layout=layout.to_dict(), regime="mild", seed=seed
            )
        )
        names.append(name)
    (root / MANIFEST).write_bytes(manifest_text(entries))
    return names


def test_compare_a_folder_of_outputs_with_a_suite(tmp_path: Path) -> None:
    from gdn_layout.reference import backward

    names = _small_suite(tmp_path / "suite")
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    for name in names:
        fixture = load_fixture(tmp_path / "suite" / f"{name}.safetensors")
        out = backward(*fixture.inputs, dtype=np.float32)
        np.save(outputs / f"{name}.npy", out)
    correct = run("compare", outputs, tmp_path / "suite")
    assert (correct.returncode, correct.stderr) == (0, "")
    assert correct.stdout.splitlines()[0].startswith(f"all {len(names)} cases passed")
    assert "--dtype float64" in correct.stdout
    # A bug only with a carried state, one output as a plain safetensors file, one missing.
    from safetensors.numpy import save_file

    for name in names:
        fixture = load_fixture(tmp_path / "suite" / f"{name}.safetensors")
        out = backward(*fixture.inputs, dtype=np.float32)
        dstate = unpack(out, fixture.layout).dstate
        if dstate is not None:
            dstate[...] *= 2
        np.save(outputs / f"{name}.npy", out)
    first = outputs / f"{names[0]}.npy"
    save_file({"packed": np.load(first)}, str(outputs / f"{names[0]}.safetensors"))
    first.unlink()
    (outputs / f"{names[1]}.npy").unlink()
    result = run("compare", outputs, tmp_path / "suite")
    carried = sum("-state" in n for n in names)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stderr
    assert lines[0] == (
        f"{carried} of {len(names) - 1} cases failed: dstate {carried}; "
        "dq, dk, dv, dg, dbeta never fail"
    )
    assert "  fails only with a carried state" in lines[1:3]
    assert lines[-1] == f"no output for case {names[1]}"
    # Every case's output there but one missing: exit 1 all the same.
    np.save(
        outputs / f"{names[1]}.npy",
        backward(
            *load_fixture(tmp_path / "suite" / f"{names[1]}.safetensors").inputs, dtype=np.float32
        ),
    )
    for name in names:
        if "-state" in name:
            (outputs / f"{name}.npy").unlink()
    passed = run("compare", outputs, tmp_path / "suite")
    assert passed.returncode == 1
    assert passed.stdout.splitlines()[0].startswith(f"all {len(names) - carried} cases passed")
    assert passed.stdout.count("no output for case") == carried


def test_compare_a_folder_user_errors(tmp_path: Path) -> None:
    names = _small_suite(tmp_path / "suite")
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    assert_user_error(
        run("compare", outputs, tmp_path / "suite" / f"{names[0]}.safetensors"),
        "EXPECTED must be a suite's folder",
    )
    assert_user_error(run("compare", outputs, tmp_path / "suite", "--rtol", "1e-3"), "drop --rtol")
    np.save(outputs / f"{names[0]}.npy", np.zeros(3, np.float32))
    assert_user_error(run("compare", outputs, tmp_path / "suite"), "3 elements")
    np.save(outputs / f"{names[0]}.npz", np.zeros(3, np.float32))
    assert_user_error(run("compare", outputs, tmp_path / "suite"), "has several outputs")
    assert_user_error(run("compare", outputs, tmp_path / "nowhere"), "nowhere")
