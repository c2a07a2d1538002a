"""The example notebook runs in a real Jupyter kernel and its pictures appear with no magic."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest


def _require(module: str, extra: str) -> Any:
    if os.environ.get("GDN_LAYOUT_NOTEBOOK_REQUIRED"):  # .ci/run: fail, never skip
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"needs gdn-layout[{extra}]")


nbformat = _require("nbformat", "notebook")
nbclient = _require("nbclient", "notebook")
_require("ipykernel", "notebook")
_require("matplotlib", "plot")

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "find-a-wrong-gradient.ipynb"
KERNEL = "gdn-layout-test"
#: Saves the executed notebook there when set, to look at its outputs.
KEEP = "GDN_LAYOUT_EXECUTED_NOTEBOOK"


def _code_cells(notebook: Any) -> list[Any]:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def test_notebook_is_stored_without_outputs_or_magic() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    for cell in _code_cells(notebook):
        assert cell.outputs == [], cell.source
        assert cell.execution_count is None, cell.source
        assert "%matplotlib" not in cell.source
        assert "display(" not in cell.source
        assert "pyplot" not in cell.source


@pytest.mark.slow
def test_notebook_runs_and_its_plotting_cells_show_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kernel spec of this interpreter, first on the search path: the notebook runs against
    # the gdn-layout under test, whatever "python3" kernel the machine has installed.
    spec = tmp_path / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    spec.joinpath("kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Afterwards: did anything fall back on pyplot, whose inline backend shows any Figure?
    # Then, with that backend on, a picture must still appear once, not twice.
    notebook.cells += [
        nbformat.v4.new_code_cell("import sys; print('matplotlib.pyplot' in sys.modules)"),
        nbformat.v4.new_code_cell("%matplotlib inline\nreport.plot()"),
    ]
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=KERNEL,
        timeout=600,
        resources={"metadata": {"path": str(tmp_path)}},  # run where the test may write
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    if os.environ.get(KEEP):
        nbformat.write(notebook, os.environ[KEEP])
    *cells, check, inline = _code_cells(notebook)
    assert check.outputs[0].text.strip() == "False"
    assert ["image/png" in out.get("data", {}) for out in inline.outputs] == [True]
    plotting = [cell for cell in cells if ".plot(" in cell.source]
    assert len(plotting) == 5
    for cell in plotting:
        kinds = [set(out.get("data", {})) for out in cell.outputs]
        assert len(kinds) == 1, cell.source  # one picture, shown once
        assert "image/png" in kinds[0], cell.source
    tables = [cell for cell in cells if cell.source.rstrip().endswith(("report", "layout"))]
    assert len(tables) == 4
    for cell in tables:
        assert "text/html" in cell.outputs[-1].data, cell.source
    for cell in cells:
        assert all(out.output_type != "error" for out in cell.outputs)
        assert all(out.get("name") != "stderr" for out in cell.outputs), cell.source
