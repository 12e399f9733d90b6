"""Pick the best policy per phase: FlexInfer's Execution Planner (section 5.2).

For every policy and phase the estimator gives TTFT or mean TPOT for every feasible M (GPU-
resident layers); the planner then scores prefill/decode pairs by end-to-end latency

    E2E = load + TTFT + switch + (output_len - 1) x TPOT

where ``load`` is the initial loading of GPU-resident weights (the paper includes it) and
``switch`` moves KV cache and weights from the prefill placement to the decode placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass, replace
from functools import cached_property, lru_cache
from collections.abc import Generator
from typing import Any

import numpy as np

from flexplan import memory
from flexplan.errors import DoesNotFitError, InvalidInputError
from flexplan.estimator import REGISTRY, DefaultEfficiency, Efficiency, Shape, phase_costs
from flexplan.estimator.efficiency import FactorSource, block_formats
from flexplan.estimator.expert_cache import profile_curves, with_profile
from flexplan.estimator.policies import POLICIES, Policy, placement_of
from flexplan.estimator.terms import PhaseCosts, t_link_s
from flexplan.factors import efficiency_for
from flexplan.hardware import get_hardware
from flexplan.hardware.spec import DTYPE_BYTES, Hardware, canonical_dtype
from flexplan.placement import (
    ACCELERATOR,
    CPU,
    EXPERT_GROUP,
    RESIDENT,
    PhasePlacement,
    Placement,
    prefill_beside,
    segments,
)
from flexplan.plan_expert_cache import CPU_EXPERTS_POLICY as X
from flexplan.plan_expert_cache import add_expert_cache, resolve_profile
from flexplan.plan_types import PHASES, Candidate, PhaseChoice, Plan
from flexplan.workload import costs, resolve_model, weight_formats
from flexplan.workload.model import ModelSpec

GiB = 1 << 30


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
    reason: str = ""  # why none is feasible, when it is not the memory

    def best(self) -> int | None:
        return self._best

    @cached_property
    def feasible_index(self) -> np.ndarray:
        """Indices of the feasible options (the pair search asks hundreds of times)."""
        return np.flatnonzero(self.feasible)

    @cached_property
    def _best(self) -> int | None:
        """The fastest feasible option."""
        idx = self.feasible_index
        return None if idx.size == 0 else int(idx[np.argmin(self.time_s[idx])])

    @cached_property
    def _feasible_index(self) -> dict[int, int]:
        """M -> the first feasible option with M GPU layers (the pair search asks thousands of times)."""
        return dict(zip(self.gpu_layers[self.feasible_index[::-1]].tolist(), self.feasible_index[::-1].tolist()))

    def index_of(self, m: int) -> int | None:
        return self._feasible_index.get(int(m))


@lru_cache(maxsize=8192)
def _placed(policy: Policy, num_layers: int, gpu_layers: int, phase: str) -> PhasePlacement:
    """``policy``'s placement with ``gpu_layers`` layers on the GPU: a pure function of these four,
    asked thousands of times per plan by the pair search (and again for each CPU dtype and shape)."""
    return policy.placement(num_layers, gpu_layers, phase)


@lru_cache(maxsize=8192)
def _beside(prefill: Policy, m_p: int, decode: Policy, m_d: int, num_layers: int) -> tuple[int, int]:
    """(canonical id, resident layers) of the prefill placement the executor runs beside that decode
    placement (placement.prefill_beside): shape-independent, so kept across plans."""
    runs = prefill_beside(_placed(prefill, num_layers, m_p, "prefill"), _placed(decode, num_layers, m_d, "decode"))
    return _canonical_id(runs), int(runs.count(lambda mode: mode is RESIDENT))


@lru_cache(maxsize=8192)
def _placed_id(policy: Policy, num_layers: int, gpu_layers: int, phase: str) -> int:
    """:func:`_canonical_id` of ``policy``'s placement with ``gpu_layers`` GPU layers."""
    return _canonical_id(_placed(policy, num_layers, gpu_layers, phase))


def _canonical_id(pp: PhasePlacement) -> int:
    """A small int naming the placement's merged runs (PhasePlacement.merged) and head mode: equal
    placements, equal ids (the pair search compares thousands; an int hashes at once)."""
    key = (PhasePlacement.merged(pp.runs).runs, pp.head_mode)
    return _CANONICAL_IDS.setdefault(key, len(_CANONICAL_IDS))


_CANONICAL_IDS: dict[tuple, int] = {}  # grows with the distinct placements planned (a few per policy and M)


@lru_cache(maxsize=8192)
def _masks(policy: Policy, num_layers: int, gpu_layers: int, phase: str) -> tuple[int, int]:
    """(streamed, resident) layers of ``policy``'s placement with ``gpu_layers`` GPU layers, as bit masks."""
    streamed = resident = first = 0
    for mode, count in _placed(policy, num_layers, gpu_layers, phase).runs:
        bits = ((1 << int(count)) - 1) << first
        streamed |= bits if mode.streamed else 0
        resident |= bits if mode is RESIDENT else 0
        first += int(count)
    return streamed, resident


@lru_cache(maxsize=1024)
def _layer_rows(policy: Policy, num_layers: int, gpu_layers: tuple[int, ...], phase: str) -> tuple[np.ndarray, np.ndarray]:
    """(streamed, resident) layers of ``policy``'s placement at each of ``gpu_layers``, bool [options, layers]."""
    streamed, resident = np.zeros((len(gpu_layers), num_layers), bool), np.zeros((len(gpu_layers), num_layers), bool)
    for k, m in enumerate(gpu_layers):
        first = 0
        for mode, count in _placed(policy, num_layers, m, phase).runs:
            streamed[k, first:first + int(count)] = mode.streamed
            resident[k, first:first + int(count)] = mode is RESIDENT
            first += int(count)
    return streamed, resident


