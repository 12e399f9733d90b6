"""The planner's expert cache: with a routing profile and memory left in the
accelerator budget by a plan that keeps some layers' routed experts on the CPU (``cpu-experts``),
keep the most-used of those experts on the accelerator.

The cache is sized after the planner has chosen its prefill/decode pair: the pair's accelerator
need (both phases' placements, ``planner.placement_memory``) leaves ``budget - need`` bytes, room
for S experts. Which S experts: the (layer, expert) pairs of the CPU layers ranked by q_e (the
profile's selection probability) across layers, most used first; a layer's share K_l(S) is then
its count among the first S. Each expert's expected reads and rows are additive in the estimator's
formulas (``estimator.expert_cache``), so ranking by q_e is the greedy choice for the weight
bytes and the FLOPs moved off the CPU (the P(any miss) link term is not additive: greedy there).
S itself is chosen by predicted E2E over every S from 0 to the room:

    E2E(S) = E2E(0) + load(S) + sum_{CPU layers in prefill} [t_p,l(K_l(S)) - t_p,l(0)]
             + (output_len - 1) sum_{CPU layers in decode} [t_d,l(K_l(S)) - t_d,l(0)]

with load(S) the S experts' weights over the link before prefill (when the plan counts the
initial load), so a short request may keep no cache. The planner sizes a cache this way for the
pair it chose and for the best pairs with ``cpu-experts`` in either phase, and keeps the lowest
E2E of them (``planner._plan_one``); M (the CPU layers) of each pair is the one chosen without a
cache, not searched again with the cache in view.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flexplan import routing_profile
from flexplan.estimator.policies import REGISTRY
from flexplan.estimator.terms import t_link_s
from flexplan.placement import ACCELERATOR, Placement
from flexplan.plan_types import PHASES, ExpertCache, Plan

CPU_EXPERTS_POLICY = "cpu-experts"
NO_CACHE = "expert cache: none: "  # the note a plan with a profile but no cache carries (explain prints it)


def resolve_profile(profile, spec):
    """A RoutingProfile of ``spec``'s shape from a profile or a path to one (None stays None)."""
    if profile is None:
        return None

    if isinstance(profile, routing_profile.RoutingProfile):
        profile.check(spec)
        return profile
    return routing_profile.load(profile, spec)


def cache_layers(placement: Placement, curves_by_phase: dict) -> dict[int, tuple[str, ...]]:
    """MoE layer -> the phases in which its routed experts compute on the CPU, for the layers
    whose experts never live on the accelerator under ``placement`` (the candidates to cache)."""
    out = {}
    for i in sorted(set().union(*(c.keys() for c in curves_by_phase.values()))):
        if ACCELERATOR in placement.expert_places(i):
            continue
        phases = tuple(ph for ph in placement.phases if placement.experts_on_cpu(i, ph))
        if phases:
            out[i] = phases
    return out


def expert_slot_bytes(spec, w_bytes: int) -> int:
    """One routed expert's weights in the accelerator dtype (what the executor allocates per cached expert)."""
    return int(spec.expert_params * w_bytes)


def cache_sizes(curves: dict, layers: list[int], slots: int) -> np.ndarray:
    """[S, l] = K_l(S): experts of ``layers[l]`` among the S most-used (layer, expert) pairs, S = 0..slots."""
    q = np.concatenate([curves[i].q_sorted for i in layers])
    owner = np.concatenate([np.full(len(curves[i].q_sorted), j) for j, i in enumerate(layers)])
    ranked = owner[np.argsort(-q, kind="stable")][:slots]
    onehot = np.zeros((len(ranked) + 1, len(layers)), dtype=int)
    onehot[np.arange(1, len(ranked) + 1), ranked] = 1
    return np.cumsum(onehot, axis=0)


