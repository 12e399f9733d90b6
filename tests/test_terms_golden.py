"""Golden values of FlexInfer's Equations 1-3, worked out by hand below (not by the code under test).

A toy model, a toy machine and constant efficiency factors, chosen so every number can be checked
with pencil and paper:

Model (Llama layout): hidden h = 4, intermediate i = 8, 2 query heads and 1 KV head of head_dim 2
(q_dim 4, kv_dim 2), N = 3 layers, vocab V = 10, untied head; everything float32 (4 bytes).
  GEMM weights per layer W = h q + 2 h kv + q h + 3 h i = 16 + 16 + 16 + 96 = 144
  parameters per layer = W + 2 RMSNorm weights (2 h = 8) = 152 -> 608 bytes
  activations per token (read + written by the GEMMs): attention (h+q) + 2(h+kv) + (q+h) + 2q
  = 8 + 12 + 8 + 8 = 36, gated MLP 2(h+i) + (i+h) + 2i = 24 + 12 + 16 = 52; 88 elements
Request: batch 1, prompt s = 4, 3 output tokens (2 decode steps attending over 5 and 6 keys).
Machine: CPU 1000 FLOP/s and 1000 B/s, GPU 10^4 FLOP/s and 10^4 B/s, link 1000 B/s each way.
Factors: Eff_CPU,Comp 0.5, Eff_CPU,Mem 0.25, CPU attention 0.125, Eff_GPU,Comp 0.5,
Eff_GPU,Mem 0.5, Eff_ICN 0.25; no per-layer or per-step overheads; CPU slowed 1.25x while
copying.
"""

from __future__ import annotations

import numpy as np
import pytest

from flexplan.estimator import REGISTRY, Shape, phase_costs
from flexplan.estimator.policies.gpu_offload import eq2_streamed_layer_s, pipeline_fill_s
from flexplan.estimator.terms import phase_work, t_compute_s, t_link_s, t_memory_s
from flexplan.executor.plans import fixed_plan
from flexplan.executor.stats import PhaseStats, step_flops
from flexplan.hardware.spec import CPUSpec, GPUSpec, Hardware, LinkSpec
from flexplan.run_cmd import phase_memory_bytes
from flexplan.workload.model import ModelSpec

N = 3
SPEC = ModelSpec.from_config(dict(model_type="llama", hidden_size=4, intermediate_size=8, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=2, num_hidden_layers=N, vocab_size=10,
                                  tie_word_embeddings=False), name="toy")
HW = Hardware(
    name="toy",
    cpu=CPUSpec(name="toy cpu", sockets=1, cores=4, peak_flops_per_s={"float32": 1e3, "bfloat16": 1e3},
                memory_bandwidth_bytes_per_s=1e3, memory_bytes=1 << 30),
    gpu=GPUSpec(name="toy gpu", memory_bytes=1 << 30, memory_bandwidth_bytes_per_s=1e4,
                peak_flops_per_s={"float32": 1e4, "bfloat16": 1e4}),
    link=LinkSpec(name="toy link", h2d_bandwidth_bytes_per_s=1e3, d2h_bandwidth_bytes_per_s=1e3),
)
SHAPE = Shape(SPEC, batch=1, input_len=4, output_len=3, dtype="float32", cpu_dtype="float32")


class ConstantEfficiency:
    source = "constant (test)"

    def cpu_compute(self, tokens, dtype=None): return 0.5
    def cpu_memory(self, tokens, dtype=None): return 0.25
    def cpu_attention(self, context_len, dtype=None): return np.full(np.shape(context_len), 0.125)
    def cpu_head_compute(self, tokens, dtype=None, tied=False): return 0.5
    def cpu_head_memory(self, tokens, dtype=None, tied=False): return 0.25
    def gpu_compute(self, tokens): return 0.5
    def gpu_memory(self, tokens): return 0.5
    def h2d(self, transfer_bytes): return 0.25
    def d2h(self, transfer_bytes): return 0.25
    def cpu_under_copy(self, tokens=None): return 1.25
    def cpu_threads(self): return None
    def cpu_layer_overhead_s(self, tokens=1, dtype=None, layer_bytes=None): return 0.0
    def cpu_step_overhead_s(self, batch=1, vocab=0): return 0.0
    def cpu_stack_overhead_s(self, batch=1, vocab=0, dtype=None): return None
    def gpu_layer_overhead_s(self): return 0.0


