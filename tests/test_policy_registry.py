"""A policy is one module plus one registry line: the toy ``alt`` policy (tests/toy_policy.py,
registered here at run time) runs through ``flexplan.plan()``, ``flexplan explain`` and the
executor, token-identical to transformers, with nothing else edited."""

from __future__ import annotations

import pytest

import flexplan
import flexplan.api as api
from flexplan.estimator.policies import REGISTRY, register, unregister
from flexplan.estimator.terms import Shape
from flexplan.explain import format_plan
from flexplan.estimator.policies import POLICIES
from flexplan.placement import CPU, RESIDENT
from flexplan.planner import placement_memory
from flexplan.workload.model import ModelSpec

from conftest import left_padded_batch
from toy_policy import AltPolicy

GIB = 1 << 30
NEW = 6


@pytest.fixture
def alt():
    register("alt", AltPolicy())
    yield "alt"
    unregister("alt")


def test_registry_is_the_only_list(alt):
    assert "alt" in POLICIES and POLICIES[-1] == "alt" and REGISTRY["alt"].name == "alt"
    pp = REGISTRY["alt"].placement(6, 2, "decode")
    assert pp.modes == (CPU, RESIDENT, CPU, RESIDENT, CPU, CPU)
    assert pp.groups(1)["mlp"].computes == "accelerator" and pp.groups(0)["attention"].weights == "host"


def test_toy_policy_is_planned_and_explained(alt):
    p = flexplan.plan("meta-llama/Llama-2-7b-hf", "flexinfer-server2", batch_size=1, input_len=128, output_len=16,
                      prefill="alt", decode="alt", gpu_layers=3)
    assert (p.prefill.policy, p.prefill.gpu_layers, p.decode.policy, p.decode.gpu_layers) == ("alt", 3, "alt", 3)
    assert p.e2e_s > 0 and p.baselines["alt"] > 0
    text = format_plan(p)
    assert "alt" in text and "29 cpu, 3 resident" in text
    free = flexplan.plan("meta-llama/Llama-2-7b-hf", "flexinfer-server2", batch_size=1, input_len=128, output_len=16)
    assert {c.policy for c in free.candidates} == set(POLICIES)


@pytest.mark.parametrize("prefill,decode", [("alt", "alt"), ("alt", "gpu-offload"), ("gpu-offload", "alt"),
                                            ("splitgen", "alt"), ("alt", "cpu")])
def test_toy_policy_runs_token_identical(alt, fresh, prefill, decode):
    model, ref = fresh("llama")
    ids, mask = left_padded_batch()
    expected = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    lm = api.load(model, plan={"prefill": prefill, "decode": decode, "gpu_layers": 2, "dtype": "float32",
                               "cpu_dtype": "float32"}, accelerator="cpu", gpu_memory_bytes=GIB)
    out = lm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch_equal(out, expected)
    assert (lm.plan.prefill.policy, lm.plan.decode.policy) == (prefill, decode)
    ex = lm.executor
    # and the one memory model, from the config alone, sizes the new pattern as the executor allocated it
    n = model.config.num_hidden_layers
    spec = ModelSpec.from_config(model.config)
    phases = {ph: REGISTRY[c.policy].placement(n, c.gpu_layers, ph) for ph, c in lm.plan.phases.items()}
    need = placement_memory(Shape(spec, 3, 9, NEW, "float32", "float32"), None, phases,
                            ex.backend.linear_kernel if ex.backend.packs_weights else None)
    assert all(need.allocated(w) == ex.link.live_bytes(w) for w in ("accelerator", "pinned", "host"))


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
