"""Online correction: what each run measured, fed back into the estimator.

APEX (section 6, "Improving Performance Predictability with Online Profiling") notes that offline
profiles miss some shapes and proposes watching real computation times to rebalance. flexplan
applies that to FlexInfer's estimator: every ``generate()`` measures TTFT and mean TPOT
(``executor/stats.py``), and the difference from the estimate becomes a time multiplier per term
class of :data:`~flexplan.estimator.efficiency.TERM_CLASSES` (CPU memory, CPU compute, overhead,
link, accelerator), applied to the calibration through
:class:`~flexplan.estimator.efficiency.ScaledEfficiency`, so the next plan and its predictions use
them. This module is the rule alone: pure functions (:func:`update`, :func:`corrections_after`,
:func:`apply`) that touch no disk.

Attribution (elasticity). For an observed run (model, hardware, shape, the policy and M of each
phase), the predicted time ``T`` of each phase is re-estimated with one class's time scaled by
``PERTURB``; its share is ``w_c = d log T / d log s_c`` (between 0 and 1, summing to about 1:
every term belongs to one class). It is generic over policies, since it only calls a policy's
own ``estimate``; a term hidden under Eq. 2's ``max()`` gets ``w_c = 0`` and is left alone.

Update rule: a Kalman filter on the log scales ``g_c = log s_c`` (recursive least squares over
the runs seen, with a random-walk drift), one phase after the other. For a usable phase with
shares ``w``, residual ``r = log(measured / predicted)`` (the prediction already corrected by
``g``, and linearly by the update of the phase before) and covariance ``P``:
``k = P w / (w' P w + NOISE_VAR)``, ``g += k r``, ``P -= k w' P``; before each run
``P += DRIFT_VAR I``. From the prior ``P = V I`` this is the normalised LMS step
``dg = w r / |w|^2`` (times ``|w|^2 / (|w|^2 + NOISE_VAR / V)``), each class in proportion to its
share. Over default factors (``V = PRIOR_VAR``) that is 0.83 to 0.96 as ``|w|^2`` goes from 0.2 to
1: the first run corrects its phases almost fully. Over a calibration of this machine
(``V = CALIBRATED_PRIOR_VAR``) 0.37 to 0.66: one call's error, measured in whatever memory state it
met and at one shape, moves the whole grid's predictions only part of the way (run fully, it made
warm worse than cold).
Later runs correct what earlier ones could not tell apart (``P`` remembers which combinations of
classes the runs so far have pinned down), converge to the least-squares scales over the shapes
seen, and, with ``DRIFT_VAR``, keep following slow drifts of the machine (its memory state).

Odd runs (Huber's weighting of the filter): a phase whose residual ``r`` lies beyond
``OUTLIER_Z`` standard deviations of what the filter expects, ``z = r / sqrt(w' P w + NOISE_VAR)``,
counts as ``OUTLIER_Z / |z|`` of an observation (its noise variance divided by that), so it moves
the scales as a residual of ``OUTLIER_Z`` deviations would. Unless the run before of that phase
was beyond the bound in the same direction: a new level that shows twice is learned in full. From
the default prior (``w' P w`` ~ ``PRIOR_VAR``) no residual below ~x2 is an outlier (from the
calibrated one, none below ~x1.4; a calibration off by more is learned over two runs); once runs have pinned
the scales down (``P`` small, ``sqrt(w' P w + NOISE_VAR)`` ~ 0.11), one spike of x1.5 counts as about
0.6 of a run, one of x2 as about 0.35. While the first few runs are still learned nearly in full, one spike
among them moves the next predictions by up to ``STEP_MAX``: the filter cannot yet tell it from a new level.

Bounds, so one odd run cannot swing the planner: the step of one run is scaled down as a whole
(direction kept) until no class moves by more than ``x STEP_MAX`` (1.25), and the run then
counts as that fraction of an observation (``P`` shrinks by the same fraction); each scale stays
within ``[1 / TOTAL_MAX, TOTAL_MAX]`` (3). Runs too short to measure give no update for that
phase: TTFT below ``MIN_TTFT_S`` (1 ms), decode with fewer than ``MIN_DECODE_STEPS`` (2) steps;
nor do non-finite or non-positive measurements or predictions, nor runs during which other
processes took more than ``MAX_OTHER_CPU_SHARE`` (a quarter) of all cores' time (they measured the
contention, not the machine; ``flexplan calibrate`` warns above 10% for the same reason).

The memory state, learned. Where the plan scaled decode's streaming to the
memory state of now (``StateScaledEfficiency``, a probe's ratio ``s`` to the calibration's state),
how much of the state's change the runs take is the machine's and the workload's, not a constant
(a small model's batch-1 decode, nearly all weight streaming, takes nearly all of it). A sixth
state of the filter, the elasticity ``e`` (``Corrections.state_elasticity``), multiplies those
terms' time by ``state_change(s, band) ** e``, ``s`` beyond the probe's own spread within a state
(``band``: ``factors.memory_state.probe_band``, measured per machine); its regressor is ``d log T / d e`` (the log of that
times their share of the phase: 0 in the calibration's own state, so runs there teach it nothing).
Runs in one state pin the class scales; runs in another then teach ``e``, and the next plan in
that state uses it. Prior
``ELASTICITY_PRIOR_VAR``, one run moves it by at most ``ELASTICITY_STEP_MAX``, and it stays within
``+-ELASTICITY_MAX``.

Where corrections are kept, and the two calls the library makes (``corrected`` in
``flexplan.factors.efficiency_for``, ``learn`` after ``FlexModel.generate``): ``correction_store``.
No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import numpy as np

from flexplan.estimator.efficiency import TERM_CLASSES, ScaledEfficiency, unwrapped, with_learned_elasticity
from flexplan.estimator.phase_costs import phase_costs
from flexplan.estimator.policies import REGISTRY
from flexplan.estimator.terms import Shape
from flexplan.factors.efficiency import CalibratedEfficiency

if TYPE_CHECKING:  # pragma: no cover
    from flexplan.estimator.efficiency import Efficiency
    from flexplan.hardware.spec import Hardware
    from flexplan.workload.model import ModelSpec

PERTURB = 1.001  # a class's time is scaled by this (and by its inverse) to measure its share
STEP_MAX = 1.25  # one run moves a scale by at most this factor
TOTAL_MAX = 3.0  # scales stay within [1 / TOTAL_MAX, TOTAL_MAX]
PRIOR_VAR = 0.5 ** 2  # prior variance of each log scale: a class is off by a factor ~1.65 (1 sigma) before any run
# ... where the factors come from a calibration of this machine (full, quick or the first-use probe):
# off by ~14% (1 sigma), what their cold MAPE of 5-10% says. The first run then corrects 0.37-0.66
# of its residual, not nearly all of it as at PRIOR_VAR: one call's error, met in one memory state
# at one shape, taken in full makes the rest of the grid's predictions worse than not correcting
# (`benchmarks/warm_gain.py` replays recorded validations at other step sizes).
CALIBRATED_PRIOR_VAR = 0.14 ** 2
NOISE_VAR = 0.1 ** 2  # variance of one phase's log(measured / predicted) beyond the model: ~10% run-to-run
DRIFT_VAR = 0.03 ** 2  # variance added per run: the machine drifts (memory-bandwidth state, other load)
MIN_TTFT_S = 1e-3  # shorter prefills are not measured reliably
MIN_DECODE_STEPS = 2
MAX_OTHER_CPU_SHARE = 0.25  # runs during which other processes took more of all cores' time are not learned from
MIN_SHARE = 0.02  # a run "informs" a class when the class holds at least this share of a phase's time
OUTLIER_Z = 2.0  # a phase whose residual lies beyond this many of its predicted standard deviations counts less
HISTORY = 8  # residuals kept for display
ELASTICITY_PRIOR_VAR = 0.3 ** 2  # of the learned memory-state elasticity: workloads differ by about this (~0.7 to ~1)
ELASTICITY_STEP_MAX = 0.25  # one run moves it by at most this
ELASTICITY_MAX = 0.6  # it stays within +-this (the state scaling's exponent within 0.1 .. 1.3 in a faster state)
STATE_ELASTICITY = "memory_state"  # its name in ``Corrections.runs`` and in the filter's states
FILTER_STATES = (*TERM_CLASSES, STATE_ELASTICITY)  # the filter's vector: the classes' log scales, then e
ACCELERATOR_CLASSES = ("link", "accelerator")


# ----------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class Observation:
    """One measured run: where each phase ran and how long it took."""

    model: "ModelSpec"
    hardware: "Hardware"
    batch: int
    input_len: int
    new_tokens: int  # tokens generated (the first by prefill)
    dtype: str
    cpu_dtype: str
    prefill: str
    prefill_gpu_layers: int
    decode: str
    decode_gpu_layers: int
    ttft_s: float
    tpot_s: float  # mean over the decode steps
    other_cpu_share: float | None = None  # of all cores' time, other processes took during the run
    weights: tuple = ()  # the blocks the CPU held, as the plan priced them (Plan.weights)

    @classmethod
    def from_stats(cls, stats, model: "ModelSpec", hardware: "Hardware") -> "Observation":
        """From a :class:`~flexplan.executor.stats.RunStats` (``FlexModel.last_stats``)."""
        p = stats.plan
        return cls(model, hardware, int(stats.batch_size), int(stats.input_len), int(stats.new_tokens), p.dtype,
                   p.cpu_dtype, p.prefill.policy, int(p.prefill.gpu_layers), p.decode.policy,
                   int(p.decode.gpu_layers), float(stats.ttft_s), float(stats.tpot_s),
                   getattr(stats, "other_processes_cpu_share", None), tuple(getattr(p, "weights", ())))

    def measured_s(self, phase: str) -> float | None:
        """The phase's measured time, None when too short or not finite to learn from, or when
        other processes held the cores (the run then measured them, not this machine)."""
        if self.other_cpu_share is not None and self.other_cpu_share > MAX_OTHER_CPU_SHARE:
            return None
        if phase == "prefill":
            t, ok = self.ttft_s, True
        else:
            t, ok = self.tpot_s, self.new_tokens - 1 >= MIN_DECODE_STEPS
        t = float(t) if isinstance(t, (int, float, np.floating)) else math.nan
        if not ok or not math.isfinite(t) or t <= 0 or (phase == "prefill" and t < MIN_TTFT_S):
            return None
        return t


@dataclass(frozen=True)
class Corrections:
    """Learned log scales per term class, with how many runs informed each and recent residuals."""

    log_scales: Mapping[str, float] = field(default_factory=dict)
    runs: Mapping[str, int] = field(default_factory=dict)  # per class: runs that informed it
    updates: int = 0  # runs that changed anything
    last: tuple = ()  # up to HISTORY dicts: phase, policy, measured_s, predicted_s
    cov: tuple = ()  # the filter's covariance (rows in FILTER_STATES order); () = the prior
    state_elasticity: float = 0.0  # learned: the memory state's scaled terms' time times scale ** this

    def covariance(self, prior_var: float = PRIOR_VAR) -> np.ndarray:
        """The filter's covariance over FILTER_STATES, ``prior_var`` per class before any run (one kept
        over the classes alone, before the elasticity was learned, gets the elasticity's prior beside it)."""
        prior = np.diag([prior_var] * len(TERM_CLASSES) + [ELASTICITY_PRIOR_VAR])
        if not self.cov:
            return prior
        m = np.array(self.cov, float)
        prior[:m.shape[0], :m.shape[1]] = m
        return prior

    def vector(self) -> np.ndarray:
        """The filter's state: log scales in TERM_CLASSES order, then the elasticity."""
        return np.array([self.log_scales.get(c, 0.0) for c in TERM_CLASSES] + [self.state_elasticity])

    @property
    def scales(self) -> dict[str, float]:
        """Time multipliers of the classes that moved."""
        return {c: float(math.exp(g)) for c, g in self.log_scales.items() if abs(g) > 1e-9}

    def describe(self) -> str:
        """'online correction: cpu_memory x1.12, overhead x0.93 from 3 runs' (or 'none')."""
        s = self.scales
        e = self.state_elasticity
        if not s and abs(e) < 0.005:
            return "online correction: none"
        parts = ", ".join([f"{c} x{s[c]:.3g}" for c in TERM_CLASSES if c in s and abs(math.log(s[c])) >= 0.005]
                          + ([f"memory-state elasticity {e:+.2f}"] if abs(e) >= 0.005 else []))
        runs = f"from {self.updates} run{'s' if self.updates != 1 else ''}"
        return f"online correction: {parts or 'every class within 0.5% of the calibration'} {runs}"

    def to_dict(self) -> dict[str, Any]:
        return {"log_scales": {c: float(g) for c, g in self.log_scales.items()},
                "scales": {c: round(v, 6) for c, v in self.scales.items()},  # for the reader; log_scales is read
                "runs": {c: int(n) for c, n in self.runs.items()}, "updates": int(self.updates),
                "last": [dict(x) for x in self.last], "covariance": [list(row) for row in self.cov],
                "state_elasticity": float(self.state_elasticity)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Corrections":
        """Checked: unknown classes, non-finite or out-of-bounds values raise ValueError."""
        g = {str(c): float(v) for c, v in dict(d.get("log_scales") or {}).items()}
        bad = {c: v for c, v in g.items() if c not in TERM_CLASSES or not math.isfinite(v)
               or abs(v) > math.log(TOTAL_MAX) + 1e-9}
        if bad:
            raise ValueError(f"log_scales {bad} (classes {TERM_CLASSES}, within +-log {TOTAL_MAX})")
        runs = {str(c): int(n) for c, n in dict(d.get("runs") or {}).items()}
        last = tuple(dict(x) for x in (d.get("last") or ()))
        cov = tuple(tuple(float(x) for x in row) for row in (d.get("covariance") or ()))
        if cov:
            m, sizes = np.array(cov, float), (len(TERM_CLASSES), len(FILTER_STATES))  # (files before the elasticity)
            if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] not in sizes or not np.all(np.isfinite(m)) or \
                    np.any(np.diag(m) < 0) or not np.allclose(m, m.T, atol=1e-9) or np.max(np.diag(m)) > 10 * PRIOR_VAR:
                raise ValueError(f"covariance is not a symmetric {sizes[1]}x{sizes[1]} matrix with a bounded, "
                                 "non-negative diagonal")
        e = float(d.get("state_elasticity") or 0.0)
        if not math.isfinite(e) or abs(e) > ELASTICITY_MAX + 1e-9:
            raise ValueError(f"state_elasticity {e} (within +-{ELASTICITY_MAX})")
        return cls(g, runs, int(d.get("updates") or 0), last, cov, e)


