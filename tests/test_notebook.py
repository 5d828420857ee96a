"""CI executes the quickstart notebook so it cannot rot."""

from __future__ import annotations

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("QUICKSTART_STEPS", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert (ROOT / "outputs" / "quickstart" / "notebook" / "quickstart.png").is_file()
    # the plot shows inline (an image output), not only as a file
    assert any("image/png" in o.get("data", {}) for o in outputs if o.get("output_type") == "display_data")
