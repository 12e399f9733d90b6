"""This machine's calibration and the factors derived from it: a pure read of stored files.

:func:`calibration_for` finds the calibration file of the local machine (none for hwdb
hardware); :func:`calibrated_factors` derives its efficiency factors once per process per file
version, optionally scaled by a caller's state function (``measure.state`` probes the memory
state of now and passes ``at_state_now``). Nothing here measures, probes or writes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from flexplan.errors import CalibrationError
from flexplan.estimator.efficiency import DefaultEfficiency, Efficiency, FactorSource, cpu_path
from flexplan.factors.efficiency import from_measurements
from flexplan.factors.store import (
    RERUN,
    Calibration,
    check_belongs_here,
    display_path,
    find_calibration,
    load_calibration,
)
from flexplan.hardware.spec import Hardware

# how to make factors where none are stored (the planner then uses the defaults)
HOW_TO = "run `flexplan calibrate --probe` (seconds), `--quick` (about 2 minutes on 2 cores) or `flexplan calibrate`"

# a caller's scaling of calibrated factors to a state measured now: (factors, measurements) -> factors
AtState = Callable[[Efficiency, dict], Efficiency]


def is_local(hw: Hardware) -> bool:
    """Calibrations describe this machine only: Hardware named "local" (or "local+...")."""
    return hw.name.startswith("local")


def calibration_for(hw: Hardware) -> Calibration | None:
    """The :class:`~flexplan.factors.store.Calibration` that applies to ``hw``, or None (hwdb
    hardware, or no calibration file of this machine). Raises CalibrationError for a corrupt or
    foreign file. Never measures: ``flexplan calibrate --probe`` (or ``measure.first_use``) makes one."""
    return find_calibration() if is_local(hw) else None


def uncalibrated_defaults(hw: Hardware) -> DefaultEfficiency:
    """DefaultEfficiency of ``hw`` whose ``source`` says that no calibration is used and how to make one."""
    eff = DefaultEfficiency.for_hardware(hw)
    return replace(eff, source=f"defaults ({cpu_path(hw)} CPU; not calibrated: no calibration of this machine: "
                              f"{HOW_TO})")


def calibrated_factors(hw: Hardware, at_state: AtState | None = None) -> Efficiency:
    """The factors of ``hw`` before online corrections: from this machine's calibration file when
    ``hw`` is local and one exists (``at_state`` applied to them when given), else the defaults."""
    return factors_of(calibration_for(hw), hw, at_state)


def factors_of(cal: Calibration | None, hw: Hardware, at_state: AtState | None = None) -> Efficiency:
    """:func:`calibrated_factors` for a calibration already looked up (None: the defaults)."""
    if cal is None:
        return uncalibrated_defaults(hw) if is_local(hw) else DefaultEfficiency.for_hardware(hw)
    eff = _calibrated(cal, hw)
    return at_state(eff, cal.measurements) if at_state is not None else eff


def factors_from_file(path, hw: Hardware, at_state: AtState | None = None) -> Efficiency:
    """Factors of ``hw`` from one named calibration file (a ``--calibration`` option): it must
    be this machine's. Raises CalibrationError otherwise."""
    cal = load_calibration(path)
    check_belongs_here(cal)
    eff = _calibrated(cal, hw)
    return at_state(eff, cal.measurements) if at_state is not None else eff


_DERIVED: dict[tuple[int, str], tuple[object, Efficiency]] = {}  # (id(cal), repr(hw)) -> (cal, factors)


def _calibrated(cal: Calibration, hw: Hardware) -> Efficiency:
    """Factors of ``hw`` from ``cal``, derived once per process per (file version, hardware)."""
    key = (id(cal), repr(hw))
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is cal:
        return hit[1]
    eff = _derive(cal, hw)
    if len(_DERIVED) > 64:
        _DERIVED.clear()
    _DERIVED[key] = (cal, eff)
    return eff


def _derive(cal: Calibration, hw: Hardware) -> Efficiency:
    measured = cal.doc["settings"]["cpu_dtypes"]
    parts = [cal.describe()]  # its age when first derived in this process; origin.age_s() is exact
    if hw.cpu.compute_dtype not in measured:
        parts.append(f"CPU {hw.cpu.compute_dtype} not measured (only {', '.join(measured)}): defaults for it")
    if hw.gpu is not None and not cal.measurements.get("gpu_gemm"):
        parts.append("GPU factors: defaults (no GPU part)")
    try:
        eff = from_measurements(cal.measurements, cal.doc["settings"], hw, "; ".join(parts))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CalibrationError(f"calibration file {display_path(cal.path)}: malformed measurements "
                               f"({type(e).__name__}: {e}); {RERUN}") from None
    return replace(eff, origin=FactorSource("calibration", str(cal.path), cal.doc.get("mode"), cal.created.timestamp()))
