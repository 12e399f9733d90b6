"""The cpu-experts policy (llama.cpp --n-cpu-moe, KTransformers): estimator, memory model, planner
picks worked out by hand, and (below) the executor, token-identical to transformers."""

from __future__ import annotations

import numpy as np
import pytest

import flexplan
from flexplan.estimator import DefaultEfficiency, REGISTRY, Shape, phase_costs
from flexplan.explain import format_plan
from flexplan.hardware import get_hardware
from flexplan.placement import ACCELERATOR, CPU_EXPERTS, HOST, ON_CPU, RESIDENT
from flexplan.planner import placement_memory
from flexplan.workload import resolve_model
from flexplan.estimator.policies import placement_of

GIB = 1 << 30
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
    # decode keeps the routed experts on the CPU: cpu-experts, or split-points (issue 15 item 2), whose
    # pair with a streaming prefill moves no KV at the switch, with the MoE block on the CPU
    assert p.decode.policy == "cpu-experts" or (p.decode.policy == "split-points"
                                                and "mlp" in p.decode.split_points.on_cpu)


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
    p = _plan(1, 128, prefill="cpu-experts", decode="cpu-experts", gpu_layers=10)
    pl = placement_of(p, 48)
    assert pl.expert_places(0) == frozenset({HOST}) and pl.layer_places(0) == frozenset({ACCELERATOR})
    assert pl.expert_places(47) == frozenset({ACCELERATOR}) and pl.experts_on_cpu(0, "decode")
    assert not pl.experts_on_cpu(47, "decode")


# ---- the executor, on the CPU stand-in ------------------------------------------------------

import torch  # noqa: E402

import flexplan.api as api  # noqa: E402
from flexplan.executor.link import D2H, H2D  # noqa: E402
from flexplan.executor.plans import fixed_plan  # noqa: E402
from flexplan.estimator.policies import POLICIES  # noqa: E402
from flexplan.workload.model import ModelSpec  # noqa: E402

from conftest import left_padded_batch  # noqa: E402

NEW = 6
PAIRS = [("cpu-experts", p) for p in POLICIES] + [(p, "cpu-experts") for p in POLICIES if p != "cpu-experts"]


def _run(fresh, family, prefill, decode, gpu_layers, **kw):
    model, ref = fresh(family)
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    plan = fixed_plan(model.config, prefill, decode, gpu_layers, batch_size=3, input_len=9, output_len=NEW,
                      gpu_memory_bytes=GIB, **kw)
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return lm, out, expected


def _cases():
    """Every MoE family x pair; the default run keeps four pairs a family, in turn (every pair comes up)."""
    for k, family in enumerate(["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"]):
        fast = {PAIRS[(4 * k + j) % len(PAIRS)] for j in range(4)}
        for prefill, decode in PAIRS:
            yield pytest.param(prefill, decode, family, id=f"{prefill}-{decode}-{family}",
                               marks=() if (prefill, decode) in fast else pytest.mark.slow)


@pytest.mark.parametrize("prefill,decode,family", list(_cases()))
def test_cpu_experts_token_identical(fresh, family, prefill, decode):
    """Every pair with cpu-experts in one phase, batched and left-padded, every MoE layer's experts
    on the CPU (M = 0; DeepSeek's dense first layer stays resident): transformers' tokens; the CPU
    expert path ran once per step of each cpu-experts phase in each MoE layer, on that phase's rows;
    and the memory model, from the config alone, sizes what the executor allocated."""
    lm, out, expected = _run(fresh, family, prefill, decode, 0)
    assert torch.equal(out, expected)
    ex = lm.executor
    steps = {"prefill": (1, 3 * 9), "decode": (NEW - 1, 3 * (NEW - 1))}
    calls = [sum(steps[ph][j] for ph, pol in (("prefill", prefill), ("decode", decode)) if pol == "cpu-experts")
             for j in (0, 1)]
    moe = [m for m in ex.expert_modules if m is not None]
    assert len(moe) == sum(ex.spec.moe_layers) > 0
    assert all((place.calls, place.rows) == tuple(calls) for _, place in moe)
    spec = ModelSpec.from_config(lm.executor.model.config)
    n = spec.num_layers
    phases = {ph: REGISTRY[c.policy].placement(n, c.gpu_layers, ph) for ph, c in lm.plan.phases.items()}
    need = placement_memory(Shape(spec, 3, 9, NEW, "float32", "float32"), None, phases,
                            ex.backend.linear_kernel if ex.backend.packs_weights else None)
    assert all(need.allocated(w) == ex.link.live_bytes(w) for w in ("accelerator", "pinned", "host"))


