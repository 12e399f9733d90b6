"""The time terms of FlexInfer's Equations 1-3, one small function each.

``PhaseCosts`` gathers, for one phase, the per-layer Table 2 quantities and the time each
device takes for one layer. Decode quantities are numpy arrays with one entry per decode
step (the KV cache grows by one token per step); prefill quantities are scalars.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexplan.estimator.efficiency import Efficiency
from flexplan.hardware.spec import DTYPE_BYTES, Hardware, cpu_weight_dtype
from flexplan.workload import costs
from flexplan.workload.model import ModelSpec


def t_compute_s(flops, peak_flops_per_s: float, eff: float):
    """C / (TH x Eff)."""
    return flops / (peak_flops_per_s * eff)


def t_memory_s(n_bytes, bandwidth_bytes_per_s: float, eff):
    """D / (BW x Eff)."""
    return n_bytes / (bandwidth_bytes_per_s * eff)


def t_link_s(n_bytes, bandwidth_bytes_per_s: float, eff: float):
    """D_CPU->GPU / (BW_ICN x Eff_ICN) (or the reverse direction)."""
    return n_bytes / (bandwidth_bytes_per_s * eff)


@dataclass(frozen=True)
class Shape:
    model: ModelSpec
    batch: int
    input_len: int
    output_len: int
    dtype: str  # GPU and pinned host dtype
    cpu_dtype: str

    @property
    def w_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def cpu_bytes(self) -> int:
        """Bytes per element of what the CPU computes on (activations, KV cache, norms)."""
        return DTYPE_BYTES[self.cpu_dtype]

    @property
    def cpu_weight_bytes(self) -> int:
        """Bytes per element of the CPU's linear weights (spec.cpu_weight_dtype: a 16-bit model
        stays 16-bit under float32 compute)."""
        return DTYPE_BYTES[cpu_weight_dtype(self.dtype, self.cpu_dtype)]

    @property
    def decode_context_lens(self) -> np.ndarray:
        """Keys attended at each decode step: the first output token comes from prefill, so
        decode step k (1..o-1) feeds token k and attends over s + k keys."""
        return self.input_len + np.arange(1, max(self.output_len, 2), dtype=float)

    @property
    def decode_steps(self) -> int:
        return max(self.output_len - 1, 0)


@dataclass(frozen=True)
class PhaseCosts:
    """One layer's time on each device and over the link, for one phase."""

    phase: str
    tokens_per_seq: int  # s for prefill, 1 for decode
    t_cpu_layer_s: object  # Eq. 1 bracket
    t_gpu_layer_s: object  # Eq. 2 first argument of max
    t_load_weights_s: float  # one layer's weights over the link
    t_load_kv_s: object  # one layer's cached KV over the link (streamed KV)
    t_store_kv_s: float  # one layer's new KV back to host (streamed KV)
    t_hidden_h2d_s: float  # D_Output over the link (host embedding -> first GPU layer, or the split)
    t_logits_d2h_s: float
    t_cpu_head_s: object
    t_gpu_head_s: object
    t_load_head_s: float
    weight_bytes_gpu: float  # one layer, GPU dtype
    kv_read_bytes: object  # one layer's cached KV read per step
    kv_write_bytes: float
    hidden_bytes: float
    logits_bytes: float
    head_bytes_gpu: float
    cpu_under_copy: float  # slowdown of CPU compute while H2D copies run (Park & Egger 4.1)


