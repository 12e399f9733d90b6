"""The memory and compute state of now: the probes that calibration records beside each step
and that a caller asks for before planning (the law itself, a pure function
of the recorded and the probed figures, is ``flexplan.factors.memory_state``).

``efficiency_now(hw)`` is what a measuring caller (``flexplan.load``, ``flexplan run``,
``validate``) passes to ``plan(efficiency=...)``: this machine's factors scaled to a probe taken
now. ``plan()`` alone never probes.
"""

from __future__ import annotations

import statistics
from typing import Any

from flexplan.estimator.efficiency import (
    Efficiency,
    ScaledEfficiency,
    StateScaledEfficiency,
)
from flexplan.factors import efficiency_for
from flexplan.factors.memory_state import (
    NOTE_PREFIX,
    PROBE_CLASSES,
    PROBE_NAMES,
    ROW_PROBES,
    _clamped,
    _gb,
    _stream_best,
    recorded_compute_kind,
    recorded_probe_threads,
    reference_bytes_per_s,
    probe_band,
    row_probe_kind,
    samples,
)
from flexplan.hardware.spec import Hardware
from flexplan.measure import membw


def efficiency_now(hw: Hardware) -> Efficiency:
    """``factors.efficiency_for(hw)`` with the calibration scaled to a probe of the memory (and
    compute) state taken now (:func:`at_state_now`); hwdb hardware and uncalibrated machines as
    ``efficiency_for`` has them."""
    return efficiency_for(hw, at_state=at_state_now)


def new_record() -> dict[str, Any]:
    """An empty ``measurements.memory_state`` for ``flexplan calibrate`` to fill (with the GEMV
    probe's lists where torch is loaded, as it is in a calibration)."""
    record = {"probe": membw.describe_probe(), "probe_threads": membw.probe_threads(), "probe_bytes_per_s": [],
              "at_step": [], "compute_probe": membw.describe_compute_probe(),
              "compute_probe_kind": membw.compute_probe_kind(), "probe_flops_per_s": [], "compute_at_step": []}
    if membw.gemv_probe_usable():
        record.update(gemv_probe=membw.describe_gemv_probe(), gemv_probe_threads=membw.gemv_probe_threads(),
                      gemv_probe_bytes_per_s=[], gemv_at_step=[])
    return record


def record_sample(record: dict[str, Any], label: str) -> None:
    """Probe now (uncached) and append the figure under ``label`` (the step about to run, or
    :data:`END`). A failed probe is noted in the record; the calibration goes on."""
    try:
        rate = membw.measure_copy_bytes_per_s()
    except (MemoryError, OSError, ValueError, ZeroDivisionError) as e:
        record.setdefault("failures", {})[label] = f"{type(e).__name__}: {e}"
        return
    record["probe_bytes_per_s"].append(float(f"{rate:.4g}"))
    record["at_step"].append(str(label))
    if "gemv_probe_bytes_per_s" in record:
        try:
            gemv = membw.measure_gemv_bytes_per_s()
        except (MemoryError, OSError, RuntimeError, ValueError, ZeroDivisionError) as e:
            record.setdefault("failures", {})[f"gemv {label}"] = f"{type(e).__name__}: {e}"
        else:
            record["gemv_probe_bytes_per_s"].append(float(f"{gemv:.4g}"))
            record["gemv_at_step"].append(str(label))
    if "probe_flops_per_s" in record:
        try:
            flops = membw.measure_matmul_flops_per_s()
        except (MemoryError, OSError, ValueError, ZeroDivisionError) as e:
            record.setdefault("failures", {})[f"compute {label}"] = f"{type(e).__name__}: {e}"
            return
        record["probe_flops_per_s"].append(float(f"{flops:.4g}"))
        record["compute_at_step"].append(str(label))


def row_probes(record: dict[str, Any]) -> dict[str, Any]:
    """{row field: probe} that ``flexplan calibrate`` times around each row of :data:`ROW_PARTS`
    (microbench.probing_state): the copy, the GEMV probe where ``record`` keeps its samples, and
    the compute probe where it keeps those (a step's first sample is not its rows' state: the
    state can change within a step, and normalising all of a step's rows by a sample that caught
    a brief slow state would price every row's kind ~2x fast)."""
    probes = {ROW_PROBES["memory"]: membw.measure_copy_bytes_per_s}
    if "gemv_probe_bytes_per_s" in record:
        probes[ROW_PROBES["gemv"]] = membw.measure_gemv_bytes_per_s
    if "probe_flops_per_s" in record:
        probes[ROW_PROBES["compute"]] = membw.measure_matmul_flops_per_s
    return probes


