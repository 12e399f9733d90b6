"""The real thing: CUDA streams, events and pinned memory (skipped without a CUDA GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

import flexplan.api as api
from flexplan.executor.link import PINNED
from flexplan.executor.plans import fixed_plan
from flexplan.estimator.policies import POLICIES

from conftest import left_padded_batch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("prefill,decode", list(itertools.product(POLICIES, POLICIES)))
def test_cuda_matches_cpu_reference(fresh, prefill, decode):
    model, ref = fresh("qwen2")
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              return_dict_in_generate=True, output_logits=True)
    expected = ref.generate(**kw)
    plan = fixed_plan(model.config, prefill, decode, 2, batch_size=3, input_len=9, output_len=6)
    lm = api.load(model, plan=plan, accelerator="cuda", gpu_memory_bytes=GIB)
    out = lm.generate(**kw)
    for a, b in zip(out.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
    assert out.sequences.device.type == "cpu"
    ex = lm.executor
    for b in ex.link.live_buffers(PINNED):
        assert b.tensor.is_pinned()
    # streamed layers pass through slots on the GPU; a layer the other phase keeps resident is not
    # streamed (gpu-offload prefill before gpu decode loads every layer once; seen on an H200)
    assert (ex.slots is not None) == bool(ex.placement.streamed_layers)
    if ex.slots is not None:
        assert ex.slots.buffers[0].tensor.device.type == "cuda"
    if (prefill, decode) == ("gpu-offload", "gpu-offload"):
        assert len(ex.placement.streamed_layers) == ex.num_layers


@pytest.mark.parametrize("policy", ["splitgen", "gpu-offload-partial"])
def test_cuda_resident_layers_replaced_onto_the_cpu(fresh, policy):
    """Re-planning with fewer resident layers makes their host copies from the GPU's (CPU packing
    of a CUDA tensor crashed validate's re-plans on an H200 before weights.on_host)."""
    model, ref = fresh("llama")
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for cpu_dtype in ("float32", "bfloat16"):
        kw = dict(batch_size=3, input_len=9, output_len=6, gpu_memory_bytes=GIB, cpu_dtype=cpu_dtype)
        lm = api.load(model if cpu_dtype == "float32" else fresh("llama")[0],
                      plan=fixed_plan(model.config, policy, policy, 2, **kw), accelerator="cuda", gpu_memory_bytes=GIB)
        lm.executor.place(fixed_plan(model.config, policy, policy, 0, **kw))
        out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        if cpu_dtype == "float32":
            assert torch.equal(out, expected)


def test_cuda_repeated_calls_pin_once(fresh):
    model, _ = fresh("llama")
    plan = fixed_plan(model.config, "gpu-offload", "splitgen", 2, batch_size=3, input_len=9, output_len=6)
    lm = api.load(model, plan=plan, accelerator="cuda", gpu_memory_bytes=GIB)
    ids, mask = left_padded_batch()
    first = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    allocations = dict(lm.executor.link.allocations)
    torch.cuda.synchronize()
    mem = torch.cuda.memory_allocated()
    for _ in range(5):
        assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False), first)
    assert dict(lm.executor.link.allocations) == allocations
    assert torch.cuda.memory_allocated() <= mem + (1 << 20)
    print(lm.last_stats.summary())


@pytest.mark.parametrize("prefill,decode", [("cpu-experts", "cpu-experts"), ("gpu-offload", "cpu-experts"),
                                            ("cpu-experts", "gpu"), ("cpu", "cpu-experts")])
def test_cuda_cpu_experts_matches_cpu_reference(fresh, prefill, decode):
    """MoE routed experts on the host beside CUDA layers: hidden states and routing cross the link."""
    model, ref = fresh("qwen3_moe")
    ids, mask = left_padded_batch()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
              return_dict_in_generate=True, output_logits=True)
    expected = ref.generate(**kw)
    plan = fixed_plan(model.config, prefill, decode, 1, batch_size=3, input_len=9, output_len=6)
    lm = api.load(model, plan=plan, accelerator="cuda", gpu_memory_bytes=GIB)
    out = lm.generate(**kw)
    assert torch.equal(out.sequences, expected.sequences)
    for a, b in zip(out.logits, expected.logits):
        torch.testing.assert_close(a.cpu(), b, atol=1e-3, rtol=1e-3)
    assert lm.executor.expert_modules[0][1].calls > 0
