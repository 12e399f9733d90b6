"""Where online corrections live, and the library's two calls.

The rule itself (attribution by elasticity, the bounded update) is ``correction``; this module
keeps its result and hooks it in: :func:`corrected` (called last by
``flexplan.factors.efficiency_for``) and :func:`learn` (called by ``FlexModel.generate`` after each run).

Corrections belong to one calibration: ``<calibration-stem>.corrections.yaml`` beside its file,
or in ``store.user_cache_dir()`` when that folder is not writable or is the package's shipped
folder; keyed to the calibration's fingerprint and ``created_utc`` (a new calibration starts
fresh), and per hardware name (``local`` and the CPU stand-in ``local+cpu-standin`` learn apart).
Written atomically (``store.write_atomic``); a corrupt file gives a one-line warning and is
ignored (the next run replaces it). Delete the file to forget. Without a calibration file,
corrections live in this process's memory only (as do those of a file that cannot be written).

Only hardware named ``local...`` learns or is corrected (a paper server's predictions are not
this machine's). Opt-out: ``FLEXPLAN_ONLINE_CORRECTION=0`` (neither learned nor applied), or
``flexplan.load(..., online_correction=False)`` (that model neither learns nor plans with them).
No torch here.
"""

from __future__ import annotations

import datetime as dt
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexplan.errors import FlexplanError
from flexplan.factors import store
from flexplan.factors.calibrated import calibrated_factors, calibration_for, is_local
from flexplan.factors.correction import STATE_ELASTICITY, Corrections, Observation, apply, uncorrected, update
from flexplan.hardware import get_hardware
from flexplan.hardware.spec import Hardware

if TYPE_CHECKING:  # pragma: no cover
    from flexplan.estimator.efficiency import Efficiency
    from flexplan.hardware.spec import Hardware
    from flexplan.workload.model import ModelSpec

ENV = "FLEXPLAN_ONLINE_CORRECTION"
FORMAT = "flexplan-corrections"
VERSION = 1


def enabled() -> bool:
    """False when ``FLEXPLAN_ONLINE_CORRECTION`` is 0/false/no/off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")




# (calibration key, hardware name) -> corrections kept in this process: all of them without a
# calibration file, and those whose file could not be written
_MEMORY: dict[tuple, Corrections] = {}
_READ: dict[str, tuple[tuple, dict | None]] = {}  # path -> ((mtime_ns, size), doc or None if unusable)
_FOLDERS: dict[str, Path] = {}  # calibration folder -> where its corrections are written
_WARNED: set[tuple] = set()  # (path, (mtime_ns, size), hardware name) whose unusable entry was reported


def _key(cal) -> tuple:
    return (str(cal.path), cal.fingerprint, str(cal.doc.get("created_utc"))) if cal is not None else ("none",)


def corrections_path(cal) -> Path:
    """``<calibration-stem>.corrections.yaml`` beside the calibration file, or in the user cache
    folder when that folder is the installed package's or not writable (decided once per folder
    per process)."""

    name = f"{cal.path.stem}.corrections.yaml"
    folder = str(cal.path.parent)
    if folder not in _FOLDERS:
        shipped, checkout = store.shipped_dir(), store.source_checkout_dir()
        in_package = shipped is not None and Path(folder).resolve() == shipped and shipped != checkout
        _FOLDERS[folder] = store.user_cache_dir() if in_package or not os.access(folder, os.W_OK) else Path(folder)
    return _FOLDERS[folder] / name


def _read_doc(path: Path) -> dict | None:
    """The file's YAML mapping (cached by mtime and size), None when absent; a corrupt file warns
    once and reads as None."""
    import yaml

    try:
        st = path.stat()
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _READ.get(str(path))
    if hit is not None and hit[0] == stamp:
        return hit[1]
    doc = None
    try:
        doc = yaml.safe_load(path.read_text())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"not a {FORMAT} version {VERSION} file")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as e:
        warnings.warn(f"ignoring the online-correction file {path} ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:120]}); it is replaced at the next run", stacklevel=3)
        doc = None
    _READ[str(path)] = (stamp, doc)
    return doc


def _from_file(cal, hw_name: str) -> Corrections | None:
    doc = _read_doc(corrections_path(cal))
    if doc is None or doc.get("fingerprint") != cal.fingerprint \
            or str(doc.get("calibration_created_utc")) != str(cal.doc.get("created_utc")):
        return None  # none yet, unusable, or of an earlier calibration
    entry = (doc.get("hardware") or {}).get(hw_name) if isinstance(doc.get("hardware"), dict) else None
    if entry is None:
        return None
    try:
        return Corrections.from_dict(entry)
    except (TypeError, ValueError, AttributeError) as e:
        path = corrections_path(cal)
        once = (str(path), _READ.get(str(path), ((),))[0], hw_name)
        if once not in _WARNED:
            _WARNED.add(once)
            warnings.warn(f"ignoring the online-correction entry {hw_name!r} of {path} "
                          f"({' '.join(str(e).split())[:160]}); it is replaced at the next run", stacklevel=3)
        return None


def current(hw: "Hardware", cal=None) -> Corrections:
    """The corrections learned for ``hw`` under calibration ``cal`` (None: no calibration file)."""
    kept = _MEMORY.get((_key(cal), hw.name))
    if kept is not None:
        return kept
    found = _from_file(cal, hw.name) if cal is not None else None
    return found if found is not None else Corrections()


def save(hw: "Hardware", cal, corrections: Corrections) -> Path | None:
    """Keep ``corrections`` for ``hw``: in its calibration's corrections file (atomically, other
    hardware names' entries kept), or in process memory when there is no calibration file."""

    if cal is None:
        _MEMORY[(_key(None), hw.name)] = corrections
        return None
    _MEMORY.pop((_key(cal), hw.name), None)
    path = corrections_path(cal)
    doc = _read_doc(path)
    same = (doc is not None and doc.get("fingerprint") == cal.fingerprint
            and str(doc.get("calibration_created_utc")) == str(cal.doc.get("created_utc")))
    entries = dict(doc.get("hardware") or {}) if same and isinstance(doc.get("hardware"), dict) else {}
    entries[hw.name] = corrections.to_dict()
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out = {"format": FORMAT, "version": VERSION, "calibration": cal.path.name, "fingerprint": cal.fingerprint,
           "calibration_created_utc": str(cal.doc.get("created_utc")), "updated_utc": now, "hardware": entries}
    out = store.plain(out)
    store.write_atomic(out, path)
    st = path.stat()
    _READ[str(path)] = ((st.st_mtime_ns, st.st_size), out)  # what was written need not be parsed again
    return path


