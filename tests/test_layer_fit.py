"""Real decoder layers in the fit (flexplan/factors/layer_fit.py): the prefill layers' compute
factor, the decode layers' attention factor over a longer cache, the pooled decode overhead."""

from __future__ import annotations

import numpy as np
import pytest

from flexplan.factors.efficiency import _attention_spec, from_measurements
from flexplan.factors.layer_fit import non_decreasing_fit
from flexplan.measure.microbench import MODES
from flexplan.estimator.phase_costs import phase_costs
from flexplan.estimator.terms import Shape
from flexplan.hardware import get_hardware
from synthetic_machine import SyntheticMachine

MACHINE = SyntheticMachine(bytes_per_s=20e9, kv_bytes_per_s=15e9, flops_per_s={"float32": 300e9, "bfloat16": 300e9},
                           op_s=5e-6, layer_s=100e-6, step_s=1e-3, logit_s=1e-10, noise=0.0)
SETTINGS = {"cpu_dtypes": ["float32"], "cpu_threads": 2}


@pytest.fixture(scope="module")
def hw():
    return get_hardware("local")


def _layer_s(eff, hw, spec, batch, q_len, past=0) -> float:
    """The estimator's CPU time of one layer of ``spec``: prefill of q_len tokens, or the first
    decode step after ``past`` cached ones."""
    if q_len > 1:
        return float(phase_costs(Shape(spec, batch, q_len, 2, "float32", "float32"), hw, eff, "prefill").t_cpu_layer_s)
    pc = phase_costs(Shape(spec, batch, past, 2, "float32", "float32"), hw, eff, "decode")
    return float(np.ravel(pc.t_cpu_layer_s)[0])


def _scaled(meas: dict, pick, factor: float) -> dict:
    rows = [{**r, "time_s": r["time_s"] * factor, "time_median_s": r["time_median_s"] * factor} if pick(r) else r
            for r in meas["cpu_layers"]]
    return {**meas, "cpu_layers": rows}


