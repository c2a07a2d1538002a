"""The ``gdn-layout`` command line; its conventions (exit statuses, escaping, signals) are in
docs/cli.md. Ctrl-C removes temporary files too, and exits with status 130.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from . import reference
from ._checks import require_matplotlib
from ._cli_values import (
    PRECISION_HELP,
    add_file_arguments,
    add_layout_arguments,
    count_arg,
    dtype_arg,
    positive_arg,
    precision_arg,
    tolerance,
)
from ._dtypes import is_floating, resolve
from ._limits import human_bytes, impossible_arrays, memory_refusal
from ._process import escaping_output, report, sigterm_as_exit
from ._progress import Progress, stderr_is_terminal
from ._stats import grad_stats, grads_text
from ._version import __version__
from .check import Comparison, compare
from .check._compare import Judging
from .files._fixture import FixtureError, load_fixture, save_fixture
from .files._outputs import FILE_KINDS, PackedFile, open_packed
from .generate import fixture_memory, make_fixture, write_suite
from .layout import GdnBackwardLayout, layout_caption, layout_table, layout_text
from .packing import GdnGrads, unpack
from .regimes import REGIME_SUMMARIES, REGIMES
from .suites import MANIFEST, STATE_TENSORS, compare_states, state_shape, suite_files, verify_suite

__all__ = ["main"]


class UsageError(Exception):
    """A mistake in what the user asked for: reported in one line, exit status 2."""


#: The library's names for the arguments the commands pass on from flags, and those flags.
_FLAGS = {
    "batch": "--batch",
    "seq": "--seq",
    "heads": "--heads",
    "state_size": "--state-size",
    "states": "--states",
    "directory": "--suite",
    "overwrite": "--force",
    "rtol": "--rtol",
    "atol": "--atol",
    "max_rms_ratio": "--max-rms-ratio",
    "precision": "--precision",
}
#: Where a library message names an argument: as its subject ("compare: rtol must ...",
#: "rtol['dq'] ...", "write_suite: directory '.' is ..."), or in advice ("pass overwrite=True").
#: A path that begins a message ("seq exists; ...") is none of these.
_NAMES = "|".join(_FLAGS)
_NAMED = re.compile(rf"^(?:\w+: )?({_NAMES})(?= must | has |\[| ')|\bpass ({_NAMES})=(True\b)?")


def _usage_error(error: Exception, where: str = "") -> UsageError:
    """A library's ``error`` as the user's, after ``where``: each argument it names by its flag."""

    def flag(named: re.Match[str]) -> str:
        if named[1] is not None:
            return _FLAGS[named[1]]
        return f"pass {_FLAGS[named[2]]}" + ("" if named[3] else "=")  # a switch takes no value

    return UsageError(where + _NAMED.sub(flag, str(error)))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    See Also
    --------
    make_fixture : What ``gdn-layout fixture`` runs.
    compare : What ``gdn-layout compare`` runs.
    """
    try:
        with escaping_output(), sigterm_as_exit():
            return _main(argv)
    except KeyboardInterrupt:  # the writers have removed their temporaries on the way out
        clear = "\r\x1b[K" if stderr_is_terminal() else ""  # over the progress bar and ^C
        report(f"{clear}gdn-layout: interrupted")
        return 128 + signal.SIGINT


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command that was given, not by the top-level parser
        args.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        result: int = args.run(args)
    except BrokenPipeError:
        # The reader went away (`gdn-layout describe | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE
    except MemoryError as error:
        report(f"gdn-layout {args.command}: error: out of memory: {error}")
        return 2
    except (UsageError, FixtureError, OSError, ImportError) as error:
        # The user's to fix; any other exception is a bug, shown with its traceback (exit 1).
        report(f"gdn-layout {args.command}: error: {error}")
        return 2
    return result


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other user error here."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


