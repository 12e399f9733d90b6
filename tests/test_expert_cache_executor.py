"""The executor's expert cache on the CPU stand-in (issue 15 item 3): cached experts of a CPU-experts
layer compute on the accelerator, the others on the CPU, and the tokens are transformers'."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import flexplan.api as api
from flexplan.measure import routing
from flexplan.estimator import REGISTRY, Shape
from flexplan.executor.plans import fixed_plan
from flexplan.plan_types import ExpertCache, Plan
from flexplan.planner import placement_memory
from flexplan.workload.model import ModelSpec

from conftest import left_padded_batch

GIB = 1 << 30
NEW = 6


def _cache(spec: ModelSpec):
    """The first MoE layer caches all its experts (it never goes to the host), the others two of four."""
    moe = [i for i, x in enumerate(spec.moe_layers) if x]
    experts = {i: tuple(range(spec.num_experts)) if j == 0 else (1, 3) for j, i in enumerate(moe)}
    nbytes = sum(len(v) for v in experts.values()) * spec.expert_params * 4
    return ExpertCache(experts, dict.fromkeys(experts, 0.5), nbytes, 0.0, "test")


def _run(fresh, family, prefill, decode, lengths=(7, 4, 9)):
    model, ref = fresh(family)
    ids, mask = left_padded_batch(lengths)
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    spec = ModelSpec.from_config(model.config)
    plan = fixed_plan(model.config, prefill, decode, 0, batch_size=len(lengths), input_len=max(lengths),
                      output_len=NEW, gpu_memory_bytes=GIB)
    plan = replace(plan, expert_cache=_cache(spec))
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return lm, out, expected, spec


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe"])
@pytest.mark.parametrize("prefill,decode", [("cpu-experts", "cpu-experts"), ("gpu-offload", "cpu-experts"),
                                            ("cpu-experts", "splitgen")])
def test_cached_experts_token_identical(fresh, family, prefill, decode):
    """Batched and left-padded: transformers' tokens; the fully cached layer never went to the host,
    the half-cached ones did, and their cache computed some pairs; the accelerator holds exactly the
    memory model's bytes plus the cache's."""
    lm, out, expected, spec = _run(fresh, family, prefill, decode)
    assert torch.equal(out, expected)
    ex = lm.executor
    moe = [m for m in ex.expert_modules if m is not None]
    first, rest = moe[0][1], [p for _, p in moe[1:]]
    assert first.calls == 0 and first.cache_pairs > 0
    assert all(p.calls > 0 and p.cache_pairs > 0 for p in rest)
    assert first.cache_hit_rate == 1.0 and all(0 < p.cache_hit_rate < 1 for p in rest)
    phases = {ph: REGISTRY[c.policy].placement(spec.num_layers, c.gpu_layers, ph) for ph, c in lm.plan.phases.items()}
    need = placement_memory(Shape(spec, 3, 9, NEW, "float32", "float32"), None, phases,
                            ex.backend.linear_kernel if ex.backend.packs_weights else None)
    assert ex.link.live_bytes("accelerator") == need.allocated("accelerator") + lm.plan.expert_cache.accelerator_bytes
    cached = [b for b in ex.link.live_buffers("accelerator") if b.tag.startswith("expert cache")]
    assert sum(b.nbytes for b in cached) == lm.plan.expert_cache.accelerator_bytes and len(cached) == len(moe)


def test_plan_round_trip_keeps_the_cache_and_a_bad_layer_is_refused(fresh):
    model, _ = fresh("mixtral")
    spec = ModelSpec.from_config(model.config)
    plan = replace(fixed_plan(model.config, "cpu-experts", "cpu-experts", 1, gpu_memory_bytes=GIB),
                   expert_cache=_cache(spec))
    assert Plan.from_dict(json.loads(plan.to_json())).expert_cache == plan.expert_cache
    from flexplan.errors import InvalidInputError

    # M = 1: layer 1's experts are resident, the cache names it
    with pytest.raises(InvalidInputError, match="expert cache names layer 1"):
        api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)


def test_load_with_a_routing_profile_plans_and_runs_the_cache(fresh, tmp_path, monkeypatch):
    """flexplan.load(..., routing_profile=) on the stand-in: the planner sizes a cache from the profile
    (the tiny model's every expert fits), the executor runs it, tokens are transformers'. Planned on a
    synthetic calibration of this machine: whether a cache pays depends on the machine's measured
    rates, and the checkout ships a real file for some machines."""
    from flexplan import routing_profile as rp
    from flexplan.factors import store
    from test_online_correction import write_local_calibration

    monkeypatch.setenv(store.FILE_ENV, str(write_local_calibration(tmp_path)))

    model, ref = fresh("qwen3_moe")
    profile = routing.take(ref, [torch.arange(3, 40)], max_new_tokens=4)
    lm = api.load(model, accelerator="cpu", routing_profile=profile,
                  plan={"prefill": "cpu-experts", "decode": "cpu-experts", "gpu_layers": 0})
    ids, mask = left_padded_batch()
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    cache = lm.plan.expert_cache
    assert cache is not None and cache.num_experts > 0
    measured = lm.executor.expert_cache_hit_rates()
    assert set(measured) == set(cache.experts)
    for i, rate in measured.items():  # every expert cached: hit rate 1 predicted and measured
        assert (rate == 1.0) == (len(cache.experts[i]) == 4) and (cache.hit_rate[i] == 1.0) == (rate == 1.0)


def test_bf16_accelerator_cache_and_a_cache_over_budget(fresh):
    """A bf16 accelerator beside a float32 CPU: the cache is held in bf16 and the logits stay within
    bf16 error of transformers' fp32 ones. A cache the accelerator budget cannot hold is refused
    before anything is allocated, its bytes named."""
    from flexplan.errors import DoesNotFitError

    model, ref = fresh("mixtral")
    spec = ModelSpec.from_config(model.config)
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    expected = ref.generate(**kw)
    plan = replace(fixed_plan(model.config, "cpu-experts", "cpu-experts", 0, dtype="bfloat16", cpu_dtype="float32",
                              batch_size=3, input_len=9, output_len=3), expert_cache=_cache(spec))
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(**kw)
    for a, b in zip(out.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
    place = next(p for m, p in (x for x in lm.executor.expert_modules if x) if p.cached is not None)
    assert place.cached.module.down_proj.dtype == torch.bfloat16
    ex = lm.executor
    need = ex.memory_need(ex.placement, 3, 12, 9).accelerator_bytes
    cache_bytes = sum(b.nbytes for b in ex.link.live_buffers("accelerator") if b.tag.startswith("expert cache"))
    assert cache_bytes == 6 * spec.expert_params * 2  # 4 + 2 experts in bf16
    model2, _ = fresh("mixtral")
    with pytest.raises(DoesNotFitError, match="expert cache"):
        api.load(model2, plan=plan, accelerator="cpu", gpu_memory_bytes=need + cache_bytes - 1)
