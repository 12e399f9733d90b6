"""Calibrated on first use: when the planner needs this machine's factors and no
calibration file of it exists, measure the few-second probe (``microbench.MODES["probe"]``) once,
cache it, and say so in one line on stderr.

- Where: ``$FLEXPLAN_CALIBRATION_DIR`` when set, else the user cache
  (``store.user_cache_dir()``, ``~/.cache/flexplan/calibration``): never the source checkout's
  ``calibration/`` folder nor the installed package. Both are lookup folders, so later lookups
  (``store.find_calibration``) find the file and nothing is measured again.
- Superseded: the newest file of this machine wins. The probe runs only when no file of this
  machine exists, so any ``flexplan calibrate`` (full or quick) taken later is newer and is used.
- Once per process: a probe that failed (no torch, a benchmark error, an unwritable cache) is not
  retried; the planner uses the defaults, their ``source`` saying why.
- Opt-out: ``FLEXPLAN_AUTO_CALIBRATE=0`` (the defaults, ``source`` saying how to calibrate).
- Re-entrance: while the probe, or any ``flexplan calibrate``, runs (:func:`measuring`), lookups
  made from inside it get no first-use probe (a full calibration's executor-layer step loads toy
  models, which would otherwise measure and cache a probe in the middle of its own benchmarks).

torch is imported only when the probe runs.
"""

from __future__ import annotations

import os
from dataclasses import replace
import sys
import time
from pathlib import Path

from flexplan.estimator.efficiency import DefaultEfficiency, Efficiency, cpu_path
from flexplan.factors import store
from flexplan.factors.calibrated import _calibrated, calibration_for, is_local
from flexplan.factors.store import Calibration
from flexplan.hardware.spec import Hardware
from flexplan.measure.calibrate import calibrate
from flexplan.measure.running import _lock, _state, measuring  # noqa: F401  (calibrate enters measuring())
from flexplan.measure.state import describe, efficiency_now

ENV = "FLEXPLAN_AUTO_CALIBRATE"
MODE = "probe"
OFF_VALUES = ("0", "false", "no", "off")
HOW_TO = "run `flexplan calibrate --quick` (about 2 minutes on 2 cores) or `flexplan calibrate` (the full set)"




def enabled() -> bool:
    """False when ``$FLEXPLAN_AUTO_CALIBRATE`` is 0/false/no/off."""
    return os.environ.get(ENV, "1").strip().lower() not in OFF_VALUES


def probe_dir() -> Path:
    """Where the probe's file goes: ``$FLEXPLAN_CALIBRATION_DIR`` when set, else the user cache."""

    explicit = os.environ.get(store.DIR_ENV)
    return Path(explicit).expanduser() if explicit else store.user_cache_dir()


def first_use_calibration() -> "Calibration | None":
    """The probe's calibration of this machine, measured now if this process has not tried yet;
    None when the probe is off, failed, or is already running (a lookup from inside it)."""
    if not enabled():
        return None
    with _lock:
        if _state["running"]:
            return None
        if _state["tried"]:
            return _state["cal"]
        _state["running"] = True
        try:
            _state["cal"], _state["why_not"] = _measure()
        finally:
            _state["running"] = False
            _state["tried"] = True
        return _state["cal"]


def _measure() -> "tuple[Calibration | None, str | None]":
    """(the loaded probe file, None), or (None, why it failed); one line on stderr either way."""

    t0 = time.perf_counter()
    try:
        path = probe_dir() / store.file_name(store.local_identity())
        res = calibrate(mode=MODE, out=path, progress=False)
        cal = store.load_calibration(res.path)
        store.check_belongs_here(cal)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a first plan must not fail because its probe did
        why = f"the first-use probe failed ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        print(f"flexplan: no calibration of this machine; {why}: planning with default factors ({HOW_TO})",
              file=sys.stderr)
        return None, why
    failed = f", {len(res.failures)} of its benchmarks failed (defaults for those)" if res.failures else ""
    print(f"flexplan: no calibration of this machine; measured a {time.perf_counter() - t0:.1f} s first-use probe "
          f"-> {store.display_path(res.path)}{failed} (run `flexplan calibrate` for the full set)", file=sys.stderr)
    return cal, None


def why_uncalibrated() -> str:
    """Why this machine plans with the defaults: the opt-out, the probe's failure, or no file."""
    if not enabled():
        return f"automatic first-use probe off ({ENV}=0): {HOW_TO}"
    if _state["why_not"]:
        return f"{_state['why_not']}: {HOW_TO}"
    return f"no calibration of this machine: {HOW_TO}"


def describe_none() -> str:
    """``flexplan hw``'s line when this machine has no calibration file (it never measures)."""
    if enabled() and not _state["tried"]:
        return ("calibration: none yet: the first local plan measures a short probe "
                "(`flexplan calibrate --quick` or `flexplan calibrate` for more)")
    if enabled() and _state["why_not"]:
        return f"calibration: none: {_state['why_not']}; run `flexplan calibrate --quick`"
    return "calibration: none: run `flexplan calibrate --quick`"


def reset() -> None:
    """Forget this process's attempt (tests)."""
    with _lock:
        _state.update(running=False, tried=False, cal=None, why_not=None)


def measured_efficiency(hw: Hardware) -> Efficiency:
    """The factors a caller about to run on ``hw`` plans with (``flexplan run``, ``explain`` on the
    local machine): this machine calibrated on first use (:func:`first_use_calibration`) when no
    file of it exists, then scaled to the memory state of now (``state.efficiency_now``)."""
    if not (is_local(hw) and calibration_for(hw) is None):
        return efficiency_now(hw)
    first_use_calibration()
    eff = efficiency_now(hw)
    if isinstance(eff, DefaultEfficiency):  # still none: the source says why (opted out, or the probe failed)
        eff = replace(eff, source=f"defaults ({cpu_path(hw)} CPU; not calibrated: {why_uncalibrated()})")
    return eff


def describe_calibration(hw: Hardware) -> str:
    """One line for ``flexplan hw``: the calibration in use and its age, or how to make one, with
    the recorded probe distributions and the probes now."""
    if not is_local(hw):
        return "calibration: none for hwdb hardware (defaults; calibrations describe the local machine)"
    cal = calibration_for(hw)
    if cal is None:
        return describe_none()
    eff = _calibrated(cal, hw)
    mode = cal.doc.get("mode", "?")
    return (f"calibration in use: {cal.describe()} ({mode} run, CPU threads {eff.cpu_threads()})\n"
            f"  {describe(cal.measurements)}")
