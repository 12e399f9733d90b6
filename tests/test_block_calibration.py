"""The GGUF block kernels calibrated per format and priced by the estimator (issue 40: "Calibration
times them per format; the estimator prices them").

Synthetic rows (``tests/synthetic_machine.py`` for the float rows, :func:`block_rows` here for the
blocks: a roofline of their own rates) go through the real derivation; the plan of a GGUF spec reads
each format's factors through every Efficiency wrapper, a format not measured the float32 ones."""

from __future__ import annotations

from dataclasses import replace

import pytest
from synthetic_machine import HW_CPU, SyntheticMachine, _roofline_s

import flexplan
from flexplan.errors import CalibrationError
from flexplan.estimator.efficiency import (
    DefaultEfficiency,
    ScaledEfficiency,
    StateScaledEfficiency,
    block_formats,
    cpu_block_factors,
)
from flexplan.estimator.phase_costs import phase_costs
from flexplan.estimator.terms import (
    Shape,
    c_gemm,
    cpu_layer_factors,
    d_gemm,
    t_on_device_s,
)
from flexplan.factors import store
from flexplan.factors.calibrated import factors_of
from flexplan.factors.correction import CorrectedEfficiency
from flexplan.factors.efficiency import BLOCK_PART, from_measurements
from flexplan.measure.calibrate import calibration_doc
from flexplan.measure.microbench import BLOCK_FORMATS, MODES, PROBE_BLOCK_FORMATS
from flexplan.quant.formats import BY_NAME
from flexplan.workload import costs, resolve_model

MACHINE = SyntheticMachine(bytes_per_s=40e9, kv_bytes_per_s=20e9, flops_per_s={"float32": 150e9, "bfloat16": 300e9},
                           op_s=5e-6, layer_s=100e-6, step_s=0.5e-3, logit_s=1e-10)
SETTINGS = {"cpu_dtypes": ["float32"], "cpu_threads": 16}
BW = HW_CPU.cpu.memory_bandwidth_bytes_per_s  # 100 GB/s
IDENTITY = store.MachineIdentity("made-up CPU", 16)


def block_rows(fmt: str, bytes_per_s: float, flops_per_s: float, mode: str = "quick") -> list[dict]:
    """``cpu_block_gemm`` rows of a block kernel that streams ``fmt``'s blocks at ``bytes_per_s`` and
    computes at ``flops_per_s``, at the mode's shapes, as microbench_blocks writes them."""
    s, bpw = MODES[mode], BY_NAME[fmt].bytes_per_weight
    rows = []
    for k, n in s.weight_shapes:
        for t in s.block_rows():
            x = MACHINE.op_s + float(_roofline_s(c_gemm(t, k, n), d_gemm(t, k, n, bpw), flops_per_s, bytes_per_s))
            rows.append({"dtype": "float32", "format": fmt, "tokens": t, "k": k, "n": n, "dtype_bytes": bpw,
                         "kernel": "synthetic", "time_s": x, "time_median_s": x, "runs": s.repeats})
    return rows


def measurements(**formats) -> dict:
    """The synthetic float rows, with block rows of each ``format=(bytes/s, FLOP/s)``."""
    meas = MACHINE.measurements("quick", ["float32"])
    rows = [r for fmt, (b, f) in formats.items() for r in block_rows(fmt, b, f)]
    return {**meas, BLOCK_PART: rows} if rows else meas


def factors(**formats):
    return from_measurements(measurements(**formats), SETTINGS, HW_CPU, "test")


def q4_k_m(spec, mlp: str = "Q6_K"):
    """``spec`` as a llama.cpp Q4_K_M-like file stores it: attention Q4_K, the MLP in ``mlp``,
    norms float32, a Q6_K embedding the tied head runs on."""
    groups = {g: sum(spec.layer_group_params(i)[g] for i in range(spec.num_layers)) for g in ("attention", "mlp", "norms")}
    return replace(spec, stored_weights=(("attention", "Q4_K", groups["attention"]), ("mlp", mlp, groups["mlp"]),
                                         ("norms", "F32", groups["norms"]), ("embedding", "Q6_K", spec.embedding_params)))


@pytest.fixture(scope="module")
def llama():
    return resolve_model("meta-llama/Llama-3.1-8B")


# ----------------------------------------------------------------------------- rows -> factors


