"""The package version, in one place (flexplan.__version__ and calibration files read it)."""

__version__ = "0.1.0"
