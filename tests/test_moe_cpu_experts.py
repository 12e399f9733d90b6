"""The cpu-experts policy (llama.cpp --n-cpu-moe, KTransformers): estimator, memory model, planner
picks worked out by hand, and (below) the executor, token-identical to transformers."""

from __future__ import annotations

import numpy as np
import pytest

import flexplan
from flexplan.estimator import DefaultEfficiency, REGISTRY, Shape, phase_costs
from flexplan.explain import format_plan
from flexplan.hardware import get_hardware
from flexplan.placement import ACCELERATOR, CPU_EXPERTS, HOST, ON_CPU, RESIDENT, Placement
from flexplan.planner import placement_memory
from flexplan.workload import resolve_model

GB, GIB = 1e9, 1 << 30
QWEN = "Qwen/Qwen3-30B-A3B"


def _plan(batch, input_len, output_len=64, **kw):
    hw = get_hardware("flexinfer-server2")
    return flexplan.plan(QWEN, hw, batch_size=batch, input_len=input_len, output_len=output_len,
                         gpu_memory_bytes=24 * GIB, efficiency=DefaultEfficiency.for_hardware(hw), **kw)


def test_placement_rule_and_groups():
    pp = REGISTRY["cpu-experts"].placement(6, 2, "decode")
    assert pp.modes == (CPU_EXPERTS,) * 4 + (RESIDENT,) * 2
    g = pp.groups(0)
    assert g["mlp"].weights == HOST and g["mlp"].computes == ON_CPU
    assert g["attention"].weights == ACCELERATOR and g["shared experts"].computes == "accelerator"
    assert pp.uses_accelerator and pp.head_mode is RESIDENT


def test_decode_batch1_picks_cpu_experts_by_hand():
    """Qwen3-30B-A3B (61 GB of bf16 weights) on an H100 PCIe given 24 GiB, decode at batch 1, with
    the default efficiency factors (AMX CPU: memory 0.40; GPU memory 0.80; PCIe 0.80; 150 us per CPU
    layer, 100 us per GPU layer). By hand, per decode step:
    - gpu-offload streams every layer's weights over PCIe 5 (64 GB/s): >= 0.9 s (a lower bound);
    - cpu reads every layer's active weights (8 of 128 experts) and the LM head from host memory at
      407.8 GB/s x 0.40, plus its layer overheads: >= 44 ms (a lower bound);
    - cpu-experts with every layer's experts on the CPU (its M = 0 option; the planner takes the best M)
      reads the 8 picked experts (8 x 3 x 2048 x 768 params) per layer on the CPU, the rest of each layer
      from GPU memory at 1754 GB/s x 0.8, the hidden state over PCIe and back: <= 39 ms (an upper bound)."""
    from flexplan.estimator.efficiency import STEP_OVERHEAD_DEFAULT_S

    spec = resolve_model(QWEN)
    n, k, h, inter = spec.num_layers, spec.experts_per_token, spec.hidden_size, spec.expert_intermediate_size
    cpu_bw, gpu_bw = 407.8e9 * 0.40, 1754.4e9 * 0.80
    head_bytes = spec.vocab_size * h * 2
    t_offload_min = spec.layers_params * 2 / 64e9
    active_layer_params = spec.active_params - spec.embedding_params - spec.lm_head_params
    t_cpu_min = active_layer_params * 2 / cpu_bw + n * 150e-6 + head_bytes / cpu_bw
    rest_layer_bytes = (spec.layer_params(0) - spec.num_experts * spec.expert_params) * 2
    t_cpu_experts_max = (n * (k * 3 * h * inter * 2 / cpu_bw + 150e-6 + rest_layer_bytes / gpu_bw + 100e-6 + 2e-5)
                         + head_bytes / gpu_bw + 100e-6 + STEP_OVERHEAD_DEFAULT_S + 1e-4)
    assert t_offload_min > 0.9 and t_cpu_min > 0.044 and t_cpu_experts_max < 0.039
    p = _plan(1, 128)
    assert p.decode.policy == "cpu-experts"
    tpot = {c.policy: c.time_s for c in p.candidates if c.phase == "decode"}
    assert tpot["cpu-experts"] <= t_cpu_experts_max and tpot["gpu-offload"] >= t_offload_min
    assert tpot["cpu"] >= t_cpu_min and tpot["cpu-experts"] < tpot["cpu"]
    text = format_plan(p)
    assert "cpu-experts" in text and "cpu experts" in text  # the candidate line and the placement