def add_expert_cache(p: Plan, shape, hw, eff, curves_by_phase: dict, need_accelerator_bytes: float,
                     include_initial_load: bool, profile_name: str = "") -> Plan:
    """``p`` with the expert cache of lowest predicted E2E (the module docstring); ``p`` itself when
    no cache lowers it, the plan keeps no expert on the CPU, or no expert fits."""

    if not curves_by_phase or CPU_EXPERTS_POLICY not in (p.prefill.policy, p.decode.policy):
        return p

    n = p.num_layers
    placement = Placement.of({ph: REGISTRY[c.policy].placement(n, c.gpu_layers, ph) for ph, c in p.phases.items()},
                             p.dtype, p.cpu_dtype)
    where = cache_layers(placement, curves_by_phase)
    slot_bytes = expert_slot_bytes(shape.model, shape.w_bytes)
    room = int(max(0.0, p.gpu_memory_bytes - need_accelerator_bytes) // slot_bytes) if slot_bytes else 0
    layers = sorted(where)
    q_any = _any_curves(curves_by_phase)
    slots = min(room, sum(len(q_any[i].q_sorted) for i in layers))
    if not layers or slots <= 0:
        why = ("no CPU layer's experts are off the accelerator in every phase" if not layers else
               f"the plan leaves {max(0.0, p.gpu_memory_bytes - need_accelerator_bytes) / (1 << 20):.0f} MiB of the "
               f"accelerator budget, less than one expert ({slot_bytes / (1 << 20):.1f} MiB)")
        return replace(p, notes=p.notes + (f"{NO_CACHE}{why}",))
    k = cache_sizes(q_any, layers, slots)
    delta = {}
    for ph in PHASES:
        d = np.zeros(k.shape[0])
        for j, i in enumerate(layers):
            if ph in where[i]:
                t = curves_by_phase[ph][i].time_s
                d += t[k[:, j]] - t[0]
        delta[ph] = d
    cache_bytes = np.arange(k.shape[0]) * float(slot_bytes)
    load = np.zeros(k.shape[0])
    if include_initial_load and hw.link is not None:
        h2d = hw.link.h2d_bandwidth_bytes_per_s
        load = np.array([t_link_s(b, h2d, eff.h2d(b)) if b else 0.0 for b in cache_bytes])
    steps = shape.decode_steps
    gain = load + delta["prefill"] + steps * delta["decode"]
    s = int(np.argmin(gain))
    if s == 0 or gain[s] >= 0:
        return replace(p, notes=p.notes + (f"{NO_CACHE}no cached expert saves more than loading it costs "
                                           f"(room for {slots})",))
    experts = {i: tuple(int(e) for e in q_any[i].order[:k[s, j]]) for j, i in enumerate(layers) if k[s, j]}
    hit = {i: float(q_any[i].hit_rate[k[s, j]]) for j, i in enumerate(layers) if k[s, j]}
    cache = ExpertCache(experts, hit, int(cache_bytes[s]), float(-gain[s]), profile_name)
    pre = replace(p.prefill, time_s=p.prefill.time_s + float(delta["prefill"][s]),
                  gpu_memory_bytes=p.prefill.gpu_memory_bytes + int(cache_bytes[s]))
    dec = replace(p.decode, time_s=p.decode.time_s + float(delta["decode"][s]),
                  gpu_memory_bytes=p.decode.gpu_memory_bytes + int(cache_bytes[s]))
    mean_hit = float(np.mean(list(hit.values())))
    note = (f"expert cache: {cache.num_experts} routed experts of {len(experts)} CPU layers kept on the accelerator "
            f"({cache.accelerator_bytes / (1 << 30):.2f} GiB), predicted hit rate {100 * mean_hit:.0f}% in those layers, "
            f"E2E {cache.saved_s:.3g} s lower")
    e2e = p.e2e_s + float(gain[s])
    reason = f"{p.reason} The expert cache takes E2E from {p.e2e_s:.3g} s to {e2e:.3g} s."
    return replace(p, prefill=pre, decode=dec, ttft_s=pre.time_s, tpot_s=dec.time_s, load_s=p.load_s + float(load[s]),
                   e2e_s=e2e, expert_cache=cache, notes=p.notes + (note,), reason=reason)


def _any_curves(curves_by_phase: dict) -> dict:
    """Layer -> a curve of any phase (order, q and hit rate are the profile's, the same in both)."""
    out = {}
    for c in curves_by_phase.values():
        out.update(c)
    return out