# ----------------------------------------------------------------------------- attribution


def phase_time_s(obs: Observation, eff: "Efficiency", phase: str) -> float:
    """The estimator's time of ``phase`` for the placement the run used (TTFT or mean TPOT): the
    policy's own ``estimate`` over Table 2's per-layer costs, for its single M."""

    shape = Shape(obs.model, obs.batch, obs.input_len, max(obs.new_tokens, 2), obs.dtype, obs.cpu_dtype, obs.weights)
    policy, m = (obs.prefill, obs.prefill_gpu_layers) if phase == "prefill" else (obs.decode, obs.decode_gpu_layers)
    pc = phase_costs(shape, obs.hardware, eff, phase)
    return float(REGISTRY[policy].estimate(pc, obs.model.num_layers, np.array([int(m)])).time_s[0])


def shares(obs: Observation, eff: "Efficiency", phase: str) -> tuple[float, np.ndarray]:
    """(predicted time T, w) with ``w[i] = d log T / d log s`` of class ``TERM_CLASSES[i]``, by
    scaling that class's time by PERTURB and by 1 / PERTURB (only the classes the phase's formula
    reads move it). Central: the formulas take maxima and minima (the best split's CPU part against
    the next layer's copy, Eq. 5), whose sides the search balances: a one-sided 1% step across such
    a kink counted both sides whole (shares summing to 1.17 for a split-points prefill whose sides
    were 0.8% apart; central at 1%: 1.05; central at 0.1%: 1.00)."""

    t0 = phase_time_s(obs, eff, phase)
    w = np.zeros(len(TERM_CLASSES))
    if not (math.isfinite(t0) and t0 > 0):
        return t0, w
    policy, m = (obs.prefill, obs.prefill_gpu_layers) if phase == "prefill" else (obs.decode, obs.decode_gpu_layers)
    on_accelerator = REGISTRY[policy].placement(obs.model.num_layers, int(m), phase).uses_accelerator
    for i, c in enumerate(TERM_CLASSES):
        if c in ACCELERATOR_CLASSES and not on_accelerator:
            continue  # a placement that never touches the accelerator reads none of its terms
        up = phase_time_s(obs, ScaledEfficiency(eff, {c: PERTURB}), phase)
        down = phase_time_s(obs, ScaledEfficiency(eff, {c: 1.0 / PERTURB}), phase)
        if all(math.isfinite(x) and x > 0 for x in (up, down)):
            w[i] = max(0.0, math.log(up / down) / (2.0 * math.log(PERTURB)))
    return t0, w