def test_large_prefill_prefers_streaming_by_hand():
    """Batch 16 x 2048 tokens of prefill: the CPU would run 32768 tokens x 8 experts x 3 GEMMs of
    2048 x 768 per layer, 2.5 TFLOP per layer, at 144.2 TFLOP/s x 0.07 (the AMX default): 0.24 s per
    layer whose experts it computes. Streaming every layer instead moves 61 GB over PCIe 5 at
    64 GB/s x 0.8 (1.2 s for all 48), with the GPU's compute hidden under it. So cpu-experts' TTFT is at
    least (CPU layers) x 0.24 s, a streaming policy wins prefill, and decode stays cpu-experts."""
    spec = resolve_model(QWEN)
    flops_layer = 2 * 16 * 2048 * spec.experts_per_token * 3 * spec.hidden_size * spec.expert_intermediate_size
    assert flops_layer > 2.4e12
    p = _plan(16, 2048)
    ttft = {c.policy: c.time_s for c in p.candidates if c.phase == "prefill"}
    m_exp = next(c.gpu_layers for c in p.candidates if c.phase == "prefill" and c.policy == "cpu-experts")
    cpu_moe_layers = spec.num_layers - m_exp
    assert ttft["cpu-experts"] >= cpu_moe_layers * flops_layer / (144.2e12 * 0.07)
    assert p.prefill.policy in ("gpu-offload", "gpu-offload-partial")
    assert ttft[p.prefill.policy] < ttft["cpu-experts"]
    assert p.decode.policy == "cpu-experts"


def test_dense_model_is_refused_with_a_reason():
    p = flexplan.plan("meta-llama/Llama-2-7b-hf", "flexinfer-server2", batch_size=1, input_len=128, output_len=8)
    c = next(c for c in p.candidates if c.policy == "cpu-experts")
    assert not c.feasible and "dense" in c.reason
    with pytest.raises(flexplan.errors.DoesNotFitError, match="dense"):
        flexplan.plan("meta-llama/Llama-2-7b-hf", "flexinfer-server2", decode="cpu-experts", prefill="gpu")


def test_memory_model_moves_the_cpu_layers_experts_to_the_host():
    spec = resolve_model(QWEN)
    n = spec.num_layers
    shape = Shape(spec, 1, 128, 64, "bfloat16", "bfloat16")
    ms = np.array([0, 10, 47])
    vec = placement_memory(shape, None, {"decode": REGISTRY["cpu-experts"].placement(n, ms, "decode")})
    gpu_all = placement_memory(shape, None, {"decode": REGISTRY["gpu"].placement(n, n, "decode")})
    experts_layer = spec.num_experts * spec.expert_params * 2
    for j, m in enumerate(ms):
        one = placement_memory(shape, None, {"decode": REGISTRY["cpu-experts"].placement(n, int(m), "decode")})
        assert one.accelerator_bytes == vec.accelerator_bytes[j]
        moved = (n - m) * experts_layer
        assert one.accelerator_bytes == pytest.approx(gpu_all.accelerator_bytes - moved, abs=64 * n)
        assert one.host["CPU weights"] - gpu_all.host["CPU weights"] == pytest.approx(moved, abs=64 * n)
    # dense first layers (DeepSeek-V3's first 3) hold no experts: the mode costs them nothing
    ds = resolve_model("deepseek-ai/DeepSeek-V3")
    sh = Shape(ds, 1, 16, 4, "bfloat16", "bfloat16")
    three = placement_memory(sh, None, {"decode": REGISTRY["cpu-experts"].placement(ds.num_layers, ds.num_layers - 3, "decode")})
    res = placement_memory(sh, None, {"decode": REGISTRY["gpu"].placement(ds.num_layers, ds.num_layers, "decode")})
    assert three.accelerator_bytes == res.accelerator_bytes


def test_estimate_terms_follow_the_experts_read():
    """The CPU part grows with the distinct experts a step reads: E(1 - (1 - k/E)^b) per layer."""
    spec, hw = resolve_model(QWEN), get_hardware("flexinfer-server2")
    eff = DefaultEfficiency.for_hardware(hw)
    t = {}
    for b in (1, 8, 64):
        pc = phase_costs(Shape(spec, b, 128, 16, "bfloat16", "bfloat16"), hw, eff, "decode")
        e = spec.num_experts * (1 - (1 - spec.experts_per_token / spec.num_experts) ** b)
        assert pc.experts.distinct_experts == pytest.approx(e)
        t[b] = pc.experts.t_cpu_experts_s
        est = REGISTRY["cpu-experts"].estimate(pc, spec.num_layers, np.array([0, 24]))
        assert est.terms["cpu_experts_s"][0] == pytest.approx(spec.num_layers * t[b])
        assert est.terms["cpu_experts_s"][1] == pytest.approx(24 * t[b])
    assert t[1] < t[8] < t[64]


def test_forced_plan_places_split_layers():
    p = _plan(1, 128, prefill="cpu-experts", decode="cpu-experts", gpu_layers=20)
    pl = Placement.from_plan(p, 48)
    assert pl.expert_places(0) == frozenset({HOST}) and pl.layer_places(0) == frozenset({ACCELERATOR})
    assert pl.expert_places(47) == frozenset({ACCELERATOR}) and pl.experts_on_cpu(0, "decode")
    assert not pl.experts_on_cpu(47, "decode")
