"""SplitGen: first N - M layers on the CPU, last M resident on the GPU. FlexInfer section 4.3
and Equation 3 (the equation text is garbled; the prefill timeline follows section 4.3's prose):

    prefill = max(t_compute_cpu(N - M), t_load(M)) + t_transfer + t_compute_gpu(M)
    decode  = t_compute_cpu(N - M) + t_transfer + t_compute_gpu(M)      (M already resident)

The CPU part includes its own KV cache reads in decode (Eq. 3 as printed drops D_KVCache
there; the CPU layers do read their KV). CPU compute that overlaps the H2D load is slowed by
memory contention (Park & Egger 4.1), by the calibrated ``cpu_under_copy`` factor.
"""

from __future__ import annotations

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, gpu_ends, mean_over_steps
from flexplan.estimator.terms import PhaseCosts
from flexplan.placement import CPU


def eq3_prefill_s(pc: PhaseCosts, num_layers: int, gpu_layers: np.ndarray):
    cpu_part = (num_layers - gpu_layers) * pc.t_cpu_layer_s
    load = gpu_layers * pc.t_load_weights_s + pc.t_load_head_s
    overlapped = np.maximum(np.where(load > 0, cpu_part * pc.cpu_under_copy, cpu_part), load)
    return overlapped, cpu_part, load


class SplitGenPolicy(Policy):
    host_mode = CPU
    needs_gpu_layers = True
    paper = "FlexInfer Eq. 3 / section 4.3"

    def gpu_layer_options(self, num_layers):
        return np.arange(1, num_layers)

    def estimate(self, pc, num_layers, gpu_layers):
        ends_s, ends_bytes = gpu_ends(pc)
        t_gpu = gpu_layers * mean_over_steps(pc.t_gpu_layer_s)
        if pc.phase == "prefill":
            overlapped, cpu_part, load = eq3_prefill_s(pc, num_layers, gpu_layers)
            total = overlapped + t_gpu + ends_s
            pcie = gpu_layers * pc.weight_bytes_gpu + pc.head_bytes_gpu + ends_bytes
            terms = {"cpu_layers_s": cpu_part, "load_gpu_layers_s": load, "gpu_layers_s": t_gpu}
        else:
            cpu_part = (num_layers - gpu_layers) * mean_over_steps(pc.t_cpu_layer_s)
            total = cpu_part + t_gpu + ends_s
            pcie = np.full(gpu_layers.shape, ends_bytes)
            terms = {"cpu_layers_s": cpu_part, "gpu_layers_s": t_gpu}
        terms["transfers_and_head_s"] = np.full(gpu_layers.shape, ends_s)
        return PhaseTime(gpu_layers, total, pcie, terms)

    def initial_load_s(self, pc_prefill, gpu_layers):
        return np.zeros(gpu_layers.shape)  # overlapped with CPU compute inside TTFT (Eq. 3)
