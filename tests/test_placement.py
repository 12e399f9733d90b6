"""The placement description and the memory model on cases worked out by hand."""

from __future__ import annotations

import numpy as np

from flexplan import memory
from flexplan.memory import LINEAR, PLAIN, Inventory, Tensor, footprint
from flexplan.placement import ACCELERATOR, CPU, HOST, PINNED, RESIDENT, STREAMED, PhasePlacement, Placement
from flexplan.estimator.policies import placement_of


def test_runs_expand_to_layers_and_head_follows_the_last_layer():
    pp = PhasePlacement.of((CPU, 3), (RESIDENT, 1))
    assert pp.modes == (CPU, CPU, CPU, RESIDENT) and pp.num_layers == 4
    assert pp.head_mode is RESIDENT and pp.groups(0)["attention"].weights == HOST
    assert PhasePlacement.of((CPU, 4), (RESIDENT, 0)).head_mode is CPU
    vec = PhasePlacement.of((CPU, 4 - np.array([0, 1, 4])), (RESIDENT, np.array([0, 1, 4])))
    assert list(vec.head_on_accelerator()) == [False, True, True]


def test_decode_resident_layers_stay_resident_in_prefill():
    """FlexInfer 5.3: prefill streams layers 0-3, decode keeps 2-3 resident: 2-3 are resident in both."""
    p = Placement.of({"prefill": PhasePlacement.of((STREAMED, 4)), "decode": PhasePlacement.of((CPU, 2), (RESIDENT, 2))},
                     "bfloat16", "float32")
    assert p.modes["prefill"] == (STREAMED, STREAMED, RESIDENT, RESIDENT)
    assert p.layer_places(0) == {HOST, PINNED} and p.layer_places(3) == {ACCELERATOR}
    assert p.streamed_layers == [0, 1] and not p.kv_host_pinned(0)
    assert p.census() == {(frozenset({HOST, PINNED}), True): 2, (frozenset({ACCELERATOR}), False): 2}
    same = Placement.of(dict(p.phases), "float32", "float32")
    assert same.layer_places(0) == {PINNED}  # one pinned copy serves the CPU and the stream


def test_footprint_by_hand():
    """One layer: a 64 x 32 linear (8192 B in fp32, 4096 B in bf16) and a 32-wide norm (128 B fp32,
    64 B bf16, each padded to 64 B); embedding 10 x 32 fp32 = 1280 B; head: norm + 10 x 32 linear."""
    layer = (Tensor("w", (64, 32), LINEAR), Tensor("norm", (32,), PLAIN))
    head = (Tensor("norm", (32,), PLAIN), Tensor("lm_head", (10, 32), LINEAR))
    inv = Inventory((Tensor("embed", (10, 32)),), (layer, layer), head, kv_heads=2, head_dim=8,
                    activation_elems_per_row=100, vocab_size=10)
    # splitgen with M = 1 in both phases, bf16 accelerator, fp32 CPU, blocked kernel, batch 2 x 5 (+3) tokens
    pp = PhasePlacement.of((CPU, 1), (RESIDENT, 1))
    need = footprint(inv, Placement.of({"prefill": pp, "decode": pp}, "bfloat16", "float32"), 2, 5, 8,
                     memory.KERNEL_BLOCKED)
    kv_bf16, kv_fp32 = 2 * 2 * 8 * 2 * 8 * 2, 2 * 2 * 8 * 2 * 8 * 4  # 2 (K, V) x batch x tokens x heads x dim
    assert need.accelerator["resident weights"] == 4096 + 64
    assert need.accelerator["KV cache"] == kv_bf16
    assert need.accelerator["head"] == 64 + 640  # 10 x 32 bf16 = 640
    assert need.accelerator["activations"] == 2 * 5 * 100 * 2 + 2 * 10 * 4  # prefill rows, bf16; fp32 logits
    # the CPU layer: the linear blocked in bf16 (a 16-bit model under fp32 compute), the norm fp32 padded
    assert need.host["CPU weights"] == 1280 + (4096 + 128)
    assert need.host["KV cache"] == kv_fp32 and need.pinned == {"streamed weights": 0, "KV cache": 0}
    assert need.accelerator["weight double buffers"] == 0
    # gpu-offload: both layers streamed from pinned bf16 copies, two slots of one layer each
    off = PhasePlacement.of((STREAMED, 2))
    need = footprint(inv, Placement.of({"prefill": off, "decode": off}, "bfloat16", "float32"), 2, 5, 8)
    assert need.pinned == {"streamed weights": 2 * (4096 + 64), "KV cache": 2 * kv_bf16}
    assert need.accelerator["weight double buffers"] == 2 * (4096 + 64)
    assert need.accelerator["KV double buffers"] == 2 * kv_bf16
    assert need.host["CPU weights"] == 1280  # embedding only; the head sits with the (streamed) last layer


def test_vectorised_footprint_equals_one_at_a_time():
    from flexplan.workload import resolve_model

    spec = resolve_model("meta-llama/Llama-2-7b-hf")
    inv, n = Inventory.from_spec(spec), spec.num_layers
    ms = np.arange(0, n + 1)
    vec = footprint(inv, Placement.of({"decode": PhasePlacement.of((STREAMED, n - ms), (RESIDENT, ms))},
                                      "bfloat16", "float32"), 4, 128, 160, reserved_bytes=1 << 30)
    for m in (0, 1, 17, n):
        one = footprint(inv, Placement.of({"decode": PhasePlacement.of((STREAMED, n - m), (RESIDENT, m))},
                                          "bfloat16", "float32"), 4, 128, 160, reserved_bytes=1 << 30)
        assert vec.accelerator_bytes[m] == one.accelerator_bytes and vec.host_total_bytes[m] == one.host_total_bytes


def test_operator_groups_placed_apart_are_described_but_refused_by_the_executor_path():
    import pytest

    from flexplan.errors import InvalidInputError
    from flexplan.estimator.policies import register, unregister
    from flexplan.estimator.policies.splitgen import SplitGenPolicy
    from flexplan.executor.plans import fixed_plan
    from flexplan.placement import ON_CPU, LayerMode, Where

    attn_on_cpu = LayerMode("attention on CPU", ACCELERATOR, "accelerator", (("attention", Where(HOST, ON_CPU)),))
    assert not attn_on_cpu.uniform and attn_on_cpu.groups()["attention"] == Where(HOST, ON_CPU)
    assert attn_on_cpu.groups()["mlp"] == Where(ACCELERATOR, "accelerator") and RESIDENT.uniform

    class Neo(SplitGenPolicy):  # NEO-style: decode attention on the CPU (a later issue runs it)
        def placement(self, num_layers, gpu_layers, phase):
            return PhasePlacement.of((attn_on_cpu, num_layers))

    register("neo-toy", Neo())
    try:
        with pytest.raises(InvalidInputError, match="whole layers"):  # refused when the plan is made
            fixed_plan({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 8,
                        "num_attention_heads": 2, "vocab_size": 16}, "neo-toy", "neo-toy", 1)
    finally:
        unregister("neo-toy")
