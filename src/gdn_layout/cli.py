"""The ``gdn-layout`` command line: docs/cli.md (its exit statuses, escaping and signals too)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from . import reference
from ._checks import require_matplotlib
from ._cli_values import (
    PRECISION_HELP,
    count_arg,
    dtype_arg,
    positive_arg,
    precision_arg,
    tolerance,
)
from ._dtypes import is_floating, resolve
from ._limits import human_bytes, impossible_arrays, memory_refusal
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


#: The library's names of the arguments that commands pass on from flags, and those flags.
_NAMES = ("batch", "seq", "heads", "state_size", "states", "precision", "rtol", "atol")
_FLAGS: Final = {"directory": "--suite", "overwrite": "--force"} | {
    name: "--" + name.replace("_", "-") for name in (*_NAMES, "max_rms_ratio")
}


def _usage_error(error: Exception, where: str = "") -> UsageError:
    """The library's ``error`` as the user's, after ``where``: the argument it names as subject
    ("compare: rtol must ...") or in advice ("pass overwrite=True") named by its flag."""
    text = str(error)
    for subject in (text, text.partition(": ")[2]):  # after the function's name, if any
        name = subject.split(" ", 1)[0].split("[", 1)[0]
        if name in _FLAGS and subject[len(name) :].startswith((" must ", " has ", "[", " '")):
            text = _FLAGS[name] + subject[len(name) :]
            break
    for name, flag in _FLAGS.items():  # a switch takes no value
        text = text.replace(f"pass {name}=True", f"pass {flag}")
        text = text.replace(f"pass {name}=", f"pass {flag}=")
    return UsageError(where + text)


def _shown(name: str) -> str:
    """A file's name escaped if it holds a newline or another control: no forged lines."""
    return name if name.isprintable() else repr(name)[1:-1]


def _quietly(do: Callable[..., object], *args: Any, **options: Any) -> None:
    """``do`` on a stream that may be gone or closed."""
    with contextlib.suppress(OSError, ValueError):
        do(*args, **options)


def _report(line: str) -> None:
    """An error line on stderr; with no stderr (``2>&-``), the exit status still tells."""
    if sys.stderr is not None:
        _quietly(print, line, file=sys.stderr)


def _terminate(signum: int, frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)  # the cleanup is not interrupted in turn
    raise SystemExit(128 + signum)  # so that `with` blocks clean up (the demo's folder)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    with contextlib.ExitStack() as restore:
        for stream in (sys.stdout, sys.stderr):  # escape what the encoding cannot write
            if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
                _quietly(stream.reconfigure, errors="backslashreplace")
                restore.callback(_quietly, stream.reconfigure, errors="strict")
        with contextlib.suppress(AttributeError, ValueError, OSError):  # not the main thread
            previous = signal.signal(signal.SIGTERM, _terminate)
            restore.callback(signal.signal, signal.SIGTERM, previous or signal.SIG_DFL)
        try:
            return _main(argv)
        except KeyboardInterrupt:  # the writers have removed their temporaries on the way out
            clear = "\r\x1b[K" if stderr_is_terminal() else ""  # over the progress bar and ^C
            _report(f"{clear}gdn-layout: interrupted")
            return 128 + signal.SIGINT