def test_a_faster_format_gets_a_higher_memory_factor():
    eff = factors(Q4_1=(30e9, 200e9), Q8_0=(10e9, 150e9))
    assert eff.cpu_block_formats() == {"Q4_1", "Q8_0"}
    # the GEMV at one row streams at the kernel's rate (its compute a fifth of a tiny term): factor = rate / BW
    assert eff.cpu_block_memory(1, "Q4_1") == pytest.approx(30e9 / BW, rel=0.05)
    assert eff.cpu_block_memory(1, "Q8_0") == pytest.approx(10e9 / BW, rel=0.05)
    assert eff.cpu_block_memory(1, "Q4_1") > 2.5 * eff.cpu_block_memory(1, "Q8_0")
    # the largest GEMM is compute-bound: its factor against the float32 peak (1 TFLOP/s) is the kernel's rate
    top = max(MODES["quick"].block_rows())
    assert eff.cpu_block_compute(top, "Q4_1") == pytest.approx(200e9 / 1e12, rel=0.25)
    assert eff.cpu_block_compute(top, "Q4_1") > eff.cpu_block_compute(top, "Q8_0")
    # the float rows' factors are their own (the block rows do not move them)
    assert eff.cpu_memory(1, "float32") == factors().cpu_memory(1, "float32")
    described = eff.describe_factors()["cpu_blocks"]
    assert set(described) == {"Q4_1", "Q8_0"} and described["Q4_1"]["memory"][0]["eff"] == pytest.approx(0.3, rel=0.05)


def test_a_format_not_measured_falls_back_to_the_float32_factors():
    eff = factors(Q4_1=(30e9, 200e9))
    for t in (1, 8, 256):
        assert cpu_block_factors(eff, t, "Q6_K", "float32") == (eff.cpu_compute(t, "float32"),
                                                                eff.cpu_memory(t, "float32"))
        assert cpu_block_factors(eff, t, "Q4_1", "float32") == (eff.cpu_block_compute(t, "Q4_1"),
                                                                eff.cpu_block_memory(t, "Q4_1"))
    default = DefaultEfficiency.for_hardware(HW_CPU)
    assert block_formats(default) == frozenset()
    assert cpu_block_factors(default, 1, "Q4_1", "float32") == (default.cpu_compute(1), default.cpu_memory(1))
    assert block_formats(factors()) == frozenset()  # a file without block rows


def test_every_wrapper_scales_the_block_factors_as_the_float_ones():
    eff = factors(Q4_1=(30e9, 200e9))
    m1, c1, m64 = eff.cpu_block_memory(1, "Q4_1"), eff.cpu_block_compute(256, "Q4_1"), eff.cpu_block_memory(64, "Q4_1")
    for wrapper in (ScaledEfficiency, CorrectedEfficiency):
        w = wrapper(eff, {"cpu_memory": 2.0, "cpu_compute": 4.0})
        assert block_formats(w) == {"Q4_1"}
        assert w.cpu_block_memory(1, "Q4_1") == pytest.approx(m1 / 2)
        assert w.cpu_block_compute(256, "Q4_1") == pytest.approx(c1 / 4)
        # through a wrapper of a wrapper, and the fallback too
        ww = ScaledEfficiency(w, {"cpu_memory": 2.0})
        assert ww.cpu_block_memory(1, "Q4_1") == pytest.approx(m1 / 4)
        assert cpu_block_factors(w, 1, "Q6_K", "float32")[1] == pytest.approx(eff.cpu_memory(1, "float32") / 2)
    # the memory state of now: faster now scales decode's streaming (<= 16 rows), not a prefill's GEMMs
    fast = StateScaledEfficiency(eff, {"cpu_memory": 0.5}, state=True)
    assert fast.cpu_block_memory(1, "Q4_1") == pytest.approx(2 * m1)
    assert fast.cpu_block_memory(64, "Q4_1") == pytest.approx(m64)
    # slower now: a kernel streaming at 0.3 of the bandwidth is not slowed by a state whose
    # roofline (the best stream factor, 0.4, / 1.25) stays above it; a state at 1 / 2.5 is
    best = {None: eff.cpu_memory(1, "float32"), "float32": eff.cpu_memory(1, "float32")}
    assert StateScaledEfficiency(eff, {"cpu_memory": 1.25}, state=True, stream_best=best,
                                 band=0.0).cpu_block_memory(1, "Q4_1") == pytest.approx(m1)
    assert StateScaledEfficiency(eff, {"cpu_memory": 2.5}, state=True, stream_best=best,
                                 band=0.0).cpu_block_memory(1, "Q4_1") == pytest.approx(best[None] / 2.5)


