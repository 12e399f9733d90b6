"""The memory state of now, not of calibration day.

Where the host's memory bandwidth flips between states (on some VMs the STREAM triad moves by
nearly 2x, minute to minute), a calibration records whichever state each benchmark met.
Three steps keep the predictions of memory-bound work (CPU decode) on the state of now:

1. ``flexplan calibrate`` runs the probe of :mod:`~flexplan.measure.membw` before each
   benchmark step and once at the end (:func:`new_record`, :func:`record_sample`) and stores the
   samples as a distribution, ``measurements.memory_state``:
   ``{probe, probe_bytes_per_s: [...], at_step: [step label or "end", ...]}``; the rows of
   :data:`ROW_PARTS` also carry the probe taken around their own runs (``probe_bytes_per_s``,
   microbench.probing_state): the state can flip within a step.
2. Deriving the factors (:func:`normalised`, called by ``efficiency.from_measurements``), the
   memory-bound share of each measured time is brought to ONE reference state, the median of the
   samples (:func:`reference_bytes_per_s`), using the row's own probe (else the sample taken just
   before its step): a flip in the middle of the calibration does not bend the fit. The share is what the row's bytes
   take at the best streaming rate the calibration saw (a GEMV, a decode attention: all of it;
   a decode layer: all but its fixed cost; a large GEMM or a prefill layer: little).
   Files from this version on also record the GEMV probe (membw.measure_gemv_bytes_per_s:
   decode's own kernel, which follows decode's bandwidth more closely than the copy), at each
   step and around each row; such files are normalised by it (:func:`row_probe_kind`).
3. Planning for the local machine (:func:`at_state_now`), the probe runs again (the GEMV probe
   where the file has it and torch is loaded, :func:`memory_probe_now`; else the copy) and the CPU
   memory term class is scaled by ``reference / now`` (clamped to :data:`SCALE_RANGE`) with the
   estimator's :class:`~flexplan.estimator.efficiency.ScaledEfficiency`; its note says which
   state was used ("memory state: ..."), and ``explain`` and ``last_stats`` print it. In a slower
   state than the calibration's, an op is priced at most at the state's streaming rate and at
   least as fast as it ran at calibration (:class:`~flexplan.estimator.efficiency.StateScaledEfficiency`).

Files without ``memory_state`` (written before it existed, or by hand) load as before: no
normalisation, no scaling, and the note says so.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import numpy as np

from flexplan.estimator.efficiency import STATE_SCALED_TOKENS_MAX, UNMEASURED_PROBE_BAND
from flexplan.estimator.terms import Shape, c_gemm, d_gemm, phase_work
from flexplan.factors.tables import _attention_spec
from flexplan.workload import costs

if TYPE_CHECKING:  # pragma: no cover
    from flexplan.estimator.efficiency import Efficiency

NOTE_PREFIX = "memory state:"  # the note's first words: stats.py finds the line by them
SCALE_RANGE = (1 / 3, 3.0)  # memory time is scaled by at most this much either way (a probe gone wrong)
# a probe within its own spread of the calibration's median is the same state (probe_band, measured
# per machine from the calibration's samples): scaling by a probe's noise makes predictions worse
# (the probes spread more than the runs they would scale)
MIN_SAMPLES_FOR_BAND = 6  # consecutive pairs enough for a median that one state change cannot move
END = "end"  # the label of the sample taken after the last step
ROW_PARTS = ("cpu_gemv", "cpu_gemm", "cpu_head_gemv", "cpu_attention", "cpu_layers")  # rows normalised


# ----------------------------------------------------------------------------- recording (calibrate)


# ----------------------------------------------------------------------------- reading the record


PROBES = {"memory": ("probe_bytes_per_s", "at_step"), "compute": ("probe_flops_per_s", "compute_at_step"),
          "gemv": ("gemv_probe_bytes_per_s", "gemv_at_step")}
ROW_PROBES = {"memory": "probe_bytes_per_s", "gemv": "gemv_probe_bytes_per_s",  # a row's own probe, by kind
              "compute": "probe_flops_per_s"}


def samples(meas: dict, probe: str = "memory") -> list[tuple[str, float]] | None:
    """(step label, probe figure) of the calibration's ``probe`` ("memory": the copy's bytes/s,
    "gemv": the GEMV probe's bytes/s, "compute": FLOP/s), in order; None when the file has none
    (older or hand-written files; files from before the compute or GEMV probe have the copy's
    samples only). ValueError when the record is malformed."""
    rec = meas.get("memory_state")
    if rec is None:
        return None
    key, at = PROBES[probe]
    if probe != "memory" and isinstance(rec, dict) and key not in rec:
        return None
    rates = rec.get(key) if isinstance(rec, dict) else None
    labels = rec.get(at) if isinstance(rec, dict) else None
    if not isinstance(rates, list) or not isinstance(labels, list) or len(rates) != len(labels):
        raise ValueError(f"`measurements.memory_state` should hold lists `{key}` and `{at}` of the same length")
    bad = [x for x in rates if isinstance(x, bool) or not isinstance(x, (int, float)) or not (np.isfinite(x) and x > 0)]
    if bad:
        raise ValueError(f"`measurements.memory_state.{key}` holds {bad[0]!r}: positive numbers expected")
    return [(str(lab), float(x)) for lab, x in zip(labels, rates)] or None


def reference_bytes_per_s(meas: dict, probe: str = "memory") -> float | None:
    """The reference state the factors describe: the median ``probe`` figure of the calibration
    (None: no samples)."""
    s = samples(meas, probe)
    return float(statistics.median(x for _, x in s)) if s else None


def probe_band(meas: dict, probe: str = "memory") -> float:
    """The spread of ``probe``'s readings within one memory state on the calibrated machine: the
    median relative change between the calibration's consecutive samples (a state outlasts most
    gaps between samples, so most changes are the probe's own noise, and the median ignores the
    few that span a change of state); ``UNMEASURED_PROBE_BAND`` where the file holds fewer than
    :data:`MIN_SAMPLES_FOR_BAND` samples (or none: older files)."""
    try:
        s = samples(meas, probe)
    except ValueError:
        s = None
    if not s or len(s) < MIN_SAMPLES_FOR_BAND:
        return UNMEASURED_PROBE_BAND
    xs = [x for _, x in s]
    return float(statistics.median(abs(b / a - 1.0) for a, b in zip(xs, xs[1:])))


def recorded_probe_threads(meas: dict, probe: str = "memory") -> int:
    """Threads of the memory probe (``probe``: "memory", the copy, or "gemv") that took the
    calibration's samples: files from before the probe copied in threads hold no
    ``probe_threads`` and were taken by a one-thread copy."""
    rec = meas.get("memory_state")
    n = rec.get("gemv_probe_threads" if probe == "gemv" else "probe_threads", 1) if isinstance(rec, dict) else 1
    return int(n) if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def recorded_compute_kind(meas: dict) -> str | None:
    """The compute probe kind (membw.compute_probe_kind) that took the calibration's samples:
    "numpy" for files from before torch's probe (their description names numpy), None when the
    file does not say (hand-written records: compared as they are)."""
    rec = meas.get("memory_state")
    if not isinstance(rec, dict):
        return None
    kind = rec.get("compute_probe_kind")
    if isinstance(kind, str):
        return kind
    return "numpy" if str(rec.get("compute_probe", "")).startswith("numpy") else None


def row_probe_kind(meas: dict) -> str:
    """The memory probe a calibration's rows are normalised by: the GEMV probe where the file
    recorded it (it follows decode more closely), else the copy ("memory")."""
    try:
        return "gemv" if samples(meas, "gemv") else "memory"
    except ValueError:
        return "memory"


def _clamped(ratio: float) -> float:
    return float(min(max(ratio, SCALE_RANGE[0]), SCALE_RANGE[1]))


# ----------------------------------------------------------------------------- normalising (derive)


def work(part: str, row: dict) -> tuple[float, float]:
    """(FLOPs, bytes streamed from memory) of one row of ``measurements[part]``, as
    ``efficiency.py`` sizes it: a GEMV/GEMM its weights and activations, decode attention its KV
    cache, a real layer its weights, activations and KV (read and written)."""

    if part == "cpu_attention":
        m = _attention_spec(int(row["heads"]), int(row["kv_heads"]), int(row["head_dim"]))
        b, L = int(row["batch"]), int(row["kv_len"])
        return (float(costs.c_decode(m, b, L) - costs.c_decode(m, b, 0)),
                float(costs.d_kv_cache(m, b, L, float(row["dtype_bytes"]))))
    if part == "cpu_layers":
        m = _attention_spec(int(row["heads"]), int(row["kv_heads"]), int(row["head_dim"]), int(row["hidden"]),
                            int(row["intermediate"]))
        batch, q_len, dtype = int(row["batch"]), int(row["query_len"]), row["dtype"]
        if q_len == 1:  # one decode step over kv_len keys
            w = phase_work(Shape(m, batch, int(row["kv_len"]) - 1, 2, dtype, dtype), "decode")
            return float(w.flops[0]), float(w.d_cpu + w.kv_write_cpu + w.kv_read_cpu[0])
        w = phase_work(Shape(m, batch, q_len, 1, dtype, dtype), "prefill")
        return float(w.flops), float(w.d_cpu + w.kv_write_cpu)
    t, k, n = int(row["tokens"]), int(row["k"]), int(row["n"])
    return float(c_gemm(t, k, n)), float(d_gemm(t, k, n, float(row["dtype_bytes"])))


def _row_probe(row: dict, kind: str = "memory") -> float | None:
    """The probe of ``kind`` taken around the row's own runs (microbench.probing_state), where it has one."""
    x = row.get(ROW_PROBES[kind])
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and np.isfinite(x) and x > 0
    return float(x) if ok else None