def _main(argv: Sequence[str] | None) -> int:
    args, extra = _parser().parse_known_args(argv)
    if extra:  # said by the command that was given, not by the top-level parser
        args.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.run(args))
    except BrokenPipeError:  # the reader went away (`gdn-layout describe | head`), as in Unix
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE
    # The user's to fix; any other exception is a bug, shown with its traceback (exit 1).
    except (UsageError, FixtureError, OSError, ImportError, MemoryError) as error:
        why = "out of memory: " if isinstance(error, MemoryError) else ""
        _report(f"gdn-layout {args.command}: error: {why}{error}")
        return 2


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other user error here."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gdn-layout", description="The packed gradient of GatedDeltaNetBackward.")
    version = f"%(prog)s {__version__}"
    parser.add_argument("--version", action="version", version=version, help="print the version")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    parser.set_defaults(subcommands=commands.choices)

    def command(name: str, run: Callable[..., int], what: str, more: str = "") -> Any:
        made = commands.add_parser(name, help=what, description=f"{what}. {more}".strip())
        made.set_defaults(run=run, layout_defaults=(None, None, None, None, False))
        return made

    describe = command("describe", _describe, "print where each gradient sits in the buffer")
    _layout_flags(describe, (1, 2048, 16, 128))
    describe.add_argument("--dtype", default="float32", type=dtype_arg, help="of the bytes column")
    fixture = command("fixture", _fixture, "write a reference fixture (or the standard suite)")
    _layout_flags(fixture, (2, 64, 3, 16))
    fixture.add_argument("--dtype", default="float32", type=dtype_arg, help="of the tensors")
    regimes = "; ".join(f"{name}: {text}" for name, text in REGIME_SUMMARIES.items())
    fixture.add_argument("--gate-regime", choices=REGIMES, help=f"{regimes} (default: mixed)")
    target = fixture.add_mutually_exclusive_group(required=True)
    target.add_argument("-o", "--output", metavar="PATH", help="the fixture (.safetensors)")
    target.add_argument("--suite", metavar="DIR", help="write the standard suite into DIR")
    fixture.add_argument(
        "--states", type=positive_arg, metavar="CHUNK", help="keep h and dh every CHUNK"
    )
    fixture.add_argument("--force", action="store_true", help="replace existing files")
    fixture.add_argument("--any-suffix", action="store_true", help="-o PATH of any suffix")
    cores = "threads for a fixture, processes for a suite (default: every core)"
    fixture.add_argument("--workers", type=positive_arg, metavar="N", help=cores)
    inspect = command("inspect", _inspect, "per-gradient statistics of a packed buffer")
    inspect.add_argument("path", metavar="PATH", help=FILE_KINDS)
    _file_flags(inspect)
    kinds = f"Exit 0 passed, 1 failed, 2 for a user error. Each file is {FILE_KINDS}."
    compare_ = command("compare", _compare, "judge a kernel's packed gradient", kinds)
    outputs = "the kernel's packed gradient, or a folder of outputs named after the suite's cases"
    compare_.add_argument("actual", metavar="ACTUAL", help=outputs)
    compare_.add_argument("expected", metavar="EXPECTED", help="a fixture, or a suite's folder")
    _file_flags(compare_)
    for flag, what in [
        ("--rtol", "relative tolerance"),
        ("--atol", "absolute tolerance"),
        ("--max-rms-ratio", "most rms(actual - expected) / rms(expected)"),
    ]:
        compare_.add_argument(
            flag, type=tolerance, metavar="X|dq=X,...", help=f"{what}, or per grad"
        )
    compare_.add_argument("--precision", type=precision_arg, metavar="CLASS", help=PRECISION_HELP)
    compare_.add_argument("--wide", action="store_true", help="every column, past 100 characters")
    compare_.add_argument("--plot", metavar="FILE", help="also write heatmaps (needs [plot])")
    compare_.add_argument("--force", action="store_true", help="replace an existing --plot file")
    compare_.add_argument("--tensor", choices=STATE_TENSORS, help="ACTUAL is this of its output")
    compare_.add_argument(
        "--chunk", type=positive_arg, metavar="C", help="h and dh's chunk; --plot's lines"
    )
    statuses = "Exit 0 intact, 1 some files differ (listed), 2 no readable manifest."
    verify = command("verify", _verify, "check a suite's files against its manifest", statuses)
    verify.add_argument("suite", metavar="SUITE", help="the suite's folder")
    verify.add_argument(
        "--min-seq", type=count_arg, metavar="S", help="only cases of S steps or more"
    )
    verify.add_argument("--regime", choices=REGIMES, help="only the cases of this gate regime")
    verify.add_argument(
        "--crossing", type=positive_arg, metavar="C", help="only cases crossing C-step chunks"
    )
    verify.add_argument("--quick", action="store_true", help="only the quick set (README.md)")
    demo = command("demo", _demo, "the whole round trip on a small case (the main job)")
    _layout_flags(demo, (2, 64, 3, 16), on=True)
    for made in (fixture, demo):
        made.add_argument("--seed", type=count_arg, default=0, help="of the inputs (0)")
        made.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    for made in (describe, inspect, compare_):
        made.add_argument("--json", action="store_true", help="print JSON for machines")
    return parser


