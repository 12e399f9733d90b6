"""GPU with layer-wise offloading (FlexGen): FlexInfer section 4.2, Equation 2.

Weights and KV cache of the streamed layers live in host memory; layer i+1 is loaded while
layer i computes, so a streamed layer costs max(t_compute_gpu, t_load) (and the new KV is
written back in the other direction, full duplex). The pipeline start costs one more
min(compute, load). ``gpu-offload-partial`` (FlexGen_Opt, section 6.1) keeps the last M layers
resident and streams only the rest.
"""

from __future__ import annotations

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, gpu_ends, mean_over_steps
from flexplan.estimator.terms import PhaseCosts
from flexplan.placement import STREAMED


def eq2_streamed_layer_s(pc: PhaseCosts) -> float:
    """Equation 2 per layer: max(C/(TH_GPU Eff) + (D + D_KV)/(BW_GPU Eff), D_CPU->GPU/(BW_ICN Eff_ICN))."""
    load = pc.t_load_weights_s + pc.t_load_kv_s
    return mean_over_steps(np.maximum(np.maximum(pc.t_gpu_layer_s, load), pc.t_store_kv_s))


def pipeline_fill_s(pc: PhaseCosts) -> float:
    """The first load (or last compute) that no overlap hides."""
    return mean_over_steps(np.minimum(pc.t_gpu_layer_s, pc.t_load_weights_s + pc.t_load_kv_s))


def streamed_time(pc: PhaseCosts, num_layers: int, gpu_layers: np.ndarray) -> PhaseTime:
    streamed = num_layers - gpu_layers
    ends_s, ends_bytes = gpu_ends(pc)
    t_streamed = streamed * eq2_streamed_layer_s(pc) + np.where(streamed > 0, pipeline_fill_s(pc), 0.0)
    t_resident = gpu_layers * mean_over_steps(pc.t_gpu_layer_s)
    per_layer_bytes = pc.weight_bytes_gpu + mean_over_steps(pc.kv_read_bytes) + pc.kv_write_bytes
    return PhaseTime(
        gpu_layers, t_streamed + t_resident + ends_s, streamed * per_layer_bytes + ends_bytes,
        {"streamed_layers_s": t_streamed, "resident_layers_s": t_resident,
         "transfers_and_head_s": np.full(gpu_layers.shape, ends_s)},
    )


class GPUOffloadPolicy(Policy):
    host_mode = STREAMED
    paper = "FlexInfer Eq. 2 (FlexGen)"
    reproduces = "FlexGen"

    def gpu_layer_options(self, num_layers):
        return np.array([0])

    def estimate(self, pc, num_layers, gpu_layers):
        return streamed_time(pc, num_layers, gpu_layers)


class GPUOffloadPartialPolicy(Policy):
    host_mode = STREAMED
    needs_gpu_layers = True
    paper = "FlexGen_Opt (FlexInfer 6.1): Eq. 2 for streamed layers, resident layers compute only"

    def gpu_layer_options(self, num_layers):
        return np.arange(1, num_layers)

    def estimate(self, pc, num_layers, gpu_layers):
        return streamed_time(pc, num_layers, gpu_layers)