#: What ``add_subparsers`` returns: argparse names its class privately.
_Commands = Any


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gdn-layout",
        description="The packed-gradient layout of RLX's GatedDeltaNetBackward.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {__version__}", help="print the version"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    for add in (
        _describe_command,
        _fixture_command,
        _inspect_command,
        _compare_command,
        _verify_command,
        _demo_command,
    ):
        add(commands)
    parser.set_defaults(subcommands=commands.choices)
    return parser


def _describe_command(commands: _Commands) -> None:
    describe = commands.add_parser(
        "describe",
        help="print where each gradient sits in the packed buffer",
        description="Print the layout table: name, shape, offset, length and bytes of each "
        "gradient in the packed buffer.",
    )
    add_layout_arguments(describe, batch=1, seq=2048, heads=16, state_size=128)
    describe.add_argument(
        "--dtype", default="float32", type=dtype_arg, help="for the bytes column (%(default)s)"
    )
    describe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    describe.set_defaults(run=_describe)


def _fixture_command(commands: _Commands) -> None:
    fixture = commands.add_parser(
        "fixture",
        help="run the reference and write a fixture file (or a suite of them)",
        description="Draw inputs as the op expects them, run the float64 reference forward and "
        "backward, and write inputs, dy, y and the packed gradient to a safetensors file.",
    )
    add_layout_arguments(fixture, batch=2, seq=64, heads=3, state_size=16)
    fixture.add_argument(
        "--dtype", default="float32", type=dtype_arg, help="of the stored tensors (%(default)s)"
    )
    fixture.add_argument(
        "--seed", type=count_arg, default=0, help="of the random inputs (%(default)s)"
    )
    fixture.add_argument(
        "--gate-regime",
        choices=REGIMES,
        help="; ".join(f"{name}: {text}" for name, text in REGIME_SUMMARIES.items())
        + " (default: mixed)",
    )
    target = fixture.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "-o", "--output", metavar="PATH", help="the fixture file to write (.safetensors)"
    )
    target.add_argument(
        "--suite",
        metavar="DIR",
        help="write the standard coverage set and its manifest.json into DIR instead",
    )
    fixture.add_argument(
        "--states",
        type=positive_arg,
        metavar="CHUNK",
        help="also keep the state entering each chunk of CHUNK steps and its cotangent (h, dh; "
        "the final state is kept whenever the state is carried)",
    )
    fixture.add_argument("--force", action="store_true", help="replace existing files")
    fixture.add_argument(
        "--any-suffix",
        action="store_true",
        help="write -o PATH even when its name does not end in .safetensors",
    )
    fixture.add_argument(
        "--workers",
        type=positive_arg,
        default=None,
        metavar="N",
        help="threads to compute a fixture with, processes to make a suite's files with "
        "(default: every core this process may use); the files are the same for every N",
    )
    fixture.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress on stderr (a bar on a terminal; with --suite, lines in a log)",
    )
    fixture.set_defaults(run=_fixture)


def _inspect_command(commands: _Commands) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="per-gradient statistics of a packed buffer",
        description="Per-gradient shape, dtype, min, max, mean, RMS, NaN and Inf counts of "
        f"{FILE_KINDS} (raw needs --dtype and the layout flags).",
    )
    inspect.add_argument("path", metavar="PATH", help=FILE_KINDS)
    add_file_arguments(inspect)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.set_defaults(run=_inspect)