def _layout_flags(parser: Any, defaults: Sequence[int | None], on: bool = False) -> Any:
    """The layout's flags and ``defaults`` (None: from a file); with ``on``, per-channel and
    carried unless ``--no-...``."""
    group = parser.add_argument_group("layout")
    parser.set_defaults(layout_defaults=(*defaults, on))
    for (flag, what), default in zip(_DIMS.items(), defaults, strict=True):
        told = "" if default is None else f" (default: {default})"
        group.add_argument(flag, f"-{what[-1]}", type=count_arg, help=what + told)
    action = argparse.BooleanOptionalAction if on else "store_true"
    group.add_argument(
        "--per-channel", action=action, default=None, help="g is per key channel: [B, S, H, N]"
    )
    group.add_argument(
        "--carry-state", action=action, default=None, help="an initial state: dstate is packed"
    )
    return group


_DIMS = {"--batch": "batch B", "--seq": "steps S", "--heads": "heads H", "--state-size": "size N"}


def _file_flags(parser: argparse.ArgumentParser) -> None:
    """What a file that is no fixture holds: its layout and, for a raw file, its dtype."""
    group = _layout_flags(parser, (None,) * 4)
    group.add_argument("--dtype", type=dtype_arg, help="the dtype of a raw binary file")


def _layout(args: argparse.Namespace, sources: Iterable[PackedFile] = ()) -> GdnBackwardLayout:
    """The layout the flags (or the command's defaults) give, else the files'; files that
    state one must agree with it."""
    *defaults, on = args.layout_defaults
    given = (args.batch, args.seq, args.heads, args.state_size)
    dims = tuple(d if g is None else g for g, d in zip(given, defaults, strict=True))
    per_channel = on if args.per_channel is None else args.per_channel
    carry_state = on if args.carry_state is None else args.carry_state
    layout = flagged = None
    if any(d is not None for d in dims) or per_channel or carry_state:
        if None in dims:
            raise UsageError("give all of --batch, --seq, --heads and --state-size, or none")
        try:
            b, s, h, n = dims
            layout = flagged = GdnBackwardLayout(
                b, s, h, n, gate_per_channel=per_channel, carry_state=carry_state
            )
        except ValueError as error:
            raise _usage_error(error) from None
        if (why := impossible_arrays(layout)) is not None:
            raise UsageError(why)
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


def _print_json(document: dict[str, Any], rows: Sequence[Any] = ()) -> int:
    """``document`` as JSON, with a table's ``rows`` as its "gradients"."""
    gradients = [{**row._asdict(), "shape": list(row.shape)} for row in rows]
    print(json.dumps(document | ({"gradients": gradients} if rows else {}), indent=2))
    return 0


def _describe(args: argparse.Namespace) -> int:
    layout = _layout(args)  # and the dtype's name: bytes need no optional package (bfloat16)
    if not args.json:
        print(layout_text(layout, args.dtype))
        return 0
    nbytes = layout.nbytes(args.dtype)
    document = {"layout": layout.to_dict(), "dtype": args.dtype, "total_elems": layout.total_elems}
    return _print_json(document | {"nbytes": nbytes}, layout_table(layout, args.dtype))


def _fixture(args: argparse.Namespace) -> int:
    try:
        return _write_fixtures(args, resolve(args.dtype, "--dtype"))
    # The library refuses an argument: an existing file without --force, a --suite folder that
    # holds the current one, --states past its limit.
    except (FileExistsError, ValueError) as error:
        raise _usage_error(error) from None