def _check_positive(**kw: Any) -> None:
    for k, v in kw.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise InvalidInputError(f"{k} must be a positive integer, got {v!r}")


def _resolve_hardware(hardware: Any) -> Hardware:
    return hardware if isinstance(hardware, Hardware) else get_hardware(str(hardware))


def _efficiency(hw: Hardware, efficiency: Efficiency | None) -> Efficiency:
    if efficiency is not None:
        return efficiency
    return efficiency_for(hw)


def _inventory(spec: ModelSpec, weights: tuple = ()) -> memory.Inventory:
    inv = _INVENTORIES.get((spec, weights))
    if inv is None:
        inv = _INVENTORIES[spec, weights] = memory.Inventory.from_spec(spec, weights)
        if len(_INVENTORIES) > 64:
            _INVENTORIES.pop(next(iter(_INVENTORIES)))
    return inv


_INVENTORIES: dict[tuple[ModelSpec, tuple], memory.Inventory] = {}


def placement_memory(shape: Shape, hw: Hardware | None, phases: dict[str, PhasePlacement],
                     kernel: str | None = memory.KERNEL_BLOCKED) -> memory.MemoryNeed:
    """The memory model (flexplan.memory.footprint) of a placement of one or both phases, for the
    request ``shape`` on ``hw`` (its accelerator runtime's reserve counted; None: no reserve), the
    CPU's linears held as ``kernel`` holds them (the planner assumes flexplan's blocked kernel)."""
    placement = Placement.of(phases, shape.dtype, shape.cpu_dtype)
    reserve = hw.gpu.runtime_reserved_bytes if hw is not None and hw.gpu is not None else 0
    return memory.footprint(_inventory(shape.model, shape.weights), placement, shape.batch, shape.input_len,
                            shape.input_len + shape.output_len, kernel, reserved_bytes=reserve)


def _phase_memory(shape: Shape, hw: Hardware, policy: str, ms: np.ndarray, phase: str) -> tuple[np.ndarray, np.ndarray]:
    """(accelerator bytes, host bytes) of ``policy`` in ``phase`` for each M in ``ms``: the
    placements' layouts (memory.layout) as linear functions of the request's size, kept per model."""
    pol, n, inv = REGISTRY[policy], shape.model.num_layers, _inventory(shape.model, shape.weights)

    def make() -> memory.LinearTotals:
        if pol.vectorised:
            placement = Placement.of({phase: pol.placement(n, ms, phase)}, shape.dtype, shape.cpu_dtype)
            return memory.LinearTotals.of(memory.layout(inv, placement, memory.KERNEL_BLOCKED))
        return memory.LinearTotals.of([memory.layout(inv, Placement.of({phase: _placed(pol, n, int(m), phase)},
                                                                        shape.dtype, shape.cpu_dtype),
                                                     memory.KERNEL_BLOCKED) for m in ms])

    totals = inv.memo(("phase totals", policy, phase, shape.dtype, shape.cpu_dtype, ms.tobytes()), make)
    reserve = hw.gpu.runtime_reserved_bytes if hw is not None and hw.gpu is not None else 0
    return totals.totals(inv, shape.dtype, shape.cpu_dtype, shape.batch, shape.input_len,
                         shape.input_len + shape.output_len, reserve)


def _phase_options(phase: str, policy: str, pc: PhaseCosts, pc_prefill: PhaseCosts, shape: Shape,
                   hw: Hardware, gpu_budget: float, cpu_budget: float, force_m: int | None) -> _Options:
    pol = REGISTRY[policy]
    n = shape.model.num_layers
    ms = pol.gpu_layer_options(n)
    if force_m is not None and pol.needs_gpu_layers:
        ms = ms[ms == force_m]
    why = "no GPU" if not hw.has_gpu and pol.needs_accelerator(n) else pol.not_applicable(shape.model)
    if why:
        inf = np.full(ms.shape, np.inf)
        return _Options(policy, ms, inf, inf, inf, inf, np.zeros(ms.shape, bool), {}, inf, why)
    est = pol.estimate(pc, n, ms)
    gpu_b, cpu_b = _phase_memory(shape, hw, policy, ms, phase)
    feasible = (gpu_b <= gpu_budget) & (cpu_b <= cpu_budget) & np.isfinite(est.time_s)
    load = pol.initial_load_s(pc_prefill, ms) if phase == "prefill" else np.zeros(ms.shape)
    return _Options(policy, ms, est.time_s, est.pcie_bytes, gpu_b, cpu_b, feasible, est.terms, load)


def _kept_weights(spec: ModelSpec, weights: str | None) -> tuple:
    """The (group, format, parameters) triples the plan keeps as blocks, () where it holds its
    weights in the dtypes: ``weights`` "gguf" (a GGUF file's blocks as stored: the default for one),
    "int4" / "int8" (a float checkpoint quantised at load, weight_formats.AT_LOAD) or a block format a
    kernel runs, by name in any case ("Q4_0", "q4_k": the decoder and head linears in it, as at load),
    or "float32" (dequantised; the default otherwise)."""
    fmt = weight_formats.kernel_format(weights) if weights not in (None, "gguf", "float32") else None
    if weights not in (None, "gguf", "float32") and fmt is None:
        raise InvalidInputError(f"weights={weights!r}: use 'gguf' (a GGUF file's blocks as stored), "
                                f"{', '.join(map(repr, weight_formats.AT_LOAD))} or a block format "
                                f"({', '.join(weight_formats.KERNEL_FORMATS)}; a float model's linears in it), "
                                "or 'float32' (the weights in the plan's dtypes)")
    if weights == "gguf" and not spec.stored_weights:
        raise InvalidInputError(f"weights='gguf' needs a GGUF file; {spec.name} holds its weights in a float dtype")
    if fmt is not None:
        if spec.stored_weights:
            raise InvalidInputError(f"weights={weights!r} quantises a float checkpoint; {spec.name} is a GGUF file: "
                                    "use weights='gguf' (its own blocks) or 'float32'")
        return weight_formats.at_load_weights(spec, weights)
    return spec.stored_weights if weights in (None, "gguf") else ()


