"""How fast this machine really is: ``flexplan calibrate`` and the factors it yields.

The calibrator measures (``microbench``, ``stream``; torch, imported only by ``flexplan
calibrate``), stores absolute figures in a versioned YAML file (``store``), and turns them into
shape-dependent efficiency factors for the estimator (``efficiency``). It never plans.

This module imports nothing heavy: ``flexplan hw`` and ``flexplan.plan()`` call
:func:`efficiency_for` and :func:`describe_calibration`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexplan.errors import CalibrationError

if TYPE_CHECKING:  # pragma: no cover
    from flexplan.estimator.efficiency import Efficiency
    from flexplan.hardware.spec import Hardware

__all__ = ["CalibrationError", "calibrated_cpu_threads", "calibration_for", "describe_calibration", "efficiency_for",
           "efficiency_from_file", "is_local"]


def is_local(hw: "Hardware") -> bool:
    """Calibrations describe this machine only: Hardware named "local" (or "local+...")."""
    return hw.name.startswith("local")


def calibration_for(hw: "Hardware"):
    """The :class:`~flexplan.calibration.store.Calibration` that applies to ``hw``, or None
    (hwdb hardware, or no calibration of this machine). Raises CalibrationError for a corrupt
    or foreign file."""
    if not is_local(hw):
        return None
    from flexplan.calibration.store import find_calibration

    return find_calibration()


def efficiency_for(hw: "Hardware") -> "Efficiency":
    """CalibratedEfficiency from this machine's calibration file when ``hw`` is the local
    machine and one exists; DefaultEfficiency otherwise. ``source`` says which and how old.
    The runs' online corrections (``correction_store``) are applied last."""
    from flexplan.calibration.correction_store import corrected
    from flexplan.estimator.efficiency import DefaultEfficiency

    cal = calibration_for(hw)
    eff = DefaultEfficiency.for_hardware(hw) if cal is None else _at_state_now(_calibrated(cal, hw), cal)
    return corrected(eff, hw, cal)


_DERIVED: dict[tuple[int, str], tuple[object, "Efficiency"]] = {}  # (id(cal), repr(hw)) -> (cal, factors)


def _calibrated(cal, hw: "Hardware") -> "Efficiency":
    """Factors of ``hw`` from ``cal``, derived once per process per (file version, hardware)."""
    key = (id(cal), repr(hw))
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is cal:
        return _aged(hit[1], cal)
    eff = _derive(cal, hw)
    if len(_DERIVED) > 64:
        _DERIVED.clear()
    _DERIVED[key] = (cal, eff)
    return eff


def _aged(eff, cal):
    """``eff`` with its source's age brought up to date."""
    from dataclasses import replace

    head, _, rest = eff.source.partition("; ")
    fresh = cal.describe()
    return eff if head == fresh else replace(eff, source="; ".join(x for x in (fresh, rest) if x))


def efficiency_from_file(path, hw: "Hardware") -> "Efficiency":
    """Factors of ``hw`` from one named calibration file (a ``--calibration`` option): it must
    be this machine's. Raises CalibrationError otherwise."""
    from flexplan.calibration.store import check_belongs_here, load_calibration

    cal = load_calibration(path)
    check_belongs_here(cal)
    return _at_state_now(_calibrated(cal, hw), cal)


def _at_state_now(eff: "Efficiency", cal) -> "Efficiency":
    """``eff`` scaled to the host memory state of now (a short probe; memory_state.py)."""
    from flexplan.calibration.memory_state import at_state_now

    return at_state_now(eff, cal.measurements)


def _derive(cal, hw: "Hardware") -> "Efficiency":
    from flexplan.calibration.efficiency import from_measurements
    from flexplan.calibration.store import RERUN, display_path

    measured = cal.doc["settings"]["cpu_dtypes"]
    parts = [cal.describe()]
    if hw.cpu.compute_dtype not in measured:
        parts.append(f"CPU {hw.cpu.compute_dtype} not measured (only {', '.join(measured)}): defaults for it")
    if hw.gpu is not None and not cal.measurements.get("gpu_gemm"):
        parts.append("GPU factors: defaults (no GPU part)")
    try:
        return from_measurements(cal.measurements, cal.doc["settings"], hw, "; ".join(parts))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise CalibrationError(f"calibration file {display_path(cal.path)}: malformed measurements "
                               f"({type(e).__name__}: {e}); {RERUN}") from None


def describe_calibration(hw: "Hardware") -> str:
    """One line for ``flexplan hw``: the calibration in use and its age, or how to make one."""
    if not is_local(hw):
        return "calibration: none for hwdb hardware (defaults; calibrations describe the local machine)"
    cal = calibration_for(hw)
    if cal is None:
        return "calibration: none: run `flexplan calibrate --quick`"
    eff = _calibrated(cal, hw)
    mode = cal.doc.get("mode", "?")
    from flexplan.calibration.memory_state import describe

    return (f"calibration in use: {cal.describe()} ({mode} run, CPU threads {eff.cpu_threads()})\n"
            f"  {describe(cal.measurements)}")


def calibrated_cpu_threads() -> tuple[int | None, str]:
    """(the CPU thread count this machine's calibration found fastest, where it comes from), or
    (None, why not): no calibration, no thread sweep in it, or no hardware model of this machine.
    ``flexplan.load`` gives it to the executor when the caller names no thread count."""
    from flexplan.errors import FlexplanError
    from flexplan.hardware import get_hardware

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