def _compare_command(commands: _Commands) -> None:
    compare = commands.add_parser(
        "compare",
        help="compare an actual packed buffer with an expected one",
        description="Compare ACTUAL with EXPECTED gradient by gradient. Exit status: 0 within "
        f"tolerance, 1 not, 2 for usage or file errors. Each file is {FILE_KINDS}; a fixture "
        "supplies the layout.",
    )
    compare.add_argument(
        "actual",
        metavar="ACTUAL",
        help="the kernel's packed gradient, as a file of any kind; or a folder of them named "
        "after the cases of the suite EXPECTED (<case name>.npy, ...)",
    )
    compare.add_argument(
        "expected",
        metavar="EXPECTED",
        help="the reference: usually a fixture, which brings the layout and the floors",
    )
    add_file_arguments(compare)
    for flag, what in (
        ("--rtol", "relative tolerance"),
        ("--atol", "absolute tolerance"),
        (
            "--max-rms-ratio",
            "judge by rms(actual - expected) / rms(expected) (with --rtol/--atol, both apply)",
        ),
    ):
        compare.add_argument(
            flag,
            type=tolerance,
            metavar="X|NAME=X,...",
            help=f"{what}: one number, or per gradient, e.g. dq=1e-3,dg=2e-3",
        )
    compare.add_argument("--precision", type=precision_arg, metavar="CLASS", help=PRECISION_HELP)
    compare.add_argument("--json", action="store_true", help="print JSON instead of a report")
    compare.add_argument(
        "--wide", action="store_true", help="every column, even past 100 characters a line"
    )
    compare.add_argument(
        "--plot",
        metavar="FILE",
        help="also write heatmaps of the error per gradient, e.g. errors.png (needs [plot])",
    )
    compare.add_argument("--force", action="store_true", help="replace an existing --plot file")
    compare.add_argument(
        "--tensor",
        choices=STATE_TENSORS,
        help="ACTUAL is the kernel's y, h (the state entering each chunk), dh (its cotangent) or "
        "final_state, judged against the fixture EXPECTED's (computed from its inputs when it "
        "keeps none)",
    )
    compare.add_argument(
        "--chunk",
        type=positive_arg,
        metavar="C",
        help="the chunk length of h and dh (the fixture's, else 64); with --plot, a line "
        "every C steps",
    )
    compare.set_defaults(run=_compare)


def _verify_command(commands: _Commands) -> None:
    verify = commands.add_parser(
        "verify",
        help="check a suite's files against its manifest",
        description="Check every file of a fixture suite against its manifest.json: size, "
        "SHA-256, layout, regime and seed. Exit status: 0 intact, 1 some files differ (listed), "
        "2 no readable manifest.",
    )
    verify.add_argument("suite", metavar="SUITE", help="the suite's folder")
    verify.add_argument(
        "--min-seq", type=count_arg, metavar="S", help="only the cases of at least S steps"
    )
    verify.add_argument("--regime", choices=REGIMES, help="only the cases of this gate regime")
    verify.add_argument(
        "--crossing",
        type=positive_arg,
        metavar="C",
        help="only the cases that cross a boundary of a C-step chunk",
    )
    verify.add_argument(
        "--quick",
        action="store_true",
        help="only the quick set: the fewest cases that still hold every shape, gate regime "
        "and pairing of gate and state modes",
    )
    verify.set_defaults(run=_verify)


def _demo_command(commands: _Commands) -> None:
    demo = commands.add_parser(
        "demo",
        help="the whole round trip on a small case, with defaults",
        description="Make a fixture with the float64 reference in a temporary folder, reload it "
        "memory-mapped, unpack it, and compare a float32 recomputation against it.",
    )
    add_layout_arguments(demo, batch=2, seq=64, heads=3, state_size=16, flags=True)
    demo.add_argument(
        "--seed", type=count_arg, default=0, help="of the random inputs (%(default)s)"
    )
    demo.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    demo.set_defaults(run=_demo)


def _layout_from(args: argparse.Namespace) -> GdnBackwardLayout:
    *dims, flags = args.layout_defaults
    given = (args.batch, args.seq, args.heads, args.state_size)
    b, s, h, n = (d if g is None else g for g, d in zip(given, dims, strict=True))
    per_channel = flags if args.per_channel is None else args.per_channel
    carry_state = flags if args.carry_state is None else args.carry_state
    return _checked_layout(b, s, h, n, per_channel=per_channel, carry_state=carry_state)