def _scale_now(meas: dict, probe: str, measure_now, fmt) -> tuple[float, str, bool]:
    """(time scale of the class ``probe`` describes, what the note says, whether a probe was read
    now) for one probe."""
    ref = reference_bytes_per_s(meas, probe)
    if ref is None:
        return 1.0, "", False
    name, cls = PROBE_NAMES[probe], PROBE_CLASSES[probe]
    at_cal = f"{fmt(ref)} median at calibration"
    try:
        now = measure_now(ref)
    except RuntimeError as e:
        return 1.0, f"{name} failed ({e}): factors at the calibration's median state ({at_cal})", False
    raw = ref / now
    if abs(raw - 1.0) <= probe_band(meas, probe):
        return 1.0, f"{name} {fmt(now)} now vs {at_cal} (the same state: x1.00)", True
    scale = _clamped(raw)
    clamp = f", clamped from x{raw:.2f}" if scale != raw else ""
    if cls == "compute":  # at_state_now: the fixed costs take the ratio, compute time keeps its factor
        return scale, f"{name} {fmt(now)} now vs {at_cal} (x{scale:.2f} fixed costs{clamp})", True
    return scale, f"{name} {fmt(now)} now vs {at_cal} (x{scale:.2f} {cls} time{clamp})", True


def memory_probe_now(meas: dict) -> str:
    """Which memory probe plans read the state of now with: the GEMV probe ("gemv") where the
    calibration recorded it, torch is loaded (a torch-free ``plan()`` stays so) and it runs in
    the threads it ran in at calibration; else the copy ("memory")."""
    recorded = row_probe_kind(meas) == "gemv"
    if recorded and membw.gemv_probe_usable() and recorded_probe_threads(meas, "gemv") == membw.gemv_probe_threads():
        return "gemv"
    return "memory"


def at_state_now(eff: "Efficiency", meas: dict) -> "Efficiency":
    """``eff`` (the factors of a calibration whose ``measurements`` are ``meas``) with the time of
    the CPU memory class scaled to the memory state of now, ``reference / probe now``, and, where
    the calibration recorded the compute probe, the overhead class (per-layer and per-step fixed
    costs) to the compute state of now the same way; each clamped to
    :data:`SCALE_RANGE`, and 1 within the probe's band (``probe_band``: its own spread on this machine
    is not a state). No scaling, with the reason in the note, when the file recorded no samples,
    the probe is off (``$FLEXPLAN_MEMORY_PROBE=0``) or failed."""

    try:
        ref = reference_bytes_per_s(meas)
        reference_bytes_per_s(meas, "compute")
    except ValueError as e:
        return ScaledEfficiency(eff, {}, f"{NOTE_PREFIX} unreadable record in the calibration ({e}): not scaled", state=True)
    if ref is None:
        return ScaledEfficiency(eff, {}, f"{NOTE_PREFIX} not recorded by this calibration (made before "
                                         "memory states were kept): factors as measured, not scaled", state=True)
    if not membw.probe_enabled():
        return ScaledEfficiency(eff, {}, f"{NOTE_PREFIX} probe off (${membw.PROBE_ENV}=0): factors at the "
                                         f"calibration's median state (probe {_gb(ref)} median at calibration)", state=True)
    recorded_threads = recorded_probe_threads(meas)
    if memory_probe_now(meas) == "gemv":
        mem, mem_note, mem_read = _scale_now(meas, "gemv", lambda r: membw.probe_gemv_bytes_per_s(reference=r), _gb)
    elif recorded_threads != membw.probe_threads():
        mem, mem_read, mem_note = 1.0, False, (f"memory probe: this calibration's samples came from a copy in {recorded_threads} "
                              f"thread{'s' if recorded_threads > 1 else ''}, today's probe copies in "
                              f"{membw.probe_threads()}: not comparable, memory factors at the calibration's median "
                              "state (re-run `flexplan calibrate`)")
    else:
        mem, mem_note, mem_read = _scale_now(meas, "memory", lambda r: membw.probe_bytes_per_s(reference=r), _gb)
    recorded_kind, kind_now = recorded_compute_kind(meas), membw.compute_probe_kind()
    if recorded_kind is not None and recorded_kind != kind_now and reference_bytes_per_s(meas, "compute"):
        comp, comp_read, comp_note = 1.0, False, (f"compute probe: this calibration's samples came from a {recorded_kind} product, "
                                f"today's probe is a {kind_now} one: not comparable, compute factors at the "
                                "calibration's median state (re-run `flexplan calibrate`)")
    else:
        comp, comp_note, comp_read = _scale_now(meas, "compute", lambda r: membw.probe_flops_per_s(reference=r),
                                     lambda x: f"{x / 1e9:.0f} GFLOP/s")
    scales = {"cpu_memory": mem} if mem != 1.0 else {}
    # CPU compute time keeps its calibrated factor: a GEMM's rate is the cores' own, and the short
    # compute probe swings with bursts a long prefill averages out (kept runs: TTFT moved with the
    # probe at a log-log slope of 0.13-0.38, not 1)
    if comp != 1.0:
        scales["overhead"] = comp
    return StateScaledEfficiency(eff, scales, f"{NOTE_PREFIX} " + "; ".join(x for x in (mem_note, comp_note) if x),
                                 stream_best=_stream_best(eff) if mem != 1.0 else {}, state=True,
                                 probed=mem_read or comp_read, band=probe_band(meas, memory_probe_now(meas)))


