"""MoE routed experts on the CPU (llama.cpp's ``--n-cpu-moe N`` / ``-ot exps=CPU``, KTransformers).

Every layer is resident on the accelerator with its KV cache (attention, router, shared experts,
norms), except that the routed experts of the first N - M layers stay in host memory and the CPU
computes them for the tokens routed to them: a decode step reads only the experts its tokens
picked, e(b) = E (1 - (1 - k/E)^b) per layer (``expert_terms``). M (the layers whose experts stay
on the accelerator) is searched like the other policies' GPU layers, against the accelerator
budget. Per step:

    T = N t_gpu_layer - C t_gpu_experts + C (t_cpu_experts + t_hidden_link) + ends

with C the MoE layers among the first N - M (a dense first layer has no experts to move); with a
routing profile the C (t_cpu_experts + t_hidden_link) are each layer's from the profile instead
(``estimator.expert_cache``). The
CPU experts of a layer and the accelerator run one after the other: the layer's experts need its
router's output and the next layer needs theirs, and this policy does not overlap the shared
experts with the CPU's routed ones (KTransformers does; the estimate is then an upper bound).
A dense model has no routed experts: the policy does not apply (``not_applicable``).
"""

from __future__ import annotations

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, gpu_ends, mean_over_steps
from flexplan.estimator.terms import PhaseCosts
from flexplan.placement import CPU_EXPERTS


def cpu_experts_time_s(pc: PhaseCosts, num_layers: int, gpu_layers: np.ndarray):
    """(time, CPU experts part, link part) of one step with the experts of the first N - M layers on the CPU."""
    x = pc.experts
    moe_cpu = x.cpu_moe_layers(num_layers - gpu_layers)
    layers = num_layers * mean_over_steps(pc.t_gpu_layer_s) - moe_cpu * x.t_gpu_experts_s
    if x.profile_cpu_before is not None:  # a routing profile prices each CPU layer (estimator.expert_cache)
        cpu_layers = np.asarray(num_layers - gpu_layers, dtype=int)
        cpu_part, link_part = x.profile_cpu_before[cpu_layers], x.profile_link_before[cpu_layers]
    else:
        cpu_part, link_part = moe_cpu * x.t_cpu_experts_s, moe_cpu * x.t_hidden_link_s
    return layers + cpu_part + link_part, layers, cpu_part, link_part


class CPUExpertsPolicy(Policy):
    host_mode = CPU_EXPERTS
    needs_gpu_layers = True  # M is the caller's choice in a forced plan (the planner searches it)
    paper = "llama.cpp --n-cpu-moe / KTransformers: routed experts on the CPU, the rest resident"

    def gpu_layer_options(self, num_layers):
        return np.arange(0, num_layers)

    def not_applicable(self, model) -> str:
        return "" if model.is_moe else "a dense model has no routed experts to keep on the CPU"

    def estimate(self, pc, num_layers, gpu_layers):
        if pc.experts is None:
            inf = np.full(gpu_layers.shape, np.inf)
            return PhaseTime(gpu_layers, inf, inf, {})
        ends_s, ends_bytes = gpu_ends(pc)
        body, layers, cpu_part, link_part = cpu_experts_time_s(pc, num_layers, gpu_layers)
        moe_cpu = pc.experts.cpu_moe_layers(num_layers - gpu_layers)
        return PhaseTime(gpu_layers, body + ends_s, moe_cpu * pc.experts.link_bytes + ends_bytes,
                         {"gpu_layers_s": layers, "cpu_experts_s": cpu_part, "expert_transfers_s": link_part,
                          "transfers_and_head_s": np.full(gpu_layers.shape, ends_s)})

    def initial_load_s(self, pc_prefill, gpu_layers):
        """Everything but the CPU layers' routed experts is loaded onto the accelerator first."""
        x = pc_prefill.experts
        if x is None:
            return np.zeros(np.shape(gpu_layers))
        n = x.num_layers
        resident_bytes = n * pc_prefill.weight_bytes_gpu - x.cpu_moe_layers(n - gpu_layers) * x.expert_weight_bytes_gpu
        return resident_bytes / pc_prefill.weight_bytes_gpu * pc_prefill.t_load_weights_s + pc_prefill.t_load_head_s