def test_cpu_experts_beside_resident_layers_and_their_traffic(fresh):
    """M = 1 of Mixtral's 2 layers: layer 0's experts on the CPU, layer 1 resident. A decode step
    sends layer 0's hidden states (3 x 64 fp32) and routing (3 x 2 ids and weights) to the host and the
    experts' output back, and nothing of layer 1; the accelerator holds layer 0 without its experts."""
    lm, out, expected = _run(fresh, "mixtral", "cpu-experts", "cpu-experts", 1)
    assert torch.equal(out, expected)
    ex = lm.executor
    assert [m[1].calls for m in ex.expert_modules] == [NEW, 0]
    link = ex.link
    step = max(t.step for t in link.transfers)
    ins = [t for t in link.transfers if t.kind == "expert inputs" and t.step == step]
    outs = [t for t in link.transfers if t.kind == "expert outputs" and t.step == step]
    assert {t.layer for t in ins + outs} == {0}
    assert sorted(t.nbytes for t in ins) == sorted([3 * 64 * 4, 3 * 2 * 8, 3 * 2 * 4])
    assert all(t.direction == D2H for t in ins) and [(t.direction, t.nbytes) for t in outs] == [(H2D, 3 * 64 * 4)]
    g = ex.layers[0]
    assert set(g.storages) == {"accelerator", "host"}
    assert g.storages["host"].part == "experts" and g.storages["accelerator"].part == "rest"
    assert not any(n in g.storages["accelerator"].views for n in g.experts)
    assert ex.layers[1].storages["accelerator"].part == "all"


