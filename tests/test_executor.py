"""Executor equivalence: the same tokens as plain transformers for every policy pair and family."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import TextStreamer

import flexplan.api as api
from flexplan.executor.plans import fixed_plan
from flexplan.plan_types import POLICIES

from conftest import FAMILIES, left_padded_batch

GIB = 1 << 30
NEW = 6


def load_fixed(model, prefill, decode, gpu_layers=2, batch=3, input_len=9, output_len=NEW, **kw):
    plan = fixed_plan(model.config, prefill, decode, gpu_layers, batch_size=batch, input_len=input_len,
                      output_len=output_len, gpu_memory_bytes=GIB)
    return api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB, **kw)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefill,decode", list(itertools.product(POLICIES, POLICIES)))
def test_greedy_tokens_identical(fresh, family, prefill, decode):
    model, ref = fresh(family)
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    lm = load_fixed(model, prefill, decode)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected)
    assert lm.last_stats.new_tokens == NEW
    assert lm.plan.prefill.policy == prefill and lm.plan.decode.policy == decode


@pytest.mark.parametrize("prefill,decode", [("gpu-offload", "splitgen"), ("cpu", "gpu"), ("gpu", "cpu")])
def test_sampling_with_seed_matches_transformers(fresh, prefill, decode):
    model, ref = fresh("qwen2")
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=20, top_p=0.9,
              temperature=0.8)
    torch.manual_seed(123)
    expected = ref.generate(**kw)
    lm = load_fixed(model, prefill, decode)
    torch.manual_seed(123)
    assert torch.equal(lm.generate(**kw), expected)


def test_streamer_and_dict_output(fresh, capsys):
    class Tok:  # the least a TextStreamer needs
        def decode(self, ids, **kw):
            return " ".join(str(int(i)) for i in ids)

    model, ref = fresh("llama")
    ids, mask = left_padded_batch(lengths=(5,))
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    lm = load_fixed(model, "splitgen", "gpu-offload-partial", batch=1, input_len=5)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                      streamer=TextStreamer(Tok(), skip_prompt=True), return_dict_in_generate=True, output_scores=True)
    assert torch.equal(out.sequences, expected)
    assert len(out.scores) == NEW
    printed = capsys.readouterr().out.split()
    assert printed == [str(int(t)) for t in expected[0, 5:]]


def test_eos_stops_generation(fresh):
    model, ref = fresh("opt")
    ids, mask = left_padded_batch(lengths=(6,))
    free = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    eos = int(free[0, 6 + 2])  # make the third new token the end of sequence
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    lm = load_fixed(model, "gpu-offload", "cpu", batch=1, input_len=6)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    assert torch.equal(out, expected)
    assert out.shape[1] <= 6 + 3
    assert lm.last_stats.new_tokens == out.shape[1] - 6


def test_beam_search_matches_transformers(fresh):
    model, ref = fresh("mistral")
    ids, mask = left_padded_batch(lengths=(5, 3))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=2)
    expected = ref.generate(**kw)
    lm = load_fixed(model, "gpu-offload", "splitgen", batch=4, input_len=5, output_len=4)
    assert torch.equal(lm.generate(**kw), expected)


def test_plan_overrides_dict_and_cpu_dtype_conversion(fresh):
    """bf16 on the (stand-in) accelerator, fp32 on the CPU: the KV cache is converted at the
    switch and the result stays close to the fp32 reference."""
    model, ref = fresh("llama")
    ids, mask = left_padded_batch()
    plan = fixed_plan(model.config, "gpu", "splitgen", 2, dtype="bfloat16", cpu_dtype="float32",
                      batch_size=3, input_len=9, output_len=3, gpu_memory_bytes=GIB)
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                      return_dict_in_generate=True, output_logits=True)
    ref_out = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
    torch.testing.assert_close(out.logits[0], ref_out.logits[0], atol=0.5, rtol=0.05)
    stores = {i: {p: st.layout.dtype for p, st in lm.executor.layers[i].storages.items()} for i in (0, 3)}
    assert stores[0] == {"host": torch.float32, "accelerator": torch.bfloat16}  # CPU copy in fp32 for decode
    assert stores[3] == {"accelerator": torch.bfloat16}
    switched = [t for t in lm.executor.link.transfers if t.kind == "kv-switch"]
    assert {t.layer for t in switched} == {0, 1}  # the CPU's layers' KV left the accelerator


def test_dict_overrides_and_user_model_generate(fresh):
    model, ref = fresh("llama")
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    lm = api.load(model, plan={"prefill": "gpu-offload", "decode": "splitgen", "gpu_layers": 1,
                               "dtype": "float32", "cpu_dtype": "float32"}, accelerator="cpu", gpu_memory_bytes=GIB)
    assert (lm.plan.prefill.policy, lm.plan.decode.policy, lm.plan.decode.gpu_layers) == ("gpu-offload", "splitgen", 1)
    assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False), expected)
    # a direct model.generate() (transformers' own DynamicCache) still runs correctly under the plan
    assert torch.equal(lm.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False),
                       expected)


def test_auto_plans_per_request_shape(fresh):
    model, ref = fresh("qwen2")
    weights = sum(p.numel() * 4 for p in model.parameters())
    lm = api.load(model, plan={"cpu_dtype": "float32"}, accelerator="cpu", dtype="float32",
                  gpu_memory_bytes=weights // 2)
    for lengths, new in (((7, 4, 9), 6), ((20,), 3), ((7, 4, 9), 6)):
        ids, mask = left_padded_batch(lengths)
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        assert torch.equal(out, ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False))
        p = lm.last_stats.plan
        assert (p.batch_size, p.input_len, p.output_len) == (len(lengths), max(lengths), new)
        assert lm.executor.plan is p and p.cpu_dtype == "float32"
        assert lm.last_stats.predicted_ttft_s > 0 and lm.last_stats.ttft_s > 0 and lm.last_stats.tpot_s > 0
    assert len(lm._plans) == 2  # planned once per shape


@pytest.mark.parametrize("prefill,decode", list(itertools.product(POLICIES, POLICIES)))
def test_bf16_accelerator_fp32_cpu_every_pair(fresh, prefill, decode):
    """Weights and KV converted between the accelerator dtype and the CPU dtype on every path
    (pinned <-> host conversions, the switch): logits stay within bf16 error of fp32."""
    model, ref = fresh("mistral")
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    expected = ref.generate(**kw)
    plan = fixed_plan(model.config, prefill, decode, 2, dtype="bfloat16", cpu_dtype="float32", batch_size=3,
                      input_len=9, output_len=3)
    out = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB).generate(**kw)
    for a, b in zip(out.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=0.1, rtol=0.05)