def _weights_notes(shape: Shape, eff: Efficiency) -> tuple[str, ...]:
    """What a plan of weights held as blocks priced them at: on the CPU each kernel format's calibrated
    block kernels' rate, or (not calibrated for it) the float32 factors; on the accelerator the blocks'
    bytes over the link and in its memory, dequantised there before each GEMM (dequant_terms)."""
    if not shape.weights:
        return ()
    what = "the GGUF file's blocks as stored" if shape.model.stored_weights else "quantised at load"
    held = list(dict.fromkeys([f for f, _, _ in shape.cpu_layer_formats if f is not None]
                              + ([shape.cpu_head_format] if shape.cpu_head_format else [])))
    timed = block_formats(eff)
    at, not_at = [f for f in held if f in timed], [f for f in held if f not in timed]
    how = ([f"{', '.join(at)} at {'its' if len(at) == 1 else 'their'} block kernels' calibrated rate"] if at else []) + (
        [f"{', '.join(not_at)} at the float32 GEMV/GEMM rate (block kernels not calibrated for "
         f"{'it' if len(not_at) == 1 else 'them'}: `flexplan calibrate` times them per format)"] if not_at else [])
    return (f"weights: {what} ({weight_formats.describe(shape.weights)} parameters; "
            f"{shape.cpu_weight_bytes:.3g} bytes a layer weight), priced on the CPU " + "; ".join(how or ["as float32"])
            + f"; on the accelerator as blocks over the link and in its memory ({shape.gpu_weight_bytes:.3g} bytes "
            f"a layer weight, the float ones in {shape.dtype}), dequantised by one compiled kernel a matrix before "
            "each GEMM, every call (Park & Egger's D)",)


def _why_not(o: _Options, hw: Hardware, gpu_budget: float, cpu_budget: float) -> str:
    if o.reason:
        return o.reason
    if o.gpu_layers.size == 0:
        return "no valid number of GPU layers"
    i = int(np.argmin(o.gpu_bytes + o.cpu_bytes))
    parts = []
    if o.gpu_bytes[i] > gpu_budget:
        parts.append(f"needs {o.gpu_bytes[i] / GiB:.1f} GiB GPU memory, has {gpu_budget / GiB:.1f}")
    if o.cpu_bytes[i] > cpu_budget:
        parts.append(f"needs {o.cpu_bytes[i] / GiB:.1f} GiB host memory, has {cpu_budget / GiB:.1f}")
    return "; ".join(parts) or "infeasible"


def switch_s(shape: Shape, hw: Hardware, prefill: str, m_p: int, decode: str, m_d: int,
             ttft_s: float, include_initial_load: bool = True, eff: Efficiency | None = None) -> float:
    """Moving KV (at the prompt's length) and weights from the prefill placement to the decode one,
    over the link at its calibrated efficiency (Eff_ICN per direction and transfer size).
    Layers that become GPU-resident for decode: free if prefill streamed them through the GPU
    (they stay), loaded over the link otherwise (overlapped with a CPU-only prefill). Layers
    leaving the GPU send their weights back only if no host copy exists (one always does)."""
    if not hw.has_gpu:
        return 0.0
    eff = eff if eff is not None else DefaultEfficiency.for_hardware(hw)
    m, n = shape.model, shape.model.num_layers
    w_layer = costs.d_weights(m, shape.gpu_weight_bytes)  # blocks cross as blocks
    kv_prompt = float(costs.kv_cache_bytes_per_layer(m, shape.batch, shape.input_len, shape.w_bytes))
    pp, dp = _placed(REGISTRY[prefill], n, m_p, "prefill"), _placed(REGISTRY[decode], n, m_d, "decode")
    h2d = d2h = h2d_weights = 0.0
    first = 0
    for a, b, count in segments(pp, dp):
        a_res, b_res = a.weights == ACCELERATOR, b.weights == ACCELERATOR
        first += count
        if a_res and b_res:  # both resident: routed experts prefill kept on the host go to the GPU for decode
            lo, n_ = first - count, count
            h2d_weights += max(0.0, _experts_left_on_host_bytes(m, a, lo, n_, shape.w_bytes)
                               - _experts_left_on_host_bytes(m, b, lo, n_, shape.w_bytes))
        if a_res == b_res:
            continue  # same memory (host copies in both dtypes are kept)
        if b_res:  # host -> GPU resident
            if not a.streamed:
                h2d_weights += count * w_layer - _experts_left_on_host_bytes(m, b, first - count, count, shape.w_bytes)
            h2d += count * kv_prompt
        else:  # GPU resident -> host
            d2h += count * kv_prompt
    if not pp.head_on_accelerator() and dp.head_on_accelerator():
        h2d_weights += costs.d_lm_head(m, shape.gpu_head_weight_bytes)
    bw_h2d, bw_d2h = hw.link.h2d_bandwidth_bytes_per_s, hw.link.d2h_bandwidth_bytes_per_s
    t_weights = (t_link_s(h2d_weights, bw_h2d, eff.h2d(h2d_weights)) if h2d_weights and include_initial_load
                 else 0.0)
    if not pp.uses_accelerator:  # the link is idle during a CPU-only prefill: load then
        t_weights = max(0.0, t_weights - ttft_s)
    t_h2d = t_link_s(h2d, bw_h2d, eff.h2d(h2d)) if h2d else 0.0
    t_d2h = t_link_s(d2h, bw_d2h, eff.d2h(d2h)) if d2h else 0.0
    return max(t_weights + t_h2d, t_d2h)


