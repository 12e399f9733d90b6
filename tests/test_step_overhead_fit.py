"""generate()'s per-step overhead from the calibration's step timings (factors.efficiency)."""

from synthetic_machine import HW_CPU, SyntheticMachine

from flexplan.estimator.efficiency import STEP_OVERHEAD_DEFAULT_S
from flexplan.factors.efficiency import from_measurements

SETTINGS = {"cpu_dtypes": ["float32"], "cpu_threads": 16}


def _factors(layer_overhead_s=None, **machine):
    m = SyntheticMachine(bytes_per_s=40e9, kv_bytes_per_s=20e9, flops_per_s={"float32": 150e9, "bfloat16": 300e9},
                         op_s=5e-6, layer_s=100e-6, **machine)
    meas = m.measurements("quick", ["float32"])
    if layer_overhead_s is not None:  # the layer overhead's own timing, as a busy machine may give it
        meas["cpu_layer_overhead"] = {**meas["cpu_layer_overhead"], "time_s": layer_overhead_s,
                                      "time_median_s": layer_overhead_s}
    return from_measurements(meas, SETTINGS, HW_CPU, "test")


def test_the_step_overhead_is_fitted_from_the_step_timings():
    eff = _factors(step_s=0.5e-3, logit_s=1e-10)
    assert 0 < eff.cpu_step_overhead_s(1, 1000) < eff.cpu_step_overhead_s(8, 50000)


def test_a_step_overhead_measured_at_zero_keeps_the_default():
    """The layer overhead timed above every step (a noisy probe): nothing left, so not a free loop."""
    eff = _factors(layer_overhead_s=1.0, step_s=0.5e-3, logit_s=1e-10)
    assert eff.cpu_step_overhead_s(4, 49152) == STEP_OVERHEAD_DEFAULT_S
    assert any("step overhead measured at 0" in n for n in eff.notes)
