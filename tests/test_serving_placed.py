"""The serving engine over a FlexModel (issue 39 item 4): the executor places the weights per phase
(accelerator="cpu" stands in for the GPU), the engine keeps the KV in its paged pools; each
request's greedy tokens equal transformers' generate() on its prompt alone under continuous
batching, and the caller's FlexModel still generates afterwards."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import make_model

import flexplan.api as api
from flexplan.errors import UnsupportedModelError
from flexplan.executor.plans import fixed_plan
from flexplan.serving.engine import Engine
from flexplan.serving.fcfs import FcfsScheduler
from flexplan.serving.types import MODE_ASYNC_OVERLAP, SamplingParams

GIB = 1 << 30
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [20, 21, 22], list(range(30, 45)), [99, 98])
PLANS = [("llama", "gpu-offload", "splitgen"), ("llama", "gpu-offload-partial", "gpu-offload-partial"),
         ("llama", "gpu", "cpu-attention"), ("qwen3_moe", "cpu-experts", "cpu-experts")]


def alone(model, prompt) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False)[0, len(prompt):]
    ids, eos = out.tolist(), model.generation_config.eos_token_id
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def drain(engine, got, steps):
    for _ in range(steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


@pytest.mark.parametrize("family,prefill,decode", PLANS, ids=lambda v: v)
def test_placed_model_served_with_the_engines_kv(family, prefill, decode):
    torch.set_num_threads(1)
    ref = make_model(family)
    refs = [alone(ref, p) for p in PROMPTS]
    plan = fixed_plan(ref.config, prefill, decode, 1, batch_size=1, input_len=8, output_len=6, gpu_memory_bytes=GIB)
    lm = api.load(make_model(family), plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    assert (lm.plan.prefill.policy, lm.plan.decode.policy) == (prefill, decode)
    phases = []
    # FCFS: every iteration under the engine's phase rule (placed_scheduler's choice: its own tests)
    with Engine(lm, device_blocks=16, host_blocks=16, block_size_tokens=4, token_budget=12,
                scheduler=FcfsScheduler()) as e:
        e.runner.phase_rule = lambda b, rule=e.runner.phase_rule: phases.append(rule(b)) or phases[-1]
        e.add_request("a", PROMPTS[0], GREEDY)
        e.add_request("b", PROMPTS[1], GREEDY)
        got = drain(e, {}, 2)
        e.add_request("c", PROMPTS[2], GREEDY)  # arrives later, prefilled in chunks beside decodes
        got = drain(e, got, 2)
        e.add_request("d", PROMPTS[3], GREEDY)
        got = drain(e, got, 200)
    assert [got[r] for r in "abcd"] == refs
    assert {"prefill", "decode"} <= set(phases)
    assert lm.executor.phase_stats["decode"].steps > 0  # the executor ran its decode placement
    # the caller's placement survives: generate() still gives transformers' tokens
    assert lm.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=GREEDY.max_tokens,
                       do_sample=False)[0, len(PROMPTS[0]):].tolist()[:len(refs[0])] == refs[0]


def test_from_pretrained_with_a_plan_and_threads_refused(tmp_path):
    """Engine.from_pretrained(path, plan=...) loads through flexplan.load; sub-batches on threads at
    once over one executor are refused with what works."""
    torch.set_num_threads(1)
    ref = make_model("llama")
    ref.save_pretrained(tmp_path)
    prompt = PROMPTS[0]
    with Engine.from_pretrained(tmp_path, plan={"prefill": "gpu-offload", "decode": "splitgen", "gpu_layers": 1},
                                accelerator="cpu", gpu_memory_bytes=GIB, device_blocks=8, host_blocks=8,
                                block_size_tokens=4) as e:
        assert e.flexmodel.plan.decode.policy == "splitgen"
        e.add_request("a", prompt, GREEDY)
        assert drain(e, {}, 50)["a"] == alone(ref, prompt)
    with pytest.raises(UnsupportedModelError, match="asymmetric_pipelining"):
        Engine(e.flexmodel, asymmetric_pipelining=True, host_blocks=8)


class AsyncOverlap(FcfsScheduler):
    """FCFS, every iteration with host decodes in APEX's asynchronous overlap."""

    def schedule(self, state):
        plan = super().schedule(state)
        return dataclasses.replace(plan, mode=MODE_ASYNC_OVERLAP if plan.host_decodes else plan.mode)


def test_host_pool_and_async_overlap_keep_the_tokens():
    """Requests in the host pool, their decodes on a thread beside the next iteration: the
    executor's forwards run in turn and the tokens still equal generate() alone."""
    torch.set_num_threads(1)
    ref = make_model("llama")
    refs = [alone(ref, p) for p in PROMPTS]
    plan = fixed_plan(ref.config, "gpu-offload", "splitgen", 1, batch_size=1, input_len=8, output_len=6,
                      gpu_memory_bytes=GIB)
    lm = api.load(make_model("llama"), plan=plan, accelerator="cpu", gpu_memory_bytes=GIB)
    inside, most, forward = [0], [0], lm.model.forward

    def counted(*args, **kwargs):  # forwards inside the executor's hooks at once
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.005)  # room for another thread's forward to enter
            return forward(*args, **kwargs)
        finally:
            inside[0] -= 1

    lm.model.forward = counted
    with Engine(lm, device_blocks=4, host_blocks=32, block_size_tokens=4, scheduler=AsyncOverlap()) as e:
        for rid, p in zip("abcd", PROMPTS):
            e.add_request(rid, p, GREEDY)
        got, overlapped = {}, False
        while e.has_unfinished():
            drain(e, got, 1)
            overlapped |= e._in_flight is not None
    assert overlapped and most[0] == 1 and [got[r] for r in "abcd"] == refs
    del lm.model.forward
