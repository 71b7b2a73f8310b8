"""Every notebook runs top to bottom (shrunk by SMALL = True); its cells assert their claims."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    params = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith("SMALL = False")]
    assert len(params) == 1, f"{path.name}: needs exactly one 'SMALL = False' parameter cell"
    params[0].source = "SMALL = True"
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
