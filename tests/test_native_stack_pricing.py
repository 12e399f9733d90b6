"""A decode step the executor's native stack runs (executor.cpu_decode.FusedStack: every layer in one
native call) priced with its own measured overheads: ModelSpec.native_decode_stack names the models
it runs, the calibration's cpu_stack_overhead rows give the per-layer and per-step seconds, and
FlexInfer's Eq. 1 reads them for an all-CPU float32 decode."""

import numpy as np
import pytest
from conftest import FAMILIES, MORE_FAMILIES, make_model
from synthetic_machine import HW_CPU, SyntheticMachine

from flexplan.estimator.efficiency import DefaultEfficiency
from flexplan.estimator.phase_costs import phase_costs
from flexplan.estimator.policies.cpu import eq1_time_s
from flexplan.estimator.terms import Shape
from flexplan.factors.efficiency import from_measurements
from flexplan.workload.model import ModelSpec

SETTINGS = {"cpu_dtypes": ["float32"], "cpu_threads": 16}


def _stack_ran(model) -> bool:
    """Whether the executor's native stack ran the decode steps of a short greedy generation."""
    import flexplan
    import torch

    lm = flexplan.load(model, plan={"prefill": "cpu", "decode": "cpu"}, accelerator=None)
    ids = torch.tensor([[3, 4, 5, 6]])
    lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
    return lm.last_stats.native_stack_steps > 0


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
def test_the_spec_names_the_models_whose_decode_the_executor_stacks(family):
    """The config-level rule agrees with what the executor does on every tested family: the stack
    runs a model's decode steps exactly when the rule names it (a sliding window makes it step aside
    once the keys pass the window: such a model is priced as the layer calls)."""
    model = make_model(family)
    assert ModelSpec.from_config(model.config).native_decode_stack == _stack_ran(model)


@pytest.mark.parametrize("overrides, runs", [({}, True), ({"num_key_value_heads": 1}, False),
                                             ({"intermediate_size": 96}, False)],
                         ids=["packable", "kv-rows-16", "mlp-rows-96"])
def test_the_rule_follows_whether_the_stack_runs_a_decode(overrides, runs):
    """Beyond the family: a Llama whose projections are not whole native blocks (64 rows) is not
    packed, and its stack steps aside at run time; the rule says so from the config."""
    model = make_model("llama", **overrides)
    assert ModelSpec.from_config(model.config).native_decode_stack == _stack_ran(model) == runs


def _stack_rows(layer_s: dict[int, float], step_s: dict[int, float], native: bool = True) -> list[dict]:
    return [{"dtype": "float32", "batch": b, "layer_s": layer_s[b], "step_s": step_s[b], "native_stack": native,
             "depths": [2, 26], "steps": 16} for b in layer_s]


def _factors(rows: list[dict] | None):
    m = SyntheticMachine(bytes_per_s=40e9, kv_bytes_per_s=20e9, flops_per_s={"float32": 150e9, "bfloat16": 300e9},
                         op_s=5e-6, layer_s=100e-6, step_s=0.5e-3, logit_s=1e-10)
    meas = m.measurements("quick", ["float32"])
    if rows is not None:
        meas["cpu_stack_overhead"] = rows
    return from_measurements(meas, SETTINGS, HW_CPU, "test")


def test_the_stack_rows_give_its_overheads_by_batch_and_logits():
    """Per layer: the rows' seconds by batch, interpolated in log batch between 1 and 8; per step:
    the row's intercept plus generate's per-logit cost at the model's batch x vocabulary."""
    eff = _factors(_stack_rows({1: 30e-6, 8: 90e-6}, {1: 0.8e-3, 8: 0.9e-3}))
    per_logit = eff.step_overhead.per_logit_s
    layer, step = eff.cpu_stack_overhead_s(1, 49152, "float32")
    assert layer == pytest.approx(30e-6) and step == pytest.approx(0.8e-3 + per_logit * 49152)
    layer, _ = eff.cpu_stack_overhead_s(int(np.sqrt(8) + 0.5), 0, "float32")  # 3: half way in log batch
    assert 30e-6 < layer < 90e-6
    layer, step = eff.cpu_stack_overhead_s(16, 1000, "float32")  # held beyond the last batch
    assert layer == pytest.approx(90e-6) and step == pytest.approx(0.9e-3 + per_logit * 16 * 1000)


def test_without_stack_rows_or_where_the_stack_did_not_run_there_is_no_stack_price():
    assert _factors(None).cpu_stack_overhead_s(1, 49152, "float32") is None
    assert _factors(_stack_rows({1: 30e-6}, {1: 0.8e-3}, native=False)).cpu_stack_overhead_s(1, 100) is None
    assert DefaultEfficiency.for_hardware(HW_CPU).cpu_stack_overhead_s(1, 100) is None


class _StackPriced(DefaultEfficiency):
    """Defaults, with the native stack's overheads given."""

    def cpu_stack_overhead_s(self, batch=1, vocab=0, dtype=None):
        return 20e-6, 0.4e-3


def _decode_s(spec: ModelSpec, eff, cpu_dtype: str = "float32") -> float:
    shape = Shape(spec, 1, 128, 32, "float32", cpu_dtype)
    return eq1_time_s(phase_costs(shape, HW_CPU, eff, "decode"), spec.num_layers)


def test_eq1_prices_a_stacked_decode_with_the_stack_overheads_worked_by_hand():
    """Only the overhead terms differ: N x (20 us - the layer calls' overhead) + (0.4 ms - the
    step's), with the defaults' 150 us a layer and 1 ms a step: 30 layers, 30 x -130 us - 0.6 ms."""
    base = DefaultEfficiency.for_hardware(HW_CPU)
    eff = _StackPriced.for_hardware(HW_CPU)
    llama = ModelSpec.from_config(make_model("llama", num_hidden_layers=30).config)
    assert llama.native_decode_stack
    assert _decode_s(llama, eff) - _decode_s(llama, base) == pytest.approx(30 * (20e-6 - 150e-6) + (0.4e-3 - 1e-3))
    # the prefill, a bfloat16 CPU decode and a model the stack does not run keep the layer calls' price
    olmo2 = ModelSpec.from_config(make_model("olmo2").config)
    assert not olmo2.native_decode_stack and _decode_s(olmo2, eff) == _decode_s(olmo2, base)
    assert _decode_s(llama, eff, "bfloat16") == _decode_s(llama, base, "bfloat16")
    prefill = Shape(llama, 1, 128, 32, "float32", "float32")
    assert (eq1_time_s(phase_costs(prefill, HW_CPU, eff, "prefill"), 30)
            == eq1_time_s(phase_costs(prefill, HW_CPU, base, "prefill"), 30))


def test_a_serving_iteration_is_priced_as_the_layer_calls_it_runs():
    """The engine's iterations run each layer's native calls over paged KV, never the stack: the
    placed scheduler's price (estimator.iteration) does not take the stack's overheads."""
    from flexplan.estimator.iteration import iteration_time_s

    base, eff = DefaultEfficiency.for_hardware(HW_CPU), _StackPriced.for_hardware(HW_CPU)
    llama = ModelSpec.from_config(make_model("llama", num_hidden_layers=30).config)
    args = ("cpu", 0, "decode", 4, 200, "float32", "float32")
    assert iteration_time_s(llama, HW_CPU, eff, *args) == iteration_time_s(llama, HW_CPU, base, *args)