def _experts_left_on_host_bytes(m: ModelSpec, mode, first: int, count: int, w_bytes: int) -> float:
    """Routed-expert bytes of layers first..first+count-1 that ``mode`` keeps off the accelerator."""
    if mode.groups()[EXPERT_GROUP].weights == ACCELERATOR:
        return 0.0
    return float(sum(m.layer_group_params(i)["experts"] for i in range(first, first + count)) * w_bytes)


def plan(model: Any, hardware: Any = "local", batch_size: int = 1, input_len: int = 128, output_len: int = 32,
         dtype: str = "bfloat16", gpu_memory_bytes: float | None = None, cpu_memory_bytes: float | None = None,
         prefill: str | None = None, decode: str | None = None, gpu_layers: int | None = None,
         efficiency: Efficiency | None = None, include_initial_load: bool = True, cpu_dtype: str | None = None,
         routing_profile: Any = None, policies: Any = None, weights: str | None = None) -> Plan:
    """Choose the prefill and decode policies with the lowest predicted end-to-end latency.

    ``model``: catalog id, config path/folder, PretrainedConfig, HF model or ModelSpec.
    ``hardware``: hwdb server name, composition ``CPU[xS]+GPU+LINK``, ``"local"``, or a Hardware.
    ``prefill``/``decode``/``gpu_layers`` force a policy or M. ``include_initial_load``: count the
    loading of GPU-resident weights in E2E, as the paper does (footnote 5); a long-running process
    that already holds its weights plans with False. ``cpu_dtype``: what the CPU computes in; by
    default the planner tries the CPU's native fast dtype and float32 and keeps the lower E2E
    (on some CPUs bf16 GEMMs are faster but bf16 GEMV slower than fp32). ``routing_profile``: a
    RoutingProfile or the path of one (``flexplan profile-experts``): the ``cpu-experts`` policy is
    priced from it and a cpu-experts plan keeps its most-used CPU experts on the accelerator as a
    cache in the memory it leaves (``plan_expert_cache``). ``policies``: the policy names to
    choose among (default: every registered one), e.g. FlexInfer's own five. ``weights``: for a
    GGUF file, "gguf" (default: its blocks as stored, priced at their bytes: the CPU computes in
    float32 on them, the accelerator receives and holds them and dequantises before each GEMM) or
    "float32" (dequantised); for a float checkpoint, "int4" / "int8" (quantised at load) or a block
    format's name ("Q4_0", "Q4_K", ...: its linears in it), priced the same way.
    Raises :class:`DoesNotFitError` when no placement fits, :class:`InvalidInputError` for bad arguments.
    """
    _check_positive(batch_size=batch_size, input_len=input_len, output_len=output_len)
    if policies is not None:
        policies = [policies] if isinstance(policies, str) else list(policies)
        unknown = [x for x in policies if x not in POLICIES]
        if unknown or not policies:
            raise InvalidInputError(f"unknown policies {unknown or policies!r}; choose among {', '.join(POLICIES)}")
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

    profile = resolve_profile(routing_profile, spec)
    kept = _kept_weights(spec, weights)
    if kept:  # flexplan.quant's kernels take float32 activations
        if cpu_dtype is not None and canonical_dtype(cpu_dtype) != "float32":
            raise InvalidInputError(f"a GGUF file's blocks are computed in float32 on the CPU, not {cpu_dtype}; "
                                    "pass weights='float32' to dequantise them for another CPU dtype")
        cpu_dtype = "float32"
    if cpu_dtype is not None:
        cpu_dtypes = [canonical_dtype(cpu_dtype)]
        if hw.cpu.peak_flops_per_s.get(cpu_dtypes[0], 0) <= 0:
            raise InvalidInputError(f"{hw.cpu.name} has no {cpu_dtypes[0]} figure; use one of "
                                    f"{', '.join(hw.cpu.peak_flops_per_s)}")
    else:
        cpu_dtypes = list(dict.fromkeys([hw.cpu.compute_dtype, "float32"]))
    pcs = {cd: {ph: phase_costs(Shape(spec, batch_size, input_len, output_len, dtype, cd, kept), hw, eff, ph)
                for ph in PHASES} for cd in cpu_dtypes}
    if profile is None and len(cpu_dtypes) == 2 and _dominates(cpu_dtypes[0], cpu_dtypes[1], pcs):
        cpu_dtypes = cpu_dtypes[:1]  # the other can win nothing: not priced
    best: Plan | None = None
    error: DoesNotFitError | None = None
    # each CPU dtype's options first, then the searches in the order of their floors: the first
    # search's plan usually lets the other's be skipped (its floor is no lower than that E2E)
    searches = {cd: _plan_one(spec, hw, eff, Shape(spec, batch_size, input_len, output_len, dtype, cd, kept),
                              gpu_memory_bytes, cpu_memory_bytes, prefill, decode, gpu_layers, include_initial_load,
                              profile, policies, pcs[cd]) for cd in cpu_dtypes}
    floors = {cd: next(search) for cd, search in searches.items()}
    e2e: dict[str, float] = {}
    for cd in sorted(cpu_dtypes, key=lambda c: floors[c]):  # stable: the native dtype first on a tie
        if e2e and floors[cd] >= min(e2e.values()):
            continue  # no pair of this dtype can beat the best found
        try:
            e2e[cd] = next(searches[cd])
        except DoesNotFitError as e:
            error = error or e
    if e2e:
        # the lowest E2E; on a tie the native dtype (the order the dtypes were always searched in)
        cd = min(e2e, key=lambda c: (e2e[c], cpu_dtypes.index(c)))
        try:
            next(searches[cd])
        except StopIteration as done:
            best = done.value
        if cd != cpu_dtypes[0]:
            other = cpu_dtypes[0]
            vs = f"{e2e[other]:.3g} s in {other}" if other in e2e else f"at least {floors[other]:.3g} s in {other}"
            best = replace(best, notes=best.notes + (f"CPU computes in {cd}: predicted E2E {best.e2e_s:.3g} s vs {vs}",))
    if best is None:
        raise error
    return best