# ----------------------------------------------------------------------------- the library's calls


def corrected(eff: "Efficiency", hw: "Hardware", cal=None) -> "Efficiency":
    """``eff`` (the calibration's factors for ``hw``) with the corrections learned for ``hw``
    applied last; ``eff`` itself when disabled, not local hardware, or nothing learned.
    ``flexplan.factors.efficiency_for`` calls this."""

    if not enabled() or not is_local(hw):
        return eff
    return apply(eff, current(hw, cal))


@dataclass(frozen=True)
class Learned:
    """What one run taught: the corrections before and after, and where they were kept."""

    before: Corrections
    after: Corrections
    path: Path | None
    skipped: str = ""  # why the run was not observed at all

    @property
    def changed(self) -> bool:
        return self.after is not self.before

    def describe(self) -> str:
        if self.skipped:
            return f"{self.before.describe()} (this run not learned from: {self.skipped})"
        if not self.changed:
            return f"{self.before.describe()} (this run not used: too short, not finite, or other processes busy)"
        res = "; ".join(f"{x['phase']} measured {x['measured_s'] * 1e3:.3g} ms vs {x['predicted_s'] * 1e3:.3g} ms "
                        f"predicted" for x in self.after.last[-2:])
        where = f", kept in {self.path}" if self.path else ", kept in this process"
        return f"{self.after.describe()} ({res}{where})"


def learn(stats, model: "ModelSpec", hardware: Any, skip: str = "", base: "Efficiency | None" = None) -> Learned | None:
    """Feed one run's :class:`~flexplan.executor.stats.RunStats` to the corrections of its
    hardware and keep them. None when disabled or the hardware is not this machine's. Never
    raises for a file it cannot write: it warns and keeps the corrections in memory. ``skip``:
    why this run is not to be observed (it is then only described). ``base``: the uncorrected
    factors the run was planned with (default: the calibration's, unscaled)."""

    if not enabled() or hardware is None:
        return None
    hw = hardware if isinstance(hardware, Hardware) else get_hardware(str(hardware))
    if not is_local(hw):
        return None
    try:
        cal = calibration_for(hw)
    except FlexplanError:
        return None  # the planner reports an unusable calibration; nothing to learn against
    before = current(hw, cal)
    if skip:
        return Learned(before, before, None, skip)
    after = update(before, Observation.from_stats(stats, model, hw), uncorrected(base if base is not None else calibrated_factors(hw)))
    if after is before:
        return Learned(before, after, None)
    try:
        path = save(hw, cal, after)
    except OSError as e:
        warnings.warn(f"online correction not saved ({e}); kept for this process", stacklevel=2)
        _MEMORY[(_key(cal), hw.name)] = after
        path = None
    return Learned(before, after, path)


def describe_corrections(hw: "Hardware") -> str:
    """For ``flexplan hw``: the corrections in use per class with the runs behind each, or why none."""

    if not is_local(hw):
        return "online correction: none (hwdb hardware)"
    if not enabled():
        return f"online correction: off ({ENV}=0)"
    try:
        cal = calibration_for(hw)
    except FlexplanError:
        return "online correction: none (calibration unusable)"
    c = current(hw, cal)
    if not c.scales and not c.state_elasticity:
        return "online correction: none yet (learned from the runs of flexplan.load(...).generate())"
    per = ", ".join([f"{k} x{v:.3g} ({_runs(c.runs.get(k, 0))})" for k, v in c.scales.items()]
                    + ([f"memory-state elasticity {c.state_elasticity:+.2f} ({_runs(c.runs.get(STATE_ELASTICITY, 0))})"]
                       if c.state_elasticity else []))
    where = corrections_path(cal) if cal is not None else "this process"
    return f"online correction: {per}; {_runs(c.updates)} in all, kept in {where}"


def _runs(n: int) -> str:
    return f"{n} run{'' if n == 1 else 's'}"


def _reset_memory() -> None:
    """Forget this process's in-memory corrections and file cache (tests)."""
    _MEMORY.clear()
    _READ.clear()
    _FOLDERS.clear()
    _WARNED.clear()


__all__ = ["ENV", "Learned", "corrected", "corrections_path", "current", "describe_corrections", "enabled", "learn",
           "save"]
