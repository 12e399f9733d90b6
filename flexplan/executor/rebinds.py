"""A process-wide count of parameter rebindings: each time flexplan points a module's parameter at
other storage (the executor's placement, packing for a CPU kernel), the count goes up.

A caller that checked a module tree's tensors (addresses, dtypes, where they live) at one count may
rely on that check while the count holds: the native decode stack checks its layers' weights once,
not at every step (:class:`flexplan.executor.cpu_decode.FusedStack`).
"""

from __future__ import annotations

_count = [0]


def rebinds() -> int:
    """Parameters pointed at other storage so far, in this process."""
    return _count[0]


def note_rebind() -> None:
    """Call after pointing a parameter at other storage."""
    _count[0] += 1
