"""Typed errors. Each one carries a message that says what was wrong and what would work.

The CLI prints ``str(error)`` on one line to stderr and exits non-zero; API users catch
:class:`FlexplanError` (or a subclass).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FlexplanError(Exception):
    """Base class of every error flexplan raises on purpose."""


class UnknownModelError(FlexplanError, LookupError):
    """A model name is neither in the bundled catalog nor a local config/folder."""


class UnknownHardwareError(FlexplanError, LookupError):
    """A hardware name is not in hwdb/."""


class InvalidInputError(FlexplanError, ValueError):
    """An argument is out of range (non-positive length, unknown dtype or policy, ...)."""


class DoesNotFitError(FlexplanError):
    """No policy fits the memory available; the message gives what is needed and what exists."""


class MalformedDataError(FlexplanError, ValueError):
    """A data file (hwdb YAML, model config, calibration file) is corrupt or has wrong fields."""


class CalibrationError(MalformedDataError):
    """A calibration file is corrupt, from another machine or of an unsupported version."""


class UnsupportedModelError(FlexplanError):
    """The executor cannot run this model family layer by layer."""


class DeviceUnavailableError(FlexplanError):
    """A plan or option needs a device (CUDA) that this machine does not have."""


def suggest(name: str, known: Iterable[str], n: int = 3) -> str:
    """' Did you mean: a, b?' for the closest known names, or '' when none is close."""
    known = list(known)
    lowered = {k.lower(): k for k in known}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=n, cutoff=0.5)
    contains = [k for k in known if name.lower() in k.lower() or k.lower().split("/")[-1] in name.lower()]
    picks = list(dict.fromkeys([lowered[c] for c in close] + contains))[:n]
    return f" Did you mean: {', '.join(picks)}?" if picks else ""
