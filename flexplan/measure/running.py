"""Whether a calibration is running in this process: lookups made from inside one (a full
calibration's executor-layer step loads toy models and plans them) get no first-use probe."""

from __future__ import annotations

import threading
from contextlib import contextmanager

_lock = threading.RLock()
_state: dict = {"running": False, "tried": False, "cal": None, "why_not": None}


@contextmanager
def measuring():
    """While a calibration runs: no first-use probe from lookups made inside it."""
    with _lock:
        before, _state["running"] = _state["running"], True
    try:
        yield
    finally:
        with _lock:
            _state["running"] = before
