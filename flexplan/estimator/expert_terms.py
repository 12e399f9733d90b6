"""The time terms of an MoE layer whose routed experts compute on the CPU (llama.cpp's
``--n-cpu-moe``, KTransformers): the layer is split in two, attention, router and shared experts
on the accelerator beside the KV cache, the routed experts in host memory on the CPU.

Per MoE layer and step, with b the rows of the step (batch in decode, batch x prompt in
prefill), k experts per token, E routed experts, I the expert width, w = 3 (gated) or 2 GEMMs:

    distinct experts read  e(b) = E (1 - (1 - k/E)^b)            (uniform routing, costs.py)
    C_experts = 2 b k w h I                                      (FLOPs: each token runs k experts)
    D_experts = e(b) x expert_params x bytes + b k act_elems x bytes (weights read + activations)
    t_cpu_experts  = C / (TH_CPU Eff_CPU,Comp(b k / e)) + D / (BW_CPU Eff_CPU,Mem(b k / e)) + overhead
                     (the calibrated CPU layer overhead stands for the dispatch of the e(b) GEMMs; where
                     `flexplan calibrate` timed the expert path itself, its factors, no overhead:
                     :func:`cpu_expert_rates`)
    t_gpu_experts  = the same at the accelerator's rates (what the split removes from its layer)
    t_hidden_link  = b h bytes over H2D + the same back over D2H (+ the router's k ids and weights)

Each expert GEMM sees b k / e(b) rows on average: the efficiency factors are asked at that
row count (a decode step at batch 1 is k GEMVs, a large prefill batch large GEMMs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexplan.estimator.terms import t_link_s, t_on_device_s
from flexplan.workload import costs
from flexplan.workload.model import ModelSpec

ROUTER_BYTES_PER_CHOICE = 8 + 4  # an int64 expert id and a float32 routing weight per (token, choice)


@dataclass(frozen=True)
class ExpertSplit:
    """One MoE layer's routed experts, for one step of a phase (decode: arrays over steps where the
    quantity varies, scalars otherwise), and which layers are MoE layers."""

    t_cpu_experts_s: float  # the routed experts of one MoE layer on the CPU
    t_gpu_experts_s: float  # ... on the accelerator (part of t_gpu_layer_s)
    t_hidden_link_s: float  # hidden states to the host and the experts' output back, one MoE layer
    expert_weight_bytes_gpu: float  # all routed experts of one MoE layer, accelerator dtype
    link_bytes: float  # what t_hidden_link_s moves
    distinct_experts: float  # e(b): expected experts one step reads per MoE layer
    rows_per_expert: float  # b k / e(b)
    moe_layers_before: np.ndarray  # [j] = MoE layers among the first j layers, j = 0..N
    # priced from a routing profile (estimator.expert_cache.with_profile): [j] = the CPU part and the
    # link part of the first j layers' routed experts, nothing cached; None: uniform routing
    profile_cpu_before: np.ndarray | None = None
    profile_link_before: np.ndarray | None = None

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers_before) - 1

    def cpu_moe_layers(self, cpu_expert_layers):
        """MoE layers among the first ``cpu_expert_layers`` layers (array in, array out)."""
        return self.moe_layers_before[np.asarray(cpu_expert_layers, dtype=int)]


def expert_flops(m: ModelSpec, rows: float) -> float:
    """C of the routed experts of one MoE layer for ``rows`` tokens: 2 rows k w h I."""
    w = 3 if m.gated_mlp else 2
    return 2.0 * rows * m.experts_per_token * w * m.hidden_size * m.expert_intermediate_size


def expert_bytes(m: ModelSpec, rows: float, weight_bytes: float, act_bytes: float,
                 experts_read: float | None = None) -> float:
    """D of the routed experts of one MoE layer: the weights of the e(rows) experts read (or of
    ``experts_read``), plus the activations of the k experts each token runs."""
    act = rows * m.experts_per_token * costs._mlp_activation_elems(m, m.expert_intermediate_size)
    read = costs.expected_experts_read(m, rows) if experts_read is None else experts_read
    return read * m.expert_params * weight_bytes + act * act_bytes


def cpu_expert_rates(eff, rows_per_expert: float, cpu_dtype: str, weight_bytes_read: float):
    """(Eff_comp, Eff_mem, overhead_s) of the CPU expert path at ``rows_per_expert``: the calibrated
    expert factors (``flexplan calibrate``'s cpu_experts rows, the executor's own kernel at the rows
    per expert routing produces; their fixed per-expert costs are inside them, so no overhead), else
    the GEMM/GEMV factors plus the calibrated per-layer overhead standing for the GEMMs' dispatch."""
    measured = eff.cpu_expert_factors(rows_per_expert, cpu_dtype) if hasattr(eff, "cpu_expert_factors") else None
    if measured is not None:
        return measured[0], measured[1], 0.0
    return (eff.cpu_compute(rows_per_expert, cpu_dtype), eff.cpu_memory(rows_per_expert, cpu_dtype),
            eff.cpu_layer_overhead_s(rows_per_expert, cpu_dtype, weight_bytes_read))