# ----------------------------------------------------------------------------- the file


def _doc(meas: dict) -> dict:
    return store.plain(calibration_doc("quick", meas, dict(SETTINGS, rotate_bytes=2**26), HW_CPU, IDENTITY))


def test_the_schema_takes_files_with_and_without_block_rows(tmp_path):
    older = store.write_atomic(_doc(measurements()), tmp_path / "older.yaml")
    cal = store.load_calibration(older)
    assert BLOCK_PART not in cal.measurements
    assert block_formats(factors_of(cal, HW_CPU)) == frozenset()
    newer = store.write_atomic(_doc(measurements(Q4_K=(25e9, 400e9))), tmp_path / "newer.yaml")
    cal = store.load_calibration(newer)
    assert set(cal.doc["derived"]["cpu_blocks"]) == {"Q4_K"}
    assert block_formats(factors_of(cal, HW_CPU)) == {"Q4_K"}
    doc = _doc(measurements(Q4_K=(25e9, 400e9)))
    del doc["measurements"][BLOCK_PART][0]["format"]
    bad = store.write_atomic(doc, tmp_path / "bad.yaml")
    with pytest.raises(CalibrationError, match="format"):
        factors_of(store.load_calibration(bad), HW_CPU)


# ----------------------------------------------------------------------------- the estimator


def test_a_layer_of_several_formats_pays_each_at_its_own_factors(llama):
    """Hand calculation: 1 / Eff_mem = sum of each format's share of the layer's weight bytes over
    its factor (norms in float32 at the float32 factor); 1 / Eff_comp the same with parameter shares."""
    eff = factors(Q4_K=(30e9, 400e9), Q6_K=(15e9, 300e9))
    spec = q4_k_m(llama)
    shape = Shape(spec, 1, 128, 16, "bfloat16", "float32", spec.stored_weights)
    params = {g: p for g, _, p in spec.stored_weights}
    att, mlp, norms = params["attention"], params["mlp"], params["norms"]
    b_att, b_mlp, b_norms = att * 144 / 256, mlp * 210 / 256, norms * 4
    total_b, total_p = b_att + b_mlp + b_norms, att + mlp + norms
    for rows in (1, 128):
        m = {f: eff.cpu_block_memory(rows, f) for f in ("Q4_K", "Q6_K")}
        c = {f: eff.cpu_block_compute(rows, f) for f in ("Q4_K", "Q6_K")}
        want_m = total_b / (b_att / m["Q4_K"] + b_mlp / m["Q6_K"] + b_norms / eff.cpu_memory(rows, "float32"))
        want_c = total_p / (att / c["Q4_K"] + mlp / c["Q6_K"] + norms / eff.cpu_compute(rows, "float32"))
        assert cpu_layer_factors(shape, eff, rows) == pytest.approx((want_c, want_m), rel=1e-12)
    # the decode layer's time is Eq. 1's bracket at those factors
    pc = phase_costs(shape, HW_CPU, eff, "decode")
    w_c, w_m = cpu_layer_factors(shape, eff, 1)
    m_, cpu = spec, HW_CPU.cpu
    ctx = shape.decode_context_lens
    want = t_on_device_s(costs.c_decode(m_, 1, ctx), costs.d_decode(m_, 1, shape.cpu_weight_bytes, 4)
                         + costs.d_kv_write(m_, 1, 1, 4), cpu.peak_flops_per_s["float32"], cpu.memory_bandwidth_bytes_per_s,
                         w_c, w_m, kv_bytes=costs.d_kv_cache(m_, 1, ctx, 4), eff_kv=eff.cpu_attention(ctx, "float32"),
                         overhead_s=eff.cpu_layer_overhead_s(1, "float32", costs.d_weights(m_, shape.cpu_weight_bytes)))
    assert pc.t_cpu_layer_s == pytest.approx(want, rel=1e-9)
    # the tied head runs on the embedding's Q6_K blocks: at Q6_K's factors
    head = t_on_device_s(costs.c_lm_head(m_, 1), costs.d_lm_head(m_, 210 / 256), cpu.peak_flops_per_s["float32"],
                         cpu.memory_bandwidth_bytes_per_s, eff.cpu_block_compute(1, "Q6_K"),
                         eff.cpu_block_memory(1, "Q6_K"), overhead_s=eff.cpu_step_overhead_s(1, m_.vocab_size))
    assert pc.t_cpu_head_s == pytest.approx(head, rel=1e-9)


