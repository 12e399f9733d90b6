"""The factors layer: how fast this machine really is, as the planner reads it.

Stored calibrations (``store``), the efficiency factors derived from them (``efficiency``,
``layer_fit``), the memory-state law that brings a calibration's rows to one reference state
and scales them to a state a caller measured (``memory_state``), and the corrections learned
from runs (``correction``, ``correction_store``). It imports nothing from the executor, ``api``
or the measuring harness (``flexplan.measure``), and it never measures: ``plan()`` reads it in
milliseconds. Which factors a plan used, and how old they are, is a typed
:class:`~flexplan.estimator.efficiency.FactorSource` (``Efficiency.origin``, ``Plan.factors``).
"""

from __future__ import annotations

from flexplan.errors import CalibrationError, FlexplanError
from flexplan.estimator.efficiency import Efficiency
from flexplan.factors.calibrated import (
    AtState,
    _calibrated,
    _derive,
    calibrated_factors,
    calibration_for,
    factors_from_file,
    factors_of,
    is_local,
    uncalibrated_defaults,
)
from flexplan.factors.correction_store import corrected
from flexplan.hardware import get_hardware
from flexplan.hardware.spec import Hardware

__all__ = ["CalibrationError", "calibrated_cpu_threads", "calibrated_factors", "calibration_for", "efficiency_for",
           "efficiency_from_file", "is_local", "uncalibrated_defaults"]


def efficiency_for(hw: Hardware, at_state: AtState | None = None) -> Efficiency:
    """The factors ``plan()`` uses for ``hw``: this machine's calibration when ``hw`` is local
    and one exists (defaults otherwise, ``source`` saying why), ``at_state`` applied when the
    caller measured a state (``measure.state.efficiency_now``), the runs' online corrections last."""
    cal = calibration_for(hw)
    return corrected(factors_of(cal, hw, at_state), hw, cal)  # the file looked up once


def efficiency_from_file(path, hw: Hardware, at_state: AtState | None = None) -> Efficiency:
    """Factors of ``hw`` from one named calibration file (a ``--calibration`` option), without
    corrections: it must be this machine's. Raises CalibrationError otherwise."""
    return factors_from_file(path, hw, at_state)


def calibrated_cpu_threads() -> tuple[int | None, str]:
    """(the CPU thread count this machine's calibration found fastest, where it comes from), or
    (None, why not): no calibration, no thread sweep in it, or no hardware model of this machine.
    ``flexplan.load`` gives it to the executor when the caller names no thread count."""
    try:
        hw = get_hardware("local")
        cal = calibration_for(hw)
        if cal is None:
            return None, "no calibration of this machine"
        threads = _calibrated(cal, hw).cpu_threads()
    except FlexplanError as e:
        return None, f"calibration unusable ({' '.join(str(e).split())[:120]})"
    if not threads:
        return None, f"{cal.describe()} has no thread sweep"
    return int(threads), f"calibrated: fastest in the thread sweep of {cal.describe()}"
