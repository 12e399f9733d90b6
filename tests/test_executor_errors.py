"""Bad input is refused before anything is allocated, with a message that says what would work."""

from __future__ import annotations

import pytest
import torch
import transformers

import flexplan.api as api
from flexplan.errors import DeviceUnavailableError, DoesNotFitError, InvalidInputError, UnsupportedModelError
from flexplan.executor.plans import fixed_plan

from conftest import left_padded_batch

MIB = 1 << 20


def weights_untouched(model, ptrs) -> bool:
    return [p.data_ptr() for p in model.parameters()] == ptrs


def test_plan_that_does_not_fit_the_accelerator_is_refused_before_allocation(fresh):
    model, _ = fresh("llama")
    ptrs = [p.data_ptr() for p in model.parameters()]
    plan = fixed_plan(model.config, "gpu", "gpu", batch_size=4, input_len=64, output_len=64)
    with pytest.raises(DoesNotFitError) as e:
        api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=200_000)
    msg = str(e.value)
    assert "accelerator memory" in msg and "gpu_memory_bytes" in msg and "KV cache" in msg and "MiB" in msg
    assert "gpu_layers" in msg  # what would work
    assert weights_untouched(model, ptrs)


def test_request_whose_kv_cache_does_not_fit_is_refused_before_allocation(fresh):
    model, _ = fresh("llama")
    plan = fixed_plan(model.config, "gpu", "gpu", batch_size=1, input_len=8, output_len=4)
    weights = sum(p.numel() * 4 for p in model.parameters())
    lm = api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=weights + MIB // 2)
    ids, mask = left_padded_batch((8,))
    lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    live = lm.executor.link.live_bytes()
    big = torch.randint(3, 100, (16, 200))
    with pytest.raises(DoesNotFitError, match=r"batch 16 x 264 tokens.*KV cache"):
        lm.generate(input_ids=big, attention_mask=torch.ones_like(big), max_new_tokens=64, do_sample=False)
    assert lm.executor.link.live_bytes() == live


def test_pinned_budget_is_enforced(fresh):
    model, _ = fresh("qwen2")
    ptrs = [p.data_ptr() for p in model.parameters()]
    plan = fixed_plan(model.config, "gpu-offload", "gpu-offload", batch_size=1, input_len=8, output_len=4)
    with pytest.raises(DoesNotFitError, match="pinned_memory_budget_bytes"):
        api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=1 << 30, pinned_memory_budget_bytes=100_000)
    assert weights_untouched(model, ptrs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda(fresh):
    model, _ = fresh("llama")
    with pytest.raises(DeviceUnavailableError, match="accelerator='cpu'"):
        api.load(model, accelerator="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_plan_needing_an_accelerator_without_one(fresh):
    model, ref = fresh("llama")
    plan = fixed_plan(model.config, "gpu-offload", "splitgen", 2, batch_size=1, input_len=8, output_len=4)
    with pytest.raises(DeviceUnavailableError, match="without CUDA|no CUDA"):
        api.load(model, plan=plan)
    with pytest.raises(DeviceUnavailableError):
        api.load(model, plan={"prefill": "gpu", "decode": "cpu"})
    lm = api.load(model, plan={"dtype": "float32", "cpu_dtype": "float32"})  # plans for what exists: the CPU
    assert (lm.plan.prefill.policy, lm.plan.decode.policy) == ("cpu", "cpu")
    ids, mask = left_padded_batch()
    assert torch.equal(lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False),
                       ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False))


def test_encoder_decoder_refused_in_one_line(one_thread):
    """A model that cannot run layer by layer is refused at load, before any allocation, in
    one line that says what it is and why (decoder-only causal LMs of any family run)."""
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2, vocab_size=64)
    model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(UnsupportedModelError) as e:
        api.load(model, accelerator="cpu")
    assert "is an encoder-decoder model" in str(e.value) and "decoder-only" in str(e.value) and "\n" not in str(e.value)


def test_bad_plans(fresh):
    model, _ = fresh("llama")
    with pytest.raises(InvalidInputError, match="needs gpu_layers"):
        api.load(model, plan={"prefill": "splitgen", "decode": "cpu", "decode_gpu_layers": 0}, accelerator="cpu")
    with pytest.raises(InvalidInputError, match="unknown plan override"):
        api.load(model, plan={"prefil": "cpu"}, accelerator="cpu")
    with pytest.raises(InvalidInputError, match="between 0 and 4"):
        api.load(model, plan={"prefill": "splitgen", "decode": "cpu", "gpu_layers": 9}, accelerator="cpu")
    other = fixed_plan(transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=64,
                                                num_attention_heads=4), "cpu", "cpu")
    with pytest.raises(InvalidInputError, match="2-layer model"):
        api.load(model, plan=other, accelerator="cpu")
    with pytest.raises(InvalidInputError, match="accelerator"):
        api.load(model, accelerator="tpu")
    with pytest.raises(InvalidInputError, match="not a model folder"):
        api.load("/nonexistent/model")
