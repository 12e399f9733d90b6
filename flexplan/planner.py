"""Pick the best policy per phase: FlexInfer's Execution Planner (section 5.2).

For every policy and phase the estimator gives TTFT or mean TPOT for every feasible M (GPU-
resident layers); the planner then scores prefill/decode pairs by end-to-end latency

    E2E = load + TTFT + switch + (output_len - 1) x TPOT

where ``load`` is the initial loading of GPU-resident weights (the paper includes it) and
``switch`` moves KV cache and weights from the prefill placement to the decode placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from flexplan.errors import DoesNotFitError, InvalidInputError
from flexplan.estimator import REGISTRY, DefaultEfficiency, Efficiency, Shape, phase_costs
from flexplan.estimator import memory
from flexplan.estimator.terms import PhaseCosts, t_link_s
from flexplan.hardware.spec import Hardware, canonical_dtype
from flexplan.plan_types import PHASES, POLICIES, Candidate, PhaseChoice, Plan
from flexplan.workload import resolve_model
from flexplan.workload.model import ModelSpec

GiB = 1 << 30
ICN_SWITCH_EFF = 0.8  # bulk copies at a phase switch: the default Eff_ICN


@dataclass
class _Options:
    """Feasible estimates of one (phase, policy) over its M values."""

    policy: str
    gpu_layers: np.ndarray
    time_s: np.ndarray
    pcie_bytes: np.ndarray
    gpu_bytes: np.ndarray
    cpu_bytes: np.ndarray
    feasible: np.ndarray
    terms: dict[str, np.ndarray]
    load_s: np.ndarray  # initial load before prefill (prefill options only)

    def best(self) -> int | None:
        idx = np.flatnonzero(self.feasible)
        return None if idx.size == 0 else int(idx[np.argmin(self.time_s[idx])])

    def index_of(self, m: int) -> int | None:
        idx = np.flatnonzero((self.gpu_layers == m) & self.feasible)
        return int(idx[0]) if idx.size else None


def _check_positive(**kw: Any) -> None:
    for k, v in kw.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise InvalidInputError(f"{k} must be a positive integer, got {v!r}")


def _resolve_hardware(hardware: Any) -> Hardware:
    from flexplan.hardware import get_hardware

    return hardware if isinstance(hardware, Hardware) else get_hardware(str(hardware))


def _efficiency(hw: Hardware, efficiency: Efficiency | None) -> Efficiency:
    if efficiency is not None:
        return efficiency
    try:
        from flexplan.calibration import efficiency_for
    except ImportError:
        return DefaultEfficiency.for_hardware(hw)
    return efficiency_for(hw)


def _phase_options(phase: str, policy: str, pc: PhaseCosts, pc_prefill: PhaseCosts, shape: Shape,
                   hw: Hardware, gpu_budget: float, cpu_budget: float, force_m: int | None) -> _Options:
    pol = REGISTRY[policy]
    n = shape.model.num_layers
    ms = pol.gpu_layer_options(n)
    if force_m is not None and policy in ("splitgen", "gpu-offload-partial"):
        ms = ms[ms == force_m]
    if policy != "cpu" and not hw.has_gpu:
        inf = np.full(ms.shape, np.inf)
        return _Options(policy, ms, inf, inf, inf, inf, np.zeros(ms.shape, bool), {}, inf)
    est = pol.estimate(pc, n, ms)
    gpu_b = memory.gpu_bytes(shape, hw, pol.host_mode, ms, phase)
    cpu_b = memory.cpu_bytes(shape, pol.host_mode, ms, phase)
    gpu_b = np.broadcast_to(gpu_b, ms.shape).astype(float)
    feasible = (gpu_b <= gpu_budget) & (cpu_b <= cpu_budget) & np.isfinite(est.time_s)
    load = pol.initial_load_s(pc_prefill, ms) if phase == "prefill" else np.zeros(ms.shape)
    return _Options(policy, ms, est.time_s, est.pcie_bytes, gpu_b, cpu_b, feasible, est.terms, load)


def _why_not(o: _Options, hw: Hardware, gpu_budget: float, cpu_budget: float) -> str:
    if o.policy != "cpu" and not hw.has_gpu:
        return "no GPU"
    if o.gpu_layers.size == 0:
        return "no valid number of GPU layers"
    i = int(np.argmin(o.gpu_bytes + o.cpu_bytes))
    parts = []
    if o.gpu_bytes[i] > gpu_budget:
        parts.append(f"needs {o.gpu_bytes[i] / GiB:.1f} GiB GPU memory, has {gpu_budget / GiB:.1f}")
    if o.cpu_bytes[i] > cpu_budget:
        parts.append(f"needs {o.cpu_bytes[i] / GiB:.1f} GiB host memory, has {cpu_budget / GiB:.1f}")
    return "; ".join(parts) or "infeasible"


def _location(n: int, m: int, host_mode: str) -> list[str]:
    return [("gpu" if j >= n - m else host_mode) for j in range(n)]


def switch_s(shape: Shape, hw: Hardware, prefill: str, m_p: int, decode: str, m_d: int,
             ttft_s: float, include_initial_load: bool = True) -> float:
    """Moving KV (at the prompt's length) and weights from the prefill placement to the decode one.
    Layers that become GPU-resident for decode: free if prefill streamed them through the GPU
    (they stay), loaded over the link otherwise (overlapped with a CPU-only prefill). Layers
    leaving the GPU send their weights back only if no host copy exists."""
    if not hw.has_gpu:
        return 0.0
    n = shape.model.num_layers
    lb = memory.LayerBytes.of(shape)
    kv_prompt = float(lb.kv_gpu * shape.input_len / (shape.input_len + shape.output_len))
    pm, dm = REGISTRY[prefill].host_mode, REGISTRY[decode].host_mode
    h2d = d2h = 0.0
    h2d_weights = 0.0
    for a, b in zip(_location(n, m_p, pm), _location(n, m_d, dm)):
        if a == b or {a, b} == {"cpu", "stream"}:
            continue  # same memory (host copies in both dtypes are kept)
        if b == "gpu":  # host -> GPU resident
            if a != "stream":
                h2d_weights += lb.w_gpu
            h2d += kv_prompt
        else:  # GPU resident -> host
            d2h += kv_prompt
    if REGISTRY[decode].name != "cpu" and m_p == 0 and prefill == "cpu":
        h2d_weights += lb.head_gpu
    bw_h2d, bw_d2h = hw.link.h2d_bandwidth_bytes_per_s, hw.link.d2h_bandwidth_bytes_per_s
    t_weights = t_link_s(h2d_weights, bw_h2d, ICN_SWITCH_EFF) if h2d_weights and include_initial_load else 0.0
    if prefill == "cpu":  # the link is idle during a CPU-only prefill: load then
        t_weights = max(0.0, t_weights - ttft_s)
    return max(t_weights + t_link_s(h2d, bw_h2d, ICN_SWITCH_EFF), t_link_s(d2h, bw_d2h, ICN_SWITCH_EFF))


def plan(model: Any, hardware: Any = "local", batch_size: int = 1, input_len: int = 128, output_len: int = 32,
         dtype: str = "bfloat16", gpu_memory_bytes: float | None = None, cpu_memory_bytes: float | None = None,
         prefill: str | None = None, decode: str | None = None, gpu_layers: int | None = None,
         efficiency: Efficiency | None = None, include_initial_load: bool = True, cpu_dtype: str | None = None) -> Plan:
    """Choose the prefill and decode policies with the lowest predicted end-to-end latency.

    ``model``: catalog id, config path/folder, PretrainedConfig, HF model or ModelSpec.
    ``hardware``: hwdb server name, composition ``CPU[xS]+GPU+LINK``, ``"local"``, or a Hardware.
    ``prefill``/``decode``/``gpu_layers`` force a policy or M. ``include_initial_load``: count the
    loading of GPU-resident weights in E2E, as the paper does (footnote 5); a long-running process
    that already holds its weights plans with False. ``cpu_dtype``: what the CPU computes in; by
    default the planner tries the CPU's native fast dtype and float32 and keeps the lower E2E
    (on some CPUs bf16 GEMMs are faster but bf16 GEMV slower than fp32). Raises :class:`DoesNotFitError`
    when no placement fits, :class:`InvalidInputError` for bad arguments.
    """
    _check_positive(batch_size=batch_size, input_len=input_len, output_len=output_len)
    for name, forced in (("prefill", prefill), ("decode", decode)):
        if forced is not None and forced not in POLICIES:
            raise InvalidInputError(f"unknown {name} policy {forced!r}; use one of {', '.join(POLICIES)}")
    spec: ModelSpec = resolve_model(model)
    if gpu_layers is not None and not (0 <= gpu_layers <= spec.num_layers):
        raise InvalidInputError(f"gpu_layers must be between 0 and {spec.num_layers} for {spec.name}, got {gpu_layers}")
    hw = _resolve_hardware(hardware)
    dtype = canonical_dtype(dtype)
    if hw.gpu is not None and dtype not in hw.gpu.peak_flops_per_s:
        raise InvalidInputError(f"{hw.gpu.name} has no {dtype} figure in hwdb; use one of {', '.join(hw.gpu.peak_flops_per_s)}")
    eff = _efficiency(hw, efficiency)
    if cpu_dtype is not None:
        cpu_dtypes = [canonical_dtype(cpu_dtype)]
        if hw.cpu.peak_flops_per_s.get(cpu_dtypes[0], 0) <= 0:
            raise InvalidInputError(f"{hw.cpu.name} has no {cpu_dtypes[0]} figure; use one of "
                                    f"{', '.join(hw.cpu.peak_flops_per_s)}")
    else:
        cpu_dtypes = list(dict.fromkeys([hw.cpu.compute_dtype, "float32"]))
    best: Plan | None = None
    error: DoesNotFitError | None = None
    for cd in cpu_dtypes:
        try:
            p = _plan_one(spec, hw, eff, Shape(spec, batch_size, input_len, output_len, dtype, cd), gpu_memory_bytes,
                          cpu_memory_bytes, prefill, decode, gpu_layers, include_initial_load)
        except DoesNotFitError as e:
            error = error or e
            continue
        if best is None or p.e2e_s < best.e2e_s:
            if best is not None:
                p = replace(p, notes=p.notes + (f"CPU computes in {cd}: predicted E2E {p.e2e_s:.3g} s vs "
                                                f"{best.e2e_s:.3g} s in {best.cpu_dtype}",))
            best = p
    if best is None:
        raise error
    return best


def _plan_one(spec: ModelSpec, hw: Hardware, eff: Efficiency, shape: Shape, gpu_memory_bytes, cpu_memory_bytes,
              prefill, decode, gpu_layers, include_initial_load) -> Plan:
    batch_size, input_len, output_len, dtype, cpu_dtype = (shape.batch, shape.input_len, shape.output_len,
                                                           shape.dtype, shape.cpu_dtype)

    gpu_budget = float(gpu_memory_bytes if gpu_memory_bytes is not None else (hw.gpu.memory_bytes if hw.gpu else 0))
    cpu_budget = float(cpu_memory_bytes if cpu_memory_bytes is not None
                       else hw.cpu.memory_bytes * memory.CPU_MEMORY_USABLE_FRACTION)
    if gpu_budget < 0 or cpu_budget <= 0:
        raise InvalidInputError("memory budgets must be positive")

    pcs = {ph: phase_costs(shape, hw, eff, ph) for ph in PHASES}
    forced = {"prefill": prefill, "decode": decode}
    opts: dict[str, dict[str, _Options]] = {ph: {} for ph in PHASES}
    candidates: list[Candidate] = []
    for ph in PHASES:
        for pol in POLICIES:
            o = _phase_options(ph, pol, pcs[ph], pcs["prefill"], shape, hw, gpu_budget, cpu_budget, gpu_layers)
            opts[ph][pol] = o
            i = o.best()
            if i is None:
                j = int(np.argmin(o.gpu_bytes + o.cpu_bytes)) if o.gpu_layers.size else None
                finite = j is not None and np.isfinite(o.gpu_bytes[j])
                candidates.append(Candidate(
                    ph, pol, int(o.gpu_layers[j]) if j is not None else 0, math.inf,
                    int(o.gpu_bytes[j]) if finite else 0, int(o.cpu_bytes[j]) if finite else 0, 0.0, False,
                    _why_not(o, hw, gpu_budget, cpu_budget)))
            else:
                candidates.append(Candidate(
                    ph, pol, int(o.gpu_layers[i]), float(o.time_s[i]), int(o.gpu_bytes[i]), int(o.cpu_bytes[i]),
                    float(o.pcie_bytes[i]), True, "", {k: float(v[i]) for k, v in o.terms.items()}))

    steps = shape.decode_steps

    def score(p: str, ip: int, d: str, idx_d: int) -> tuple[float, float, float] | None:
        op, od = opts["prefill"][p], opts["decode"][d]
        m_p, m_d = int(op.gpu_layers[ip]), int(od.gpu_layers[idx_d])
        host = memory.pair_cpu_bytes(shape, REGISTRY[p].host_mode, m_p, REGISTRY[d].host_mode, m_d)
        if host > cpu_budget:
            return None
        ttft = float(op.time_s[ip])
        sw = switch_s(shape, hw, p, m_p, d, m_d, ttft, include_initial_load)
        load = float(op.load_s[ip]) if include_initial_load else 0.0
        return load + ttft + sw + steps * float(od.time_s[idx_d]), load, sw

    def best_pair(p_pols, d_pols):
        best = None
        for p in p_pols:
            op = opts["prefill"][p]
            for d in d_pols:
                od = opts["decode"][d]
                ip_best, id_best = op.best(), od.best()
                if ip_best is None or id_best is None:
                    continue
                ip_set = {ip_best, int(np.flatnonzero(op.feasible)[-1])}
                id_set = {id_best, int(np.flatnonzero(od.feasible)[-1])}
                for ip in list(ip_set):  # same M in both phases avoids a switch
                    j = od.index_of(int(op.gpu_layers[ip]))
                    if j is not None:
                        id_set.add(j)
                for i_d in list(id_set):
                    j = op.index_of(int(od.gpu_layers[i_d]))
                    if j is not None:
                        ip_set.add(j)
                for ip in ip_set:
                    for i_d in id_set:
                        s = score(p, ip, d, i_d)
                        if s is not None and (best is None or s[0] < best[0]):
                            best = (s[0], s[1], s[2], p, ip, d, i_d)
        return best

    p_pols = [prefill] if prefill else list(POLICIES)
    d_pols = [decode] if decode else list(POLICIES)
    chosen = best_pair(p_pols, d_pols)
    baselines = {}
    for pol in POLICIES:
        b = best_pair([pol], [pol])
        baselines[pol] = b[0] if b else math.inf
    if chosen is None:
        raise DoesNotFitError(_no_fit_message(shape, hw, gpu_budget, cpu_budget, prefill, decode, gpu_layers, candidates))
    e2e, load_s, sw, p, ip, d, i_d = chosen
    op, od = opts["prefill"][p], opts["decode"][d]
    cp = Candidate("prefill", p, int(op.gpu_layers[ip]), float(op.time_s[ip]), int(op.gpu_bytes[ip]),
                   int(op.cpu_bytes[ip]), float(op.pcie_bytes[ip]), True)
    cd = Candidate("decode", d, int(od.gpu_layers[i_d]), float(od.time_s[i_d]), int(od.gpu_bytes[i_d]),
                   int(od.cpu_bytes[i_d]), float(od.pcie_bytes[i_d]), True)
    notes = tuple(hw.notes)
    return Plan(
        model=spec.name, hardware=hw.name, batch_size=batch_size, input_len=input_len, output_len=output_len,
        dtype=dtype, cpu_dtype=cpu_dtype, num_layers=spec.num_layers, gpu_memory_bytes=int(gpu_budget),
        cpu_memory_bytes=int(cpu_budget), prefill=PhaseChoice.of(cp), decode=PhaseChoice.of(cd),
        ttft_s=cp.time_s, tpot_s=cd.time_s, load_s=load_s, switch_s=sw, e2e_s=e2e,
        reason=_reason(cp, cd, candidates, baselines, e2e),
        candidates=tuple(candidates), baselines=baselines, calibration=eff.source, notes=notes,
    )


def _reason(cp: Candidate, cd: Candidate, candidates: list[Candidate], baselines: dict, e2e: float) -> str:
    def runner_up(phase: str, chosen: str) -> Candidate | None:
        others = [c for c in candidates if c.phase == phase and c.feasible and c.policy != chosen]
        return min(others, key=lambda c: c.time_s) if others else None

    parts = []
    for c, label in ((cp, "TTFT"), (cd, "TPOT")):
        r = runner_up(c.phase, c.policy)
        if r is None:
            parts.append(f"{c.policy} is the only {c.phase} policy that fits")
        elif r.time_s <= c.time_s * 1.01:
            parts.append(f"{c.policy} ties with {r.policy} on {label} ({c.time_s:.3g} s) and wins end to end")
        else:
            parts.append(f"{c.policy} gives the lowest {label} ({c.time_s:.3g} s vs {r.policy} {r.time_s:.3g} s)")
    homo = min(baselines.values())
    tail = (f"; together {e2e:.3g} s end to end, {100 * (1 - e2e / homo):.0f}% below the best single policy"
            if math.isfinite(homo) and homo > e2e * 1.0005 else "")
    return f"Prefill: {parts[0]}; decode: {parts[1]}{tail}."


def _no_fit_message(shape: Shape, hw: Hardware, gpu_budget, cpu_budget, prefill, decode, gpu_layers, candidates) -> str:
    lb = memory.LayerBytes.of(shape)
    n = shape.model.num_layers
    need_host_cpu = n * (lb.w_cpu + lb.kv_cpu) + lb.embed_cpu + lb.head_cpu
    forced = ", ".join(f"{k}={v}" for k, v in (("prefill", prefill), ("decode", decode), ("gpu_layers", gpu_layers)) if v is not None)
    why = "; ".join(f"{c.phase} {c.policy}: {c.reason}" for c in candidates if not c.feasible and
                    (c.policy in (prefill, decode) if forced else True))
    return (f"{shape.model.name} (batch {shape.batch}, {shape.input_len}+{shape.output_len} tokens, {shape.dtype}) fits no "
            f"placement{' with ' + forced if forced else ''} on {hw.name}: all on the CPU needs "
            f"{need_host_cpu / GiB:.1f} GiB host memory ({shape.cpu_dtype}), usable {cpu_budget / GiB:.1f} GiB; GPU "
            f"budget {gpu_budget / GiB:.1f} GiB. {why}. Try a smaller batch or sequence, or more memory.")