@pytest.mark.parametrize("prefill,decode", [("gpu-offload", "cpu-experts"), ("cpu-experts", "splitgen")])
def test_bf16_accelerator_fp32_cpu_experts(fresh, prefill, decode):
    """bf16 accelerator, fp32 CPU: the CPU's experts are held and computed in float32, the rest in
    bf16; logits stay within bf16 error of transformers' fp32 ones."""
    model, ref = fresh("qwen3_moe")
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    expected = ref.generate(**kw)
    plan = fixed_plan(model.config, prefill, decode, 1, dtype="bfloat16", cpu_dtype="float32", batch_size=3,
                      input_len=9, output_len=3)
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(**kw)
    for a, b in zip(out.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    g = lm.executor.layers[0]
    host = next(st for st in g.storages.values() if st.part == "experts" or st.place == "host")
    assert all(host.views[n].dtype == torch.float32 for n in g.experts)


def test_routed_experts_forward_is_one_gemm_per_selected_expert(monkeypatch):
    """The grouped CPU path runs a GEMM only for experts some token picked (never the others) and
    equals transformers' eager experts bit for bit."""
    import torch.nn.functional as F
    import transformers

    from flexplan.executor import cpu_experts

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_local_experts=16, num_experts_per_tok=2,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=50)
    experts = transformers.models.mixtral.modeling_mixtral.MixtralExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_()
    x = torch.randn(5, 32)
    idx = torch.tensor([[3, 7], [7, 3], [12, 3], [3, 12], [7, 12]])
    w = torch.rand(5, 2)
    seen = []
    real = F.linear
    monkeypatch.setattr(cpu_experts.F, "linear", lambda a, b, bias=None: seen.append(a.shape[0]) or real(a, b, bias))
    got = cpu_experts.routed_experts_forward(experts, x, idx, w)
    monkeypatch.setattr(cpu_experts.F, "linear", real)
    assert seen == [4, 4, 3, 3, 3, 3]  # experts 3 (4 rows), 7 (3 rows), 12 (3 rows): gate_up, then down
    assert torch.equal(got, type(experts).forward.__wrapped__(experts, x, idx, w))


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_cpu_experts_run_on_the_native_blocked_gemv(fresh, family, monkeypatch):
    """Where the native kernel builds, the CPU's float32 copy of the experts (plain and transposed
    layouts) is blocked in place (the same bytes) and the selected experts' projections are grouped
    blocked GEMVs: two native calls per (layer, step), over every routed (token, choice) row (one
    fused call with the activation for Mixtral's default SiLU gate); the tokens stay transformers'."""
    from flexplan.executor import native

    if not native.available():
        pytest.skip(native.status()[1])
    native.decode_status()  # loaded (and self-checked) before the counting starts
    rows, fused_rows = [], []
    real, real_fused = native.NativeGemv.grouped_gemv, native.NativeDecode.moe_silu
    monkeypatch.setattr(native.NativeGemv, "grouped_gemv",
                        lambda self, w, e, r, x, b: rows.append(x.shape[0]) or real(self, w, e, r, x, b))
    monkeypatch.setattr(native.NativeDecode, "moe_silu",  # one call: both projections
                        lambda self, *a: fused_rows.extend([a[4].numel()] * 2) or real_fused(self, *a))
    lm, out, expected = _run(fresh, family, "gpu", "cpu-experts", 0)
    assert torch.equal(out, expected)
    fused = native.decode_status()[0] is not None and family == "mixtral"  # gpt-oss gates its own way
    assert (bool(fused_rows), bool(rows)) == (fused, not fused)
    rows = rows or fused_rows
    g = lm.executor.layers[0]
    assert set(g.blocked_experts) and all(g.storages["host"].views[n].dim() == 4 for n in g.blocked_experts)
    lm.executor._bind_layer(0, "decode")
    assert all(g.param_tensor(n).dim() == 4 for n in g.blocked_experts)  # decode binds the blocked copy
    layers = len([m for m in lm.executor.expert_modules if m])
    assert len(rows) == 2 * (NEW - 1) * layers  # batch 3, top-2: 6 rows per call
    assert sum(rows) == 2 * 2 * 3 * (NEW - 1) * layers
    dense = g.dense(next(iter(g.blocked_experts)), g.storages["host"].views[next(iter(g.blocked_experts))])
    assert dense.dim() == 3  # reordered back exactly for a re-placement


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_grouped_expert_calls_equal_one_call_per_expert(weight_dtype):
    """All selected experts of a projection in one native call, routed and scattered natively, give
    the per-expert calls' result bit for bit, with experts picked by many tokens, by one, twice by
    one token, routing sentinels (-1, E) that select no expert, 16-bit routing weights, and enough
    rows that the scatter shares its columns among threads."""
    import transformers

    from flexplan.executor import cpu_experts, native

    if not native.available():
        pytest.skip(native.status()[1])
    cfg = transformers.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    g = torch.Generator().manual_seed(0)
    m = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    with torch.no_grad():
        for name, transposed in cpu_experts.blockable_experts(m).items():
            dense = (torch.randn(m._parameters[name].shape, generator=g) * 0.05).to(weight_dtype)
            m._parameters[name] = torch.nn.Parameter(cpu_experts.block_experts_into(
                dense, transposed, torch.empty(dense.numel(), dtype=weight_dtype)), requires_grad=False)
    for b, w_dtype in ((1, torch.float32), (5, torch.float32), (33, torch.bfloat16), (700, torch.float32)):
        x = torch.randn(b, 128, generator=g)
        idx = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(b)])
        if b > 1:
            idx[0, 1], idx[-1, 2] = -1, 16
            idx[1, 3] = idx[1, 0]
        w = torch.rand(b, 4, generator=g).to(w_dtype)
        with torch.no_grad():
            grouped = cpu_experts.routed_experts_forward(m, x, idx, w, fused=False)
            per_expert = cpu_experts.routed_experts_forward(m, x, idx, w, grouped=False)
            fused = cpu_experts.routed_experts_forward(m, x, idx, w)
        assert torch.equal(grouped, per_expert), b
        # the fused call: the same routing, GEMVs and scatter, SiLU by native_decode.c's exp
        assert ((fused - per_expert).abs().max() / per_expert.abs().max()).item() < 1e-5, b
    with torch.no_grad():  # nothing routed: zeros, not an allocation error
        none = cpu_experts.routed_experts_forward(m, torch.randn(0, 128), torch.zeros(0, 4, dtype=torch.long),
                                                  torch.zeros(0, 4))
    assert none.shape == (0, 128)


def test_fused_expert_call_only_for_the_default_silu_gate():
    """The one-call path takes transformers' default gate with SiLU (Mixtral, Qwen3-MoE) and nothing
    else: not gpt-oss's own gate, not another activation, not a norm after the experts."""
    import transformers

    from flexplan.executor import cpu_experts

    def experts(cls, cfg):
        return cls(cfg)

    mixtral = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_local_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=50)
    m = experts(transformers.models.mixtral.modeling_mixtral.MixtralExperts, mixtral)
    assert cpu_experts.default_silu_gate(m)
    m.act_fn = transformers.activations.ACT2FN["gelu"]
    assert not cpu_experts.default_silu_gate(m)
    m = experts(transformers.models.mixtral.modeling_mixtral.MixtralExperts, mixtral)
    m.has_post_expert_norm = True
    assert not cpu_experts.default_silu_gate(m)
    oss = transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    vocab_size=50)
    assert not cpu_experts.default_silu_gate(experts(transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts, oss))