def _checked_layout(
    b: int, s: int, h: int, n: int, *, per_channel: bool, carry_state: bool
) -> GdnBackwardLayout:
    """The layout the flags give; one whose arrays cannot exist is the user's error."""
    flags = {"gate_per_channel": per_channel, "carry_state": carry_state}
    try:
        layout = GdnBackwardLayout(b, s, h, n, **flags)
    except ValueError as error:
        raise _usage_error(error) from None
    if (why := impossible_arrays(layout)) is not None:
        raise UsageError(why)
    return layout


def _given_layout_flags(args: argparse.Namespace) -> list[str]:
    names = ("batch", "seq", "heads", "state_size", "per_channel", "carry_state", "gate_regime")
    return ["--" + name.replace("_", "-") for name in names if getattr(args, name) is not None]


def _describe(args: argparse.Namespace) -> int:
    layout = _layout_from(args)
    dtype = args.dtype  # a name: byte counts need no optional package, bfloat16's included
    if args.json:
        rows = layout_table(layout, dtype)
        document: dict[str, Any] = {
            "layout": layout.to_dict(),
            "dtype": args.dtype,
            "total_elems": layout.total_elems,
            "nbytes": layout.nbytes(dtype),
            "gradients": _rows_json(rows),
        }
        print(json.dumps(document, indent=2))
    else:
        print(layout_text(layout, dtype))
    return 0


def _rows_json(rows: Sequence[Any]) -> list[dict[str, Any]]:
    return [{**row._asdict(), "shape": list(row.shape)} for row in rows]


def _fixture(args: argparse.Namespace) -> int:
    try:
        return _write_fixtures(args, resolve(args.dtype, "--dtype"))
    # The library refuses an argument: an existing file without --force, a --suite folder that
    # holds the current one, --states past its limit. The user's to fix.
    except (FileExistsError, ValueError) as error:
        raise _usage_error(error) from None


