"""Split points inside a streamed layer (``split-points``, issue 15 item 2; Park & Egger 3.1-4.2):
the search against a brute-force loop and a hand-worked case, the operator list against the
workload model, the planner's picks, explain, the plan's JSON, the executor on the CPU stand-in."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import numpy as np
import pytest

import flexplan
from flexplan.errors import DoesNotFitError, FlexplanError, InvalidInputError
from flexplan.estimator import REGISTRY
from flexplan.estimator.operator_terms import OperatorCosts
from flexplan.estimator.policies.split_points import (
    eq5_layer_s, eq6_cpu_s, eq7_h2d_s, eq13_candidates, eq14_h2d_s, search)
from flexplan.hardware import get_hardware
from flexplan.plan_types import Plan, SplitPoints
from flexplan.workload import resolve_model
from flexplan.workload.operators import layer_operators

SERVER = "flexinfer-server2"


def _costs(C, G, H, IN=None, OUT=None, shares=None, glue=0.0, overhead=0.0, kv=None, D=None):
    C, G, H = (np.atleast_2d(np.asarray(x, dtype=float)) for x in (C, G, H))
    n = C.shape[1]
    zeros = np.zeros_like(C)
    return OperatorCosts(
        names=tuple(f"op{k}" for k in range(n)), cpu_s=C, gpu_s=G, h2d_s=H,
        dequant_s=zeros if D is None else np.atleast_2d(np.asarray(D, dtype=float)), in_h2d_s=zeros if IN is None else np.atleast_2d(IN), out_d2h_s=zeros if OUT is None else np.atleast_2d(OUT),
        shares_input=np.zeros(n, bool) if shares is None else np.asarray(shares), weight_bytes=np.ones(n),
        kv_bytes=np.zeros(C.shape[0]) if kv is None else np.asarray(kv, float), in_bytes=np.ones(n),
        out_bytes=np.ones(n), attention_index=0, cpu_glue_s=glue, gpu_overhead_s=overhead)


# ---- the search ------------------------------------------------------------------------------
def test_eq13_counts_every_pair_once():
    for n in range(2, 12):
        i, j = eq13_candidates(n)
        assert len(i) == n * (n - 1) // 2 == (n - 1) + (n - 1) * (n - 2) // 2
        assert len(set(zip(i.tolist(), j.tolist()))) == len(i) and (i >= 1).all() and (i < j).all() and (j <= n).all()


def test_hand_worked_four_operators():
    """C = [1, 3, 1, 2], H = [4, 1, 6, 1] (G, activations, glue 0). Eq. 6 and 7 per pair:
    (1,2): CPU 1+1+2 = 4, H2D 1 -> 4;  (1,3): 3, 7 -> 7;  (1,4): 1, 8 -> 8;
    (2,3): 4+2 = 6, 6 -> 6;  (2,4): 4, 7 -> 7;  (3,4): 5, 1 -> 5.
    Two split points win: the CPU computes operators 0, 2 and 3, the accelerator operator 1.
    With 10 streamed layers: 10 x 4 + the fill min(4, 1) = 41."""
    oc = _costs([1, 3, 1, 2], [0, 0, 0, 0], [4, 1, 6, 1])
    i, j = eq13_candidates(4)
    L, _, _ = eq5_layer_s(oc, 1.0, i, j)
    assert dict(zip(zip(i.tolist(), j.tolist()), L[0].tolist())) == {
        (1, 2): 4, (1, 3): 7, (1, 4): 8, (2, 3): 6, (2, 4): 7, (3, 4): 5}
    best, t, (bi, bj) = search(oc, 1.0, np.array([10]))
    assert (bi[best[0]], bj[best[0]]) == (1, 2) and t[0] == 41
    # links ten times slower and a cheaper last transfer, H = [40, 10, 60, 5]: (1,2) CPU 4, H2D 10 -> 10;
    # (3,4) CPU 1+3+1 = 5, H2D 5 -> 5 (the others >= 60): one split point, the CPU takes all but the last
    slow_link = _costs([1, 3, 1, 2], [0, 0, 0, 0], [40, 10, 60, 5])
    best, t, (bi, bj) = search(slow_link, 1.0, np.array([1]))
    assert (bi[best[0]], bj[best[0]]) == (3, 4) and t[0] == 5 + 5
    # the CPU slowed by 3 while the copy runs (Park & Egger 4.1): per layer (3,4) costs 15, (1,2) 12,
    # (2,3) 60: over 100 layers (the fill, min(chain, link), aside) (1,2) wins
    best, t, (bi, bj) = search(slow_link, 3.0, np.array([100]))
    assert (bi[best[0]], bj[best[0]]) == (1, 2) and t[0] == 100 * 12 + 10


def test_the_accelerator_segment_runs_in_the_open():
    """Two operators, C = [2, 2], G = [0.5, 0.5], H = [4, 4], IN = OUT = 0.1, the one pair (1, 2):
    the next layer's copy (4) runs beside the CPU's operator (2); the accelerator's segment (input
    0.1, compute 0.5, output 0.1) waits for the copy engine, in order: 4 + 0.7 = 4.7 (Park & Egger's
    overlap, max(2 + 0.7, 4 + 0.1), gave 4.1)."""
    oc = _costs([2, 2], [0.5, 0.5], [4, 4], [0.1, 0.1], [0.1, 0.1])
    L, cpu, link = eq5_layer_s(oc, 1.0, np.array([1]), np.array([2]))
    assert L[0, 0] == pytest.approx(4.7) and cpu[0, 0] == 2 and link[0, 0] == 4


def test_search_equals_brute_force_loop():
    """Random C, G, H, IN, OUT over 3 steps, shared inputs, glue and overheads: the vectorised search
    picks what a Python loop over (i, j) writing Eq. 5-7 out picks, for every number of streamed layers:
    Eq. 5 as the executor orders it, max(P (CPU + glue), H2D) + IN + G + OUT + overhead."""
    rng = np.random.default_rng(7)
    for trial in range(30):
        n, steps = int(rng.integers(2, 10)), int(rng.integers(1, 4))
        C, G, H, IN, OUT = (rng.random((steps, n)) * s for s in (5, 0.5, 5, 0.3, 0.3))
        shares = rng.random(n) < 0.3
        shares[0] = False
        u, glue, ovh = 1 + rng.random(), rng.random() * 0.2, rng.random() * 0.1
        oc = _costs(C, G, H, IN, OUT, shares, glue, ovh)
        streamed = np.arange(0, 6)
        best, t, (ci, cj) = search(oc, u, streamed)
        for s in streamed:
            loop = {}
            for i in range(1, n):
                for j in range(i + 1, n + 1):
                    per_step, fills = [], []
                    for st in range(steps):
                        cpu = sum(C[st, :i]) + sum(C[st, j:])
                        h2d = sum(H[st, i:j])
                        act_in = sum(IN[st, k] for k in range(i, j) if k == i or not shares[k])
                        act_out = sum(OUT[st, i:j])
                        # the next layer's copy beside the CPU's part; the accelerator's segment in the open
                        segment = act_in + sum(G[st, i:j]) + act_out + ovh
                        per_step.append(max(u * (cpu + glue), h2d) + segment)
                        fills.append(min(u * (cpu + glue), h2d))
                    loop[(i, j)] = s * np.mean(per_step) + (np.mean(fills) if s > 0 else 0.0)
            want = min(loop.values())
            assert t[s] == pytest.approx(want, rel=1e-12, abs=1e-12)
            assert loop[(int(ci[best[s]]), int(cj[best[s]]))] == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_eq6_eq7_eq14_by_hand():
    C, H, G = np.array([[1.0, 2, 3, 4]]), np.array([[10.0, 20, 30, 40]]), np.array([[0.1, 0.2, 0.3, 0.4]])
    i, j = np.array([1, 2]), np.array([3, 4])
    assert eq6_cpu_s(C, i, j).tolist() == [[1 + 4, 1 + 2]]
    assert eq7_h2d_s(H, i, j).tolist() == [[20 + 30, 30 + 40]]
    assert eq14_h2d_s(H, G, [5.0], i, j, batches=1).tolist() == eq7_h2d_s(H, i, j).tolist()
    assert eq14_h2d_s(H, G, [5.0], i, j, batches=3)[0] == pytest.approx([50 + 2 * (0.5 + 5), 70 + 2 * (0.7 + 5)])


# ---- operators from the workload model ------------------------------------------------------
@pytest.mark.parametrize("model", ["meta-llama/Llama-2-7b-hf", "meta-llama/Llama-3.1-70B", "Qwen/Qwen3-8B",
                                   "mistralai/Mixtral-8x7B-v0.1", "Qwen/Qwen3-30B-A3B"])
def test_operators_sum_to_the_layer(model):
    """The operators' weights are the layer's parameters less its norms (and QK-norms), and a dense
    layer's FLOPs per token are 2 x its linear weights (costs.c_decode's GEMM part)."""
    m = resolve_model(model)
    ops = layer_operators(m)
    qk_norm = {"": 0, "head": 2 * m.head_dim, "full": (m.num_heads + m.num_kv_heads) * m.head_dim}[m.qk_norm]
    assert sum(o.weight_params for o in ops) == pytest.approx(m.params_per_layer - m.layer_norm_params - qk_norm)
    assert [o.name for o in ops][:5] == ["q_proj", "k_proj", "v_proj", "attention", "o_proj"]
    if not m.is_moe:
        assert sum(o.flops_per_row for o in ops) == 2 * m.linear_weight_params_per_layer
        assert [o.name for o in ops][5:] == ["gate_proj", "up_proj", "down_proj"]
    else:
        assert [o.name for o in ops][5:] == ["mlp"]
        assert sum(o.flops_per_row for o in ops) == pytest.approx(2 * m.linear_weight_params_per_layer)


# ---- the planner --------------------------------------------------------------------------------
def test_prefill_residual_of_real_layers_follows_the_operators_on_the_cpu(tmp_path):
    """What calibrated layers take beyond the factors as tokens grow is spread over the operators but
    the attention core in proportion to their CPU time, and only the one-token overhead is per-layer
    glue: all operators on the CPU cost the layer's factors plus its overhead at those tokens (the cpu
    policy's layer), and each operator's share is the same."""
    from dataclasses import dataclass as _dc

    from flexplan.estimator.operator_terms import operator_costs
    from flexplan.estimator.terms import Shape
    from flexplan.workload import costs
    from synthetic_machine import HW_GPU, SyntheticMachine
    from test_calibration_properties import calibrated

    machine = SyntheticMachine(bytes_per_s=40e9, kv_bytes_per_s=20e9, flops_per_s={"float32": 500e9, "bfloat16": 500e9},
                               op_s=5e-6, layer_s=500e-6, step_s=1e-3, logit_s=1e-10, noise=0.1, seed=0,
                               token_hidden_s=2e-9)
    eff = calibrated(machine, "full", HW_GPU, tmp_path)
    spec = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")

    @_dc(frozen=True)
    class OneTokenOverhead:  # eff with its overhead held at one token: the bare factors' C
        base: object

        def cpu_layer_overhead_s(self, tokens=1, dtype=None, layer_bytes=None):
            return self.base.cpu_layer_overhead_s(1, dtype, layer_bytes)

        def __getattr__(self, name):
            return getattr(self.base, name)

    for b, i in ((1, 128), (4, 512)):
        shape = Shape(spec, b, i, 4, "bfloat16", "float32")
        oc, bare = operator_costs(shape, HW_GPU, eff, "prefill"), operator_costs(shape, HW_GPU, OneTokenOverhead(eff), "prefill")
        layer_bytes = float(costs.d_weights(spec, shape.w_bytes))
        assert oc.cpu_glue_s == pytest.approx(eff.cpu_layer_overhead_s(1, "float32", layer_bytes))
        whole = bare.cpu_s.sum() + eff.cpu_layer_overhead_s(b * i, "float32", layer_bytes)
        assert oc.cpu_s.sum() + oc.cpu_glue_s == pytest.approx(whole)
        assert oc.cpu_s[0, oc.attention_index] == bare.cpu_s[0, oc.attention_index]  # its time grows with context
        share = np.delete(oc.cpu_s[0] / bare.cpu_s[0], oc.attention_index)
        per_token_s = eff.cpu_layer_overhead_s(b * i, "float32", layer_bytes) - oc.cpu_glue_s
        assert np.allclose(share, share[0]) and share[0] == pytest.approx(
            1.0 + per_token_s / np.delete(bare.cpu_s[0], oc.attention_index).sum())
        if b * i == 2048:  # a narrow layer's per-token work leaves a residual above one token's at 2048 tokens
            assert per_token_s > 0 and share[0] > 1.0


def test_split_layers_cpu_linears_are_priced_at_their_own_kernel(tmp_path):
    """A split layer's CPU Linears run on dense weights (split_layer.cpu_operator_linear), not on
    the packed layout the GEMV/GEMM factors describe: calibration times both in turn
    (``cpu_split_linear``) and the estimator scales those operators' C by the ratio at their rows,
    interpolated between measured rows; the attention core and the glue are not scaled; a file
    without those rows prices them as the packed kernel."""
    from flexplan.estimator.operator_terms import operator_costs
    from flexplan.estimator.terms import Shape
    from flexplan.workload.operators import LINEAR
    from synthetic_machine import HW_GPU, SyntheticMachine
    from test_calibration_properties import calibrated

    machine = SyntheticMachine(bytes_per_s=40e9, kv_bytes_per_s=20e9, flops_per_s={"float32": 500e9, "bfloat16": 500e9},
                               op_s=5e-6, layer_s=500e-6, step_s=1e-3, logit_s=1e-10)
    ratio = {1: 1.0, 4: 1.2, 16: 1.6, 256: 1.25}
    rows = [{"dtype": "float32", "tokens": t, "k": 2048, "n": 5632, "time_s": 1e-3 * r, "reference_time_s": 1e-3}
            for t, r in ratio.items()]
    plain = calibrated(machine, "full", HW_GPU, tmp_path / "plain")
    split = calibrated(machine, "full", HW_GPU, tmp_path / "split", {"cpu_split_linear": rows})
    assert plain.cpu_split_linear(8, "float32") == 1.0
    assert split.cpu_split_linear(4, "float32") == pytest.approx(1.2)
    assert 1.2 < split.cpu_split_linear(8, "float32") < 1.6  # between measured rows
    assert split.cpu_split_linear(4096, "float32") == pytest.approx(1.25)  # held beyond the ends
    spec = resolve_model("meta-llama/Meta-Llama-3-8B")
    linear = np.array([o.kind == LINEAR for o in layer_operators(spec)])
    for phase, b, i in (("decode", 4, 512), ("decode", 16, 512), ("prefill", 1, 256)):
        shape = Shape(spec, b, i, 4, "float32", "float32")
        base, scaled = (operator_costs(shape, HW_GPU, e, phase) for e in (plain, split))
        rows_ = b if phase == "decode" else b * i
        want = base.cpu_s[:, linear] * ratio[rows_]
        # the per-token residual of real layers is spread in proportion to C: compare without it
        assert scaled.cpu_glue_s == base.cpu_glue_s
        assert np.array_equal(scaled.cpu_s[:, ~linear], base.cpu_s[:, ~linear])
        assert np.allclose(scaled.cpu_s[:, linear], want, rtol=0.05), (phase, b, i)


def _cand(plan, phase, policy):
    return next(c for c in plan.candidates if c.phase == phase and c.policy == policy)


def test_planner_splits_where_transfers_dominate():
    """Llama-2-70B, batch 16, 2048 + 256 on an H100 PCIe beside a Sapphire Rapids host: a decode
    step streams 1.7 GB of weights per layer while the CPU can compute the MLP in less than the
    attention weights take to cross: the split beats streaming (and FlexGen's plan) and is chosen."""
    p = flexplan.plan("meta-llama/Llama-2-70b-hf", SERVER, batch_size=16, input_len=2048, output_len=256)
    assert p.decode.policy == "split-points"
    sp = p.decode.split_points
    assert sp is not None and sp.on_cpu and sp.on_accelerator and sp.candidates == 28
    assert _cand(p, "decode", "split-points").time_s < 0.5 * _cand(p, "decode", "gpu-offload-partial").time_s
    assert sp.layer_s == pytest.approx(max(sp.cpu_s, sp.h2d_s), rel=0.2)  # balanced: neither side idles long


def test_planner_does_not_split_when_the_cpu_is_far_slower():
    hw = get_hardware(SERVER)
    slow_cpu = replace(hw.cpu, memory_bandwidth_bytes_per_s=hw.cpu.memory_bandwidth_bytes_per_s / 200,
                       peak_flops_per_s={k: v / 200 for k, v in hw.cpu.peak_flops_per_s.items()})
    hw_slow = replace(hw, cpu=slow_cpu)
    p = flexplan.plan("meta-llama/Llama-2-70b-hf", hw_slow, batch_size=16, input_len=2048, output_len=256)
    assert p.decode.policy != "split-points" and p.decode.split_points is None
    assert _cand(p, "decode", "split-points").time_s > _cand(p, "decode", "gpu-offload-partial").time_s


def test_refused_where_it_cannot_run():
    """Flexplan errors, no stack trace: an MLA model (its attention is not q/k/v/o), a machine
    without an accelerator, a hand-made plan that names no split points."""
    with pytest.raises(DoesNotFitError, match="cannot cut its layers into operators"):
        flexplan.plan("deepseek-ai/DeepSeek-V3", SERVER, batch_size=1, input_len=128, output_len=8,
                      decode="split-points", cpu_memory_bytes=4 << 40)
    from flexplan.hardware.spec import Hardware
    hw = get_hardware(SERVER)
    p = flexplan.plan("meta-llama/Llama-2-7b-hf", Hardware("cpu only", hw.cpu, None, None), batch_size=4,
                      input_len=512, output_len=16)
    assert not _cand(p, "decode", "split-points").feasible and "no GPU" in _cand(p, "decode", "split-points").reason
    with pytest.raises(ValueError):
        SplitPoints(("a", "b", "c"), (0, 2), 0, 0, 0)


# ---- explain and the plan's JSON ----------------------------------------------------------------
def test_plan_json_round_trip_keeps_the_split():
    p = flexplan.plan("meta-llama/Llama-2-70b-hf", SERVER, batch_size=16, input_len=2048, output_len=256)
    q = Plan.from_dict(json.loads(p.to_json()))
    assert q == p and q.decode.split_points == p.decode.split_points
    d = json.loads(p.to_json())["decode"]["split_points"]
    assert d["points"] == list(p.decode.split_points.points) and d["on_cpu"] == list(p.decode.split_points.on_cpu)


def test_explain_shows_split_points_and_timeline(capsys):
    from flexplan.cli import main
    from flexplan.explain import format_plan

    p = flexplan.plan("meta-llama/Llama-2-70b-hf", SERVER, batch_size=16, input_len=2048, output_len=256)
    text = format_plan(p)
    i, j = p.decode.split_points.points
    assert f"decode split points ({i}, {j}) of 8 operators (28 pairs searched, Eq. 13)" in text
    for name, lane, *_ in p.decode.split_points.timeline:
        assert any(name in line and lane in line for line in text.splitlines())
    assert main(["explain", "--hw", SERVER, "Qwen/Qwen3-30B-A3B", "--gpu-memory", "24", "-b", "16", "-i", "2048",
                 "-o", "256", "--decode", "split-points", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["decode"]["split_points"]
    assert d["operators"] == ["q_proj", "k_proj", "v_proj", "attention", "o_proj", "mlp"]
    lanes = {e["lane"] for e in d["timeline"]}
    assert {"cpu", "h2d"} <= lanes and all(e["end_s"] >= e["start_s"] >= 0 for e in d["timeline"])
    cpu_ops = [e["operator"] for e in d["timeline"] if e["lane"] == "cpu"]
    assert set(d["on_cpu"]) <= set(cpu_ops)


# ---- the executor on the CPU stand-in ----------------------------------------------------------
NEW = 6
DENSE = ("llama", "mistral", "qwen2", "opt", "llama3", "qwen3", "mistral_sw")
MOE = ("qwen3_moe", "mixtral")


def _generate(fresh, family, plan_or_pair, gpu_layers=1):
    import torch

    import flexplan.api as api
    from conftest import left_padded_batch
    from flexplan.executor.plans import fixed_plan

    model, ref = fresh(family)
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    plan = plan_or_pair(model) if callable(plan_or_pair) else fixed_plan(
        model.config, *plan_or_pair, gpu_layers, batch_size=3, input_len=9, output_len=NEW, gpu_memory_bytes=1 << 30)
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=1 << 30)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    return lm


def _pairs():
    others = [p for p in REGISTRY if p != "split-points"]
    return [("split-points", "split-points")] + [pair for o in others
                                                 for pair in (("split-points", o), (o, "split-points"))]


def _pair_cases():
    """Every family x pair; the default run keeps two pairs a family, in turn (every pair comes up)."""
    pairs = _pairs()
    for k, family in enumerate(DENSE + MOE):
        fast = {pairs[(2 * k + j) % len(pairs)] for j in (0, 1)}
        for prefill, decode in pairs:
            yield pytest.param(prefill, decode, family, id=f"{prefill}-{decode}-{family}",
                               marks=() if (prefill, decode) in fast else pytest.mark.slow)


@pytest.mark.parametrize("prefill,decode,family", list(_pair_cases()))
def test_token_identical_with_every_policy(fresh, family, prefill, decode):
    """Batched, left-padded; every pair with split-points in one phase or both (the default split of a
    hand-made plan: the CPU computes the first and the last operator)."""
    lm = _generate(fresh, family, (prefill, decode))
    assert "not the plan's split-point operators" not in lm.executor.cpu_decode_ops  # really cut, not streamed


@pytest.mark.parametrize("family", ["llama3", pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_every_split_is_token_identical_and_moves_only_its_operators(fresh, family):
    """Every (i, j) of Eq. 13 in decode: the same tokens; each decode step copies exactly the
    accelerator operators' weights of each split layer, and the KV cache crosses only when the
    attention core computes on the accelerator."""
    from flexplan.executor.link import H2D
    from flexplan.executor.plans import fixed_plan

    spec = resolve_model(fresh(family)[1].config)
    names = tuple(o.name for o in layer_operators(spec))
    n = len(names)
    for i, j in itertools.combinations(range(1, n + 1), 2):
        def plan(model, i=i, j=j):
            p = fixed_plan(model.config, "gpu", "split-points", 0, batch_size=3, input_len=9, output_len=NEW,
                           gpu_memory_bytes=1 << 30)
            return replace(p, decode=replace(p.decode, split_points=SplitPoints(names, (i, j), 0, 0, 0)))
        lm = _generate(fresh, family, plan)
        ex = lm.executor
        layers = ex.num_layers
        expected = sum(ex.layers[0].param_tensor(nm).numel() * 4 for nm in ex.split.accelerator_names(0, (i, j)))
        moved = ex.link.bytes_moved(H2D, "decode", "weights")
        assert moved == (NEW - 1) * layers * expected, (i, j)
        kv = ex.link.bytes_moved(H2D, "decode", "kv")
        assert (kv > 0) == (i <= names.index("attention") < j), (i, j)


def test_cpu_operators_run_the_cpu_kernel_not_stock_f_linear(fresh, monkeypatch):
    """The Linear operators a split leaves on the CPU compute through split_layer.cpu_operator_linear
    (the native dense GEMV at decode batches: what the estimator's calibrated GEMV rates price), each
    decode step, in every split layer; the hand plan's default split leaves the first and the last."""
    from flexplan.executor import split_layer

    calls = []
    real = split_layer.cpu_operator_linear
    monkeypatch.setattr(split_layer, "cpu_operator_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    lm = _generate(fresh, "llama3", ("gpu", "split-points"), gpu_layers=0)
    assert len(calls) == (NEW - 1) * lm.executor.num_layers * 2
    assert all(s[:-1] == (3, 1) for s in calls)  # decode steps: batch 3, one token


def test_attention_core_left_on_the_cpu_runs_the_native_decode_kernel(fresh):
    """A split whose attention core stays on the CPU (O[4, n) on the accelerator) attends over the
    host KV cache with flexplan's native decode kernel where it covers the layer, as cpu-attention
    does and as the calibrated CPU attention term prices it; the tokens stay transformers'."""
    from flexplan.executor import native
    from flexplan.executor.plans import fixed_plan

    if native.decode_status()[0] is None:
        pytest.skip("the native decode kernels are not built here")
    spec = resolve_model(fresh("llama3")[1].config)
    names = tuple(o.name for o in layer_operators(spec))

    def plan(model):
        p = fixed_plan(model.config, "gpu", "split-points", 0, batch_size=3, input_len=9, output_len=NEW,
                       gpu_memory_bytes=1 << 30)
        return replace(p, decode=replace(p.decode, split_points=SplitPoints(names, (4, len(names)), 0, 0, 0)))

    ex = _generate(fresh, "llama3", plan).executor
    assert ex.cpu_attention_calls["native"] == (NEW - 1) * ex.num_layers
    assert ex.cpu_attention_calls["transformers"] == 0


def test_hand_plan_without_split_points_is_refused(fresh):
    import flexplan.api as api
    from flexplan.executor.plans import fixed_plan

    model, _ = fresh("llama")
    p = fixed_plan(model.config, "gpu", "split-points", 0, batch_size=3, input_len=9, output_len=NEW)
    p = replace(p, decode=replace(p.decode, split_points=None))
    with pytest.raises(InvalidInputError, match="names none"):
        api.load(model, plan=p, accelerator="cpu", gpu_memory_bytes=1 << 30)
    assert issubclass(InvalidInputError, FlexplanError)


def test_memory_model_counts_one_layer_kv_in_transit():
    """A split layer is placed as a streamed layer whose KV stays home in pinned host memory (no KV
    double buffers), plus one layer's KV on the accelerator for an attention core computed there:
    Llama-2-70B, batch 16 x (2048 + 256) tokens x 2 x 8 KV heads x 128 x 2 bytes = 151 MB."""
    from flexplan.estimator import Shape
    from flexplan.planner import placement_memory

    shape = Shape(resolve_model("meta-llama/Llama-2-70b-hf"), 16, 2048, 256, "bfloat16", "bfloat16")
    ms = REGISTRY["split-points"].gpu_layer_options(80)
    need = placement_memory(shape, None, {"decode": REGISTRY["split-points"].placement(80, ms, "decode")})
    assert (need.accelerator["KV in transit"] == 16 * 2304 * 2 * 8 * 128 * 2).all()
    assert (need.accelerator["KV double buffers"] == 0).all() and (need.pinned["KV cache"][:-1] > 0).all()
    off = placement_memory(shape, None, {"decode": REGISTRY["gpu-offload-partial"].placement(80, 40, "decode")})
    assert off.accelerator["KV in transit"] == 0


def test_validate_split_ops_cli_writes_rows_and_mape(tmp_path, capsys, monkeypatch):
    """`flexplan validate --split-ops MODEL`: each CPU operator timed as the split executor runs it on
    the host, beside operator_terms' C, through the shared CPU-term mechanism; MoE is refused."""
    import json as _json

    import transformers

    import flexplan.validate_split_ops as vs
    from flexplan.cli import main
    from flexplan.errors import InvalidInputError as _Invalid
    from flexplan.workload import resolve_model
    from flexplan.workload.operators import layer_operators

    real = vs.validate_split_ops
    monkeypatch.setattr(vs, "validate_split_ops", lambda *a, **k: real(*a, **{**k, "batches": (1, 2), "repeats": 2,
                                                                              "context_len": 64, "prefill_tokens": (40,)}))
    spec_dir = tmp_path / "llama"
    spec_dir.mkdir()
    transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000).save_pretrained(spec_dir)
    assert main(["validate", "--split-ops", str(spec_dir / "config.json"), "--out", str(tmp_path / "o")]) == 0
    assert "MAPE by operator" in capsys.readouterr().out
    d = _json.loads((tmp_path / "o" / "split_ops.json").read_text())
    names = [o.name for o in layer_operators(resolve_model(str(spec_dir / "config.json")))]
    assert [(r["phase"], r["tokens"], r["operator"]) for r in d["rows"]] == (
        [("decode", b, op) for b in (1, 2) for op in names] + [("prefill", 40, op) for op in names])
    assert set(d["mape_pct_by_phase"]) == {"decode", "prefill"}
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in d["rows"]) and d["mape_pct"] > 0
    with pytest.raises(_Invalid, match="MoE"):
        real("Qwen/Qwen3-30B-A3B")


@pytest.mark.parametrize("family,points", [("llama3", (1, 7)), ("llama3", (2, 4)), ("llama3", (3, 4)),
                                           ("qwen3_moe", (1, 6))])
def test_next_copy_waits_for_the_accelerator_segment(fresh, monkeypatch, family, points):
    """A split layer issues the next streamed layer's weight copy once its accelerator operators are
    done (their last output back on the host), not at its start: a copy engine runs host-to-device
    copies in issue order, so the segment's inputs would wait behind the whole copy (Eq. 5). In every
    step, each prefetch of layer i + 1 follows layer i's last activation back and precedes its end."""
    from flexplan.executor.link import D2H, Link
    from flexplan.executor.plans import fixed_plan

    spec = resolve_model(fresh(family)[1].config)
    names = tuple(o.name for o in layer_operators(spec))
    if points[1] > len(names):
        pytest.skip("fewer operators")
    real_log = Link.log

    def log(self, direction, kind, layer, nbytes):  # transfers into the host-side order too
        self.order.append((f"{direction} {kind}", layer))
        real_log(self, direction, kind, layer, nbytes)

    monkeypatch.setattr(Link, "log", log)

    def plan(model):
        p = fixed_plan(model.config, "split-points", "split-points", 0, batch_size=3, input_len=9, output_len=NEW,
                       gpu_memory_bytes=1 << 30)
        return replace(p, **{ph: replace(getattr(p, ph), split_points=SplitPoints(names, points, 0, 0, 0))
                             for ph in ("prefill", "decode")})

    lm = _generate(fresh, family, plan)
    order = lm.executor.link.order
    checked = 0
    for k, (what, layer) in enumerate(order):
        if what != "prefetch" or layer == 0:
            continue
        i = layer - 1
        begun = max(n for n in range(k) if order[n] == ("compute", i))
        back = [n for n in range(begun, k) if order[n] == (f"{D2H} activation", i)]
        assert back and all(order[n] != ("computed", i) for n in range(begun, k)), order[begun:k + 1]
        checked += 1
    assert checked == NEW * (lm.executor.num_layers - 1)
    assert dict(lm.executor.split_prefetch_issued) == {"segment_done": checked}


def test_the_earlier_copy_order_still_gives_the_same_tokens(fresh):
    """``Executor.defer_split_prefetch = False`` (the order before the deferral, kept so that a
    benchmark can time both in one process) issues each next copy at the layer's start, and says so."""
    import torch

    from conftest import left_padded_batch

    lm = _generate(fresh, "llama3", ("split-points", "split-points"), gpu_layers=0)
    first = lm.executor.split_prefetch_issued["segment_done"]
    assert first > 0 and set(lm.executor.split_prefetch_issued) == {"segment_done"}
    lm.executor.defer_split_prefetch = False
    lm.executor.split_prefetch_issued.clear()
    ids, mask = left_padded_batch()
    again = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    _, ref = fresh("llama3")
    assert torch.equal(again, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    assert dict(lm.executor.split_prefetch_issued) == {"at_start": first}