def _dominates(a: str, b: str, pcs: dict[str, dict[str, PhaseCosts]]) -> bool:
    """Whether CPU dtype ``a`` makes every placement no slower and no larger than ``b`` does: its
    values take no more bytes, and in each phase every CPU time is no longer and everything else
    the same. Every policy's estimate is non-decreasing in each CPU time it reads (a longer term
    never shortens a phase: tests/test_planner_dominance.py checks it), so ``b``'s best pair cannot beat
    ``a``'s and, on a tie, the plan keeps ``a`` (the native dtype) anyway."""
    return DTYPE_BYTES[a] <= DTYPE_BYTES[b] and all(_no_slower(pcs[a][ph], pcs[b][ph]) for ph in PHASES)


def _no_slower(x: Any, y: Any, name: str = "") -> bool:
    """``x`` is ``y`` with no CPU time (:func:`_is_cpu_time`) greater, walking nested dataclasses."""
    if type(x) is not type(y):
        return False
    if isinstance(x, (float, int, np.floating, np.integer)) and not isinstance(x, bool):
        return x <= y if _is_cpu_time(name) else x == y
    if isinstance(x, np.ndarray):
        return x.shape == y.shape and bool(np.all(x <= y) if _is_cpu_time(name) else np.array_equal(x, y))
    if is_dataclass(x) and not isinstance(x, type):
        return all(_no_slower(getattr(x, f.name), getattr(y, f.name), f.name) for f in fields(x))
    if isinstance(x, tuple):
        return len(x) == len(y) and all(_no_slower(a, b, name) for a, b in zip(x, y))
    return x == y


def _is_cpu_time(field_name: str) -> bool:
    """A PhaseCosts field (or a nested one) that is a time on the CPU: the only kind a CPU dtype changes."""
    return field_name.endswith("_s") and "cpu" in field_name.split("_")