def state_share(obs: Observation, eff: "Efficiency", phase: str, elasticity: float, t0: float) -> float:
    """``d log T / d e`` of the learned memory-state elasticity ``e`` (now ``elasticity``; ``t0``:
    the phase's time at it): ``log state_change(s)`` times the share of the state-scaled terms,
    signed; 0 where nothing is state-scaled (a state within the probe's band of the calibration's,
    or no StateScaledEfficiency)."""
    step = math.log(PERTURB)
    t1 = phase_time_s(obs, with_learned_elasticity(eff, elasticity + step), phase)
    return math.log(t1 / t0) / step if math.isfinite(t1) and t1 > 0 and t0 > 0 else 0.0


# ----------------------------------------------------------------------------- the update


def apply(eff: "Efficiency", corrections: Corrections | None) -> "Efficiency":
    """``eff`` with ``corrections`` on top (``eff`` itself when there are none): the class scales
    around it, the learned elasticity given to its memory-state scaling."""
    if corrections is None or (not corrections.scales and not corrections.state_elasticity):
        return eff
    return CorrectedEfficiency(with_learned_elasticity(eff, corrections.state_elasticity), corrections.scales,
                               corrections.describe())


@dataclass(frozen=True)
class CorrectedEfficiency(ScaledEfficiency):
    """The ScaledEfficiency that carries online corrections (told apart by :func:`uncorrected`)."""


