"""Routing profile, the estimator's pricing of a cached expert, the planner's cache choice (issue 15
item 3). The executor's side is in test_expert_cache_executor.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flexplan
from flexplan.measure import routing
from flexplan import routing_profile as rp
from flexplan.errors import InvalidInputError, MalformedDataError
from flexplan.estimator import REGISTRY, DefaultEfficiency, Shape, phase_costs
from flexplan.estimator.expert_cache import layer_cache_curve, profile_curves
from flexplan.estimator.expert_terms import t_cpu_experts_s
from flexplan.hardware import get_hardware
from flexplan.plan_expert_cache import expert_slot_bytes
from flexplan.plan_types import Plan
from flexplan.planner import placement_memory
from flexplan.workload import resolve_model

GIB = 1 << 30
QWEN = "Qwen/Qwen3-30B-A3B"


def _profile(spec, q_of_layer, tokens=1000):
    """A profile whose layer i picked expert e in round(q[e] * tokens) of ``tokens`` tokens."""
    moe = [i for i, x in enumerate(spec.moe_layers) if x]
    counts = {i: tuple(int(x * tokens + 1e-9) for x in q_of_layer(i)) for i in moe}
    return rp.RoutingProfile(spec.name, spec.num_layers, spec.num_experts, spec.experts_per_token, counts,
                             dict.fromkeys(moe, tokens), 3)


def _hot(spec, hot=(0.9, 0.9)):
    """q: the first len(hot) experts picked with these probabilities, the rest of the k picks spread evenly."""
    e, k = spec.num_experts, spec.experts_per_token
    rest = (k - sum(hot)) / (e - len(hot))
    return lambda i: [*hot, *([rest] * (e - len(hot)))]


# ---- the profile file ----------------------------------------------------------------------------

def test_profile_round_trip_and_atomic_write(tmp_path, monkeypatch):
    spec = resolve_model(QWEN)
    p = _profile(spec, _hot(spec))
    path = rp.save(p, tmp_path / "prof.json")
    assert rp.load(path, spec) == p
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind
    np.testing.assert_allclose(p.selection_probability(0)[:2], [0.9, 0.9])
    # a write that fails half way leaves the old file whole
    before = path.read_text()

    def boom(fd):  # the new text is half on disk when the write fails
        raise OSError("disk full")

    import flexplan.atomic_file

    monkeypatch.setattr(flexplan.atomic_file.os, "fsync", boom)
    with pytest.raises(OSError):
        rp.save(p, path)
    assert path.read_text() == before and list(tmp_path.iterdir()) == [path]


def test_corrupt_or_mismatched_profile_is_refused(tmp_path):
    spec = resolve_model(QWEN)
    good = _profile(spec, _hot(spec)).to_dict()
    path = tmp_path / "p.json"
    cases = {
        "not valid JSON": "{\"format\": \"flexplan-routing-profile\", ",
        "not a flexplan routing profile": json.dumps({"counts": {}}),
        "version 99": json.dumps({**good, "version": 99}),
        "expert counts, expected 128": json.dumps({**good, "counts": {**good["counts"], "0": [1, 2, 3]}}),
        "malformed": json.dumps({k: v for k, v in good.items() if k != "tokens"}),
        "do not fit": json.dumps({**good, "counts": {**good["counts"], "0": [2000] * 128}}),
    }
    for message, text in cases.items():
        path.write_text(text)
        with pytest.raises(MalformedDataError, match=message):
            rp.load(path)
    with pytest.raises(InvalidInputError, match="cannot read"):
        rp.load(tmp_path / "missing.json")
    path.write_text(json.dumps(good))
    other = resolve_model("Qwen/Qwen1.5-MoE-A2.7B") if "Qwen/Qwen1.5-MoE-A2.7B" in flexplan.workload.catalog_names() \
        else resolve_model("mistralai/Mixtral-8x7B-v0.1")
    with pytest.raises(InvalidInputError, match="profile-experts"):
        rp.load(path, other)
    with pytest.raises(InvalidInputError, match="profile-experts"):  # the planner checks it too
        flexplan.plan(other, "flexinfer-server2", routing_profile=path)


def test_take_counts_the_routers_choices(more_models):
    """On a tiny Qwen3-MoE: every MoE layer counted, each token picking k experts."""
    import torch

    model = more_models["qwen3_moe"]
    p = routing.take(model, [torch.arange(3, 12), [5, 6, 7]])
    assert p.prompts == 2 and set(p.tokens.values()) == {12}
    assert all(sum(c) == 12 * p.experts_per_token for c in p.counts.values())
    with pytest.raises(InvalidInputError, match="dense"):
        routing.take(more_models["llama3"], [[1, 2]])


# ---- the estimator ---------------------------------------------------------------------------------

def _setup(batch=4, input_len=128, output_len=64):
    hw = get_hardware("flexinfer-server2")
    eff = DefaultEfficiency.for_hardware(hw)
    spec = resolve_model(QWEN)
    shape = Shape(spec, batch, input_len, output_len, "bfloat16", "bfloat16")
    return hw, eff, spec, shape


def test_expected_hits_from_a_skewed_profile_by_hand():
    """Two hot experts (q = 0.9 each), the other 6.2 picks of k = 8 spread over 126 experts; decode
    at batch 4 with the two hot ones cached. By hand: each hot expert is read with probability
    1 - 0.1^4 = 0.9999; a cold one (q = 6.2/126) with 1 - (1 - q)^4; hit rate 1.8 / 8 = 0.225;
    P(any miss) = 1 - 0.225^32; the CPU reads the misses' weights, the accelerator the hits'."""
    hw, eff, spec, shape = _setup()
    q = np.array(_hot(spec)(0))
    split = phase_costs(shape, hw, eff, "decode").experts
    c = layer_cache_curve(shape, hw, eff, "decode", q, 0, split)
    cold = 6.2 / 126
    assert list(c.order[:2]) == [0, 1]
    assert c.hits[2] == pytest.approx(2 * (1 - 0.1 ** 4))
    assert c.misses[2] == pytest.approx(126 * (1 - (1 - cold) ** 4))
    assert c.misses[0] == pytest.approx(c.hits[2] + c.misses[2])
    assert c.hit_rate[2] == pytest.approx(0.225) and c.hit_rate[0] == 0 and c.hit_rate[-1] == pytest.approx(1)
    assert c.p_any_miss[2] == pytest.approx(1 - 0.225 ** 32) and c.p_any_miss[0] == 1 and c.p_any_miss[-1] == 0
    # the CPU part of K = 2 by hand, at the default factors: misses' weights + activations, FLOPs of the miss pairs
    cpu = hw.cpu
    per_expert = split.rows_per_expert
    miss_pairs = 4 * 8 * (1 - 0.225)
    act = 2 * (2048 + 768) + (768 + 2048) + 2 * 768
    cpu_s = (miss_pairs * 2 * 3 * 2048 * 768 / (cpu.peak_flops_per_s["bfloat16"] * eff.cpu_compute(per_expert, "bfloat16"))
             + (c.misses[2] * spec.expert_params + miss_pairs * act) * 2
             / (cpu.memory_bandwidth_bytes_per_s * eff.cpu_memory(per_expert, "bfloat16"))
             + c.p_any_miss[2] * eff.cpu_layer_overhead_s())
    assert c.cpu_s[2] == pytest.approx(cpu_s)
    assert c.link_s[2] == pytest.approx(c.p_any_miss[2] * split.t_hidden_link_s)
    assert c.time_s[2] == pytest.approx(c.acc_s[2] + c.cpu_s[2] + c.link_s[2])
    assert np.all(np.diff(c.time_s) < 0)  # each expert cached is faster on the accelerator


def test_uniform_profile_prices_as_the_uniform_formula():
    """q_e = k/E: with nothing cached the profile's price is the uniform one of expert_terms."""
    hw, eff, spec, shape = _setup(batch=3)
    for phase, rows in (("decode", 3), ("prefill", 3 * 128)):
        split = phase_costs(shape, hw, eff, phase).experts
        q = np.full(spec.num_experts, spec.experts_per_token / spec.num_experts)
        c = layer_cache_curve(shape, hw, eff, phase, q, 0, split)
        assert c.cpu_s[0] == pytest.approx(t_cpu_experts_s(spec, rows, hw.cpu, eff, "bfloat16", 2, 2))
        assert c.link_s[0] == pytest.approx(split.t_hidden_link_s) and c.acc_s[0] == 0


