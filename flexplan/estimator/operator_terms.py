"""Per-operator time terms of one streamed decoder layer: Park & Egger's arrays C, G, H and D
(section 4.2), plus the activation transfers at the operators that compute on the accelerator.

For each operator of ``workload.operators.layer_operators`` and each step of a phase (decode:
one row per step, the KV cache grows; prefill: one row):

    C[k]  = C_k / (TH_CPU Eff_CPU,Comp(rows)) + D_k / (BW_CPU Eff_CPU,Mem(rows))   the CPU, alone
    G[k]  = C_k / (TH_GPU Eff_GPU,Comp(rows)) + D_k / (BW_GPU Eff_GPU,Mem(rows))
    H[k]  = W_k / (BW_ICN Eff_ICN)          its weights over the link (the attention core: the KV it reads)
    D[k]  = its blocks dequantised on the accelerator (``dequant_terms``; 0 for float weights and the core)
    IN[k] = rows x in_k x bytes / (BW_ICN Eff_ICN),   OUT[k] = rows x out_k x bytes / (BW_ICN Eff_ICN)

with D_k its weights plus its activations, at the accelerator's dtype: a split layer's weights and KV
cache live in pinned host memory in that dtype, and the CPU computes on them in place (as
``cpu-attention`` does). W_k is what crosses the link: weights held as blocks (``Shape.weights``) cross
as blocks (``weight_formats.group_bytes_per_weight`` at the dtype for the float ones), and the
accelerator's GEMM then reads them dequantised, at the dtype, after D[k]. The attention core on the CPU is ``terms.t_cpu_attention_s`` (its calibrated
KV read rate); an MoE block's routed experts on the CPU are ``expert_terms.t_cpu_experts_s``. The
efficiency factors are the calibrated ones (GEMV / GEMM by rows, attention, link by size); a Linear's
C is scaled by ``cpu_split_linear``, the measured time of the split executor's kernel on dense
weights over the packed kernel's those factors describe. The glue
between operators (norms, residual adds, rotary, activation, dispatch) costs the calibrated CPU
layer overhead at one token once per layer. What calibrated layers take beyond the factors as the
tokens grow (the overhead at ``rows`` less that; in prefill it is most of the overhead, and on a
compute-bound layer partly the noise of one timing) is spread over the operators other than the
attention core (whose time grows with the context) in proportion to their CPU time: a layer all on the CPU costs what the ``cpu`` policy's layer term gives, and a layer
whose operators mostly compute on the accelerator is not charged the CPU's whole-layer residual
(charged whole, one noisy prefill row made a quick and a full calibration of one synthetic machine
predict split-points TTFT 21% apart). The CPU slowdown while a copy runs (``cpu_under_copy``, Park & Egger
4.1) is applied by the policy, which knows what overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexplan.estimator.dequant_terms import layer_matrices, t_gpu_dequant_s
from flexplan.estimator.efficiency import cpu_prefill_attention, cpu_split_linear
from flexplan.estimator.expert_terms import expert_flops, t_cpu_experts_s
from flexplan.estimator.terms import (
    host_kv_attention_dtype,
    t_compute_s,
    t_cpu_attention_s,
    t_link_s,
    t_memory_s,
    t_on_device_s,
)
from flexplan.workload import costs, weight_formats
from flexplan.workload.operators import ATTENTION, LINEAR, MLP, layer_operators, why_not_split


@dataclass(frozen=True)
class OperatorCosts:
    """C, G, H and the activation transfers of one layer's operators: arrays [steps, n] (prefill: one
    step), bytes [n] (the attention core's KV bytes [steps])."""

    names: tuple[str, ...]
    cpu_s: np.ndarray  # C
    gpu_s: np.ndarray  # G
    h2d_s: np.ndarray  # H
    dequant_s: np.ndarray  # D: [steps, n] the operator's blocks dequantised on the accelerator
    in_h2d_s: np.ndarray  # IN: the operator's input to the accelerator
    out_d2h_s: np.ndarray  # OUT: its output back to the host
    shares_input: np.ndarray  # [n] bool: reads what the operator before it read (moved once)
    weight_bytes: np.ndarray  # [n] as they cross the link (blocks, or the accelerator dtype)
    kv_bytes: np.ndarray  # [steps]: what the attention core reads from the KV cache
    in_bytes: np.ndarray  # [n]
    out_bytes: np.ndarray  # [n]
    attention_index: int
    cpu_glue_s: float  # per layer on the host: norms, residuals, rotary, activation, dispatch
    gpu_overhead_s: float  # per layer on the accelerator: kernel launches

    @property
    def n(self) -> int:
        return len(self.names)

    def h2d_bytes(self) -> np.ndarray:
        """[steps, n]: weights (and the attention core's KV) each operator moves over the link."""
        out = np.broadcast_to(self.weight_bytes, self.cpu_s.shape).copy()
        out[:, self.attention_index] += self.kv_bytes
        return out


def _moe_cpu_s(m, rows, hw, eff, shape, flops, params) -> float:
    """An MoE block on the CPU: its routed experts (calibrated expert path), router and shared
    experts as GEMMs, mean over layers (a dense layer of the model: its MLP as GEMMs)."""

    cd, wb = shape.cpu_dtype, shape.w_bytes
    th, bw = hw.cpu.peak_flops_per_s[cd], hw.cpu.memory_bandwidth_bytes_per_s
    share = sum(m.moe_layers) / m.num_layers
    routed = t_cpu_experts_s(m, rows, hw.cpu, eff, cd, wb, wb)
    other_params = params - share * m.num_experts * m.expert_params
    other_flops = max(flops - share * expert_flops(m, rows), 0.0)
    other = t_on_device_s(other_flops, other_params * wb + rows * 2 * m.hidden_size * wb, th, bw,
                          eff.cpu_compute(rows, cd), eff.cpu_memory(rows, cd))
    return float(share * routed + other)


def _operator_groups(op) -> tuple[str, ...]:
    """The operator groups (``ModelSpec.layer_group_params``) whose weights ``op`` holds."""
    if op.kind == MLP:
        return ("mlp", "router", "experts", "shared_experts")  # an MoE block (a dense layer's MLP among them)
    return () if op.kind == ATTENTION else ("attention",) if op.name in ("q_proj", "k_proj", "v_proj", "o_proj") \
        else ("mlp",)


def _link_bytes_and_dequant_s(shape, hw, ops, eff_gpu_memory) -> tuple[np.ndarray, np.ndarray]:
    """([n] each operator's weight bytes over the link, [n] its D): a linear's weights at its group's
    bytes per weight on the accelerator (blocks, or the dtype) and one matrix to dequantise; the MoE
    block its groups' per-layer parameters (mean over layers) and their matrices (dequant_terms)."""
    m, wb, weights = shape.model, shape.w_bytes, shape.weights
    if not weights:
        return np.array([o.weight_params * wb for o in ops], dtype=float), np.zeros(len(ops))
    bpw = weight_formats.group_bytes_per_weight(weights, float(wb))
    group_params = {g: sum(p for g_, _, p in weights if g_ == g) / m.num_layers for g in bpw}
    matrices = layer_matrices(m)
    bw = hw.gpu.memory_bandwidth_bytes_per_s
    link, dq = [], []
    for o in ops:
        groups = _operator_groups(o)
        if o.kind == MLP:
            link.append(sum(group_params.get(g, 0.0) * bpw.get(g, wb) for g in groups))
            dq.append(sum(t_gpu_dequant_s(weights, g, group_params.get(g, 0.0), matrices.get(g, 0.0), wb, bw,
                                          eff_gpu_memory) for g in groups))
        else:
            link.append(o.weight_params * (bpw.get(groups[0], wb) if groups else wb))
            dq.append(t_gpu_dequant_s(weights, groups[0], o.weight_params, 1, wb, bw, eff_gpu_memory) if groups else 0.0)
    return np.array(link, dtype=float), np.array(dq, dtype=float)


def operator_costs(shape, hw, eff, phase: str, cpu_attention_s=None) -> OperatorCosts | None:
    """The per-operator terms of ``phase`` (module docstring); None without an accelerator or for a
    layout ``workload.operators`` cannot cut. ``cpu_attention_s``: the decode attention on the CPU per
    step when the caller has it (``terms.cpu_attention_costs``), else computed here."""

    m = shape.model
    if hw.gpu is None or hw.link is None or why_not_split(m):
        return None
    ops = layer_operators(m)
    b, wb, cd = shape.batch, shape.w_bytes, shape.cpu_dtype
    if phase == "prefill":
        rows = b * shape.input_len
        attn_flops = np.array([costs.c_prefill_attention(m, b, shape.input_len)])
        kv = np.array([costs.d_kv_write(m, b, shape.input_len, wb)])  # the prompt's K, V, appended on the host
    else:
        rows, ctx = b, shape.decode_context_lens
        keys = costs.mean_keys_read(m, ctx)  # c_decode_attention and d_kv_cache, the span shares counted once
        attn_flops = float(b * costs.attention_flops_per_pair(m)) * keys
        kv = float(b * m.kv_elems_per_token * wb) * keys  # after this step's append
    steps, n = kv.shape[0], len(ops)
    th_c, bw_c = hw.cpu.peak_flops_per_s[cd], hw.cpu.memory_bandwidth_bytes_per_s
    th_g, bw_g = hw.gpu.peak_flops_per_s[shape.dtype], hw.gpu.memory_bandwidth_bytes_per_s
    h2d, d2h = hw.link.h2d_bandwidth_bytes_per_s, hw.link.d2h_bandwidth_bytes_per_s
    ec, em, eg, egm = eff.cpu_compute(rows, cd), eff.cpu_memory(rows, cd), eff.gpu_compute(rows), eff.gpu_memory(rows)
    in_b = np.array([rows * o.in_elems * wb for o in ops], dtype=float)
    out_b = np.array([rows * o.out_elems * wb for o in ops], dtype=float)
    w_b = np.array([o.weight_params * wb for o in ops], dtype=float)  # what C and G read, at the dtype
    link_b, D = _link_bytes_and_dequant_s(shape, hw, ops, egm)
    flops = np.array([rows * o.flops_per_row for o in ops], dtype=float)
    read = w_b.copy()
    moe = [k for k, o in enumerate(ops) if o.kind == MLP]
    for k in moe:  # a decode step reads only the experts its tokens pick
        unread = (m.num_experts - costs.expected_experts_read(m, rows)) * m.expert_params
        read[k] -= unread * sum(m.moe_layers) / m.num_layers * wb
    data = read + in_b + out_b
    C = np.broadcast_to(t_on_device_s(flops, data, th_c, bw_c, ec, em), (steps, n)).copy()
    C[:, [o.kind == LINEAR for o in ops]] *= cpu_split_linear(eff, rows, cd)  # dense weights, not packed ones
    G = np.broadcast_to(t_on_device_s(flops, data, th_g, bw_g, eg, egm), (steps, n)).copy()
    H = np.broadcast_to(np.array([t_link_s(x, h2d, eff.h2d(x)) for x in link_b]), (steps, n)).copy()
    for k in moe:
        C[:, k] = _moe_cpu_s(m, rows, hw, eff, shape, flops[k], ops[k].weight_params)
    att = next(k for k, o in enumerate(ops) if o.kind == ATTENTION)
    act = in_b[att] + out_b[att]
    if phase == "decode":
        C[:, att] = t_cpu_attention_s(shape, hw, eff, ctx) if cpu_attention_s is None else cpu_attention_s
    else:
        ad = host_kv_attention_dtype(shape, hw)  # q, k, v in the accelerator dtype: transformers' SDPA in it
        C[:, att] = (t_compute_s(attn_flops, hw.cpu.peak_flops_per_s[ad], cpu_prefill_attention(eff, rows, ad))
                     + t_memory_s(kv + act, bw_c, em))
    G[:, att] = t_compute_s(attn_flops, th_g, eg) + t_memory_s(kv + act, bw_g, egm)
    H[:, att] = t_link_s(kv, h2d, eff.h2d(float(np.mean(kv))))
    in_s = np.array([t_link_s(x, h2d, eff.h2d(x)) for x in in_b])
    out_s = np.array([t_link_s(x, d2h, eff.d2h(x)) for x in out_b])
    layer_bytes = float(costs.d_weights(m, wb))
    glue_s = float(eff.cpu_layer_overhead_s(1, cd, layer_bytes))
    per_token_s = max(float(eff.cpu_layer_overhead_s(rows, cd, layer_bytes)) - glue_s, 0.0)
    share = np.delete(C[0], att) / np.delete(C[0], att).sum()  # the attention core's grows with the context:
    C[:, np.arange(n) != att] += per_token_s * share  # the operators whose time does not take the extra
    return OperatorCosts(
        names=tuple(o.name for o in ops), cpu_s=C, gpu_s=G, h2d_s=H, dequant_s=np.broadcast_to(D, (steps, n)),
        in_h2d_s=np.broadcast_to(in_s, (steps, n)), out_d2h_s=np.broadcast_to(out_s, (steps, n)),
        shares_input=np.array([o.shares_input for o in ops]), weight_bytes=link_b, kv_bytes=kv, in_bytes=in_b,
        out_bytes=out_b, attention_index=att, cpu_glue_s=glue_s,
        gpu_overhead_s=float(eff.gpu_layer_overhead_s()))
