"""``flexplan.load`` leaves a model passed in as it was, and an explicit dtype holds on every device.

A model passed in: the executor runs a module tree of its own over the model's tensors (shared, never
written), so the caller's modules, Parameters and values are untouched, the model still generates
what it did, and loading it again (a second plan to compare) works while the first wrapper still runs.
``dtype="float32"``: the CPU's part of a plan computes in float32 too, even where the CPU's own
fast dtype (or the planner's choice) would be bfloat16, unless ``cpu_dtype`` is given.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import flexplan.api as api
from flexplan.errors import InvalidInputError
from flexplan.executor.link import HOST_MEMORY
from flexplan.executor.plans import fixed_plan
from flexplan.hardware import get_hardware

from conftest import left_padded_batch

GIB = 1 << 30
NEW = 5


def _greedy(model, **kw):
    ids, mask = left_padded_batch()
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw)


def _snapshot(model):
    """What the caller can see of a model: its Parameter objects, their data, values and flags,
    the modules' instance attributes (forwards installed on an instance) and hooks, and its config."""
    return dict(
        params=[(n, p, p.data_ptr(), p.dtype, tuple(p.shape), p.requires_grad)
                for n, p in model.named_parameters(remove_duplicate=False)],
        values={n: t.clone() for n, t in model.state_dict().items()},
        modules=[(n, type(m), sorted(m.__dict__), len(m._forward_hooks), len(m._forward_pre_hooks))
                 for n, m in model.named_modules()],
        configs=[(n, m.config, getattr(m.config, "_attn_implementation", None)) for n, m in model.named_modules()
                 if hasattr(m, "config")],
        training=model.training,
    )


def _assert_unchanged(model, before):
    after = _snapshot(model)
    assert [(n, ptr, dt, shape, rg) for n, _, ptr, dt, shape, rg in after["params"]] == \
        [(n, ptr, dt, shape, rg) for n, _, ptr, dt, shape, rg in before["params"]]
    # the same Parameter objects
    assert all(a[1] is b[1] for a, b in zip(after["params"], before["params"], strict=True))
    assert after["values"].keys() == before["values"].keys()
    assert all(torch.equal(after["values"][k], v) for k, v in before["values"].items())
    assert after["modules"] == before["modules"]  # no instance forward, attribute or hook added
    assert all(a[1] is b[1] and a[2] == b[2] for a, b in zip(after["configs"], before["configs"], strict=True))
    assert after["training"] == before["training"]
    assert not hasattr(model, "flexplan_executor")


def _load(model, prefill, decode, gpu_layers=2, **kw):
    plan = fixed_plan(model.config, prefill, decode, gpu_layers, batch_size=3, input_len=9, output_len=NEW,
                      gpu_memory_bytes=GIB)
    return api.load(model, plan=plan, accelerator="cpu", gpu_memory_bytes=GIB, **kw)


@pytest.mark.parametrize("family,first,second", [
    ("llama", ("cpu", "cpu"), ("gpu-offload", "splitgen")),  # tied head: packed embedding, untied on the accelerator
    ("mixtral", ("cpu-experts", "cpu-attention"), ("gpu", "split-points")),  # experts, attention and split installs
])
def test_the_same_model_loads_twice_and_stays_as_it_was(fresh, family, first, second):
    model, _ = fresh(family)
    expected = _greedy(model)
    before = _snapshot(model)
    a = _load(model, *first)
    _assert_unchanged(model, before)
    b = _load(model, *second)  # a second plan over the same object (failed with a size mismatch before)
    _assert_unchanged(model, before)
    assert a.model is not model and b.model is not a.model
    assert (a.plan.prefill.policy, a.plan.decode.policy) == first
    assert (b.plan.prefill.policy, b.plan.decode.policy) == second
    assert torch.equal(_greedy(a), expected)
    assert torch.equal(_greedy(b), expected)
    assert torch.equal(_greedy(a), expected)  # the first wrapper still runs after the second ran
    assert torch.equal(_greedy(model), expected)  # the caller's model generates as before, without the plan
    _assert_unchanged(model, before)


def test_the_wrapper_shares_the_callers_tensors_until_it_places_them(fresh):
    """The wrapper's module tree is a copy of the modules, not of the weights: the caller's tensors
    are read once into the executor's buffers and never written; nothing of them is held afterwards
    beyond what the placement copied."""
    model, _ = fresh("llama")
    values = {n: t.clone() for n, t in model.state_dict().items()}
    lm = _load(model, "gpu-offload", "cpu", 1, cpu_linear_kernel="F.linear")
    callers = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = {p.untyped_storage().data_ptr() for p in lm.model.parameters()}
    assert not callers & held  # the wrapper's parameters are views of its own buffers
    assert all(torch.equal(model.state_dict()[n], v) for n, v in values.items())


def test_a_placed_tree_is_refused_with_what_to_pass(fresh):
    model, _ = fresh("llama")
    lm = _load(model, "cpu", "cpu")
    with pytest.raises(InvalidInputError) as e:
        api.load(lm.model, plan={"prefill": "cpu", "decode": "cpu"}, accelerator="cpu", gpu_memory_bytes=GIB)
    msg = str(e.value)
    assert "\n" not in msg and "already placed" in msg and "pass the model you gave flexplan.load" in msg
    assert torch.equal(_greedy(lm), _greedy(model))  # the refused load changed neither