def uncorrected(eff: "Efficiency") -> "Efficiency":
    """``eff`` without the online correction applied last (itself when it has none)."""
    return with_learned_elasticity(eff.base, 0.0) if isinstance(eff, CorrectedEfficiency) else eff


def update(corrections: Corrections | None, obs: Observation, base: "Efficiency") -> Corrections:
    """Corrections after one observed run, learned against ``base`` (the efficiency without
    corrections). The rule and its bounds: module docstring. Unchanged when no phase is usable."""
    corrections = corrections if corrections is not None else Corrections()
    g0 = corrections.vector()
    runs = np.array([corrections.runs.get(c, 0) for c in FILTER_STATES])
    p = p_prior = corrections.covariance(prior_var(base)) + DRIFT_VAR * np.eye(len(FILTER_STATES))
    eff = apply(base, corrections)
    g = g0.copy()
    informed = np.zeros(g.shape, bool)
    history = []
    for phase, policy in (("prefill", obs.prefill), ("decode", obs.decode)):
        measured = obs.measured_s(phase)
        if measured is None:
            continue
        t, w = shares(obs, eff, phase)
        if not (math.isfinite(t) and t > 0) or float(w @ w) < 1e-6:
            continue
        w = np.append(w, state_share(obs, eff, phase, corrections.state_elasticity, t))
        r = math.log(measured / t) - float(w @ (g - g0))  # residual after the phase before's update
        z = r / math.sqrt(float(w @ p @ w) + NOISE_VAR)
        gain = p @ w / (float(w @ p @ w) + NOISE_VAR / outlier_weight(z, _last_z(corrections, phase)))
        g += gain * r
        p = p - np.outer(gain, w @ p)
        p = (p + p.T) / 2
        informed |= np.abs(w) >= MIN_SHARE
        history.append({"phase": phase, "policy": policy, "measured_s": measured, "predicted_s": t, "z": round(z, 4)})
    if not history:
        return corrections
    step = g - g0
    step_max = np.array([math.log(STEP_MAX)] * len(TERM_CLASSES) + [ELASTICITY_STEP_MAX])
    biggest = float(np.max(np.abs(step) / step_max))
    if biggest > 1.0:  # bounded: the run counts as that fraction of an observation
        shrink = 1.0 / biggest
        step *= shrink
        p = p_prior + shrink * (p - p_prior)
    bound = np.array([math.log(TOTAL_MAX)] * len(TERM_CLASSES) + [ELASTICITY_MAX])
    g_new = np.clip(g0 + step, -bound, bound)
    log_scales = {c: float(x) for c, x in zip(TERM_CLASSES, g_new[:-1]) if abs(x) > 1e-12}
    new_runs = {c: int(n) for c, n in zip(FILTER_STATES, runs + informed) if n}
    return Corrections(log_scales, new_runs, corrections.updates + 1, (tuple(corrections.last) + tuple(history))[-HISTORY:],
                       tuple(tuple(float(x) for x in row) for row in p), float(g_new[-1]))


