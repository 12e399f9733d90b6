"""A toy policy, to show that a new policy is one module plus one registry line.

``alt``: every other layer, from the second, is resident on the accelerator (the first M odd
layers); the rest compute on the CPU. The hidden state crosses the link twice per resident
layer. Nothing outside this module knows its name: tests register it with
``flexplan.estimator.policies.register("alt", AltPolicy())``.
"""

from __future__ import annotations

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, gpu_ends, mean_over_steps
from flexplan.placement import CPU, RESIDENT, PhasePlacement


class AltPolicy(Policy):
    host_mode = CPU
    needs_gpu_layers = True
    vectorised = False  # placement() takes one M at a time
    paper = "toy: CPU and accelerator layers alternate"

    def gpu_layer_options(self, num_layers):
        return np.arange(1, num_layers // 2 + 1)

    def placement(self, num_layers, gpu_layers, phase):
        m = int(gpu_layers)
        return PhasePlacement.from_modes(
            [RESIDENT if i % 2 == 1 and i // 2 < m else CPU for i in range(num_layers)])

    def estimate(self, pc, num_layers, gpu_layers):
        ends_s, ends_bytes = gpu_ends(pc)
        cpu = (num_layers - gpu_layers) * mean_over_steps(pc.t_cpu_layer_s)
        gpu = gpu_layers * mean_over_steps(pc.t_gpu_layer_s)
        hops = 2 * gpu_layers * pc.t_hidden_h2d_s
        return PhaseTime(gpu_layers, cpu + gpu + hops + ends_s, 2 * gpu_layers * pc.hidden_bytes + ends_bytes,
                         {"cpu_layers_s": cpu, "gpu_layers_s": gpu, "hidden_hops_s": hops})

    def initial_load_s(self, pc_prefill, gpu_layers):
        return gpu_layers * pc_prefill.t_load_weights_s
