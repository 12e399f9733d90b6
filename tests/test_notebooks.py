"""The notebooks execute headless (policy maps; validation error on a committed validation CSV)."""

import glob
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))


# the policy maps (two sweeps of the planner, ~9 s) run in the slow set; the default run executes one
# notebook (a kernel started, cells run, outputs read)
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if "policy_maps" in p else p
                                  for p in NOTEBOOKS], ids=os.path.basename)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    # the policy maps save their figures where they run: a temporary folder, not the checkout
    cwd = str(tmp_path) if "policy_maps" in path else os.path.dirname(path)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": cwd}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if o.output_type == "stream")
    if "policy_maps" in path:
        assert "mean predicted E2E reduction vs FlexGen" in printed
    else:
        assert "MAPE" in printed


def test_two_notebooks():
    assert {os.path.basename(p) for p in NOTEBOOKS} >= {"policy_maps.ipynb", "validation_error.ipynb"}