def _write_fixtures(args: argparse.Namespace, dtype: np.dtype[Any]) -> int:
    if args.suite is not None:
        if given := _given_layout_flags(args):
            raise UsageError(f"--suite writes its own layouts and regimes; drop {', '.join(given)}")
        # A bar on a terminal; off one (a CI log), a line at every tenth and every few seconds.
        terminal = stderr_is_terminal()
        progress = Progress(enabled=not args.quiet, label="suite", lines=not terminal)
        if args.states is not None:
            raise UsageError("--suite writes no states; drop --states")
        paths = write_suite(
            args.suite,
            dtype=dtype,
            seed=args.seed,
            overwrite=args.force,
            progress=progress.update,
            workers=args.workers,
        )
        progress.done()
        total = sum(path.stat().st_size for path in paths)
        print(
            f"wrote {len(paths)} fixtures and manifest.json to {args.suite} ({human_bytes(total)})"
        )
        return 0
    if not args.any_suffix and not args.output.lower().endswith(".safetensors"):
        raise UsageError(
            f"{args.output}: a fixture is a safetensors file; name it *.safetensors "
            "(or pass --any-suffix)"
        )
    layout = _layout_from(args)
    needed = fixture_memory(layout, dtype=dtype, states=args.states, workers=args.workers)
    if (why := memory_refusal(layout, needed, states=args.states)) is not None:
        raise UsageError(why)
    regime = args.gate_regime or "mixed"
    progress = Progress(enabled=not args.quiet and stderr_is_terminal())
    fixture = make_fixture(
        layout,
        dtype=dtype,
        regime=regime,
        seed=args.seed,
        progress=progress.update,
        states=args.states,
        workers=args.workers,
    )
    path = save_fixture(args.output, fixture, overwrite=args.force)
    progress.done()
    print(
        f"wrote {path} ({human_bytes(path.stat().st_size)}): {layout!r}, {args.dtype}, "
        f"gate regime {regime}, seed {args.seed}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    source = _open(args.path, args.dtype)
    layout = _resolve_layout([source], args)
    grads = _unpack(source, layout)
    if args.json:
        rows = grad_stats(grads)
        document = {
            "path": args.path,
            "kind": source.kind,
            "dtype": str(source.packed.dtype),
            "layout": layout.to_dict(),
            "gradients": _rows_json(rows),
        }
        print(json.dumps(document, indent=2))
    else:
        print(f"{args.path}: {source.kind}, {source.packed.dtype}, {layout_caption(layout)}")
        print(grads_text(grads))
    return 0


def _compare(args: argparse.Namespace) -> int:
    if Path(args.actual).is_dir():
        return _compare_folder(args)
    if args.tensor is not None:
        return _compare_tensor(args)
    if args.chunk is not None and args.plot is None:
        raise UsageError(
            "--chunk is the chunk length of --tensor h or dh, or of --plot's chunk lines; "
            "give --tensor or --plot"
        )
    actual = _open(args.actual, args.dtype)
    expected = _open(args.expected, args.dtype)
    layout = _resolve_layout([actual, expected], args)
    for source in (actual, expected):
        _unpack(source, layout)  # a length that does not fit the layout is a usage error
    if args.plot is not None:  # fail before the work, not after it
        _check_plot_path(args.plot, force=args.force)
    with actual.unchanged(), expected.unchanged():  # a mapped file that changes is not judged
        judging: Judging = {
            "rtol": args.rtol,
            "atol": args.atol,
            "max_rms_ratio": args.max_rms_ratio,
            "precision": args.precision,
        }
        try:
            if expected.fixture is not None:  # its inputs too: a misreading is re-run
                result = compare(actual.packed, expected.fixture, **judging)
            else:
                result = compare(
                    actual.packed,
                    expected.packed,
                    layout,
                    floors=actual.floors,
                    scales=actual.scales,
                    **judging,
                )
        # A tolerance out of range, a --precision finer than the files' dtypes: refused before
        # any work, and the user's to fix.
        except ValueError as error:
            raise _usage_error(error) from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.table(wide=args.wide))
    if args.plot is not None:
        from .plot import plot_errors

        sys.stdout.flush()
        plot_errors(result, path=args.plot, chunk=args.chunk)
        print(f"wrote {args.plot}")
    return 0 if result.passed else 1


def _compare_folder(args: argparse.Namespace) -> int:
    """``compare OUTPUTS/ SUITE/``: each case's output, ``<case name>.<any suffix>``, against
    the case; then what failed across the cases. A case without its output is listed."""
    from .suites import load_suite
    from .summary import case_result, summarize

    flags = ("rtol", "atol", "max_rms_ratio", "tensor", "plot", "chunk")
    given = [f for f in flags if getattr(args, f) is not None]
    if given:
        named = ", ".join(_FLAGS.get(f, f"--{f}") for f in given)
        raise UsageError(f"a folder of outputs is judged against its suite's floors; drop {named}")
    if not Path(args.expected).is_dir():
        raise UsageError(
            f"{args.expected}: ACTUAL is a folder of outputs, so EXPECTED must be "
            "a suite's folder (gdn-layout fixture --suite DIR)"
        )
    outputs: dict[str, list[Path]] = {}
    for path in sorted(Path(args.actual).iterdir()):
        if path.is_file():
            outputs.setdefault(path.name.split(".", 1)[0], []).append(path)
    results = []
    missing = []
    for case in load_suite(args.expected):
        found = outputs.pop(case.name, [])
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise UsageError(f"{args.actual}: case {case.name} has several outputs: {names}")
        if not found:
            missing.append(case.name)
            continue
        source = _open(str(found[0]), args.dtype)
        _unpack(source, case.layout)  # a length that does not fit the case is a usage error
        with source.unchanged():
            try:
                result = case.compare(source.packed, precision=args.precision)
            except ValueError as error:  # a --precision finer than the buffers
                raise _usage_error(error) from None
        results.append(case_result(case, result))
    if results:
        print(summarize(results, command="cli"))
    for name in missing:
        print(f"no output for case {name}")
    for name in sorted(outputs):
        print(f"not a case of the suite: {', '.join(p.name for p in outputs[name])}")
    return 0 if not missing and all(r.passed for r in results) else 1


