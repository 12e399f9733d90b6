"""A non-editable `pip install .` carries every package and its data (hwdb YAML, model catalog)."""

import os
import sys

if sys.version_info >= (3, 11):
    import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_package_is_listed_in_pyproject():
    cfg = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {os.path.relpath(root, REPO).replace(os.sep, ".")
             for root, _, files in os.walk(os.path.join(REPO, "flexplan")) if "__init__.py" in files}
    assert found <= listed, f"add to pyproject [tool.setuptools] packages: {sorted(found - listed)}"
    assert cfg["package-dir"]["flexplan._hwdb"] == "hwdb" and "flexplan._hwdb" in listed
    assert os.path.isfile(os.path.join(REPO, "hwdb", "__init__.py"))
    assert "*.yaml" in cfg["package-data"]["flexplan._hwdb"]
    assert "*.c" in cfg["package-data"]["flexplan.executor"]  # native_gemv.c, compiled on first use
    # calibration files of real machines ship too, so a non-editable install on one finds its file
    assert cfg["package-dir"]["flexplan._calibration"] == "calibration" and "flexplan._calibration" in listed
    assert os.path.isfile(os.path.join(REPO, "calibration", "__init__.py"))
    assert "*.yaml" in cfg["package-data"]["flexplan._calibration"]