# the decode rows whose weight-streaming factor bounds the state's: those the state scales
def refresh() -> None:
    """Probe afresh now (``flexplan.load``: the plans it makes use the state at load time, not
    one up to :data:`~flexplan.measure.membw.PROBE_TTL_S` old). Nothing when the probe is off;
    a failure is remembered and reported by the plan's note."""
    if membw.probe_enabled():
        # where torch is loaded plans read the GEMV probe (an older file without its samples
        # probes the copy when it plans): the copy's 2 x 128 MB are not mapped for nothing
        memory = membw.probe_gemv_bytes_per_s if membw.gemv_probe_usable() else membw.probe_bytes_per_s
        for probe in (memory, membw.probe_flops_per_s):
            try:
                probe(max_age_s=0.0)
            except RuntimeError:
                pass


def readings_now(keep: bool = True) -> dict[str, float]:
    """Every plan-time probe measured afresh now, ``{"memory": copy bytes/s, "gemv": GEMV bytes/s
    (where torch is loaded), "compute": FLOP/s}``, each confirmed as plans confirm it without a
    reference (membw.confirmed). With ``keep`` they become the figures the next plans read
    (membw's cache), else they are only returned. A failed probe is left out; {} when the probes
    are off."""
    if not membw.probe_enabled():
        return {}
    probes = {"memory": (membw.probe_bytes_per_s, membw.measure_copy_bytes_per_s),
              "compute": (membw.probe_flops_per_s, membw.measure_matmul_flops_per_s)}
    if membw.gemv_probe_usable():
        probes["gemv"] = (membw.probe_gemv_bytes_per_s, membw.measure_gemv_bytes_per_s)
    if keep:
        membw.forget_probe()
    out = {}
    for name, (cached, measure) in probes.items():
        try:
            out[name] = cached(max_age_s=0.0) if keep else membw.confirmed(measure)
        except (RuntimeError, MemoryError, OSError, ValueError, ZeroDivisionError):
            pass
    return out


def describe(meas: dict) -> str:
    """For ``flexplan hw``: the calibration's recorded distributions (probe min / median / max,
    the STREAM triad it stored) and the probes now."""
    stream = meas.get("cpu_stream") or {}
    triad = stream.get("triad_bytes_per_s") if isinstance(stream, dict) else None
    triad_s = f"; STREAM triad {_gb(float(triad))} (once, at its start)" if isinstance(triad, (int, float)) else ""
    gf = lambda x: f"{x / 1e9:.0f} GFLOP/s"  # noqa: E731
    parts = []
    for probe, fmt, now_fn in (("memory", _gb, membw.probe_bytes_per_s), ("gemv", _gb, membw.probe_gemv_bytes_per_s),
                               ("compute", gf, membw.probe_flops_per_s)):
        try:
            s = samples(meas, probe)
        except ValueError as e:
            return f"{NOTE_PREFIX} unreadable record ({e}){triad_s}"
        if not s:
            if probe == "memory":
                parts.append("none recorded by this calibration")
            continue
        xs = [x for _, x in s]
        text = f"{PROBE_NAMES[probe]} min {fmt(min(xs))} / median {fmt(statistics.median(xs))} / max {fmt(max(xs))} " \
               f"over {len(xs)} samples"
        if probe == "memory" and recorded_probe_threads(meas) != membw.probe_threads():
            text += f" (a {recorded_probe_threads(meas)}-thread copy: not comparable with today's probe, not scaled)"
        if probe == "compute" and recorded_compute_kind(meas) not in (None, membw.compute_probe_kind()):
            text += f" (a {recorded_compute_kind(meas)} product: not comparable with today's probe, not scaled)"
        if not membw.probe_enabled():
            text += f", now: off (${membw.PROBE_ENV}=0)"
        elif probe == "gemv" and not membw.gemv_probe_usable():
            text += ", now: not read (torch not loaded: plans here read the copy)"
        else:
            try:
                text += f", now {fmt(now_fn())}"
            except RuntimeError as e:
                text += f", now failed ({e})"
        parts.append(text)
    return f"{NOTE_PREFIX} " + "; ".join(parts) + triad_s
