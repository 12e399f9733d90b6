"""Per-operator costs of one decoder layer, for Park & Egger's split points (section 4.2).

A layer is taken as four operators in the order they run: the attention's input projections
(Q, K, V and any latent or norm parameters of the attention group), the attention over the KV
cache (scores, softmax, weighted values: FLOPs and the cache, no weights), the attention's
output projection, and the MLP (or, in an MoE layer, router, routed and shared experts; in
decode the experts a step reads, ``costs.expected_experts_read``). Their FLOPs and bytes are the
layer's (Table 2, ``terms.phase_work``) shared out by the parameters each holds, so the
operators add up to the layer the other policies price; the output projection is
``heads x v_head_dim x hidden`` parameters, the input projections the rest of the attention group.

Each operator's time on the CPU and on the accelerator comes from the same efficiency factors as
the layer's (``t_on_device_s``; the attention on the CPU at the calibrated attention factor,
``terms.t_cpu_attention_s``), and its host-to-device copy from its weights at the accelerator's
dtype (the attention's from the KV cache it would read on the accelerator). The layer's fixed
per-layer overhead is shared by bytes. The CPU times are those of a CPU that shares host memory
with a running copy (``cpu_under_copy``, Park & Egger 4.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flexplan.estimator.efficiency import Efficiency
from flexplan.hardware.spec import Hardware
from flexplan.workload import costs

OPERATORS = ("attention input projections", "attention over the KV cache", "attention output projection", "mlp")
KV_OPERATOR = 1  # the one that reads the KV cache and holds no weights


@dataclass(frozen=True)
class SplitOps:
    """One layer's operators (``OPERATORS`` order); arrays [op] in prefill, [step, op] in decode."""

    names: tuple[str, ...]
    cpu_s: np.ndarray  # C, under a concurrent copy
    acc_s: np.ndarray  # G
    h2d_weights_s: np.ndarray  # H of the weights (accelerator dtype)
    h2d_kv_s: np.ndarray  # H of the KV cache an operator reads on the accelerator
    boundary_s: float  # X: the hidden state across the link, one way plus the other


@lru_cache(maxsize=256)
def _shares(m, phase: str, batch: int) -> np.ndarray:
    """Share of the layer's linear work (FLOPs and weight bytes) each operator holds (sums to 1
    over the three linear operators; the attention over the cache holds none)."""
    out_p = m.num_heads * m.v_head_dim * m.hidden_size
    in_p = max(m.attention_params - out_p, 0)
    n = m.num_layers
    if phase == "decode":  # the routed experts a step reads, not all of them
        mlp_p = np.mean([m.active_layer_params(i) - m.attention_params if not m.moe_layers[i] else
                         m.layer_params(i) - m.attention_params - m.num_experts * m.expert_params
                         + costs.expected_experts_read(m, batch) * m.expert_params for i in range(n)])
    else:
        mlp_p = np.mean([m.layer_params(i) - m.attention_params for i in range(n)])
    p = np.array([in_p, 0.0, out_p, mlp_p], dtype=float) / (in_p + out_p + mlp_p)
    p.setflags(write=False)  # cached: shared by every call
    return p


def _work_by_op(shape, phase: str, w):
    """(linear shares [3], attention FLOPs, linear FLOPs) of one layer of ``shape`` in ``phase``."""
    m = shape.model
    lin = _shares(m, phase, shape.batch)[[0, 2, 3]]
    if phase == "decode":
        attn_flops = costs.c_decode_attention(m, shape.batch, shape.decode_context_lens)
    else:
        attn_flops = np.asarray(w.flops - costs.c_decode_linear(m, w.rows), dtype=float)
    return lin, attn_flops, np.asarray(w.flops, dtype=float) - attn_flops


def _per_op(total, weights):
    """[.., op]: the share ``weights`` of ``total`` for each operator."""
    return np.asarray(total, dtype=float)[..., None] * weights


def cpu_op_times_s(shape, hw: Hardware, eff: Efficiency, phase: str, w) -> np.ndarray:
    """C of each operator on an idle CPU (no copy running): [op] in prefill, [step, op] in decode
    (``w``: the layer's ``terms.phase_work``). ``flexplan validate --split-ops`` checks these."""
    from flexplan.estimator.terms import t_cpu_attention_s, t_on_device_s

    cpu, cd, rows = hw.cpu, shape.cpu_dtype, w.rows
    lin, attn_flops, lin_flops = _work_by_op(shape, phase, w)
    th_c, bw_c = cpu.peak_flops_per_s[cd], cpu.memory_bandwidth_bytes_per_s
    c_lin = t_on_device_s(_per_op(lin_flops, lin), _per_op(w.d_cpu, lin), th_c, bw_c, eff.cpu_compute(rows, cd),
                          eff.cpu_memory(rows, cd))
    if phase == "decode":
        c_attn = t_cpu_attention_s(shape, hw, eff, shape.decode_context_lens)
    else:
        c_attn = t_on_device_s(attn_flops, w.kv_write_cpu, th_c, bw_c, eff.cpu_compute(rows, cd), eff.cpu_memory(rows, cd))
    c_ops = np.insert(c_lin, 1, np.broadcast_to(c_attn, np.shape(attn_flops)), axis=-1)
    weight_share = np.insert(lin, 1, 0.0)  # the per-layer overhead, by the weights each operator holds
    return c_ops + eff.cpu_layer_overhead_s(rows, cd, w.weight_bytes_cpu) * weight_share