def test_a_model_handed_over_runs_once_and_a_second_load_says_what_to_pass(fresh):
    """``keep_model=False``: the executor re-places the caller's own modules (no copy of the model
    beside the placed weights); loading that model again is refused before any planning."""
    model, ref = fresh("llama")
    lm = _load(model, "gpu-offload", "splitgen", keep_model=False)
    assert lm.model is model and model.flexplan_executor is lm.executor
    assert torch.equal(_greedy(lm), _greedy(ref))
    with pytest.raises(InvalidInputError, match=r"keep_model=False.*pass the model you gave flexplan.load"):
        _load(model, "cpu", "cpu")
    with pytest.raises(InvalidInputError, match="keep_model must be True"):
        _load(ref, "cpu", "cpu", keep_model="no")


# ----------------------------------------------------------------------------- dtype


def _bf16_cpu():
    """This machine described as a CPU whose fast dtype is bfloat16 (AMX): the planner would pick a
    bfloat16 CPU part, and the stand-in accelerator is built on it."""
    local = get_hardware("local")
    return replace(local, cpu=replace(local.cpu, isa=local.cpu.isa | {"amx_bf16"},
                                      peak_flops_per_s={"float32": 1e11, "bfloat16": 1e12}))


def _held_dtypes(lm) -> set[torch.dtype]:
    """The dtypes of every weight the executor holds, per place (flat buffers and packed weights)."""
    ex = lm.executor
    out = set()
    for g in (ex.embed, *ex.layers, ex.head):
        for st in g.storages.values():
            out.add((st.place, st.layout.dtype))
            out |= {(st.place, v.dtype) for v in st.views.values()}
            out |= {(st.place, b.tensor.dtype) for b in st.packed}
    return out


# the planner's path (policies forced, M and the CPU's dtype planned) and the fixed path (per-phase M,
# the CPU's dtype the local one: bfloat16 here by monkeypatch)
@pytest.mark.parametrize("plan", [
    {"prefill": "gpu-offload", "decode": "splitgen"},
    {"prefill": "gpu-offload", "decode": "splitgen", "prefill_gpu_layers": 1, "decode_gpu_layers": 2},
    {"prefill": "splitgen", "decode": "split-points"},
], ids=["planned", "fixed", "split-points"])
def test_explicit_float32_holds_on_the_cpu(fresh, monkeypatch, plan):
    monkeypatch.setattr(api, "local_cpu_dtype", lambda: "bfloat16")
    model, ref = fresh("llama")
    expected = _greedy(ref)
    lm = api.load(model, plan=plan, accelerator="cpu", dtype="float32", hardware=_bf16_cpu(), gpu_memory_bytes=GIB)
    assert (lm.plan.dtype, lm.plan.cpu_dtype) == ("float32", "float32")
    assert lm.executor.placement.cpu_weight_dtype == "float32"
    assert HOST_MEMORY in {p for p, _ in _held_dtypes(lm)}, "the plan computes some layers on the CPU"
    assert {dt for _, dt in _held_dtypes(lm)} == {torch.float32}
    assert torch.equal(_greedy(lm), expected)
    assert lm.executor.split.cpu_dtype == torch.float32


def test_a_separate_cpu_dtype_is_honoured(fresh, monkeypatch):
    monkeypatch.setattr(api, "local_cpu_dtype", lambda: "float32")
    model, _ = fresh("llama")
    plan = {"prefill": "gpu-offload", "decode": "splitgen", "prefill_gpu_layers": 1, "decode_gpu_layers": 2}
    lm = api.load(model, plan=plan, accelerator="cpu", dtype="float32", cpu_dtype="bf16", gpu_memory_bytes=GIB)
    assert (lm.plan.dtype, lm.plan.cpu_dtype) == ("float32", "bfloat16")
    assert (HOST_MEMORY, torch.bfloat16) in _held_dtypes(lm)
    # a plan dict's dtype holds on the CPU too; its cpu_dtype wins over load's
    lm = api.load(model, plan={**plan, "dtype": "float32"}, accelerator="cpu", dtype="bfloat16", gpu_memory_bytes=GIB)
    assert (lm.plan.dtype, lm.plan.cpu_dtype) == ("float32", "float32")
    lm = api.load(model, plan={**plan, "cpu_dtype": "float32"}, accelerator="cpu", cpu_dtype="bfloat16",
                  gpu_memory_bytes=GIB)
    assert lm.plan.cpu_dtype == "float32"


def test_bad_cpu_dtype_and_a_dtype_the_cpu_cannot_plan_are_refused(fresh):
    model, _ = fresh("llama")
    with pytest.raises(InvalidInputError, match=r"cpu_dtype: unknown dtype 'int3'; use one of float32"):
        api.load(model, accelerator="cpu", cpu_dtype="int3", gpu_memory_bytes=GIB)
    local = get_hardware("local")
    no_fp16 = replace(local, cpu=replace(local.cpu, peak_flops_per_s={"float32": 1e11, "bfloat16": 1e10}))
    with pytest.raises(InvalidInputError) as e:
        api.load(model, plan={"prefill": "gpu-offload", "decode": "splitgen"}, accelerator="cpu", dtype="float16",
                 hardware=no_fp16, gpu_memory_bytes=GIB)
    msg = str(e.value)
    assert "\n" not in msg and "float16" in msg and "cpu_dtype=" in msg and "float32" in msg