def _plan_one(spec: ModelSpec, hw: Hardware, eff: Efficiency, shape: Shape, gpu_memory_bytes, cpu_memory_bytes,
              prefill, decode, gpu_layers, include_initial_load, profile=None, allowed=None,
              pcs: dict[str, PhaseCosts] | None = None) -> Generator[float, None, Plan]:
    """The plan of one CPU dtype, in three stages (a generator): it prices every policy's options
    and yields a lower bound of any pair's E2E; resumed, it searches the pairs and yields the best
    pair's E2E; resumed again (where this dtype's pair is the plan's), it prices the single-policy
    baselines and returns the plan (StopIteration's value)."""
    batch_size, input_len, output_len, dtype, cpu_dtype = (shape.batch, shape.input_len, shape.output_len,
                                                           shape.dtype, shape.cpu_dtype)

    gpu_budget = float(gpu_memory_bytes if gpu_memory_bytes is not None else (hw.gpu.memory_bytes if hw.gpu else 0))
    cpu_budget = float(cpu_memory_bytes if cpu_memory_bytes is not None
                       else hw.cpu.memory_bytes * memory.CPU_MEMORY_USABLE_FRACTION)
    if gpu_budget < 0 or cpu_budget <= 0:
        raise InvalidInputError("memory budgets must be positive")

    pcs = dict(pcs) if pcs is not None else {ph: phase_costs(shape, hw, eff, ph) for ph in PHASES}
    curves = {}  # phase -> MoE layer -> estimator.expert_cache.LayerCacheCurve, from the routing profile
    if profile is not None:
        for ph in PHASES:
            if pcs[ph].experts is not None:
                curves[ph] = profile_curves(shape, hw, eff, ph, profile, pcs[ph].experts)
                pcs[ph] = replace(pcs[ph], experts=with_profile(pcs[ph].experts, curves[ph]))
    policies = [p for p in POLICIES if allowed is None or p in allowed or p in (prefill, decode)]
    opts: dict[str, dict[str, _Options]] = {ph: {} for ph in PHASES}
    candidates: list[Candidate] = []
    for ph in PHASES:
        for pol in policies:
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

    n = spec.num_layers
    scores: dict[tuple, tuple[float, float, float] | None] = {}
    over_gpu: dict[tuple, bool] = {}  # a pair that does not fit: whether the accelerator's budget is what it exceeds
    runs_as_cache: dict[tuple, tuple[str, int]] = {}
    option_with: dict[tuple, tuple[str, int] | None] = {}  # (policy, canonical placement) -> the option that has it
    # policies whose prefill streams layers (at its fewest or most GPU layers): beside a decode that
    # keeps layers resident they run as another option
    streams = {p: any(mode.streamed for m in (o.gpu_layers.min(initial=0), o.gpu_layers.max(initial=0))
                      for mode, count in _placed(REGISTRY[p], n, int(m), "prefill").runs if int(count))
               for p, o in opts["prefill"].items()}
    def masks(phase: str, pol: str, m: int) -> tuple[int, int]:
        return _masks(REGISTRY[pol], n, m, phase)

    def runs_as(p: str, ip: int, d: str, idx_d: int) -> tuple[str, int]:
        """The prefill option the executor runs in a pair: (p, ip) itself, or where decode keeps
        layers resident that prefill would stream (placement.prefill_beside: they stay resident,
        FlexInfer section 5.3), the prefill option with that placement, the first policy in the
        registry's order that has it: priced as all streamed, such a prefill is priced at layers it
        never streams."""
        if not streams[p]:
            return p, ip
        key = (p, ip, d, idx_d)  # options' indices: one M each
        out = runs_as_cache.get(key)
        if out is None:
            m_p, m_d = int(opts["prefill"][p].gpu_layers[ip]), int(opts["decode"][d].gpu_layers[idx_d])
            out = (p, ip)
            if masks("prefill", p, m_p)[0] & masks("decode", d, m_d)[1]:  # a streamed layer decode holds
                want, m = _beside(REGISTRY[p], m_p, REGISTRY[d], m_d, n)
                if (p, want) not in option_with:  # many (M, decode M) pairs run as one option
                    option_with[p, want] = next(
                        ((q, j) for q in dict.fromkeys([p, *opts["prefill"]])
                         if (j := opts["prefill"][q].index_of(m)) is not None
                         and _placed_id(REGISTRY[q], n, m, "prefill") == want), None)
                out = option_with[p, want] or (p, ip)
            runs_as_cache[key] = out
        return out

    inv = _inventory(spec, shape.weights)
    reserve = hw.gpu.runtime_reserved_bytes if hw.gpu is not None else 0

    def pair_memory(p: str, m_p: int, d: str, m_d: int) -> tuple[float, float]:
        """(accelerator, host) totals of placement_memory of the pair, its coefficients kept per model
        (memory.LinearTotals: they do not depend on the request's size)."""
        def make() -> memory.LinearTotals:
            phases = {"prefill": _placed(REGISTRY[p], n, m_p, "prefill"), "decode": _placed(REGISTRY[d], n, m_d, "decode")}
            return memory.LinearTotals.of(memory.layout(inv, Placement.of(phases, dtype, cpu_dtype), memory.KERNEL_BLOCKED))

        totals = inv.memo(("pair totals", p, m_p, d, m_d, dtype, cpu_dtype), make, memory.LAYOUT_CACHE_ENTRIES)
        return totals.one(inv, dtype, cpu_dtype, batch_size, input_len, input_len + output_len, reserve)

    def score(p: str, ip: int, d: str, idx_d: int) -> tuple[float, float, float] | None:
        """E2E of a pair, None when both placements together (the executor holds what either phase
        needs) do not fit; priced, and cached, as the prefill option it runs as (runs_as)."""
        p, ip = runs_as(p, ip, d, idx_d)
        key = (p, ip, d, idx_d)
        if key in scores:
            return scores[key]
        op, od = opts["prefill"][p], opts["decode"][d]
        m_p, m_d = int(op.gpu_layers[ip]), int(od.gpu_layers[idx_d])
        # the pair never needs more than both phases' placements apart: only near a budget is it sized
        surely_fits = (op.gpu_bytes[ip] + od.gpu_bytes[idx_d] <= gpu_budget
                       and op.cpu_bytes[ip] + od.cpu_bytes[idx_d] <= cpu_budget)
        if not surely_fits:
            need_acc, need_host = pair_memory(p, m_p, d, m_d)
            if need_host > cpu_budget or need_acc > gpu_budget:
                scores[key] = None
                over_gpu[key] = need_acc > gpu_budget
                return None
        ttft = float(op.time_s[ip])
        sw = switch_s(shape, hw, p, m_p, d, m_d, ttft, include_initial_load, eff)
        load = float(op.load_s[ip]) if include_initial_load else 0.0
        scores[key] = (load + ttft + sw + steps * float(od.time_s[idx_d]), load, sw)
        return scores[key]

    def floor_s(o: _Options, per_step: float, with_load: bool) -> float:
        """The least a phase can add to any pair's E2E (its fastest feasible M, with its load)."""
        idx = o.feasible_index
        if idx.size == 0:
            return math.inf
        t = o.time_s[idx] * per_step + (o.load_s[idx] if with_load else 0.0)
        return float(t.min())

    floors = {("prefill", p): floor_s(o, 1.0, include_initial_load) for p, o in opts["prefill"].items()}
    lowest = min(floors.values(), default=math.inf)  # a streaming prefill may run as any other option
    floors.update({("prefill", p): lowest for p in opts["prefill"] if streams[p]})
    floors.update({("decode", d): floor_s(o, steps, False) for d, o in opts["decode"].items()})
    # prefill's part of E2E (load + TTFT) at each M: with decode's fastest TPOT, a bound on any pair
    own = {p: o.time_s + (o.load_s if include_initial_load else 0.0) for p, o in opts["prefill"].items()}
    least_own_by_m = np.full(n + 1, math.inf)  # M -> the least prefill part of any feasible option with M GPU layers
    for o in opts["prefill"].values():
        np.minimum.at(least_own_by_m, o.gpu_layers[o.feasible_index], own[o.policy][o.feasible_index])
    rows_of: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}
    ms_of: dict[str, list[int]] = {}  # prefill policy -> its options' M as ints

    def layer_rows(phase: str, pol: str) -> tuple[np.ndarray, np.ndarray]:
        if (phase, pol) not in rows_of:
            rows_of[phase, pol] = _layer_rows(REGISTRY[pol], n, tuple(opts[phase][pol].gpu_layers.tolist()), phase)
        return rows_of[phase, pol]

    def least_own(p: str, d: str, idx_d: int) -> tuple[np.ndarray, np.ndarray]:
        """A lower bound on the prefill part of the pair's E2E at each of ``p``'s options, without
        runs_as: the option it runs as has as many resident layers as prefill's and the streamed
        ones decode holds; and which options run as another (runs_as: a streamed layer decode holds)."""
        if not streams[p]:
            return own[p], np.zeros(own[p].shape, bool)
        streamed, resident = layer_rows("prefill", p)
        held_streamed = streamed & layer_rows("decode", d)[1][idx_d]
        m = (resident | held_streamed).sum(axis=1)
        return np.minimum(own[p], least_own_by_m[m]), held_streamed.any(axis=1)

    def best_pair(p_pols, d_pols, every_prefill_m: bool = True):
        """The lowest-E2E pair, pairs taken in the order of their floor (prefill's fastest M with its
        load, plus decode's fastest M over the steps; a switch only adds): once a pair's floor is
        no lower than the best E2E found, no later pair can beat it and the search stops. Decode's
        M: its fastest, its most, and prefill's; prefill's: first its fastest, its most and
        decode's, then (``every_prefill_m``) every other feasible one against the best found
        (beside a decode that keeps layers resident, the best is not the fastest alone: its load
        and the switch trade against it, and runs_as can move it)."""
        best = None

        def consider(p, ip, d, i_d, shrink_decode: bool = True):
            nonlocal best
            s = score(p, ip, d, i_d)
            if s is None and shrink_decode:  # both phases' buffers together: the most decode GPU layers that fit,
                lo, hi = 0, i_d - 1  # by bisection (fewer decode layers need less accelerator memory)
                while lo <= hi:
                    mid = (lo + hi) // 2
                    s_mid = score(p, ip, d, mid) if opts["decode"][d].feasible[mid] else None
                    if s_mid is None:
                        hi = mid - 1
                    else:
                        i_d, s, lo = mid, s_mid, mid + 1
            if s is not None and (best is None or s[0] < best[0]):
                best = (s[0], s[1], s[2], p, ip, d, i_d)

        pairs = sorted(((floors["prefill", p] + floors["decode", d], p, d) for p in p_pols for d in d_pols),
                       key=lambda x: x[0])
        decode_ms: dict[tuple[str, str], set[int]] = {}  # (prefill, decode) -> decode options tried
        for floor, p, d in pairs:
            if not math.isfinite(floor) or (best is not None and floor >= best[0]):
                break
            op, od = opts["prefill"][p], opts["decode"][d]
            ip_best, id_best = op.best(), od.best()
            if ip_best is None or id_best is None:
                continue
            ip_set = {ip_best, int(op.feasible_index[-1])}
            id_set = {id_best, int(od.feasible_index[-1])}
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
                    consider(p, ip, d, i_d)
            decode_ms[p, d] = id_set
        if not every_prefill_m:
            return best
        # then every other prefill M of those pairs, against the best found so far (it prunes most)
        for floor, p, d in pairs:
            if (p, d) not in decode_ms:
                continue
            if best is not None and floor >= best[0]:
                break
            op, od = opts["prefill"][p], opts["decode"][d]
            idx = op.feasible_index
            rest = idx[np.argsort(own[p][idx], kind="stable")]
            ms_of.setdefault(p, op.gpu_layers.tolist())
            for i_d in decode_ms[p, d]:
                decode_s = steps * float(od.time_s[i_d])
                too_many = math.inf  # the fewest prefill GPU layers found over the accelerator's budget
                least, moved = least_own(p, d, i_d)
                # the options whose bound is under the best found now (the best only falls below)
                seen = set()  # the options this row's M ran as: another M that runs as one is priced already
                for ip in (rest if best is None else rest[least[rest] + decode_s < best[0]]).tolist():
                    if best is not None and least[ip] + decode_s >= best[0]:  # a switch only adds
                        if not streams[p]:
                            break  # every later M (sorted by own) runs as itself: none can beat the best
                        continue
                    m_p = ms_of[p][ip]
                    if too_many <= m_p < n:
                        continue  # more GPU layers need no less accelerator memory (all of them: no stream buffers)
                    key = (*runs_as(p, ip, d, i_d), d, i_d) if moved[ip] else (p, ip, d, i_d)
                    if key not in seen:
                        seen.add(key)
                        consider(p, ip, d, i_d, shrink_decode=False)  # decode's M as found above
                    if over_gpu.get(key):
                        too_many = min(too_many, m_p)
        return best

    p_pols = [prefill] if prefill else list(policies)
    d_pols = [decode] if decode else list(policies)
    # a lower bound of every pair's E2E (a switch only adds; an expert cache may lower a pair's)
    yield -math.inf if curves else min((floors["prefill", p] + floors["decode", d] for p in p_pols for d in d_pols),
                                        default=math.inf)
    chosen = best_pair(p_pols, d_pols)
    if chosen is None:
        raise DoesNotFitError(_no_fit_message(shape, hw, gpu_budget, cpu_budget, prefill, decode, gpu_layers, candidates))
    baselines = {}

    def build(pair) -> Plan:
        e2e, load_s, sw, p, ip, d, i_d = pair
        op, od = opts["prefill"][p], opts["decode"][d]
        q, iq = runs_as(p, ip, d, i_d)
        if q == p:  # the same policy at the M it runs with
            ip = iq
        oq = opts["prefill"][q]
        cp = Candidate("prefill", p, int(op.gpu_layers[ip]), float(oq.time_s[iq]), int(oq.gpu_bytes[iq]),
                       int(oq.cpu_bytes[iq]), float(oq.pcie_bytes[iq]), True)
        cd = Candidate("decode", d, int(od.gpu_layers[i_d]), float(od.time_s[i_d]), int(od.gpu_bytes[i_d]),
                       int(od.cpu_bytes[i_d]), float(od.pcie_bytes[i_d]), True)
        out = Plan(
            model=spec.name, hardware=hw.name, batch_size=batch_size, input_len=input_len, output_len=output_len,
            dtype=dtype, cpu_dtype=cpu_dtype, num_layers=spec.num_layers, gpu_memory_bytes=int(gpu_budget),
            cpu_memory_bytes=int(cpu_budget),
            prefill=PhaseChoice.of(cp, REGISTRY[p].split_choice(pcs["prefill"], n, cp.gpu_layers)),
            decode=PhaseChoice.of(cd, REGISTRY[d].split_choice(pcs["decode"], n, cd.gpu_layers)),
            ttft_s=cp.time_s, tpot_s=cd.time_s, load_s=load_s, switch_s=sw, e2e_s=e2e,
            reason=_reason(cp, cd, candidates, baselines, e2e),
            candidates=tuple(candidates), baselines=baselines, calibration=eff.source, factors=getattr(eff, "origin", FactorSource()),
            weights=shape.weights,
            notes=tuple(hw.notes) + ((f"prefill keeps the {int(oq.gpu_layers[iq])} layers decode holds on the GPU "
                                      f"resident (FlexInfer 5.3): priced as {q} with {int(oq.gpu_layers[iq])} GPU "
                                      "layers",) if (q, iq) != (p, ip) else ()) + _weights_notes(shape, eff),
        )
        out = replace(out, placement=placement_of(out, n))  # the Plan carries what its policies place
        if curves:
            need = placement_memory(shape, hw, {"prefill": REGISTRY[p].placement(n, cp.gpu_layers, "prefill"),
                                                "decode": REGISTRY[d].placement(n, cd.gpu_layers, "decode")})
            out = add_expert_cache(out, shape, hw, eff, curves, need.accelerator_bytes, include_initial_load,
                                   f"{profile.model}, {profile.prompts} prompts")
        return out

    def finish() -> Plan:
        """The plan of the chosen pair, with the single-policy baselines explain compares with (the
        first round only: every prefill M would cost the plan a quarter more time for a baseline
        that is only a comparison)."""
        for pol in policies:
            b = best_pair([pol], [pol], every_prefill_m=False)
            baselines[pol] = b[0] if b else math.inf
        best = build(chosen)
        if curves:  # a cache can make a cpu-experts pair the better one: the best pair with it in either phase
            alts = ([best_pair(p_pols, [X])] if X in d_pols else []) + ([best_pair([X], d_pols)] if X in p_pols else [])
            for alt in alts:
                if alt is not None and alt[3:] != chosen[3:]:
                    cand = build(alt)
                    if cand.e2e_s < best.e2e_s:
                        best = replace(cand, notes=cand.notes + (
                            f"with its expert cache this pair beats {chosen[3]}:{chosen[5]} ({chosen[0]:.3g} s E2E "
                            "without a cache)",))
        return best

    if curves:  # an expert cache may lower the E2E: the plan itself is what compares
        made = finish()
        yield made.e2e_s
        return made
    yield chosen[0]  # this dtype's E2E: resumed only where it is the plan's
    return finish()