# ---- the planner -----------------------------------------------------------------------------------

def _forced(shape, hw, eff, m, budget, profile, **kw):
    return flexplan.plan(shape.model, hw, batch_size=shape.batch, input_len=shape.input_len,
                         output_len=shape.output_len, dtype="bfloat16", cpu_dtype="bfloat16", gpu_memory_bytes=budget,
                         prefill="cpu-experts", decode="cpu-experts", gpu_layers=m, efficiency=eff,
                         routing_profile=profile, **kw)


def test_planner_caches_what_the_budget_holds_by_hand():
    """cpu-experts in both phases with M = 40 of 48 layers: 8 CPU layers, each with two hot experts.
    A budget that leaves room for 3 experts beyond the placement: the cache holds 3, the most used
    first (layer 0's two hot ones, then layer 1's first); TPOT falls by exactly those layers' decode
    price difference, and the plan round-trips through JSON. No room: no cache."""
    hw, eff, spec, shape = _setup(batch=1)
    n, m = spec.num_layers, 40
    profile = _profile(spec, _hot(spec))
    phases = {ph: REGISTRY["cpu-experts"].placement(n, m, ph) for ph in ("prefill", "decode")}
    need = placement_memory(shape, hw, phases).accelerator_bytes
    slot = expert_slot_bytes(spec, 2)
    assert slot == 3 * 2048 * 768 * 2
    p = _forced(shape, hw, eff, m, need + 3 * slot + slot // 2, profile, include_initial_load=False)
    cache = p.expert_cache
    assert cache is not None and dict(cache.experts) == {0: (0, 1), 1: (0,)}
    assert cache.accelerator_bytes == 3 * slot and cache.num_experts == 3
    assert cache.hit_rate[0] == pytest.approx(1.8 / 8) and cache.hit_rate[1] == pytest.approx(0.9 / 8)
    curves = profile_curves(shape, hw, eff, "decode", profile, phase_costs(shape, hw, eff, "decode").experts)
    base = _forced(shape, hw, eff, m, need, profile, include_initial_load=False)
    assert base.expert_cache is None
    drop = (curves[0].time_s[0] - curves[0].time_s[2]) + (curves[1].time_s[0] - curves[1].time_s[1])
    assert base.tpot_s - p.tpot_s == pytest.approx(drop)
    assert p.e2e_s < base.e2e_s and p.decode.gpu_memory_bytes == base.decode.gpu_memory_bytes + 3 * slot
    assert Plan.from_dict(json.loads(p.to_json())) == p
    # without a profile: no cache, and the uniform pricing
    assert _forced(shape, hw, eff, m, need + 3 * slot, None, include_initial_load=False).expert_cache is None


def test_a_cache_that_does_not_pay_for_its_load_is_not_kept():
    """The initial load counted, memory for every CPU expert. One output token of an 8-token prompt
    at batch 1: loading a hot expert (3 x 2048 x 768 bf16 = 9.4 MB over PCIe 5 at 64 GB/s x 0.8: ~184 us)
    costs more than its one prefill read saves (9.4 MB from host memory at 407.8 GB/s x 0.4, ~58 us,
    against ~7 us from HBM): no cache. 16 output tokens: a hot expert saves ~50 us in each of the 15
    decode steps (750 us > 184 us), a cold one (read with q = 6.2/126 = 0.049 per step) ~2.5 us per
    step (38 us < 184 us), and caching all 126 cold ones to spare the host trip (150 us overhead +
    ~20 us link per step) costs 23 ms of loading for 2.6 ms: a cache of the hot experts only, its
    reported saving the E2E difference."""
    hw, eff, spec, _ = _setup()
    profile = _profile(spec, _hot(spec))
    n, m = spec.num_layers, 40
    for out_len, expect in ((1, None), (16, {i: (0, 1) for i in range(8)})):
        shape = Shape(spec, 1, 8, out_len, "bfloat16", "bfloat16")
        phases = {ph: REGISTRY["cpu-experts"].placement(n, m, ph) for ph in ("prefill", "decode")}
        need = placement_memory(shape, hw, phases).accelerator_bytes
        p = _forced(shape, hw, eff, m, need + 20 * GIB, profile)
        base = _forced(shape, hw, eff, m, need, profile)
        got = dict(p.expert_cache.experts) if p.expert_cache is not None else None
        assert got == expect
        if expect is not None:
            assert p.e2e_s == pytest.approx(base.e2e_s - p.expert_cache.saved_s) and p.expert_cache.saved_s > 0
            assert p.load_s > base.load_s


# ---- the command line ------------------------------------------------------------------------------

def _tiny_moe_folder(path, model):
    """A saved tiny MoE model with a word-level tokenizer (built offline) beside it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, model.config.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(path)
    model.save_pretrained(path)
    return path


def test_profile_experts_cli_then_explain_with_it(tmp_path, more_models, capsys):
    """`flexplan profile-experts` on a saved tiny Qwen3-MoE writes a profile that `flexplan explain
    --routing-profile` reads (a forced cpu-experts plan with memory to spare shows its cache, text
    and JSON); bad input is one line, exit code 2."""
    from flexplan.cli import main

    folder = _tiny_moe_folder(tmp_path / "moe", more_models["qwen3_moe"])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w5 w9 w12 w3\n\nw40 w41 w7\n")
    out = tmp_path / "prof.json"
    assert main(["profile-experts", str(folder), "--prompts", str(prompts), "--out", str(out), "--new-tokens", "3",
                 "--accelerator", "cpu"]) == 0
    p = rp.load(out)
    assert p.prompts == 2 and p.model == "moe" and set(p.tokens.values()) == {5 + 2 + 3 + 2}
    assert "2 prompts" in capsys.readouterr().out
    args = ["explain", str(folder / "config.json"), "--hw", "flexinfer-server2", "--prefill", "cpu-experts",
            "--decode", "cpu-experts", "--gpu-layers", "0", "-o", "512", "--routing-profile", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "expert cache: 8 routed experts of 2 CPU layers on the accelerator" in text, text
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["expert_cache"]["cached_per_layer"] == {"0": 4, "1": 4}
    assert Plan.from_dict(d).expert_cache.experts == {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["profile-experts", str(folder), "--prompts", str(empty), "--out", str(out)]) == 2
    assert "holds no prompt" in capsys.readouterr().err
    out.write_text("{")
    assert main(args) == 2
    assert "not valid JSON" in capsys.readouterr().err


# ---- calibration: the CPU expert path at the rows per expert routing produces (issue 15 item 4) ----

def _expert_spec(hidden=1024, inter=512, experts=64, k=4):
    import transformers

    from flexplan.workload.model import ModelSpec

    return ModelSpec.from_config(transformers.Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=k,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=128, vocab_size=1000))


def test_expert_microbench_rows_and_modes():
    """The tiny mode times the executor's expert path at each rows-per-expert; quick and full take
    it, the first-use probe does not (it stays a few seconds)."""
    from flexplan.measure import calibrate as cal_cli
    from flexplan.measure import microbench as mb

    rows = mb.expert_gemv(mb.MODES["tiny"], "float32")
    assert [r["tokens_per_expert"] for r in rows] == list(mb.MODES["tiny"].expert_tokens)
    assert all(r["time_s"] > 0 and r["experts"] == 2 and r["hidden"] == 128 for r in rows)
    hw = get_hardware("local")
    keys = {m: {s.key for s in cal_cli._steps(m, hw, 1, ["float32"], None)} for m in ("quick", "full", "probe")}
    assert "cpu_experts" in keys["quick"] and "cpu_experts" in keys["full"] and "cpu_experts" not in keys["probe"]


def test_calibrated_expert_path_reproduces_its_measurement():
    """Synthetic cpu_experts rows (4 experts of 1024 x 512, weights at 5 GB/s effective plus 40 us
    per call): the derived expert factors make t_cpu_experts_s of a model with that expert shape,
    at batch 1 (1 row per expert, k = 4 experts read), come out at the measured time; without the
    rows (an older calibration file) the GEMV factors and the layer overhead price it as before."""
    from flexplan.factors.efficiency import derive_gemm, expert_gemm_row
    from flexplan.estimator.expert_terms import cpu_expert_rates

    hw = get_hardware("local")
    th, bw = hw.cpu.peak_flops_per_s["float32"], hw.cpu.memory_bandwidth_bytes_per_s
    h, inter, k = 1024, 512, 4
    rows = [{"dtype": "float32", "tokens_per_expert": t, "experts": k, "hidden": h, "intermediate": inter,
             "dtype_bytes": 4, "time_s": 40e-6 + k * 3 * h * inter * 4 / 5e9 + 2 * t * k * 3 * h * inter / (th * 0.2)}
            for t in (1, 2, 4, 8)]
    eff_c, eff_m, _ = derive_gemm([expert_gemm_row(r) for r in rows], th, bw)

    class Calibrated(DefaultEfficiency):
        def cpu_expert_factors(self, tokens, dtype=None):
            return eff_c(tokens), eff_m(tokens)

    base = DefaultEfficiency.for_hardware(hw)
    cal = Calibrated(**{f: getattr(base, f) for f in base.__dataclass_fields__})
    spec = _expert_spec()
    t = t_cpu_experts_s(spec, 1, hw.cpu, cal, "float32", 4, 4)
    assert t == pytest.approx(rows[0]["time_s"], rel=0.02)
    assert cpu_expert_rates(cal, 1, "float32", 1.0)[2] == 0  # the fixed costs are in the factors
    old = t_cpu_experts_s(spec, 1, hw.cpu, base, "float32", 4, 4)
    assert cpu_expert_rates(base, 1, "float32", 1.0) == (base.cpu_compute(1), base.cpu_memory(1),
                                                         base.cpu_layer_overhead_s())
    assert old != pytest.approx(t)


def test_validate_cpu_experts_cli_writes_rows_and_mape(tmp_path, capsys, monkeypatch):
    """`flexplan validate --cpu-experts MODEL` runs flexplan.validate_experts through the same CPU-term
    mechanism as --cpu-attention: a JSON file with the rows and MAPE, the table printed."""
    import flexplan.validate_experts as ve
    from flexplan.cli import main

    real = ve.validate_cpu_experts
    monkeypatch.setattr(ve, "validate_cpu_experts", lambda *a, **k: real(*a, **{**k, "batches": (1, 2), "repeats": 2}))
    spec_dir = tmp_path / "moe"
    spec_dir.mkdir()
    import transformers

    transformers.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=64, num_experts=64, num_experts_per_tok=2,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                vocab_size=1000).save_pretrained(spec_dir)
    assert main(["validate", "--cpu-experts", str(spec_dir / "config.json"), "--out", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert "32 experts held" in text and "MAPE" in text
    d = json.loads((tmp_path / "o" / "cpu_experts.json").read_text())
    assert [r["batch"] for r in d["rows"]] == [1, 2] and d["mape_pct"] > 0 and d["num_experts"] == 32


def test_a_cache_can_change_the_chosen_pair():
    """Six experts per layer picked by every token, two by half (k = 8 of 128), 24 GiB, batch 4 x 1024:
    without a cache the planner prefills with gpu-offload; the cache makes cpu-experts' prefill the
    better pair end to end, so the plan takes it (and says so), lower than that pair forced with its
    own cache."""
    hw, eff, spec, _ = _setup()
    profile = _profile(spec, _hot(spec, hot=(1.0,) * 6 + (0.5, 0.5)))
    kw = dict(batch_size=4, input_len=1024, output_len=128, gpu_memory_bytes=24 * GIB, efficiency=eff)
    before = flexplan.plan(spec, hw, **kw)
    after = flexplan.plan(spec, hw, routing_profile=profile, **kw)
    old_pair = flexplan.plan(spec, hw, routing_profile=profile, prefill=before.prefill.policy,
                             decode=before.decode.policy, **kw)
    assert (before.prefill.policy, after.prefill.policy) == ("gpu-offload", "cpu-experts")
    assert after.expert_cache is not None and any("beats" in n for n in after.notes)
    assert after.e2e_s < old_pair.e2e_s


from hypothesis import Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CACHED_PLANS = dict(gib=st.integers(8, 64), batch=st.sampled_from([1, 2, 8, 32]),
                    input_len=st.sampled_from([16, 256, 2048]), output_len=st.sampled_from([2, 64, 512]),
                    skew=st.floats(0.0, 1.0))


@settings(max_examples=6, deadline=None)  # the slow run draws 25 more
@given(**CACHED_PLANS)
def test_a_plan_with_a_cache_never_exceeds_its_accelerator_budget(gib, batch, input_len, output_len, skew):
    cache_within_budget(gib, batch, input_len, output_len, skew)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, phases=(Phase.generate, Phase.target, Phase.shrink))
@given(**CACHED_PLANS)
def test_a_plan_with_a_cache_never_exceeds_its_accelerator_budget_more_shapes(gib, batch, input_len, output_len,
                                                                              skew):
    cache_within_budget(gib, batch, input_len, output_len, skew)


def cache_within_budget(gib, batch, input_len, output_len, skew):
    """Whatever the budget, shape and profile skew: the pair's placements plus the cache fit the
    budget, the cache's E2E saving is what the plan gained, and its layers are CPU-expert layers."""
    hw, eff, spec, _ = _setup()
    e, k = spec.num_experts, spec.experts_per_token
    hot = min(1.0, k / e + skew)
    profile = _profile(spec, _hot(spec, hot=(hot,) * 4))
    kw = dict(batch_size=batch, input_len=input_len, output_len=output_len, gpu_memory_bytes=gib * GIB,
              efficiency=eff)
    try:
        p = flexplan.plan(spec, hw, routing_profile=profile, **kw)
    except flexplan.errors.DoesNotFitError:
        return
    c = p.expert_cache
    if c is None:
        return
    n = spec.num_layers
    phases = {ph: REGISTRY[ch.policy].placement(n, ch.gpu_layers, ph) for ph, ch in p.phases.items()}
    shape = Shape(spec, batch, input_len, output_len, p.dtype, p.cpu_dtype)
    assert placement_memory(shape, hw, phases).accelerator_bytes + c.accelerator_bytes <= gib * GIB
    assert c.accelerator_bytes == c.num_experts * expert_slot_bytes(spec, 2) and c.saved_s > 0
    assert all(p.prefill.policy == "cpu-experts" and i < n - p.prefill.gpu_layers
               or p.decode.policy == "cpu-experts" and i < n - p.decode.gpu_layers for i in c.experts)