def split_op_costs(shape, hw: Hardware, eff: Efficiency, phase: str, w, cpu_under_copy: float) -> SplitOps | None:
    """The operators of one layer of ``shape`` in ``phase`` (``w``: its ``terms.phase_work``);
    None without an accelerator."""
    from flexplan.estimator.terms import t_link_s, t_on_device_s

    if hw.gpu is None or hw.link is None:
        return None
    b = shape.batch
    gpu, link = hw.gpu, hw.link
    lin, attn_flops, lin_flops = _work_by_op(shape, phase, w)
    steps = np.shape(attn_flops)
    th_g, bw_g = gpu.peak_flops_per_s[shape.dtype], gpu.memory_bandwidth_bytes_per_s
    rows = w.rows
    g_lin = t_on_device_s(_per_op(lin_flops, lin), _per_op(w.d_gpu, lin), th_g, bw_g, eff.gpu_compute(rows),
                          eff.gpu_memory(rows))
    if phase == "decode":
        kv_gpu = w.kv_read + w.kv_write  # the cache the accelerator reads, and the new K, V it writes
        g_attn = t_on_device_s(attn_flops, kv_gpu, th_g, bw_g, eff.gpu_compute(b), eff.gpu_memory(b))
    else:
        g_attn = t_on_device_s(attn_flops, w.kv_write, th_g, bw_g, eff.gpu_compute(rows), eff.gpu_memory(rows))
    g_ops = np.insert(g_lin, 1, np.broadcast_to(g_attn, steps), axis=-1)
    g_ops = g_ops + eff.gpu_layer_overhead_s() * np.insert(lin, 1, 0.0)
    c_ops = cpu_op_times_s(shape, hw, eff, phase, w) * cpu_under_copy
    h_w = t_link_s(_shares(shape.model, phase, b) * w.weight_bytes_gpu, link.h2d_bandwidth_bytes_per_s,
                   eff.h2d(w.weight_bytes_gpu))
    kv_read = np.asarray(w.kv_read if phase == "decode" else 0.0, dtype=float)
    h_kv = np.zeros(steps + (len(OPERATORS),))
    h_kv[..., KV_OPERATOR] = t_link_s(kv_read, link.h2d_bandwidth_bytes_per_s, eff.h2d(float(np.mean(kv_read)) or 1.0))
    x = (t_link_s(w.hidden_bytes, link.h2d_bandwidth_bytes_per_s, eff.h2d(w.hidden_bytes))
         + t_link_s(w.hidden_bytes, link.d2h_bandwidth_bytes_per_s, eff.d2h(w.hidden_bytes)))
    return SplitOps(OPERATORS, c_ops, g_ops, np.broadcast_to(h_w, c_ops.shape), h_kv, float(x))


def layer_timeline(ops: SplitOps, first: int, last: int, micro_batches: int = 1) -> list[dict]:
    """One layer's operators with their device and (start, end) seconds, the decode steps'
    mean: the CPU runs O[0..first-1] while the link copies the weights of O[first..last-1], the
    accelerator computes those once both are there (and the hidden state has crossed), the CPU
    finishes O[last..n-1] after the result is back (Park & Egger Figures 6-7, one batch)."""
    mean = lambda a: np.asarray(a, dtype=float).reshape(-1, len(ops.names)).mean(axis=0)  # noqa: E731
    c, g, h = mean(ops.cpu_s), mean(ops.acc_s), mean(ops.h2d_weights_s) + micro_batches * mean(ops.h2d_kv_s)
    n = len(ops.names)
    split = 0 < last - first < n
    rows, t_cpu, t_link = [], 0.0, 0.0
    for k in range(first):
        rows.append({"operator": ops.names[k], "device": "cpu", "start_s": t_cpu, "end_s": t_cpu + c[k]})
        t_cpu += c[k]
    for k in range(first, last):
        what = " (KV cache)" if k == KV_OPERATOR else " (weights)"
        rows.append({"operator": ops.names[k] + what, "device": "link", "start_s": t_link, "end_s": t_link + h[k]})
        t_link += h[k]
    t_acc = max(t_link, t_cpu + (ops.boundary_s / 2 if split and first > 0 else 0.0))
    for k in range(first, last):
        rows.append({"operator": ops.names[k], "device": "accelerator", "start_s": t_acc, "end_s": t_acc + g[k]})
        t_acc += g[k]
    t_cpu = max(t_cpu, t_acc + (ops.boundary_s / 2 if split else 0.0)) if last > first else t_cpu
    for k in range(last, n):
        rows.append({"operator": ops.names[k], "device": "cpu", "start_s": t_cpu, "end_s": t_cpu + c[k]})
        t_cpu += c[k]
    return rows
