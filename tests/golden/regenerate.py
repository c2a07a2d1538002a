"""Rebuild ``layout_golden.json`` from the Rust seed.

Run as a script to rewrite the committed table; tests import :func:`build_table` to check that
the committed table still matches what the seed computes.

The seed is ``src/gdn.rs`` of the ``rlx-ir`` crate, in the RLX repository
(https://github.com/MIT-RLX/rlx): set ``GDN_SEED`` to the path of a copy of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

GOLDEN_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = GOLDEN_DIR.parent.parent
GENERATOR = GOLDEN_DIR / "gen_golden.rs"
TABLE = GOLDEN_DIR / "layout_golden.json"


#: Where to get the seed, for the messages that find none.
HOW_TO_GET_THE_SEED = (
    "set GDN_SEED to a copy of rlx-ir's src/gdn.rs, from the RLX repository "
    "(https://github.com/MIT-RLX/rlx)"
)


def default_seed_path() -> Path:
    """The seed this project mirrors: ``$GDN_SEED``, else a copy kept beside the project."""
    override = os.environ.get("GDN_SEED")
    if override:
        return Path(override)
    return PROJECT_ROOT.parent / "shared" / "seed" / "gdn.rs"


def build_table(seed_path: Path, workdir: Path) -> dict[str, Any]:
    """Compile the generator against the seed in ``workdir``, run it, return its table."""
    workdir.mkdir(parents=True, exist_ok=True)
    # The generator says `mod gdn;`, so the seed must sit beside it as gdn.rs.
    shutil.copyfile(GENERATOR, workdir / "main.rs")
    shutil.copyfile(seed_path, workdir / "gdn.rs")
    binary = workdir / "gen_golden"
    # No -O, and overflow checks forced on anyway: overflow must panic, never wrap.
    subprocess.run(
        [
            "rustc",
            "--edition",
            "2021",
            "-C",
            "overflow-checks=on",
            "main.rs",
            "-o",
            binary.name,
        ],
        cwd=workdir,
        check=True,
        capture_output=True,
        text=True,
    )
    result = subprocess.run([str(binary)], cwd=workdir, check=True, capture_output=True, text=True)
    table: dict[str, Any] = json.loads(result.stdout)
    return table


def render(table: dict[str, Any]) -> str:
    """The table as JSON with the header first and one case per line, for readable diffs."""
    header = [
        f"  {json.dumps(key)}: {json.dumps(value)}"
        for key, value in table.items()
        if key != "cases"
    ]
    cases = ",\n".join(f"    {json.dumps(case)}" for case in table["cases"])
    return "{\n" + ",\n".join([*header, f'  "cases": [\n{cases}\n  ]']) + "\n}\n"


def main() -> int:
    seed = default_seed_path()
    if not seed.is_file():
        print(f"the seed is not found: {HOW_TO_GET_THE_SEED}", file=sys.stderr)
        return 1
    if shutil.which("rustc") is None:
        print("rustc is not on PATH", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        try:
            table = build_table(seed, Path(tmp))
        except subprocess.CalledProcessError as err:
            print(f"{err.cmd[0]} failed:\n{err.stderr}", file=sys.stderr)
            return 1
    TABLE.write_text(render(table), encoding="utf-8")
    overflow = sum(1 for case in table["cases"] if case.get("overflow"))
    print(f"wrote {TABLE}: {len(table['cases'])} cases, {overflow} overflow")
    return 0


if __name__ == "__main__":
    sys.exit(main())
