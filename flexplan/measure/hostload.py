"""CPU time other processes took while we measured (/proc/stat): a run or calibration made on a
busy host says so, and online correction does not learn from it."""

from __future__ import annotations

import os
import resource


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds all processes spent busy, CPU seconds this process spent), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:3]) + sum(fields[5:8])  # user nice system irq softirq steal (not idle, iowait)
    me = resource.getrusage(resource.RUSAGE_SELF)
    return busy / os.sysconf("SC_CLK_TCK"), me.ru_utime + me.ru_stime


def other_share(start, end, wall_s: float, cores: int) -> float | None:
    """Share of all cores' time that other processes used during the run."""
    if start is None or end is None or wall_s <= 0:
        return None
    others = (end[0] - start[0]) - (end[1] - start[1])
    return round(max(0.0, others) / (wall_s * max(1, os.cpu_count() or cores)), 3)
