"""CPU-only: FlexInfer section 4.1, Equation 1."""

from __future__ import annotations

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, mean_over_steps
from flexplan.estimator.terms import PhaseCosts
from flexplan.placement import CPU


def eq1_time_s(pc: PhaseCosts, num_layers: int) -> float:
    """Equation 1: (C / (TH_CPU Eff_CPU,Comp) + (D [+ D_KVCache]) / (BW_CPU Eff_CPU,Mem)) x N, plus the LM head
    (a decode step the native stack runs: its terms, ``PhaseCosts.t_cpu_stack_s``)."""
    layer, head = pc.t_cpu_stack_s or (pc.t_cpu_layer_s, pc.t_cpu_head_s)
    return mean_over_steps(layer) * num_layers + mean_over_steps(head)


class CPUPolicy(Policy):
    host_mode = CPU
    paper = "FlexInfer Eq. 1"

    def gpu_layer_options(self, num_layers):
        return np.array([0])

    def estimate(self, pc, num_layers, gpu_layers):
        t = np.full(gpu_layers.shape, eq1_time_s(pc, num_layers))
        return PhaseTime(gpu_layers, t, np.zeros_like(t), {"cpu_layers_s": t})

    def initial_load_s(self, pc_prefill, gpu_layers):
        return np.zeros(gpu_layers.shape)
