"""The routed experts of a CPU-experts layer priced from a routing profile, with the K most-used
of them cached on the accelerator (the profile: ``flexplan.routing_profile``).

Per MoE layer, q_e is the fraction of profiled tokens whose router picked expert e (sum_e q_e = k).
Assumptions: the b rows of a step (batch in decode, batch x prompt in prefill) route independently
of each other, each row picking expert e with probability q_e (its marginal in the profile; the
expected distinct experts are then exact at b = 1, and equal ``costs.expected_experts_read``'s
E (1 - (1 - k/E)^b) at q_e = k/E); for P(any miss) a row's k picks are taken as independent draws
from the profile's pick distribution q_e / k. With C the cached experts (the K with the largest q_e)
and h = sum_{e in C} q_e / k the hit rate:

    P(e read in a step)    = 1 - (1 - q_e)^b
    hits  (distinct)       = sum_{e in C}     1 - (1 - q_e)^b      accelerator reads their weights
    misses (distinct)      = sum_{e not in C} 1 - (1 - q_e)^b      the CPU reads their weights
    hit pairs              = b k h                                 (token, choice) pairs computed on
    miss pairs             = b k (1 - h)                           the accelerator / on the CPU
    P(any miss)            = 1 - h^(b k)                           the step goes to the host at all

    t_experts(K) = t_acc(hit pairs, hits) + t_cpu(miss pairs, misses) + P(any miss) (t_hidden_link + overhead)

with t_acc and t_cpu the ``expert_terms`` formulas (t_cpu at the calibrated expert-path factors where
``flexplan calibrate`` measured them, ``expert_terms.cpu_expert_rates``) (C / (TH Eff_Comp) + D / (BW Eff_Mem), FLOPs from the
pairs, bytes from the distinct experts' weights plus the pairs' activations). The accelerator's
hits and the CPU's misses run one after the other, as the ``cpu-experts`` policy runs its parts
(an upper bound where they would overlap). The efficiency factors are asked once per phase at
the uniform-routing rows per expert (``ExpertSplit.rows_per_expert``), not per K: a simplification
where a skewed profile gives the hot experts more rows than the cold ones.

Without a profile nothing here is used: the ``cpu-experts`` policy prices uniform routing
(``expert_terms``) and no cache is planned.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from flexplan.estimator.expert_terms import cpu_expert_rates
from flexplan.workload import costs


@dataclass(frozen=True)
class LayerCacheCurve:
    """One MoE layer in one phase: its experts by descending q_e, and per K = 0..E cached
    (arrays of E + 1), the expected step time of its routed experts and what it is made of."""

    layer: int
    order: np.ndarray  # expert ids, most used first: the cache of size K is order[:K]
    q_sorted: np.ndarray  # q_e in that order
    time_s: np.ndarray  # t_experts(K)
    acc_s: np.ndarray  # t_acc of the hits
    cpu_s: np.ndarray  # t_cpu of the misses (its overhead counted at P(any miss))
    link_s: np.ndarray  # P(any miss) x t_hidden_link
    hits: np.ndarray  # distinct cached experts read per step
    misses: np.ndarray  # distinct uncached experts read per step
    p_any_miss: np.ndarray
    hit_rate: np.ndarray


def expected_reads(q: np.ndarray, rows: float) -> np.ndarray:
    """P(e read in a step of ``rows`` rows) = 1 - (1 - q_e)^rows, per expert."""
    return 1.0 - np.power(1.0 - np.clip(q, 0.0, 1.0), rows)


def layer_cache_curve(shape, hw, eff, phase: str, q: np.ndarray, layer: int, split) -> LayerCacheCurve:
    """:class:`LayerCacheCurve` of an MoE layer whose routers pick expert e with probability q[e],
    for ``phase`` of the request ``shape`` on ``hw`` (``split``: that phase's ExpertSplit)."""
    return _curves(shape, hw, eff, phase, np.asarray(q, float)[None, :], [layer], split)[layer]


def profile_curves(shape, hw, eff, phase: str, profile, split) -> dict[int, LayerCacheCurve]:
    """MoE layer -> its :class:`LayerCacheCurve` in ``phase`` from the routing ``profile``."""
    layers = list(profile.counts)
    return _curves(shape, hw, eff, phase, np.stack([profile.selection_probability(i) for i in layers]), layers, split)


def _curves(shape, hw, eff, phase: str, q: np.ndarray, layers: list[int], split) -> dict[int, LayerCacheCurve]:
    """The module docstring's formulas for every layer at once: ``q`` [layers, E], results [layers, E + 1]."""
    m = shape.model
    rows = shape.batch * (shape.input_len if phase == "prefill" else 1)
    order = np.argsort(-q, axis=1, kind="stable")
    qs = np.take_along_axis(q, order, axis=1)
    reads = expected_reads(qs, rows)
    zero = np.zeros((len(layers), 1))
    hit_pairs = rows * np.concatenate([zero, np.cumsum(qs, axis=1)], axis=1)
    miss_pairs = rows * qs.sum(axis=1, keepdims=True) - hit_pairs
    hits = np.concatenate([zero, np.cumsum(reads, axis=1)], axis=1)
    misses = np.maximum(reads.sum(axis=1, keepdims=True) - hits, 0.0)
    k = max(m.experts_per_token, 1)
    hit_rate = np.minimum(hit_pairs / rows / k, 1.0)
    p_any_miss = 1.0 - np.power(hit_rate, rows * k)
    p_any_miss[:, -1] = 0.0  # every expert cached: nothing goes to the host
    w = 3 if m.gated_mlp else 2
    pair_flops = 2.0 * w * m.hidden_size * m.expert_intermediate_size
    act = costs._mlp_activation_elems(m, m.expert_intermediate_size)
    per_expert, cd = split.rows_per_expert, shape.cpu_dtype
    cpu, gpu = hw.cpu, hw.gpu
    # the factors at the uniform rows per expert and bytes read (module docstring), once for all layers
    eff_c, eff_m, overhead_s = cpu_expert_rates(eff, per_expert, cd,
                                                split.distinct_experts * m.expert_params * shape.cpu_bytes)
    cpu_s = (miss_pairs * pair_flops / (cpu.peak_flops_per_s[cd] * eff_c)
             + (misses * m.expert_params + miss_pairs * act) * shape.cpu_bytes / (cpu.memory_bandwidth_bytes_per_s * eff_m)
             + p_any_miss * overhead_s)
    acc_s = (hit_pairs * pair_flops / (gpu.peak_flops_per_s[shape.dtype] * eff.gpu_compute(per_expert))
             + (hits * m.expert_params + hit_pairs * act) * shape.w_bytes
             / (gpu.memory_bandwidth_bytes_per_s * eff.gpu_memory(per_expert)))
    link_s = p_any_miss * split.t_hidden_link_s
    total = acc_s + cpu_s + link_s
    return {i: LayerCacheCurve(i, order[j], qs[j], total[j], acc_s[j], cpu_s[j], link_s[j], hits[j], misses[j],
                               p_any_miss[j], hit_rate[j]) for j, i in enumerate(layers)}


def with_profile(split, curves: dict[int, LayerCacheCurve]):
    """``split`` (an ExpertSplit) whose CPU layers are priced from the profile with nothing cached:
    ``profile_cpu_before[j]`` / ``profile_link_before[j]`` sum the first j layers' CPU and link parts
    (the ``cpu-experts`` policy reads them instead of C x the uniform per-layer term)."""
    n = split.num_layers
    cpu = np.zeros(n + 1)
    link = np.zeros(n + 1)
    for i, c in curves.items():
        cpu[i + 1] += c.cpu_s[0]
        link[i + 1] += c.link_s[0]
    return replace(split, profile_cpu_before=np.cumsum(cpu), profile_link_before=np.cumsum(link))