def _compare_tensor(args: argparse.Namespace) -> int:
    given = [f for f in ("rtol", "atol", "max_rms_ratio") if getattr(args, f) is not None]
    if given:
        flags = ", ".join(_FLAGS[f] for f in given)
        raise UsageError(f"--tensor is judged against the fixture's floors; drop {flags}")
    if args.plot is not None:  # fail before the work, not after it
        _check_plot_path(args.plot, force=args.force)
    try:
        expected = load_fixture(args.expected)
    except FixtureError as error:
        raise _usage_error(error, "--tensor judges against a gdn-layout fixture: ") from None
    shape = state_shape(expected, args.tensor, args.chunk)
    actual = _open(args.actual, args.dtype)
    flat = actual.packed.reshape(-1)
    if flat.size != math.prod(shape):
        raise UsageError(
            f"{args.actual}: {flat.size} elements, but {args.tensor} of {args.expected} has "
            f"shape {shape} ({math.prod(shape)} elements)"
        )
    try:
        with actual.unchanged():
            result = compare_states(
                flat.reshape(shape),
                expected,
                args.tensor,
                chunk=args.chunk,
                precision=args.precision,
            )
    except (TypeError, ValueError) as error:  # the file's dtype, say: the user's to fix
        raise _usage_error(error, f"{args.actual}: ") from None
    one = Comparison(expected.layout, (result,))  # its causes' words; one panel of a plot
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print("\n".join([str(result), *one.causes()]))
    if args.plot is not None:
        from .plot import plot_errors

        plot_errors(one, path=args.plot, chunk=args.chunk if args.tensor == "y" else None)
        print(f"wrote {args.plot}")
    return 0 if result.passed else 1


