"""The serving engine on a CUDA device (skipped without one): the device pool on the GPU beside a
host pool attended on the CPU, NEO's asymmetric pipelining on threads with their own streams,
NEO/APEX's scheduler priced for this machine; a request's greedy tokens equal transformers'
generate() on the same GPU model, whatever shares its batch. Run by benchmarks/gpu_session.sh's
``serve`` step when a GPU is lent."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from flexplan.hardware import get_hardware
from flexplan.measure.state import efficiency_now
from flexplan.serving.engine import Engine
from flexplan.serving.kv_blocks import DEVICE, HOST
from flexplan.serving.scheduler import NeoApexScheduler
from flexplan.serving.types import SamplingParams
from flexplan.workload import resolve_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 52)), [99])


def alone(model, prompt) -> list[int]:
    out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=GREEDY.max_tokens,
                         do_sample=False)[0, len(prompt):]
    ids = out.tolist()
    eos = model.generation_config.eos_token_id
    return ids[:ids.index(eos) + 1] if eos in ids else ids


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma2"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_greedy_tokens_on_the_gpu_with_both_pools(family, pipelined):
    model = make_model(family).to("cuda")
    refs = [alone(model, p) for p in PROMPTS]
    with Engine(model, device_blocks=6, host_blocks=64, block_size_tokens=4, token_budget=16,
                asymmetric_pipelining=pipelined) as e:
        assert e.device.type == "cuda" and e.blocks.pools[DEVICE].device.type == "cuda"
        assert e.blocks.pools[HOST].device.type == "cpu"
        outs = e.generate(list(PROMPTS), GREEDY)
        assert [list(o.new_token_ids) for o in outs] == refs


def test_neo_apex_scheduler_drives_the_gpu_engine():
    model = make_model("llama").to("cuda")
    refs = [alone(model, p) for p in PROMPTS]
    hw = get_hardware("local")
    scheduler = NeoApexScheduler(resolve_model(model.config), hw, efficiency_now(hw))
    with Engine(model, device_blocks=6, host_blocks=64, block_size_tokens=4, token_budget=16,
                scheduler=scheduler) as e:
        outs = e.generate(list(PROMPTS), GREEDY)
        assert [list(o.new_token_ids) for o in outs] == refs
        assert e.stats().iterations > 0


@pytest.mark.parametrize("prefill,decode", [("gpu-offload", "splitgen"), ("gpu", "cpu-attention")])
def test_a_placed_model_on_the_gpu_served_under_the_priced_placement(prefill, decode):
    """A FlexModel on CUDA (streamed / resident layers per phase), the device pool on the GPU: each
    iteration under the placement the estimator prices lower; generate()'s tokens on the CPU model
    (float32 on both)."""
    import flexplan.api as api
    from flexplan.executor.plans import fixed_plan
    from flexplan.serving.placed_scheduler import PlacementScheduler

    cpu_model = make_model("llama")
    refs = [alone(cpu_model, p) for p in PROMPTS]
    plan = fixed_plan(cpu_model.config, prefill, decode, 1, batch_size=1, input_len=8, output_len=10,
                      gpu_memory_bytes=1 << 30, dtype="float32", cpu_dtype="float32")
    lm = api.load(make_model("llama"), plan=plan, accelerator="cuda", gpu_memory_bytes=1 << 30, dtype="float32")
    with Engine(lm, device_blocks=6, host_blocks=64, block_size_tokens=4, token_budget=16) as e:
        assert isinstance(e.scheduler, PlacementScheduler) and e.blocks.pools[DEVICE].device.type == "cuda"
        outs = e.generate(list(PROMPTS), GREEDY)
        assert [list(o.new_token_ids) for o in outs] == refs