def prior_var(base: "Efficiency") -> float:
    """The prior variance of each class's log scale over ``base``: CALIBRATED_PRIOR_VAR over a
    calibration of this machine, PRIOR_VAR over default factors (hwdb peaks times guesses)."""

    return CALIBRATED_PRIOR_VAR if isinstance(unwrapped(base), CalibratedEfficiency) else PRIOR_VAR


def outlier_weight(z: float, z_before: float | None) -> float:
    """How much of an observation a phase with standardised residual ``z`` counts as (Huber):
    1 within ``OUTLIER_Z``, else ``OUTLIER_Z / |z|``; 1 again when the run before of the phase
    (``z_before``) was beyond the bound in the same direction (a new level, shown twice)."""
    if abs(z) <= OUTLIER_Z:
        return 1.0
    if z_before is not None and abs(z_before) > OUTLIER_Z and (z_before > 0) == (z > 0):
        return 1.0
    return OUTLIER_Z / abs(z)


def _last_z(corrections: Corrections, phase: str) -> float | None:
    """The standardised residual of the latest run of ``phase`` the corrections remember (None:
    none, or one from before residuals were kept)."""
    for entry in reversed(corrections.last):
        if entry.get("phase") == phase:
            z = entry.get("z")
            return float(z) if isinstance(z, (int, float)) and math.isfinite(z) else None
    return None


def corrections_after(observations: Iterable[Observation], base: "Efficiency",
                      start: Corrections | None = None) -> Corrections:
    """The corrections that ``observations``, fed in order, leave (from ``start`` or none). Pure:
    no disk, no process state (``flexplan validate`` reports cold and warm errors with it)."""
    c = start if start is not None else Corrections()
    for obs in observations:
        c = update(c, obs, base)
    return c


__all__ = ["Corrections", "CorrectedEfficiency", "Observation", "apply", "corrections_after", "phase_time_s", "shares",
           "state_share", "uncorrected", "update"]
