"""Weights held as blocks on the accelerator (issue 40): the link and the accelerator's memory carry
the blocks, and the accelerator dequantises them before each GEMM (Park & Egger's D). Numbers worked
by hand below, not by the code under test.

Toy model (Llama layout): hidden h = 64, intermediate 128, 2 query heads and 1 KV head of head_dim 32,
2 layers, vocab 256, untied head; plan dtype bfloat16 (2 bytes), linears in Q4_0 (18 bytes a block
of 32 = 0.5625 a weight).
  attention per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 4096 + 2048 + 2048 + 4096 = 12288
  MLP: 3 x 64 x 128 = 24576; norms 2 x 64 = 128 (float: bfloat16 on the accelerator)
  one layer over the link: 36864 x 0.5625 + 128 x 2 = 20736 + 256 = 20992 bytes (bfloat16: 73984)
  the head: (256 x 64 + final norm 64) x 0.5625 = 9252 bytes
Machine: GPU 1e13 FLOP/s, 1e11 B/s; link 1e8 B/s each way; Eff_GPU,Mem 0.5, Eff_ICN 0.25, no overheads.
D of a Q4_0 matrix of p weights in bfloat16 (fused_dequant's one kernel: the blocks read, 0.5625
bytes a weight, the bfloat16 weights written, 2): p x 2.5625 / (1e11 x 0.5) + 1 launch x 5 us.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import flexplan
from flexplan.errors import InvalidInputError
from flexplan.estimator import phase_costs
from flexplan.estimator.efficiency import GPU_KERNEL_LAUNCH_S, DefaultEfficiency
from flexplan.estimator.policies.gpu_offload import eq2_streamed_layer_s
from flexplan.estimator.policies.split_points import eq5_layer_s, eq8_dc_s
from flexplan.estimator.terms import Shape
from flexplan.hardware.spec import CPUSpec, GPUSpec, Hardware, LinkSpec
from flexplan.workload import weight_formats
from flexplan.workload.model import ModelSpec

SPEC = ModelSpec.from_config(dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=32, num_hidden_layers=2, vocab_size=256,
                                  tie_word_embeddings=False), name="toy")
HW = Hardware(
    name="toy",
    cpu=CPUSpec(name="toy cpu", sockets=1, cores=4, peak_flops_per_s={"float32": 1e11, "bfloat16": 1e11},
                memory_bandwidth_bytes_per_s=1e10, memory_bytes=1 << 34),
    gpu=GPUSpec(name="toy gpu", memory_bytes=1 << 34, memory_bandwidth_bytes_per_s=1e11,
                peak_flops_per_s={"float32": 1e13, "bfloat16": 1e13}),
    link=LinkSpec(name="toy link", h2d_bandwidth_bytes_per_s=1e8, d2h_bandwidth_bytes_per_s=1e8),
)
EFF = DefaultEfficiency(cpu_compute_eff=0.5, cpu_memory_eff=0.5, gpu_compute_eff=0.5, gpu_memory_eff=0.5,
                        icn_eff=0.25, cpu_overhead_s=0.0, gpu_overhead_s=0.0)
Q4_0 = weight_formats.at_load_weights(SPEC, "Q4_0")
approx = pytest.approx


def _shape(weights=()):
    return Shape(SPEC, batch=1, input_len=32, output_len=4, dtype="bfloat16", cpu_dtype="float32", weights=weights)


def _dequant_s(params: float, matrices: int) -> float:
    return params * 2.5625 / (1e11 * 0.5) + matrices * 1 * 5e-6


def test_the_weights_are_q4_0_linears_and_float_rest():
    assert dict(((g, f), p) for g, f, p in Q4_0) == {
        ("attention", "Q4_0"): 24576, ("mlp", "Q4_0"): 49152, ("norms", "F32"): 256,
        ("embedding", "F32"): 16384, ("lm_head", "Q4_0"): 16384}


def test_the_link_carries_the_blocks():
    shape = _shape(Q4_0)
    assert shape.gpu_weight_bytes * SPEC.params_per_layer == approx(20992)
    assert shape.gpu_head_weight_bytes == approx(0.5625)
    pc = phase_costs(shape, HW, EFF, "decode")
    assert pc.weight_bytes_gpu == approx(20992) and pc.head_bytes_gpu == approx(9252)
    assert pc.t_load_weights_s == approx(20992 / (1e8 * 0.25))  # 839.68 us
    assert pc.t_load_head_s == approx(9252 / (1e8 * 0.25))
    float_pc = phase_costs(_shape(), HW, EFF, "decode")
    assert float_pc.weight_bytes_gpu == approx(73984) and float_pc.t_gpu_dequant_s == 0.0


def test_the_dequantisation_term_by_hand():
    assert GPU_KERNEL_LAUNCH_S == 5e-6
    for phase in ("prefill", "decode"):
        pc = phase_costs(_shape(Q4_0), HW, EFF, phase)
        # 7 matrices, 36864 weights in blocks: 36864 x 2.5625 / 5e10 = 1.88928 us + 7 x 1 x 5 us = 35 us
        assert pc.t_gpu_dequant_s == approx(_dequant_s(36864, 7)) == approx(36.88928e-6)
        # the head: 16384 x 2.5625 / 5e10 = 0.83968 us + 5 us
        assert pc.t_gpu_head_dequant_s == approx(_dequant_s(16384, 1)) == approx(5.83968e-6)
        # the layer on the accelerator is the float layer's time plus D (its GEMMs read bfloat16 weights)
        base = phase_costs(_shape(), HW, EFF, phase)
        assert np.mean(pc.t_gpu_layer_s) == approx(np.mean(base.t_gpu_layer_s) + pc.t_gpu_dequant_s)
        assert np.mean(pc.t_gpu_head_s) == approx(np.mean(base.t_gpu_head_s) + pc.t_gpu_head_dequant_s)
        if phase == "decode":  # cpu-attention's accelerator part dequantises too
            assert np.mean(pc.cpu_attention.t_gpu_linear_s) == approx(
                np.mean(base.cpu_attention.t_gpu_linear_s) + pc.t_gpu_dequant_s)


def test_gpu_offload_decode_follows_the_compressed_bytes():
    q4 = phase_costs(_shape(Q4_0), HW, EFF, "decode")
    bf16 = phase_costs(_shape(), HW, EFF, "decode")
    # streamed layer: max(accelerator 0.039 ms incl. D 0.037, link 1.01 ms): link-bound, its weights and the
    # cached KV (k, v of 32 each in bfloat16 = 128 bytes a token, 32..34 tokens: 4224 bytes on average)
    assert eq2_streamed_layer_s(q4) == approx((20992 + 4224) / (1e8 * 0.25))
    assert eq2_streamed_layer_s(bf16) == approx((73984 + 4224) / (1e8 * 0.25))  # 0.322 of it
    p4 = flexplan.plan(SPEC, HW, batch_size=1, input_len=32, output_len=4, weights="Q4_0", efficiency=EFF,
                       prefill="gpu-offload", decode="gpu-offload")
    pf = flexplan.plan(SPEC, HW, batch_size=1, input_len=32, output_len=4, efficiency=EFF,
                       prefill="gpu-offload", decode="gpu-offload")
    assert p4.tpot_s < pf.tpot_s
    # the ends (hidden in, head, logits out, the host's 1 ms step) do not shrink, so the ratio sits above
    assert 4.5 / 16 < p4.tpot_s / pf.tpot_s < 0.6
    # per step: 2 layers x (weights + cached KV + the new token's 128 bytes back) + hidden 128 + logits 1024
    assert p4.decode.pcie_bytes == approx(2 * (20992 + 4224 + 128) + 1152)  # 51840
    assert pf.decode.pcie_bytes == approx(2 * (73984 + 4224 + 128) + 1152)  # 157824


def test_split_points_h_is_compressed_and_the_segment_includes_d():
    oc = phase_costs(_shape(Q4_0), HW, EFF, "decode").operators
    assert oc.names == ("q_proj", "k_proj", "v_proj", "attention", "o_proj", "gate_proj", "up_proj", "down_proj")
    params = np.array([4096, 2048, 2048, 0, 4096, 8192, 8192, 8192])
    assert oc.weight_bytes == approx(params * 0.5625)
    assert oc.h2d_s[0, 0] == approx(4096 * 0.5625 / (1e8 * 0.25))
    assert oc.dequant_s[0] == approx([_dequant_s(p, 1) if p else 0.0 for p in params])
    i, j = np.array([1]), np.array([5])  # k_proj, v_proj, attention, o_proj on the accelerator
    assert eq8_dc_s(oc.dequant_s, i, j)[0, 0] == approx(_dequant_s(2048, 1) * 2 + _dequant_s(4096, 1))
    with_d, _, _ = eq5_layer_s(oc, 1.0, i, j)
    without, _, _ = eq5_layer_s(replace(oc, dequant_s=np.zeros_like(oc.dequant_s)), 1.0, i, j)
    assert (with_d - without)[:, 0] == approx(eq8_dc_s(oc.dequant_s, i, j)[:, 0])
    float_oc = phase_costs(_shape(), HW, EFF, "decode").operators
    assert float_oc.weight_bytes == approx(params * 2.0) and not float_oc.dequant_s.any()


@pytest.mark.parametrize("name, fmt", [("Q4_0", "Q4_0"), ("q4_k", "Q4_K"), ("Q8_0", "Q8_0"), ("int4", "Q4_1")])
def test_a_block_format_name_plans(name, fmt):
    p = flexplan.plan(SPEC, HW, batch_size=1, input_len=32, output_len=4, weights=name, efficiency=EFF)
    assert {f for _, f, _ in p.weights} == {fmt, "F32"}
    assert any("dequantised by one compiled kernel" in n for n in p.notes)


def test_an_unknown_format_is_refused_naming_what_works():
    with pytest.raises(InvalidInputError, match=r"weights='Q3_K'.*Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"):
        flexplan.plan(SPEC, HW, weights="Q3_K", efficiency=EFF)