def _reason(cp: Candidate, cd: Candidate, candidates: list[Candidate], baselines: dict, e2e: float) -> str:
    def runner_up(phase: str, chosen: str) -> Candidate | None:
        others = [c for c in candidates if c.phase == phase and c.feasible and c.policy != chosen]
        return min(others, key=lambda c: c.time_s) if others else None

    parts = []
    for c, label in ((cp, "TTFT"), (cd, "TPOT")):
        r = runner_up(c.phase, c.policy)
        if r is None:
            parts.append(f"{c.policy} is the only {c.phase} policy that fits")
        elif r.time_s < c.time_s * 0.99:  # a faster phase lost on load, switch or the other phase
            parts.append(f"{c.policy} wins end to end although {r.policy} has a lower {label} "
                         f"({r.time_s:.3g} s vs {c.time_s:.3g} s)")
        elif r.time_s <= c.time_s * 1.01:
            parts.append(f"{c.policy} ties with {r.policy} on {label} ({c.time_s:.3g} s) and wins end to end")
        else:
            parts.append(f"{c.policy} gives the lowest {label} ({c.time_s:.3g} s vs {r.policy} {r.time_s:.3g} s)")
    homo = min(baselines.values())
    tail = (f"; together {e2e:.3g} s end to end, {100 * (1 - e2e / homo):.0f}% below the best single policy"
            if math.isfinite(homo) and homo > e2e * 1.0005 else "")
    return f"Prefill: {parts[0]}; decode: {parts[1]}{tail}."


def _no_fit_message(shape: Shape, hw: Hardware, gpu_budget, cpu_budget, prefill, decode, gpu_layers, candidates) -> str:
    n = shape.model.num_layers
    cpu_only = PhasePlacement.of((CPU, n))
    need_host_cpu = placement_memory(shape, hw, {"prefill": cpu_only, "decode": cpu_only}).host_total_bytes
    forced = ", ".join(f"{k}={v}" for k, v in (("prefill", prefill), ("decode", decode), ("gpu_layers", gpu_layers)) if v is not None)
    why = "; ".join(f"{c.phase} {c.policy}: {c.reason}" for c in candidates if not c.feasible and
                    (c.policy in (prefill, decode) if forced else True))
    return (f"{shape.model.name} (batch {shape.batch}, {shape.input_len}+{shape.output_len} tokens, {shape.dtype}) fits no "
            f"placement{' with ' + forced if forced else ''} on {hw.name}: all on the CPU needs "
            f"{need_host_cpu / GiB:.1f} GiB host memory ({shape.cpu_dtype}), usable {cpu_budget / GiB:.1f} GiB; GPU "
            f"budget {gpu_budget / GiB:.1f} GiB. {why}. Try a smaller batch or sequence, or more memory.")