EFF = ConstantEfficiency()
PRE = phase_costs(SHAPE, HW, EFF, "prefill")
DEC = phase_costs(SHAPE, HW, EFF, "decode")
approx = pytest.approx


def test_the_three_time_terms():
    assert t_compute_s(1312, 1e3, 0.5) == approx(2.624)  # C / (TH x Eff)
    assert t_memory_s(2080, 1e3, 0.25) == approx(8.32)  # D / (BW x Eff)
    assert t_link_s(608, 1e3, 0.25) == approx(2.432)  # D_CPU->GPU / (BW_ICN x Eff_ICN)


def test_table2_quantities():
    pre, dec = phase_work(SHAPE, "prefill"), phase_work(SHAPE, "decode")
    # C_Prefill = 2 s W + 4 heads head_dim s(s+1)/2 = 2*4*144 + 4*2*2*10 = 1152 + 160
    assert pre.flops == approx(1312)
    # D_Prefill = 608 weight bytes + s * 88 elements * 4 bytes = 608 + 1408; prompt KV 2 s kv_dim 4 = 64
    assert pre.d_cpu == approx(2016) and pre.d_gpu == approx(2016) and pre.kv_write_cpu == approx(64)
    # C_Decode = 2 W + 4 heads head_dim ctx = 288 + 16 ctx, ctx = 5, 6
    assert dec.flops == approx([368, 384])
    # D_Decode = 608 + 88 * 4 = 960; KV read over ctx keys 16 ctx, one new token 16, cached part 16 (ctx - 1)
    assert dec.d_cpu == approx(960) and dec.kv_read_cpu == approx([80, 96]) and dec.kv_write_cpu == approx(16)
    assert dec.kv_read == approx([64, 80])
    # LM head: 2 h V = 80 FLOPs, (V h + final norm h) 4 = 176 bytes; D_Output s h 4 = 64 (prefill), 16; logits V 4 = 40
    assert pre.head_flops == approx(80) and pre.head_bytes_cpu == approx(176)
    assert (pre.hidden_bytes, dec.hidden_bytes, dec.logits_bytes) == approx((64, 16, 40))


def test_eq1_cpu_layer():
    # prefill: 1312 / (1000 * 0.5) + (2016 + 64) / (1000 * 0.25) = 2.624 + 8.32
    assert PRE.t_cpu_layer_s == approx(10.944)
    # decode: C / 500 + (960 + 16) / 250 + KV(ctx) / 125, per step: 0.736 + 3.904 + 0.64, 0.768 + 3.904 + 0.768
    assert DEC.t_cpu_layer_s == approx([5.28, 5.44])


def test_lm_head_term():
    # CPU: 80 / 500 + 176 / 250 = 0.16 + 0.704; GPU: 80 / 5000 + 176 / 5000
    assert PRE.t_cpu_head_s == approx(0.864) and PRE.t_gpu_head_s == approx(0.0512)


def test_eq1_cpu_only_ttft_and_tpot():
    # TTFT = 3 x 10.944 + 0.864; TPOT = 3 x mean(5.28, 5.44) + 0.864 = 16.08 + 0.864
    gl = np.array([0])
    assert REGISTRY["cpu"].estimate(PRE, N, gl).time_s == approx([33.696])
    assert REGISTRY["cpu"].estimate(DEC, N, gl).time_s == approx([16.944])


def test_gpu_layer_and_link_terms():
    # GPU layer: (C + D + KV read + KV write) / 5000: prefill (1312 + 2016 + 0 + 64), decode 1408 and 1440
    assert PRE.t_gpu_layer_s == approx(0.6784) and DEC.t_gpu_layer_s == approx([0.2816, 0.288])
    # over the link at 250 B/s: 608 weight bytes, 64 / 80 cached KV bytes, 16 new KV bytes, 40 logit bytes
    assert PRE.t_load_weights_s == approx(2.432) and DEC.t_load_kv_s == approx([0.256, 0.32])
    assert DEC.t_store_kv_s == approx(0.064) and PRE.t_store_kv_s == approx(0.256)
    assert DEC.t_logits_d2h_s == approx(0.16) and PRE.t_load_head_s == approx(0.704)