def test_plan_of_a_gguf_spec_prices_its_blocks_at_their_formats_factors(llama):
    spec = q4_k_m(llama, mlp="Q4_K")
    kw = {"hardware": HW_CPU, "batch_size": 1, "input_len": 128, "output_len": 32}
    fast = flexplan.plan(spec, efficiency=factors(Q4_K=(60e9, 400e9), Q6_K=(40e9, 400e9)), **kw)
    slow = flexplan.plan(spec, efficiency=factors(Q4_K=(15e9, 400e9), Q6_K=(40e9, 400e9)), **kw)
    float_rate = flexplan.plan(spec, efficiency=factors(Q8_0=(60e9, 400e9)), **kw)  # Q4_K, Q6_K not measured
    uncalibrated = flexplan.plan(spec, efficiency=factors(), **kw)
    assert (fast.decode.policy, slow.decode.policy) == ("cpu", "cpu")
    # decode streams the Q4_K layers: 4x the rate, most of TPOT 4x shorter
    assert slow.tpot_s > 2.5 * fast.tpot_s
    assert float_rate.tpot_s == pytest.approx(uncalibrated.tpot_s, rel=1e-12)  # the float32 factors: 40 GB/s
    assert fast.tpot_s < float_rate.tpot_s < slow.tpot_s
    note = next(n for n in fast.notes if n.startswith("weights:"))
    assert "Q4_K, Q6_K at their block kernels' calibrated rate" in note
    note = next(n for n in float_rate.notes if n.startswith("weights:"))
    assert "Q4_K, Q6_K at the float32 GEMV/GEMM rate (block kernels not calibrated for them" in note
    mixed = flexplan.plan(spec, efficiency=factors(Q4_K=(60e9, 400e9)), **kw)
    note = next(n for n in mixed.notes if n.startswith("weights:"))
    assert "Q4_K at its block kernels' calibrated rate; Q6_K at the float32 GEMV/GEMM rate" in note


def test_the_shipped_gguf_plan_says_how_its_formats_were_priced():
    from flexplan.smollm import gguf_path

    p = flexplan.plan(str(gguf_path()), HW_CPU, batch_size=1, input_len=16, output_len=8,
                      efficiency=factors(Q4_1=(20e9, 400e9)))
    note = next(n for n in p.notes if n.startswith("weights:"))
    assert "Q4_1 at its block kernels' calibrated rate; Q8_0 at the float32 GEMV/GEMM rate" in note


# ----------------------------------------------------------------------------- the benchmark


def test_the_format_list_is_one_list_and_the_probe_takes_few_of_it():
    assert {"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"} <= set(BLOCK_FORMATS)
    assert all(BY_NAME[f].native_kernel for f in BLOCK_FORMATS)
    probe = MODES["probe"]
    assert set(probe.block_formats) <= set(BLOCK_FORMATS) and len(probe.block_formats) <= 2
    assert probe.block_formats == PROBE_BLOCK_FORMATS and probe.measures(BLOCK_PART)
    assert len(probe.block_rows()) <= 3 and len(probe.weight_shapes) == 1
    assert MODES["quick"].block_formats == MODES["full"].block_formats == BLOCK_FORMATS


def test_the_block_benchmark_times_the_executors_kernel():
    from flexplan.measure import microbench_blocks as mbb
    from flexplan.quant import kernels

    if kernels.status()[0] is None:
        pytest.skip(f"no native block kernels: {kernels.status()[1]}")
    tiny = MODES["tiny"]
    rows = mbb.block_gemm(tiny, "Q4_1")
    assert [r["tokens"] for r in rows] == list(tiny.block_rows()) * len(tiny.weight_shapes)
    assert all(r["format"] == "Q4_1" and r["dtype"] == "float32" and r["dtype_bytes"] == 0.625 for r in rows)
    assert all(r["kernel"] == f"quant-{kernels.status()[0].isa}" and r["time_s"] > 0 for r in rows)
    k, n = tiny.weight_shapes[0]
    assert rows[0]["weight_bytes_per_s"] == pytest.approx(k * n * 0.625 / rows[0]["time_s"], rel=1e-4)
    eff = from_measurements({**MACHINE.measurements("tiny", ["float32"]), BLOCK_PART: rows}, SETTINGS, HW_CPU, "t")
    assert block_formats(eff) == {"Q4_1"} and 0 < eff.cpu_block_memory(1, "Q4_1")
