"""The split-points policies (Park & Egger): planned by hand on the paper server, explained with a
per-operator timeline, left out of what flexplan.load runs (the executor does not run them yet)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flexplan
from flexplan.errors import InvalidInputError
from flexplan.estimator import REGISTRY, DefaultEfficiency, Shape, phase_costs
from flexplan.estimator.policies.split_points import split_time
from flexplan.estimator.split_terms import OPERATORS
from flexplan.explain import format_plan
from flexplan.hardware import get_hardware
from flexplan.plan_types import Plan
from flexplan.workload.catalog import resolve_model

SERVER = "flexinfer-server2"
LLAMA70 = dict(batch_size=16, input_len=2048, output_len=256)


def _decode_costs(model="meta-llama/Llama-2-70b-hf", hw=SERVER, **shape):
    hw = get_hardware(hw) if isinstance(hw, str) else hw
    spec = resolve_model(model)
    s = {**LLAMA70, **shape}
    sh = Shape(spec, s["batch_size"], s["input_len"], s["output_len"], "bfloat16", hw.cpu.compute_dtype)
    return spec, phase_costs(sh, hw, DefaultEfficiency.for_hardware(hw), "decode")


def test_the_operators_add_up_to_the_layer():
    """Shared out by parameters, the operators' accelerator time and copy are the layer's."""
    _, pc = _decode_costs()
    ops = pc.split
    assert ops.names == OPERATORS
    np.testing.assert_allclose(ops.h2d_weights_s.reshape(-1, 4)[0].sum(), pc.t_load_weights_s, rtol=1e-9)
    np.testing.assert_allclose(ops.h2d_kv_s.sum(axis=-1), pc.t_load_kv_s, rtol=1e-9)


def test_llama2_70b_decode_split_by_hand():
    """Llama-2-70B, batch 16, 2048 in, 256 out on server 2: per streamed decode layer the link needs
    ~8.7 ms for the attention's weights and KV and ~11 ms more for the MLP's weights, while the CPU
    computes the MLP in ~11 ms. Keeping the MLP on the CPU (split points 0, 3) costs max(CPU MLP +
    accelerator attention + hidden copies, attention copies) per layer, below streaming the whole
    layer (Eq. 2) and below the whole layer on the CPU."""
    spec, pc = _decode_costs()
    n = spec.num_layers
    t = split_time(pc, n, np.array([0]))
    i, j = int(t.terms["split_first_op"][0]), int(t.terms["split_last_op"][0])
    assert (i, j) == (0, 3)
    ops = pc.split
    c, g = ops.cpu_s.mean(axis=0), ops.acc_s.mean(axis=0)
    copy = ops.h2d_weights_s.mean(axis=0)[:3].sum() + ops.h2d_kv_s.mean(axis=0)[:3].sum()
    chain = c[3] + g[:3].sum() + ops.boundary_s
    by_hand = max(chain, copy)  # the mean over steps of a max: the steps agree on which side wins here
    per_layer = (t.terms["streamed_layers_s"][0] - np.minimum(copy, by_hand)) / n
    assert per_layer == pytest.approx(by_hand, rel=1e-3)
    eq2 = np.mean(np.maximum(pc.t_gpu_layer_s, pc.t_load_weights_s + pc.t_load_kv_s))
    assert by_hand < 0.6 * eq2 and by_hand < np.mean(pc.t_cpu_layer_s)
    p = flexplan.plan("meta-llama/Llama-2-70b-hf", SERVER, **LLAMA70)
    assert p.decode.policy in ("split-points", "split-points-partial")
    assert p.prefill.policy == "gpu-offload"  # a 16 x 2048 prefill: the accelerator computes, the copy hides


def test_no_split_where_the_cpu_is_far_slower():
    """A CPU 100x slower: every operator crosses the link, the split is (0, n) and the phase costs
    what gpu-offload's does (up to the hidden-state copies, absent without a split)."""
    hw = get_hardware(SERVER)
    slow = type(hw)(**{**hw.__dict__, "cpu": type(hw.cpu)(**{
        **hw.cpu.__dict__, "memory_bandwidth_bytes_per_s": hw.cpu.memory_bandwidth_bytes_per_s / 100,
        "peak_flops_per_s": {k: v / 100 for k, v in hw.cpu.peak_flops_per_s.items()}})})
    spec, pc = _decode_costs(hw=slow)
    t = split_time(pc, spec.num_layers, np.array([0]))
    assert (t.terms["split_first_op"][0], t.terms["split_last_op"][0]) == (0, 4)
    off = REGISTRY["gpu-offload"].estimate(pc, spec.num_layers, np.array([0]))
    assert t.time_s[0] == pytest.approx(off.time_s[0], rel=0.02)


def test_explain_prints_the_split_and_a_timeline():
    p = flexplan.plan("meta-llama/Llama-2-70b-hf", SERVER, **LLAMA70)
    text = format_plan(p)
    assert "decode split points 0, 3: CPU computes mlp" in text
    for device in ("link", "accelerator", "cpu"):
        assert f"    {device}" in text
    d = json.loads(json.dumps(p.to_dict()))
    cand = next(c for c in d["candidates"] if c["phase"] == "decode" and c["policy"] == p.decode.policy)
    assert cand["terms"]["split_first_op"] == 0 and cand["terms"]["split_last_op"] == 3
    assert any(k.startswith("timeline:") for k in cand["terms"])
    assert Plan.from_dict(d).decode.policy == p.decode.policy


def test_load_leaves_it_out_and_refuses_it_forced():
    from conftest import make_model

    p = flexplan.plan("meta-llama/Llama-2-70b-hf", SERVER, executable_only=True, **LLAMA70)
    assert "split-points" not in (p.prefill.policy, p.decode.policy)
    with pytest.raises(InvalidInputError, match="executor does not run it yet"):
        flexplan.plan("meta-llama/Llama-2-70b-hf", SERVER, decode="split-points", executable_only=True, **LLAMA70)
    with pytest.raises(InvalidInputError, match="executor does not run it yet"):
        flexplan.load(make_model("llama"), plan={"prefill": "gpu-offload", "decode": "split-points"},
                      accelerator="cpu")


def test_validate_split_ops_cli_writes_rows_and_mape(tmp_path, capsys, monkeypatch):
    """`flexplan validate --split-ops MODEL`: each CPU operator timed as the executor's CPU path runs
    it beside the estimator's term, through the shared CPU-term mechanism; an MoE model is refused."""
    import transformers

    import flexplan.validate_split_ops as vs
    from flexplan.cli import main

    real = vs.validate_split_ops
    monkeypatch.setattr(vs, "validate_split_ops", lambda *a, **k: real(*a, **{**k, "batches": (1, 2), "repeats": 2,
                                                                              "context_len": 64}))
    spec_dir = tmp_path / "llama"
    spec_dir.mkdir()
    transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=1000).save_pretrained(spec_dir)
    assert main(["validate", "--split-ops", str(spec_dir / "config.json"), "--out", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert "MAPE by operator" in text
    d = json.loads((tmp_path / "o" / "split_ops.json").read_text())
    assert [(r["batch"], r["operator"]) for r in d["rows"]] == [(b, op) for b in (1, 2) for op in OPERATORS]
    assert all(r["measured_s"] > 0 and r["predicted_s"] > 0 for r in d["rows"]) and d["mape_pct"] > 0
    with pytest.raises(InvalidInputError, match="MoE"):
        real("Qwen/Qwen3-30B-A3B")