def _stream(part: str) -> str:
    """Which streaming rate a part's bytes move at: KV reads their own, the rest the weights'."""
    return "kv" if part == "cpu_attention" else "weights"


def normalised(meas: dict) -> dict:
    """``meas`` with the memory-bound share of each row of :data:`ROW_PARTS` brought to the
    reference state (:func:`reference_bytes_per_s`), by the probe taken around the row's own runs
    (``probe_bytes_per_s``, files from this version on), else the sample taken just before the
    row's step (``<part>[<dtype>]``, else ``<part>``): with ``r = sample / reference`` (clamped to
    :data:`SCALE_RANGE`), the row's times become ``t x (1 - w + w x r)``.

    ``w``, the memory-bound share of the row's time: ``min(1, bytes / (B x r) / t)``, with ``B``
    the best streaming rate any row of that dtype reached (weights: GEMV/GEMM rows; KV: attention
    rows), itself brought to the reference state. A GEMV or decode attention is all memory
    (w ~ 1), a large GEMM or a prefill layer hardly any, a real decode layer all but its fixed
    per-layer cost. Achieved rates, not the Hardware's nominal peaks (guesses where a VM hides the SKU).

    The rest of the time, ``1 - w`` (compute, and the fixed costs that run at the CPU's speed),
    is kept as measured: a GEMM's rate is the cores' own, which the memory state does not set.

    The probe is the GEMV probe where the file recorded it (:func:`row_probe_kind`), else the copy.

    Unchanged when the file holds no samples (older files: not normalised) and for rows whose
    step has none; a row too malformed to size is left for ``check_rows`` to report."""
    kind = row_probe_kind(meas)
    s = samples(meas, kind)
    if not s:
        return meas
    ref = float(statistics.median(x for _, x in s))
    band = probe_band(meas, kind)
    before: dict[str, float] = {}
    for label, x in s:
        before.setdefault(label, x)
    sized: dict[str, list] = {}  # part -> [(row, ratio or None, bytes, time_s) or (row, None, None, None)]
    best: dict[tuple[str, str], float] = {}  # (stream, dtype) -> bytes/s at the reference state
    for part in ROW_PARTS:
        rows = meas.get(part)
        if not isinstance(rows, list):
            continue
        out = sized.setdefault(part, [])
        for r in rows:
            try:
                rate = _row_probe(r, kind) or before.get(f"{part}[{r['dtype']}]", before.get(part))
                _, n_bytes = work(part, r)
                t = float(r["time_s"])
                ratio = _clamped(rate / ref) if rate is not None else None
                if not (t > 0 and n_bytes > 0):
                    raise ValueError
            except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
                out.append((r, None, None, None))
                continue
            out.append((r, ratio, n_bytes, t))
            if ratio is None and part != "cpu_layers":  # layers carry their fixed cost: not a streaming rate
                key = (_stream(part), r["dtype"])
                best[key] = max(best.get(key, 0.0), n_bytes / t)
    # No row is normalised to a rate above the fastest that rows timed at the reference state (their
    # probe within the probe's band of it) reached in its stream: a row whose probe read a slower state
    # but that streamed that fast ran in the reference state (the state flipped between probe and
    # row), so its ratio is at least its rate over that best, and at most 1. Normalised by the probe
    # alone, such a row would come out faster than the machine ever streams and price decode fast.
    # Only rows that stream (decode attention, GEMMs of up to STATE_SCALED_TOKENS_MAX rows) set that
    # best: a prefill GEMM's bytes per second is its compute's pace, far below any stream, and as a
    # "best" it would hold slow-state GEMVs' ratio at 1 (their slow times kept as the reference's).
    at_ref: dict[tuple[str, str], float] = {}
    for part, rows in sized.items():
        for r, ratio, n_bytes, t in rows:
            streams = part == "cpu_attention" or int(r.get("tokens", 0)) <= STATE_SCALED_TOKENS_MAX
            if ratio is not None and part != "cpu_layers" and streams and abs(ratio - 1.0) <= band:
                key = (_stream(part), r["dtype"])
                at_ref[key] = max(at_ref.get(key, 0.0), n_bytes / t)
    for part, rows in sized.items():
        for j, (r, ratio, n_bytes, t) in enumerate(rows):
            top = at_ref.get((_stream(part), r.get("dtype"))) if ratio is not None else None
            if top and ratio < 1.0:
                rows[j] = (r, max(ratio, min(1.0, n_bytes / t / top)), n_bytes, t)
            if ratio is not None and part != "cpu_layers":
                key = (_stream(part), r["dtype"])
                best[key] = max(best.get(key, 0.0), n_bytes / t / rows[j][1])
    result = dict(meas)
    for part, rows in sized.items():
        new = []
        for r, ratio, n_bytes, t in rows:
            rate_ref = best.get((_stream(part), r["dtype"])) if ratio is not None else None
            if not rate_ref:
                new.append(r)
                continue
            w = min(1.0, n_bytes / (rate_ref * ratio) / t)
            k = (1.0 - w) + w * ratio
            new.append({**r, **{key: float(r[key]) * k for key in ("time_s", "time_median_s") if key in r}})
        result[part] = new
    return result


# ----------------------------------------------------------------------------- the state of now (plan)


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB/s"


PROBE_NAMES = {"memory": "memory probe", "gemv": "memory probe (decode GEMV)", "compute": "compute probe"}
PROBE_CLASSES = {"memory": "memory", "gemv": "memory", "compute": "compute"}  # the time each probe scales


STREAM_TOKENS = tuple(2 ** k for k in range(STATE_SCALED_TOKENS_MAX.bit_length()) if 2 ** k <= STATE_SCALED_TOKENS_MAX)


def _stream_best(eff: "Efficiency") -> dict:
    """CPU dtype (and None, the default one) -> the best weight-streaming factor of ``eff`` over
    :data:`STREAM_TOKENS`: the rate of the calibration's state that a slower state scales
    (estimator.efficiency.StateScaledEfficiency)."""
    dtypes = [None, *getattr(eff, "cpu", {})]
    return {dt: max(float(np.max(eff.cpu_memory(t, dt))) for t in STREAM_TOKENS) for dt in dtypes}


PROBE_UNITS = {"memory": "bytes_per_s", "gemv": "bytes_per_s", "compute": "flops_per_s"}