def test_eq2_streamed_layer_max_and_pipeline_fill():
    # prefill: max(0.6784 compute, 2.432 load, 0.256 store) = 2.432
    assert eq2_streamed_layer_s(PRE) == approx(2.432)
    # decode, per step then the mean: max(0.2816, 2.432 + 0.256) = 2.688, max(0.288, 2.432 + 0.32) = 2.752
    assert eq2_streamed_layer_s(DEC) == approx(2.72)
    # the first load (or last compute) no overlap hides: min(compute, load)
    assert pipeline_fill_s(PRE) == approx(0.6784) and pipeline_fill_s(DEC) == approx(0.2848)


def test_eq2_gpu_offload_ttft_and_tpot():
    # N streamed layers + fill + hidden in, GPU head, logits out (0.256 + 0.0512 + 0.16 in prefill)
    gl = np.array([0])
    assert REGISTRY["gpu-offload"].estimate(PRE, N, gl).time_s == approx([3 * 2.432 + 0.6784 + 0.4672])
    # decode: 3 x 2.72 + 0.2848 + (0.064 + 0.0512 + 0.16)
    assert REGISTRY["gpu-offload"].estimate(DEC, N, gl).time_s == approx([8.72])


def test_eq3_splitgen():
    gl = np.array([1])  # M = 1: the first 2 layers on the CPU, the last on the GPU
    # prefill: max(CPU 2 x 10.944 slowed 1.25x by the copy, load 1 x 2.432 + head 0.704) + GPU 0.6784 + ends 0.4672
    assert REGISTRY["splitgen"].estimate(PRE, N, gl).time_s == approx([27.36 + 0.6784 + 0.4672])
    # decode (M resident): CPU 2 x 5.36 + GPU mean(0.2816, 0.288) + ends (0.064 + 0.0512 + 0.16)
    assert REGISTRY["splitgen"].estimate(DEC, N, gl).time_s == approx([10.72 + 0.2848 + 0.2752])


def test_executor_flop_count():
    # prefill of 4 tokens: 3 layers x 1312 + head 80
    assert step_flops(SPEC, 1, 4, 0) == approx(4016)
    # one token on a past of 4 (5 keys): 3 x 368 + 80
    assert step_flops(SPEC, 1, 1, 4) == approx(1184)
    # 2 tokens on a past of 4: GEMMs 2 x 2 x 144 = 576, attention 4 x 2 x 2 x (2 x 4 + 3 causal pairs) = 176
    assert step_flops(SPEC, 1, 2, 4) == approx(3 * 752 + 80)


def test_phase_stats_count_decode_steps_as_step_flops_does():
    """The executor's count: decode steps settled in one vectorised sum, the others at once; the
    same total as step_flops one step at a time, whatever the order of batches and contexts."""
    steps = [(1, 4, 0), (1, 1, 4), (2, 1, 5), (1, 1, 5), (1, 2, 6), (2, 1, 6), (3, 1, 9)]
    ps = PhaseStats("decode")
    for batch, q, past in steps:
        ps.count_step(SPEC, batch, q, past)
    assert ps.to_dict()["flops"] == approx(sum(step_flops(SPEC, *s) for s in steps))
    assert ps.flops_per_s == 0.0 and not ps.pending_decode


def test_achieved_memory_traffic_of_a_cpu_plan():
    plan = fixed_plan(SPEC, "cpu", "cpu", batch_size=1, input_len=4, output_len=3)
    # prefill: 3 x (2016 + 64) + head 176
    assert phase_memory_bytes(SPEC, plan, "prefill", 3) == approx(6416)
    # decode: 3 x ((960 + 16 + 80) + (960 + 16 + 96)) + 2 steps x 176
    assert phase_memory_bytes(SPEC, plan, "decode", 3) == approx(3 * 2128 + 352)