def _verify(args: argparse.Namespace) -> int:
    selection = {"min_seq": args.min_seq, "regime": args.regime, "crossing": args.crossing}
    problems = verify_suite(args.suite, **selection, quick=args.quick)
    if problems:
        print(f"{args.suite}: {len(problems)} file(s) differ from {MANIFEST}:")
        for problem in problems:
            print(f"  {problem}")
        return 1
    count = len(suite_files(args.suite, **selection, quick=args.quick))
    chosen = " selected" if args.quick or any(v is not None for v in selection.values()) else ""
    print(f"{args.suite}: {count}{chosen} fixtures match {MANIFEST}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    layout = _layout_from(args)
    # The fixture, then a float32 recomputation beside it.
    needed = int(1.5 * fixture_memory(layout, dtype=np.float64))
    if (why := memory_refusal(layout, needed)) is not None:
        raise UsageError(why)
    with tempfile.TemporaryDirectory(prefix="gdn-layout-demo-") as folder:
        path = Path(folder) / "demo.safetensors"
        print(f"1. the layout of the backward, {layout_caption(layout)}:")
        print(layout_text(layout, np.float64))
        stdout = sys.stdout
        stdout.flush()  # the table first, then any progress bar on stderr
        bar = Progress(enabled=not args.quiet and stderr_is_terminal(), label="float64 reference")
        fixture = make_fixture(
            layout, dtype=np.float64, regime="mixed", seed=args.seed, progress=bar.update
        )
        bar.done()
        save_fixture(path, fixture)
        print(
            f"\n2. a float64 reference fixture: {human_bytes(path.stat().st_size)} of safetensors"
        )
        loaded = load_fixture(path)
        how = "memory-mapped" if loaded.mapped else "into memory (a file under 64 MiB is read)"
        print(f"   reloaded {how}; its gradients, unpacked without a copy:")
        print(grads_text(loaded.grads))
        stdout.flush()
        bar.label = "float32 recomputation"
        recomputed = reference.backward(*loaded.inputs, dtype=np.float32, progress=bar.update)
        bar.done()
        result = compare(
            recomputed, loaded.packed, layout, floors=loaded.floors, scales=loaded.scales
        )
        print("\n3. a float32 recomputation against it, judged against the fixture's floors:")
        print(result)
    print(f"\n{_NEXT_STEP}")
    return 0 if result.passed else 1


#: What the demo ends with: the step after it, making the suite and testing a kernel over it.
_NEXT_STEP: Final = (
    "Next: gdn-layout fixture --suite suite makes the standard suite; a kernel test taking\n"
    "gdn_case runs over its quick set: pytest --gdn-suite suite --gdn-quick test_my_kernel.py"
)


def _check_plot_path(path: str, *, force: bool) -> None:
    require_matplotlib()
    from matplotlib.figure import Figure

    target = Path(path)
    formats = Figure().canvas.get_supported_filetypes()
    if target.suffix.lower().lstrip(".") not in formats:
        raise UsageError(
            f"{path}: name the picture's format by its suffix, one of "
            f"{', '.join('.' + name for name in sorted(formats))}"
        )
    if target.is_dir():
        raise UsageError(f"{path}: is a folder")
    if not force and (target.exists() or target.is_symlink()):
        raise UsageError(f"{path} exists; pass --force to replace it")
    if not target.resolve().parent.is_dir():
        raise UsageError(f"{path}: the folder {target.parent} does not exist")


def _resolve_layout(sources: list[PackedFile], args: argparse.Namespace) -> GdnBackwardLayout:
    """The layout the files state, checked against the flags; else the one the flags give."""
    dims = (args.batch, args.seq, args.heads, args.state_size)
    flagged = None
    if any(d is not None for d in dims) or args.per_channel or args.carry_state:
        if any(d is None for d in dims):
            raise UsageError("give all of --batch, --seq, --heads and --state-size, or none")
        flagged = _checked_layout(
            *dims, per_channel=bool(args.per_channel), carry_state=bool(args.carry_state)
        )
    layout = flagged
    for source in sources:
        if source.layout is None:
            continue
        if layout is not None and source.layout != layout:
            told = "the flags give" if layout is flagged else "the other file has"
            raise UsageError(f"{source.path}: has {source.layout!r}, but {told} {layout!r}")
        layout = source.layout
    if layout is None:
        raise UsageError(
            "no fixture gives the layout: pass --batch, --seq, --heads, --state-size "
            "(and --per-channel, --carry-state as they apply)"
        )
    return layout


def _open(path: str, dtype: str | None) -> PackedFile:
    try:
        return open_packed(path, dtype)
    # Not a packed buffer, a tensor NumPy cannot read (TypeError), or torch missing: the user's.
    except (ValueError, TypeError, ImportError) as error:
        raise _usage_error(error) from None


def _unpack(source: PackedFile, layout: GdnBackwardLayout) -> GdnGrads:
    if not is_floating(source.packed.dtype):
        hint = (
            " (np.save writes bfloat16 as raw void bytes: save the raw bytes and pass --dtype bf16)"
            if source.packed.dtype.kind == "V"
            else ""
        )
        raise UsageError(
            f"{source.path}: a packed gradient has a floating dtype, got {source.packed.dtype}"
            + hint
        )
    if source.packed.ndim != 1:
        raise UsageError(
            f"{source.path}: expected a 1-D packed buffer, got shape {source.packed.shape}"
        )
    if source.packed.shape[0] != layout.total_elems:
        raise UsageError(
            f"{source.path}: {source.packed.shape[0]} elements, but {layout!r} packs "
            f"{layout.total_elems}"
        )
    return unpack(source.packed, layout)