def _write_fixtures(args: argparse.Namespace, dtype: np.dtype[Any]) -> int:
    told = {"dtype": dtype, "seed": args.seed, "workers": args.workers}
    if args.suite is not None:
        names = ("batch", "seq", "heads", "state_size", "per_channel", "carry_state", "gate_regime")
        if given := [n for n in names if getattr(args, n) is not None]:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise UsageError(f"--suite writes its own layouts and regimes; drop {flags}")
        if args.states is not None:
            raise UsageError("--suite writes no states; drop --states")
        # A bar on a terminal; off one (a CI log), a line at every tenth and every few seconds.
        progress = Progress(enabled=not args.quiet, label="suite", lines=not stderr_is_terminal())
        paths = write_suite(args.suite, overwrite=args.force, progress=progress.update, **told)
        progress.done()
        size = human_bytes(sum(path.stat().st_size for path in paths))
        print(f"wrote {len(paths)} fixtures and manifest.json to {args.suite} ({size})")
        return 0
    if not args.any_suffix and not args.output.lower().endswith(".safetensors"):
        raise UsageError(
            f"{args.output}: a fixture is a safetensors file; name it *.safetensors "
            "(or pass --any-suffix)"
        )
    layout = _layout(args)
    needed = fixture_memory(layout, dtype=dtype, states=args.states, workers=args.workers)
    if (why := memory_refusal(layout, needed, states=args.states)) is not None:
        raise UsageError(why)
    regime = args.gate_regime or "mixed"
    progress = Progress(enabled=not args.quiet and stderr_is_terminal())
    made = make_fixture(layout, regime=regime, states=args.states, progress=progress.update, **told)
    path = save_fixture(args.output, made, overwrite=args.force)
    progress.done()
    size = human_bytes(path.stat().st_size)
    print(
        f"wrote {path} ({size}): {layout!r}, {args.dtype}, gate regime {regime}, seed {args.seed}"
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    source = _open(args.path, args.dtype)
    layout = _layout(args, [source])
    grads = _unpack(source, layout)
    if not args.json:
        print(f"{args.path}: {source.kind}, {source.packed.dtype}, {layout_caption(layout)}")
        print(grads_text(grads))
        return 0
    kind = {"path": args.path, "kind": source.kind, "dtype": str(source.packed.dtype)}
    return _print_json(kind | {"layout": layout.to_dict()}, grad_stats(grads))


def _judging(args: argparse.Namespace, refused: str = "") -> Judging:
    """The tolerances given; where ``refused`` says they do not apply, none may be."""
    judging: Judging = {"rtol": args.rtol, "atol": args.atol, "max_rms_ratio": args.max_rms_ratio}
    if refused and (given := [_FLAGS[name] for name, v in judging.items() if v is not None]):
        raise UsageError(f"{refused}; drop {', '.join(given)}")
    return {**judging, "precision": args.precision}


def _compare(args: argparse.Namespace) -> int:
    if Path(args.actual).is_dir():
        return _compare_folder(args)
    if args.tensor is None and args.chunk is not None and args.plot is None:
        raise UsageError(
            "--chunk is the chunk length of --tensor h or dh, or of --plot's chunk lines; "
            "give --tensor or --plot"
        )
    if args.plot is not None:  # fail before the work, not after it
        _check_plot_path(args.plot, force=args.force)
    if args.tensor is not None:
        return _compare_tensor(args)
    actual, expected = _open(args.actual, args.dtype), _open(args.expected, args.dtype)
    layout = _layout(args, [actual, expected])
    for source in (actual, expected):
        _unpack(source, layout)  # a length that does not fit the layout is a usage error
    judging = _judging(args)
    with actual.unchanged(), expected.unchanged():  # a mapped file that changes is not judged
        try:
            if expected.fixture is not None:  # its inputs too: a misreading is re-run
                result = compare(actual.packed, expected.fixture, **judging)
            else:
                floors, scales = actual.floors, actual.scales
                result = compare(
                    actual.packed, expected.packed, layout, floors=floors, scales=scales, **judging
                )
        except ValueError as error:  # a tolerance out of range, a --precision too fine
            raise _usage_error(error) from None
    return _verdict(args, result, result.table(wide=args.wide), result, args.chunk)


def _verdict(
    args: argparse.Namespace, result: Any, text: str, drawn: Comparison, chunk: Any
) -> int:
    """Print ``text`` (or ``result`` as JSON), draw ``drawn`` if asked; ``result``'s status."""
    print(json.dumps(result.to_dict(), indent=2) if args.json else text)
    if args.plot is not None:
        from .plot import plot_errors

        sys.stdout.flush()
        plot_errors(drawn, path=args.plot, chunk=chunk)
        print(f"wrote {args.plot}")
    return 0 if result.passed else 1


def _outputs(folder: Path) -> dict[str, list[Path]]:
    """The one rule for which files are outputs: those of ``folder`` by the case they name,
    ``<case name>.<any suffix>``, but for sidecars, which extend another file's name
    (``case.bin.json`` goes with ``case.bin``)."""
    names = {path.name for path in folder.iterdir() if path.is_file()}
    outputs: dict[str, list[Path]] = {}
    for name in sorted(names):
        if name.rsplit(".", 1)[0] not in names - {name}:
            outputs.setdefault(name.split(".", 1)[0], []).append(folder / name)
    return outputs


def _compare_folder(args: argparse.Namespace) -> int:
    """``compare OUTPUTS/ SUITE/``: each case's output against the case, then the summary."""
    from .suites import load_suite
    from .summary import summarize

    refused = "a folder of outputs is judged against its suite's floors"
    if named := [f"--{f}" for f in ("tensor", "plot", "chunk") if getattr(args, f) is not None]:
        raise UsageError(f"{refused}; drop {', '.join(named)}")
    _judging(args, refused)
    if not Path(args.expected).is_dir():
        raise UsageError(
            f"{args.expected}: ACTUAL is a folder of outputs, so EXPECTED must be "
            "a suite's folder (gdn-layout fixture --suite DIR)"
        )
    outputs = _outputs(Path(args.actual))
    results, missing = [], []
    if not (cases := load_suite(args.expected)):  # nothing judged is no pass
        raise UsageError(f"{args.expected}: the suite's {MANIFEST} lists no cases to judge")
    for case in cases:
        found = outputs.pop(case.name, [])
        if len(found) > 1:
            names = ", ".join(_shown(path.name) for path in found)
            raise UsageError(f"{args.actual}: case {case.name} has several outputs: {names}")
        if not found:
            missing.append(case.name)
            continue
        source = _open(str(found[0]), args.dtype)
        if source.fixture is not None:  # `compare SUITE/ SUITE/` would pass every case
            raise UsageError(f"{found[0]}: a fixture, not a kernel's output; ACTUAL holds outputs")
        _unpack(source, case.layout)  # a length that does not fit the case is a usage error
        with source.unchanged():
            try:
                results.append((case, case.compare(source.packed, precision=args.precision)))
            except ValueError as error:  # a --precision finer than the buffers
                raise _usage_error(error) from None
    if results:
        print(summarize(results, command="cli"))
    for name in missing:
        print(f"no output for case {_shown(name)}")
    for _, paths in sorted(outputs.items()):
        print(f"not a case of the suite: {', '.join(_shown(path.name) for path in paths)}")
    return 0 if not missing and all(result.passed for _, result in results) else 1


def _compare_tensor(args: argparse.Namespace) -> int:
    _judging(args, "--tensor is judged against the fixture's floors")
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
            state, chunk, precision = flat.reshape(shape), args.chunk, args.precision
            result = compare_states(state, expected, args.tensor, chunk=chunk, precision=precision)
    except (TypeError, ValueError) as error:  # the file's dtype, say: the user's to fix
        raise _usage_error(error, f"{args.actual}: ") from None
    one = Comparison(expected.layout, (result,))  # its causes' words; one panel of a plot
    text = "\n".join([str(result), *one.causes()])
    return _verdict(args, result, text, one, args.chunk if args.tensor == "y" else None)


def _verify(args: argparse.Namespace) -> int:
    selection = {"min_seq": args.min_seq, "regime": args.regime, "crossing": args.crossing}
    if problems := verify_suite(args.suite, **selection, quick=args.quick):
        print(f"{args.suite}: {len(problems)} file(s) differ from {MANIFEST}:")
        print("\n".join(f"  {problem}" for problem in problems))
        return 1
    count = len(suite_files(args.suite, **selection, quick=args.quick))
    chosen = " selected" if args.quick or any(v is not None for v in selection.values()) else ""
    print(f"{args.suite}: {count}{chosen} fixtures match {MANIFEST}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    layout = _layout(args)
    needed = int(1.5 * fixture_memory(layout, dtype=np.float64))  # and a float32 recomputation
    if (why := memory_refusal(layout, needed)) is not None:
        raise UsageError(why)
    bar = Progress(enabled=not args.quiet and stderr_is_terminal(), label="float64 reference")
    with tempfile.TemporaryDirectory(prefix="gdn-layout-demo-") as folder:
        path = Path(folder) / "demo.safetensors"
        print(f"1. the layout of the backward, {layout_caption(layout)}:")
        print(layout_text(layout, np.float64), flush=True)  # before any progress bar on stderr
        save_fixture(
            path, make_fixture(layout, dtype=np.float64, seed=args.seed, progress=bar.update)
        )
        bar.done()
        print(
            f"\n2. a float64 reference fixture: {human_bytes(path.stat().st_size)} of safetensors"
        )
        loaded = load_fixture(path)
        how = "memory-mapped" if loaded.mapped else "into memory (a file under 64 MiB is read)"
        print(f"   reloaded {how}; its gradients, unpacked without a copy:")
        print(grads_text(loaded.grads), flush=True)
        bar.label = "float32 recomputation"
        recomputed = reference.backward(*loaded.inputs, dtype=np.float32, progress=bar.update)
        bar.done()
        floors, scales = loaded.floors, loaded.scales
        result = compare(recomputed, loaded.packed, layout, floors=floors, scales=scales)
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

    target, formats = Path(path), Figure().canvas.get_supported_filetypes()
    if target.suffix.lower().lstrip(".") not in formats:
        suffixes = ", ".join("." + name for name in sorted(formats))
        raise UsageError(f"{path}: name the picture's format by its suffix, one of {suffixes}")
    if target.is_dir():
        raise UsageError(f"{path}: is a folder")
    if not force and (target.exists() or target.is_symlink()):
        raise UsageError(f"{path} exists; pass --force to replace it")
    if not target.resolve().parent.is_dir():
        raise UsageError(f"{path}: the folder {target.parent} does not exist")


def _open(path: str, dtype: str | None) -> PackedFile:
    try:
        return open_packed(path, dtype)
    # Not a packed buffer, a tensor NumPy cannot read (TypeError), or torch missing: the user's.
    except (ValueError, TypeError, ImportError) as error:
        raise _usage_error(error) from None


def _unpack(source: PackedFile, layout: GdnBackwardLayout) -> GdnGrads:
    packed, path = source.packed, source.path
    if not is_floating(packed.dtype):
        void = " (np.save writes bfloat16 as raw void bytes: save the raw bytes, pass --dtype bf16)"
        hint = void if packed.dtype.kind == "V" else ""
        raise UsageError(
            f"{path}: a packed gradient has a floating dtype, got {packed.dtype}{hint}"
        )
    if packed.ndim != 1:
        raise UsageError(f"{path}: expected a 1-D packed buffer, got shape {packed.shape}")
    if packed.shape[0] != layout.total_elems:
        total = layout.total_elems
        raise UsageError(f"{path}: {packed.shape[0]} elements, but {layout!r} packs {total}")
    return unpack(packed, layout)