def phase_costs(shape: Shape, hw: Hardware, eff: Efficiency, phase: str) -> PhaseCosts:
    m, b = shape.model, shape.batch
    cpu, gpu, link = hw.cpu, hw.gpu, hw.link
    th_cpu = cpu.peak_flops_per_s[shape.cpu_dtype]
    if phase == "prefill":
        tokens_per_seq, rows = shape.input_len, b * shape.input_len
        flops = costs.c_prefill(m, b, shape.input_len)
        d_cpu = costs.d_prefill(m, b, shape.input_len, shape.cpu_weight_bytes, shape.cpu_bytes)
        d_gpu = costs.d_prefill(m, b, shape.input_len, shape.w_bytes, shape.w_bytes)
        kv_read = 0.0  # nothing cached yet; the prompt's K, V are produced by the layer
        kv_write = float(costs.d_kv_cache(m, b, shape.input_len, shape.w_bytes))
        kv_write_cpu = float(costs.d_kv_cache(m, b, shape.input_len, shape.cpu_bytes))
        t_cpu_attn = 0.0
    else:
        ctx = shape.decode_context_lens
        tokens_per_seq, rows = 1, b
        flops = costs.c_decode(m, b, ctx)
        d_cpu = costs.d_decode(m, b, shape.cpu_weight_bytes, shape.cpu_bytes)
        d_gpu = costs.d_decode(m, b, shape.w_bytes, shape.w_bytes)
        kv_read = costs.d_kv_cache(m, b, ctx - 1, shape.w_bytes)  # cached part, before this token
        kv_write = float(costs.d_kv_cache(m, b, 1, shape.w_bytes))
        kv_write_cpu = float(costs.d_kv_cache(m, b, 1, shape.cpu_bytes))
        t_cpu_attn = t_memory_s(costs.d_kv_cache(m, b, ctx, shape.cpu_bytes), cpu.memory_bandwidth_bytes_per_s,
                                eff.cpu_attention(ctx, shape.cpu_dtype))
    cd = shape.cpu_dtype
    t_cpu = (t_compute_s(flops, th_cpu, eff.cpu_compute(rows, cd))
             + t_memory_s(d_cpu + kv_write_cpu, cpu.memory_bandwidth_bytes_per_s, eff.cpu_memory(rows, cd))
             + t_cpu_attn + eff.cpu_layer_overhead_s(rows, cd, costs.d_weights(m, shape.cpu_weight_bytes)))
    head_flops = costs.c_lm_head(m, b)
    step_overhead = eff.cpu_step_overhead_s(b, m.vocab_size)  # the host runs generate()'s loop, whatever the policy
    t_cpu_head = (t_compute_s(head_flops, th_cpu, eff.cpu_head_compute(b, cd))
                  + t_memory_s(costs.d_lm_head(m, shape.cpu_weight_bytes), cpu.memory_bandwidth_bytes_per_s,
                               eff.cpu_head_memory(b, cd)) + step_overhead)
    hidden = costs.d_output(m, b, tokens_per_seq, shape.w_bytes)
    logits = costs.d_logits(m, b)
    head_gpu = costs.d_lm_head(m, shape.w_bytes)
    w_gpu = costs.d_weights(m, shape.w_bytes)
    if gpu is None or link is None:
        inf = float("inf")
        return PhaseCosts(phase, tokens_per_seq, t_cpu, inf, inf, inf, inf, inf, inf, t_cpu_head, inf, inf,
                          w_gpu, kv_read, kv_write, hidden, logits, head_gpu, 1.0)
    th_gpu = gpu.peak_flops_per_s[shape.dtype]
    bw_gpu = gpu.memory_bandwidth_bytes_per_s
    t_gpu = (t_compute_s(flops, th_gpu, eff.gpu_compute(rows))
             + t_memory_s(d_gpu + kv_read + kv_write, bw_gpu, eff.gpu_memory(rows)) + eff.gpu_layer_overhead_s())
    t_gpu_head = (t_compute_s(head_flops, th_gpu, eff.gpu_compute(b)) + t_memory_s(head_gpu, bw_gpu, eff.gpu_memory(b))
                  + step_overhead)
    h2d, d2h = link.h2d_bandwidth_bytes_per_s, link.d2h_bandwidth_bytes_per_s
    return PhaseCosts(
        phase=phase, tokens_per_seq=tokens_per_seq, t_cpu_layer_s=t_cpu, t_gpu_layer_s=t_gpu,
        t_load_weights_s=t_link_s(w_gpu, h2d, eff.h2d(w_gpu)),
        t_load_kv_s=t_link_s(kv_read, h2d, eff.h2d(np.mean(kv_read) if np.ndim(kv_read) else kv_read)),
        t_store_kv_s=t_link_s(kv_write, d2h, eff.d2h(kv_write)),
        t_hidden_h2d_s=t_link_s(hidden, h2d, eff.h2d(hidden)),
        t_logits_d2h_s=t_link_s(logits, d2h, eff.d2h(logits)),
        t_cpu_head_s=t_cpu_head, t_gpu_head_s=t_gpu_head,
        t_load_head_s=t_link_s(head_gpu, h2d, eff.h2d(head_gpu)),
        weight_bytes_gpu=w_gpu, kv_read_bytes=kv_read, kv_write_bytes=kv_write, hidden_bytes=hidden,
        logits_bytes=logits, head_bytes_gpu=head_gpu, cpu_under_copy=eff.cpu_under_copy(),
    )