def test_replacing_moves_experts_between_split_and_whole_layers(fresh):
    """Re-placing a loaded model between split and whole-layer placements reads each tensor back
    from wherever it lives (blocked expert copies reordered back exactly): tokens stay transformers'
    and the memory model still equals what is allocated."""
    model, ref = fresh("gpt_oss")
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)

    def plan(p, d, m):
        return fixed_plan(model.config, p, d, m, batch_size=3, input_len=9, output_len=NEW, gpu_memory_bytes=GIB)

    lm = api.load(model, plan=plan("cpu-experts", "cpu-experts", 0), accelerator="cpu", gpu_memory_bytes=GIB)
    for p in (plan("gpu-offload", "cpu", 0), plan("gpu", "cpu-experts", 1), plan("cpu", "cpu", 0),
              plan("splitgen", "cpu-experts", 0), plan("gpu", "gpu", 2)):
        lm.executor.place(p)
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, expected), (p.prefill.policy, p.decode.policy)
        ex = lm.executor
        need = ex.memory_need(ex.placement, 3, 9 + NEW, 9)
        assert all(need.allocated(w) == ex.link.live_bytes(w) for w in ("accelerator", "pinned", "host"))


def test_validate_cpu_experts_compares_prediction_and_measurement(fresh):
    """flexplan.validate_experts runs the CPU expert path on the model's expert shape and sets the
    estimator's term beside it, per batch, with the MAPE; a dense model is refused."""
    from flexplan.validate_experts import validate_cpu_experts

    model, _ = fresh("qwen3_moe")
    out = validate_cpu_experts(model.config, batches=(1, 4), repeats=2, hardware="flexinfer-server2")
    assert [r["batch"] for r in out["rows"]] == [1, 4]
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in out["rows"])
    assert out["rows"][0]["distinct_experts"] == pytest.approx(2.0)  # k = 2 of 4 at batch 1
    assert out["rows"][1]["predicted_s"] > out["rows"][0]["predicted_s"]
    errors = [r["error_pct"] for r in out["rows"]]
    assert all(e >= 0 for e in errors) and min(errors) <= out["mape_pct"] <= max(errors)  # the batches' mean
    with pytest.raises(flexplan.errors.InvalidInputError, match="dense"):
        validate_cpu_experts("meta-llama/Llama-2-7b-hf", batches=(1,))


def test_reason_says_when_a_faster_phase_lost_end_to_end():
    """Batch 1: cpu-experts has the lower TTFT but its prefill must first load ~23 GB onto the GPU;
    the CPU's prefill overlaps that load, so cpu wins prefill end to end, and the reason says so
    rather than calling the two a tie."""
    p = _plan(1, 128)
    ttft = {c.policy: c.time_s for c in p.candidates if c.phase == "prefill"}
    assert p.prefill.policy == "cpu" and ttft["cpu-experts"] < 0.99 * ttft["cpu"]
    assert "cpu wins end to end although cpu-experts has a lower TTFT" in p.reason


def test_switch_loads_the_experts_prefill_kept_on_the_host():
    """Prefill cpu-experts then decode gpu (both resident): the switch loads the CPU layers' routed
    experts onto the GPU; the reverse pair moves no weights (the host copy is kept)."""
    from flexplan.planner import switch_s

    spec, hw = resolve_model("mistralai/Mixtral-8x7B-v0.1"), get_hardware("flexinfer-server2")
    shape = Shape(spec, 1, 16, 8, "bfloat16", "bfloat16")
    eff = DefaultEfficiency.for_hardware(hw)
    n = spec.num_layers
    there = switch_s(shape, hw, "cpu-experts", 0, "gpu", n, 0.0, eff=eff)
    back = switch_s(shape, hw, "gpu", n, "cpu-experts", 0, 0.0, eff=eff)
    experts = n * spec.num_experts * spec.expert_params * 2
    assert there == pytest.approx(experts / (64e9 * 0.8), rel=1e-6) and back == 0.0
