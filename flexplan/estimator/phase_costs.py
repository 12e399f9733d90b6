"""One layer's time on each device for one phase: the terms of terms.py, expert_terms.py and
operator_terms.py put together (FlexInfer Equations 1-3 read these :class:`PhaseCosts`)."""

from __future__ import annotations

import numpy as np

from flexplan.estimator.dequant_terms import t_gpu_dequant_head_s, t_gpu_dequant_layer_s
from flexplan.estimator.efficiency import Efficiency
from flexplan.estimator.expert_terms import expert_split_costs
from flexplan.estimator.operator_terms import operator_costs
from flexplan.estimator.terms import (
    PhaseCosts,
    Shape,
    cpu_attention_costs,
    cpu_head_factors,
    cpu_layer_factors,
    phase_work,
    t_cpu_prefill_attention_s,
    t_link_s,
    t_on_device_s,
)
from flexplan.hardware.spec import Hardware
from flexplan.workload import costs


def phase_costs(shape: Shape, hw: Hardware, eff: Efficiency, phase: str) -> PhaseCosts:
    w = phase_work(shape, phase)
    cpu, gpu, link = hw.cpu, hw.gpu, hw.link
    cd, rows, b = shape.cpu_dtype, w.rows, shape.batch
    th_cpu, bw_cpu = cpu.peak_flops_per_s[cd], cpu.memory_bandwidth_bytes_per_s
    eff_kv = eff.cpu_attention(w.context_len, cd) if phase == "decode" else 1.0
    # weights held as blocks (a GGUF file's): each format's block kernels' factors (terms.cpu_layer_factors)
    eff_comp, eff_mem = cpu_layer_factors(shape, eff, rows)
    head_factors = cpu_head_factors(shape, eff, b)

    def cpu_layer_s(overhead_s):
        return (t_on_device_s(w.flops - w.prefill_attention_flops, w.d_cpu + w.kv_write_cpu, th_cpu, bw_cpu,
                              eff_comp, eff_mem, kv_bytes=w.kv_read_cpu, eff_kv=eff_kv, overhead_s=overhead_s)
                + t_cpu_prefill_attention_s(w, th_cpu, eff, cd))

    def cpu_head_s(overhead_s):
        return t_on_device_s(w.head_flops, w.head_bytes_cpu, th_cpu, bw_cpu, *head_factors, overhead_s=overhead_s)

    t_cpu = cpu_layer_s(eff.cpu_layer_overhead_s(rows, cd, w.weight_bytes_cpu))
    step_overhead = eff.cpu_step_overhead_s(b, shape.model.vocab_size)  # the host runs generate()'s loop, whatever the policy
    t_cpu_head = cpu_head_s(step_overhead)
    # an all-CPU float32 decode step of a Llama-structured model runs every layer in one native call
    # (executor.cpu_decode.FusedStack): its own per-layer and per-step overheads, where calibrated
    stack = (eff.cpu_stack_overhead_s(b, shape.model.vocab_size, cd)
             if phase == "decode" and cd == "float32" and shape.native_stack
             and shape.model.native_decode_stack_with(shape.weights) else None)
    t_stack = None if stack is None else (cpu_layer_s(stack[0]), cpu_head_s(stack[1]))
    if gpu is None or link is None:
        inf = float("inf")
        return PhaseCosts(phase, w.tokens_per_seq, t_cpu, inf, inf, inf, inf, inf, inf, t_cpu_head, inf, inf,
                          w.weight_bytes_gpu, w.kv_read, w.kv_write, w.hidden_bytes, w.logits_bytes,
                          w.head_bytes_gpu, 1.0, t_cpu_stack_s=t_stack)
    th_gpu, bw_gpu = gpu.peak_flops_per_s[shape.dtype], gpu.memory_bandwidth_bytes_per_s
    # weights held as blocks: the accelerator dequantises them before each GEMM, every call (D, dequant_terms)
    t_dequant = t_gpu_dequant_layer_s(shape.weights, shape.model, shape.w_bytes, bw_gpu, eff.gpu_memory(rows))
    t_head_dequant = t_gpu_dequant_head_s(shape.weights, shape.model, shape.w_bytes, bw_gpu, eff.gpu_memory(b))
    t_gpu = t_on_device_s(w.flops, w.gpu_memory_bytes, th_gpu, bw_gpu, eff.gpu_compute(rows), eff.gpu_memory(rows),
                          overhead_s=eff.gpu_layer_overhead_s()) + t_dequant
    head_bytes_read = costs.d_lm_head(shape.model, shape.w_bytes)  # the GEMV reads the head dequantised
    t_gpu_head = t_on_device_s(w.head_flops, head_bytes_read, th_gpu, bw_gpu, eff.gpu_compute(b), eff.gpu_memory(b),
                               overhead_s=step_overhead) + t_head_dequant
    h2d, d2h = link.h2d_bandwidth_bytes_per_s, link.d2h_bandwidth_bytes_per_s
    kv_read = w.kv_read
    attention = cpu_attention_costs(shape, hw, eff) if phase == "decode" else None
    return PhaseCosts(
        phase=phase, tokens_per_seq=w.tokens_per_seq, t_cpu_layer_s=t_cpu, t_gpu_layer_s=t_gpu,
        t_load_weights_s=t_link_s(w.weight_bytes_gpu, h2d, eff.h2d(w.weight_bytes_gpu)),
        t_load_kv_s=t_link_s(kv_read, h2d, eff.h2d(np.mean(kv_read) if np.ndim(kv_read) else kv_read)),
        t_store_kv_s=t_link_s(w.kv_write, d2h, eff.d2h(w.kv_write)),
        t_hidden_h2d_s=t_link_s(w.hidden_bytes, h2d, eff.h2d(w.hidden_bytes)),
        t_logits_d2h_s=t_link_s(w.logits_bytes, d2h, eff.d2h(w.logits_bytes)),
        t_cpu_head_s=t_cpu_head, t_gpu_head_s=t_gpu_head,
        t_load_head_s=t_link_s(w.head_bytes_gpu, h2d, eff.h2d(w.head_bytes_gpu)),
        weight_bytes_gpu=w.weight_bytes_gpu, kv_read_bytes=kv_read, kv_write_bytes=w.kv_write,
        hidden_bytes=w.hidden_bytes, logits_bytes=w.logits_bytes, head_bytes_gpu=w.head_bytes_gpu,
        cpu_under_copy=eff.cpu_under_copy(rows), experts=expert_split_costs(shape, hw, eff, phase),
        cpu_attention=attention, operators=operator_costs(shape, hw, eff, phase, None if attention is None else attention.t_cpu_attention_s),
        t_gpu_dequant_s=t_dequant, t_gpu_head_dequant_s=t_head_dequant, t_cpu_stack_s=t_stack,
    )