def test_the_pooled_fit_is_the_closest_non_decreasing_sequence():
    assert non_decreasing_fit([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert non_decreasing_fit([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    # one slow middle point is split with the next, not carried to every later one
    assert non_decreasing_fit([0.2, 0.7, 0.1]) == pytest.approx([0.2, 0.4, 0.4])


def test_real_prefill_layers_faster_than_the_gemm_model_set_the_compute_factor(hw):
    meas = MACHINE.measurements("full")
    hidden, inter, heads, kv_heads, hd = MODES["full"].layer_widths[0]
    spec = _attention_spec(heads, kv_heads, hd, hidden, inter)
    as_gemms = from_measurements(meas, SETTINGS, hw, "test")
    # the real layers' prefill 25% faster than the isolated GEMMs say (other weight shapes, fused work)
    faster = from_measurements(_scaled(meas, lambda r: r["query_len"] > 1, 0.75), SETTINGS, hw, "test")
    for q_len in (128, 512):
        base, fast = _layer_s(as_gemms, hw, spec, 1, q_len), _layer_s(faster, hw, spec, 1, q_len)
        assert fast == pytest.approx(0.75 * base, rel=0.08), q_len  # an overhead that could only add time gave 1.0
    # decode is not what the prefill rows speak for
    assert _layer_s(faster, hw, spec, 1, 1, 128) == pytest.approx(_layer_s(as_gemms, hw, spec, 1, 1, 128), rel=1e-9)


def test_a_decode_layer_slower_over_a_long_cache_sets_the_attention_factor(hw):
    sizes = MODES["full"]
    meas = MACHINE.measurements("full")
    hidden, inter, heads, kv_heads, hd = sizes.layer_widths[0]
    spec = _attention_spec(heads, kv_heads, hd, hidden, inter)
    long_kv = sizes.layer_long_kv_len + 1
    assert any(r["kv_len"] == long_kv for r in meas["cpu_layers"])  # full mode measures it
    base = from_measurements(meas, SETTINGS, hw, "test")
    # the real layer's attention reads its cache at a third of the SDPA benchmark's rate: the long rows
    # take three times the extra time the short ones' KV costs
    slow_rows = []
    short = {(r["hidden"], r["batch"]): r for r in meas["cpu_layers"] if r["query_len"] == 1 and r["kv_len"] < long_kv}
    for r in meas["cpu_layers"]:
        if r["query_len"] == 1 and r["kv_len"] == long_kv:
            s = short[r["hidden"], r["batch"]]
            extra = r["time_s"] - s["time_s"]
            r = {**r, "time_s": s["time_s"] + 3 * extra, "time_median_s": s["time_median_s"] + 3 * extra}
        slow_rows.append(r)
    slow = from_measurements({**meas, "cpu_layers": slow_rows}, SETTINGS, hw, "test")
    grow_base = _layer_s(base, hw, spec, 1, 1, 2048) - _layer_s(base, hw, spec, 1, 1, 128)
    grow_slow = _layer_s(slow, hw, spec, 1, 1, 2048) - _layer_s(slow, hw, spec, 1, 1, 128)
    assert grow_slow == pytest.approx(3 * grow_base, rel=0.15)
    # the short-cache layer it was calibrated on is still reproduced, as far as the monotone fit allows
    assert _layer_s(slow, hw, spec, 1, 1, sizes.layer_kv_len) == pytest.approx(
        _layer_s(base, hw, spec, 1, 1, sizes.layer_kv_len), rel=0.1)  # 5.6% seen: the pooled overhead


@pytest.mark.parametrize("mode", ["full", "quick", "probe"])
def test_a_slow_prefill_attention_core_gets_its_own_factor(hw, mode):
    """Real layers whose attention core runs at a tenth of the GEMMs' rate: the 8 x 128 and 1 x 1024
    prefill rows (same GEMMs) give its factor, and the estimator then tells a batch of short
    prompts from one long prompt of the same tokens, which one factor by tokens could not."""
    from dataclasses import replace

    slow_attn = replace(MACHINE, prefill_attention_flops_per_s={"float32": 30e9, "bfloat16": 30e9})
    meas = slow_attn.measurements(mode)
    assert {(r["batch"], r["query_len"]) for r in meas["cpu_layers"]} >= {(8, 128), (1, 1024)}  # the pair is measured
    eff = from_measurements(meas, SETTINGS, hw, "test")
    peak = hw.cpu.peak_flops_per_s["float32"]
    assert eff.cpu_prefill_attention(512, "float32") == pytest.approx(30e9 / peak, rel=0.02)
    for width in MODES[mode].layer_widths + ((4096, 14336, 32, 8, 128),):  # and a width it did not measure
        hidden, inter, heads, kv_heads, hd = width
        spec = _attention_spec(heads, kv_heads, hd, hidden, inter)
        for batch, q_len in ((4, 128), (1, 512), (8, 64), (1, 1024)):
            truth = slow_attn.layer_time_s("float32", spec, batch, q_len, 0)
            assert _layer_s(eff, hw, spec, batch, q_len) == pytest.approx(truth, rel=0.1), (width, batch, q_len)
    # the same machine's rows without the pair: the attention stays with the compute factor
    no_pair = {**meas, "cpu_layers": [r for r in meas["cpu_layers"] if (r["batch"], r["query_len"]) != (8, 128)]}
    plain = from_measurements(no_pair, SETTINGS, hw, "test")
    assert plain.cpu_prefill_attention(512, "float32") == plain.cpu_compute(512, "float32")


def test_every_calibrated_prefill_width_is_reproduced_the_widest_included(hw):
    """Narrow layers spend more per FLOP (norms, rotary, activations per token and hidden unit):
    the compute factor is the widest layer's and the narrower ones' extra time their overhead, so
    each width's prefill comes out as measured. With the median over widths, the widest (the size
    of the models people offload) was priced ~20% slow here, and an overhead cannot take time off."""
    machine = SyntheticMachine(bytes_per_s=20e9, kv_bytes_per_s=15e9, flops_per_s={"float32": 300e9, "bfloat16": 300e9},
                               op_s=5e-6, layer_s=100e-6, step_s=1e-3, logit_s=1e-10, noise=0.0, token_hidden_s=5e-8)
    eff = from_measurements(machine.measurements("full"), SETTINGS, hw, "test")
    widths = MODES["full"].layer_widths
    assert len(widths) >= 3
    for hidden, inter, heads, kv_heads, hd in widths:
        spec = _attention_spec(heads, kv_heads, hd, hidden, inter)
        for batch, q_len in ((1, 128), (1, 512), (8, 128)):
            true_s = machine.layer_time_s("float32", spec, batch, q_len, 0)
            assert _layer_s(eff, hw, spec, batch, q_len) == pytest.approx(true_s, rel=0.03), (hidden, q_len)


def test_widths_lifted_by_the_largest_shared_token_count_when_few_are_shared():
    """The H100 host's bf16 probe: the narrow layer's 128-token row was an outlier (0.019 against
    0.13 at 512 tokens); a median of the two ratios (their mean) lifted every narrow point 4.2x and
    priced long prefills 4x too fast. With two shared counts the ratio at the larger one is taken;
    with two widths at a count, one lifted more than 2x off the widest's own is left out, and past
    the widest's largest count no factor falls below its own there."""
    from flexplan.factors.layer_fit import _at_the_widest

    by_t = {32: {7e6: 0.0694}, 128: {7e6: 0.019, 90e6: 0.1403}, 512: {7e6: 0.13, 90e6: 0.1244},
            1024: {7e6: 0.1261}}
    out = _at_the_widest(by_t)
    lift = 0.1244 / 0.13
    assert out[32.0] == pytest.approx(0.0694 * lift)  # below the widest's span: the narrow's lifted
    assert out[128.0] == 0.1403  # the narrow's lifted 0.018 is an outlier: the widest's own
    assert out[512.0] == pytest.approx((0.1244 + 0.13 * lift) / 2)  # both agree: their median
    assert out[1024.0] == pytest.approx(0.1244)  # the narrow's lifted 0.1207 held at the widest's 512
    assert max(out.values()) < 0.15  # nothing lifted above what the layers measured
    # three or more shared counts: the median ratio, robust to one outlier, and three widths' median
    by_t[2048] = {7e6: 0.12, 90e6: 0.12}
    by_t[32][90e6] = 0.07
    for t in (128, 512):
        by_t[t][20e6] = by_t[t][90e6]
    lift3 = sorted([0.1403 / 0.019, 0.1244 / 0.13, 1.0, 0.07 / 0.0694])
    out = _at_the_widest(by_t)
    assert out[1024.0] == pytest.approx(0.1261 * (lift3[1] + lift3[2]) / 2)
    assert out[128.0] == pytest.approx(0.1403)  # the median of 0.1403 twice and the narrow's lifted


def test_three_widths_outvote_an_outlier_of_the_widest():
    """With three widths at a count the median decides, whichever row is the outlier: the two-width
    rule (drop what is 2x off the widest's own) would keep a noisy widest row and drop the two that
    agree."""
    from flexplan.factors.layer_fit import _at_the_widest

    by_t = {t: {7e6: 0.5, 20e6: 0.5, 90e6: 0.5} for t in (128, 512, 1024, 2048)}
    by_t[512][90e6] = 1.6  # the widest's 512-token row 3.2x the others
    out = _at_the_widest(by_t)
    assert out[512.0] == pytest.approx(0.5)
    assert all(out[float(t)] == pytest.approx(0.5) for t in (128, 1024, 2048))


def test_a_narrow_outlier_at_the_largest_shared_count_cannot_drag_long_prefills_down():
    """The H200 host's bf16 probe (AMX, 16 cores): the narrow layer ran 512 tokens in 2.6 ms and
    128 in 4.6, so its factor at 512 (0.75) was 5.6x the widest's (0.13); lifted by that, its
    1024-token factor came out 0.043 and the mean of two widths took 128 tokens from 0.21 to 0.11:
    splitgen's 2048-token CPU prefill was priced at 1345 ms, measured 306."""
    from flexplan.factors.layer_fit import _at_the_widest

    by_t = {128: {7e6: 0.0457, 90e6: 0.2124}, 512: {7e6: 0.7451, 90e6: 0.1321}, 1024: {7e6: 0.2409}}
    out = _at_the_widest(by_t)
    assert out[128.0] == 0.2124 and out[512.0] == 0.1321  # the narrow's lifted: 26x and 5.6x off
    assert out[1024.0] == pytest.approx(0.1321)
    # the VM's probe (run 13, cycle 1): the narrow layer within 3% of the widest once lifted, kept
    vm = {32: {7e6: 1.0092}, 128: {7e6: 1.0217, 90e6: 1.5134}, 512: {7e6: 0.8995, 90e6: 1.2968}, 1024: {7e6: 0.918}}
    lift = 1.2968 / 0.8995
    out = _at_the_widest(vm)
    assert out[128.0] == pytest.approx((1.5134 + 1.0217 * lift) / 2)
    assert out[1024.0] == pytest.approx(0.918 * lift)  # above the widest's 512: lifted, not held