def t_cpu_experts_s(m: ModelSpec, rows: int, cpu, eff, cpu_dtype: str, weight_bytes: float, act_bytes: float) -> float:
    """The routed experts of one MoE layer for ``rows`` tokens on the CPU ``cpu`` (a hardware
    CPUSpec), weights held at ``weight_bytes`` per element: t_cpu_experts of the module docstring."""

    distinct = costs.expected_experts_read(m, rows)
    per_expert = rows * m.experts_per_token / distinct
    eff_c, eff_m, overhead_s = cpu_expert_rates(eff, per_expert, cpu_dtype, distinct * m.expert_params * weight_bytes)
    return float(t_on_device_s(expert_flops(m, rows), expert_bytes(m, rows, weight_bytes, act_bytes),
                               cpu.peak_flops_per_s[cpu_dtype], cpu.memory_bandwidth_bytes_per_s,
                               eff_c, eff_m, overhead_s=overhead_s))


def expert_split_costs(shape, hw, eff, phase: str) -> ExpertSplit | None:
    """The :class:`ExpertSplit` of ``phase`` for the request ``shape`` (estimator.terms.Shape) on
    ``hw``; None for a dense model or a machine without an accelerator and link."""

    m = shape.model
    if not m.is_moe or hw.gpu is None or hw.link is None:
        return None
    rows = shape.batch * (shape.input_len if phase == "prefill" else 1)
    distinct = costs.expected_experts_read(m, rows)
    per_expert = rows * m.experts_per_token / distinct
    flops = expert_flops(m, rows)
    gpu = hw.gpu
    # the CPU's copy of routed experts is held in the CPU dtype (memory.py, executor.weights), not
    # kept 16-bit as the blocked linears are: a float32 CPU reads 4 bytes per expert weight
    t_cpu = t_cpu_experts_s(m, rows, hw.cpu, eff, shape.cpu_dtype, shape.cpu_bytes, shape.cpu_bytes)
    # the experts' share of the accelerator's layer as phase_costs prices that layer (its factors
    # at the layer's rows; prefill's D holds every expert, decode's the e(b) read), so that taking it
    # off leaves the rest of the layer, which never shrinks as the tokens grow (priced on its own
    # terms, per-expert factors and e(rows) experts, a prefill's remainder fell as the prompt grew)
    in_layer = m.num_experts if phase == "prefill" else distinct
    t_gpu = t_on_device_s(flops, expert_bytes(m, rows, shape.w_bytes, shape.w_bytes, in_layer),
                          gpu.peak_flops_per_s[shape.dtype], gpu.memory_bandwidth_bytes_per_s,
                          eff.gpu_compute(rows), eff.gpu_memory(rows))
    hidden = costs.d_output(m, shape.batch, rows // shape.batch, shape.w_bytes)
    router = rows * m.experts_per_token * ROUTER_BYTES_PER_CHOICE
    h2d, d2h = hw.link.h2d_bandwidth_bytes_per_s, hw.link.d2h_bandwidth_bytes_per_s
    t_link = (t_link_s(hidden + router, h2d, eff.h2d(hidden + router))
              + t_link_s(hidden, d2h, eff.d2h(hidden)))
    before = np.concatenate([[0], np.cumsum(np.array(m.moe_layers, dtype=int))])
    return ExpertSplit(float(t_cpu), float(t_gpu), float(t_link), float(m.num_experts * m.expert_params * shape.w_bytes),
                       float(2 * hidden + router), float(distinct), float(per_expert), before)
