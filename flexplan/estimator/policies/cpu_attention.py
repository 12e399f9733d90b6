"""Decode attention on the CPU, next to its KV cache: FlexGen's ``cpu_cache_compute``, the
non-pipelined core of NEO (section 3), Park & Egger section 3.1's attention on the host.

The layers are streamed as in ``gpu-offload`` (weights in pinned host memory, copied into an
accelerator double buffer layer by layer), but in decode each streamed layer's KV cache stays in
host memory and its attention (scores over the cached keys, softmax, weighted values, appending
the new K and V) runs on the CPU beside it. A decode step then moves, per streamed layer, q/k/v of
the new token (accelerator -> host) and the attention output (host -> accelerator) instead of the
layer's whole KV cache (FlexInfer Eq. 2's D_KVCache term on the link). Prefill runs as
``gpu-offload`` (the prompt's K, V are written back to the same pinned home, so there is no
switch). ``cpu-attention-partial`` keeps the last M layers resident, KV included, as
``gpu-offload-partial`` does.

Decode time of one streamed layer (:func:`cpu_attention_layer_s`):

    max(t_linear_gpu + t_qkv_d2h + t_attn_cpu x slowdown + t_out_h2d,  t_load_weights + t_out_h2d)

What overlaps and why: the next layer's weight copy (host -> accelerator copy stream) overlaps the
whole of this layer, as in Eq. 2. Inside the layer nothing overlaps: with one batch the output
projection needs the attention output, which needs q/k/v from the projections (NEO overlaps them
only by splitting the batch in two, which this policy does not do). The attention output shares
the host -> accelerator direction with the weights, so it is on both sides of the max. The CPU
reads its KV cache while the copy engine reads the weights from the same host memory: its time is
scaled by the calibrated ``cpu_under_copy`` slowdown (Park & Egger 4.1).
"""

from __future__ import annotations

import numpy as np

from flexplan.estimator.policies.base import PhaseTime, Policy, gpu_ends, mean_over_steps
from flexplan.estimator.policies.gpu_offload import streamed_time
from flexplan.estimator.terms import PhaseCosts
from flexplan.placement import RESIDENT, STREAMED, STREAMED_CPU_ATTENTION, PhasePlacement


def cpu_attention_layer_s(pc: PhaseCosts) -> np.ndarray:
    """One streamed decode layer with attention on the CPU, per step (see the module docstring)."""
    a = pc.cpu_attention
    chain = a.t_gpu_linear_s + a.t_qkv_d2h_s + a.t_cpu_attention_s * pc.cpu_under_copy + a.t_out_h2d_s
    return np.maximum(chain, pc.t_load_weights_s + a.t_out_h2d_s)


def cpu_attention_fill_s(pc: PhaseCosts) -> np.ndarray:
    """The first weight load (or the last layer's work) that no overlap hides."""
    a = pc.cpu_attention
    chain = a.t_gpu_linear_s + a.t_qkv_d2h_s + a.t_cpu_attention_s * pc.cpu_under_copy + a.t_out_h2d_s
    return np.minimum(chain, pc.t_load_weights_s)


def cpu_attention_decode_time(pc: PhaseCosts, num_layers: int, gpu_layers: np.ndarray) -> PhaseTime:
    streamed = num_layers - gpu_layers
    if pc.cpu_attention is None:  # no accelerator
        inf = np.full(gpu_layers.shape, np.inf)
        return PhaseTime(gpu_layers, inf, inf)
    a = pc.cpu_attention
    ends_s, ends_bytes = gpu_ends(pc)
    t_streamed = (streamed * mean_over_steps(cpu_attention_layer_s(pc))
                  + np.where(streamed > 0, mean_over_steps(cpu_attention_fill_s(pc)), 0.0))
    t_resident = gpu_layers * mean_over_steps(pc.t_gpu_layer_s)
    per_layer_bytes = pc.weight_bytes_gpu + a.qkv_bytes + a.out_bytes
    return PhaseTime(
        gpu_layers, t_streamed + t_resident + ends_s, streamed * per_layer_bytes + ends_bytes,
        {"streamed_layers_s": t_streamed, "cpu_attention_s": streamed * mean_over_steps(a.t_cpu_attention_s),
         "attention_io_s": streamed * (a.t_qkv_d2h_s + a.t_out_h2d_s), "resident_layers_s": t_resident,
         "transfers_and_head_s": np.full(gpu_layers.shape, ends_s)})


class CPUAttentionPolicy(Policy):
    host_mode = STREAMED_CPU_ATTENTION
    paper = "FlexGen cpu_cache_compute / NEO section 3: Eq. 2 with the KV load replaced by attention on the CPU"

    def gpu_layer_options(self, num_layers):
        return np.array([0])

    def placement(self, num_layers, gpu_layers, phase):
        mode = STREAMED_CPU_ATTENTION if phase == "decode" else STREAMED
        return PhasePlacement(((mode, num_layers - gpu_layers), (RESIDENT, gpu_layers)))

    def estimate(self, pc, num_layers, gpu_layers):
        if pc.phase == "prefill":
            return streamed_time(pc, num_layers, gpu_layers)
        return cpu_attention_decode_time(pc, num_layers, gpu_layers)


class CPUAttentionPartialPolicy(CPUAttentionPolicy):
    needs_gpu_layers = True
    paper = "cpu-attention with the last M layers resident (as FlexGen_Opt, FlexInfer 6.1)"

    def gpu_layer_options(self, num_layers):
        return np.arange(1, num_layers)
