"""iteration_time_s: the serving scheduler's per-iteration price is the planner's own estimate."""

import pytest

import flexplan
from flexplan.errors import InvalidInputError
from flexplan.estimator.efficiency import DefaultEfficiency
from flexplan.estimator.iteration import iteration_time_s
from flexplan.hardware import get_hardware
from flexplan.workload import resolve_model

MODEL = "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize("gpu_memory_gib", [24, 80])
def test_one_step_equals_the_plans_ttft_and_tpot_of_that_shape(gpu_memory_gib):
    hw, spec = get_hardware("flexinfer-server2"), resolve_model(MODEL)
    eff = DefaultEfficiency.for_hardware(hw)
    p = flexplan.plan(spec, hardware=hw, batch_size=4, input_len=300, output_len=2, efficiency=eff,
                      gpu_memory_bytes=gpu_memory_gib << 30, include_initial_load=False)
    dec = iteration_time_s(spec, hw, eff, p.decode.policy, p.decode.gpu_layers, "decode", 4, 301, p.dtype, p.cpu_dtype)
    pre = iteration_time_s(spec, hw, eff, p.prefill.policy, p.prefill.gpu_layers, "prefill", 4, 300, p.dtype,
                           p.cpu_dtype)
    assert dec == pytest.approx(p.tpot_s, rel=1e-9)
    assert pre == pytest.approx(p.ttft_s, rel=1e-9)


def test_more_keys_or_a_bigger_batch_never_costs_less():
    hw, spec = get_hardware("flexinfer-server2"), resolve_model(MODEL)
    eff = DefaultEfficiency.for_hardware(hw)
    t = [iteration_time_s(spec, hw, eff, "gpu-offload", 8, "decode", b, k) for b, k in ((1, 128), (1, 4096), (16, 4096))]
    assert t[0] <= t[1] <= t[2]


@pytest.mark.parametrize("kw", [dict(phase="train"), dict(policy="nope"), dict(batch=0)])
def test_bad_arguments_get_a_clear_error(kw):
    args = dict(policy="cpu", phase="decode", batch=1)
    args.update(kw)
    hw = get_hardware("flexinfer-server2")
    with pytest.raises(InvalidInputError):
        iteration_time_s(resolve_model(MODEL), hw, DefaultEfficiency.for_hardware(hw), args["policy"], 0, args["phase"],
                         args["batch"], 16)
