"""Everything resident on the GPU (the model fits): the baseline every offloading scheme chases."""

from __future__ import annotations

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, gpu_ends, mean_over_steps


class GPUPolicy(Policy):
    host_mode = None
    paper = "all layers resident; Eq. 2 without the transfer term"

    def gpu_layer_options(self, num_layers):
        return np.array([num_layers])

    def estimate(self, pc, num_layers, gpu_layers):
        ends_s, ends_bytes = gpu_ends(pc)
        layers = mean_over_steps(pc.t_gpu_layer_s) * gpu_layers
        return PhaseTime(gpu_layers, layers + ends_s, np.full(gpu_layers.shape, ends_bytes),
                         {"gpu_layers_s": layers, "transfers_and_head_s": np.full(gpu_layers.shape, ends_s)})
