"""The memory state of now, not of calibration day (issue 14, item 2).

Calibration files of THIS machine (its fingerprint) are written from synthetic rows
(``tests/synthetic_machine.py``) with the real writer, so that ``hardware="local"`` planning reads
them; the probe of now is monkeypatched to a chosen figure. conftest.py turns the probe off for
every other test; these turn it on.
"""

from __future__ import annotations

import pytest

import flexplan
from flexplan.factors import _derive, efficiency_for, memory_state, store
from flexplan.measure import state
from flexplan.measure.first_use import describe_calibration
from flexplan.measure import membw
from flexplan.errors import CalibrationError
from flexplan.explain import format_plan
from flexplan.executor.stats import memory_state_of
from flexplan.hardware import get_hardware
from synthetic_machine import SyntheticMachine

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
REF = 10e9  # the probe's median figure at calibration in these files
REF_FLOPS = 100e9  # the compute probe's, where a record has one
FAST = SyntheticMachine(bytes_per_s=20e9, kv_bytes_per_s=15e9, flops_per_s={"float32": 300e9, "bfloat16": 300e9},
                        op_s=5e-6, layer_s=100e-6, step_s=1e-3, logit_s=1e-10)
SLOW = SyntheticMachine(bytes_per_s=10e9, kv_bytes_per_s=7.5e9, flops_per_s=FAST.flops_per_s, op_s=FAST.op_s,
                        layer_s=FAST.layer_s, step_s=FAST.step_s, logit_s=FAST.logit_s)


@pytest.fixture(scope="module")
def local():
    return get_hardware("local")


def _dtypes(hw) -> list[str]:
    return list(dict.fromkeys([hw.cpu.compute_dtype, "float32"]))


def _record(hw, slow_steps=(), slow_rate=REF / 2) -> dict:
    """A memory_state record as ``flexplan calibrate`` writes it: one sample before each step and
    one at the end, all at REF but those of ``slow_steps``."""
    labels = ["cpu_stream"] + [f"{p}[{dt}]" for dt in _dtypes(hw) for p in memory_state.ROW_PARTS] + [memory_state.END]
    return {"probe": "test", "probe_threads": membw.probe_threads(),
            "probe_bytes_per_s": [slow_rate if lab in slow_steps else REF for lab in labels],
            "at_step": labels}


def _with_compute(record: dict, slow_steps=(), slow_rate=REF_FLOPS / 2) -> dict:
    """``record`` with compute samples beside its memory samples, all at REF_FLOPS but ``slow_steps``."""
    labels = record["at_step"]
    return {**record, "compute_probe": "test", "compute_at_step": list(labels),
            "probe_flops_per_s": [slow_rate if lab in slow_steps else REF_FLOPS for lab in labels]}


def _write(tmp_path, hw, meas: dict, name: str):
    from flexplan.measure.calibrate import calibration_doc

    settings = {"cpu_dtypes": _dtypes(hw), "cpu_threads": hw.cpu.cores, "gpu_dtype": None, "rotate_bytes": 2**27,
                "cpu_linear_kernel": "synthetic"}
    doc = calibration_doc("quick", meas, settings, hw, store.local_identity())
    return store.write_atomic(store.plain(doc), tmp_path / name)


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """Turns the probe on, with ``set(now)`` choosing what it measures; counts its calls."""
    monkeypatch.setenv(membw.PROBE_ENV, "1")
    monkeypatch.setenv(store.DIR_ENV, str(tmp_path / "none"))
    state = {"now": REF, "calls": 0, "flops_now": REF_FLOPS}

    def measure(*a, **k):
        state["calls"] += 1
        if isinstance(state["now"], Exception):
            raise state["now"]
        return state["now"]

    monkeypatch.setattr(membw, "measure_copy_bytes_per_s", measure)
    monkeypatch.setattr(membw, "measure_matmul_flops_per_s", lambda *a, **k: state["flops_now"])
    membw.forget_probe()

    def set_now(now):
        state["now"] = now
        membw.forget_probe()
    set_now.state = state
    yield set_now
    membw.forget_probe()


def _use(monkeypatch, path):
    monkeypatch.setenv(store.FILE_ENV, str(path))


def _cpu_plan(**kw):
    """A CPU plan as a measuring caller makes it (flexplan.load, run): at a probe of the state of now."""
    kw.setdefault("efficiency", state.efficiency_now(get_hardware("local")))
    return flexplan.plan(MODEL, hardware="local", batch_size=kw.pop("batch_size", 1), input_len=128, output_len=32,
                         prefill="cpu", decode="cpu", **kw)


# ----------------------------------------------------------------------------- the probe


def test_the_probe_returns_a_positive_rate_quickly_and_is_reused_for_a_while(monkeypatch):
    membw.forget_probe()
    first = membw.probe_bytes_per_s()  # allocates and touches its buffers once per process
    copies, real = [], membw._copy_in_threads

    def counted(a, b, threads):
        copy = real(a, b, threads)
        return lambda: (copies.append(a.nbytes), copy())

    monkeypatch.setattr(membw, "_copy_in_threads", counted)
    rate = membw.probe_bytes_per_s(max_age_s=0)
    assert 1e8 < first and 1e8 < rate < 1e13
    # quick by its size, not by a clock a busy machine stretches (~35 ms on the 2-core VM): at most two
    # readings (a confirmation), each an untimed copy and PROBE_REPEATS timed ones of one bounded buffer
    assert 1 + membw.PROBE_REPEATS <= len(copies) <= 2 * (1 + membw.PROBE_REPEATS), copies
    assert max(copies) <= membw.MAX_BUFFER_BYTES

    def broken(*a, **k):
        raise OSError("no memory to probe")

    monkeypatch.setattr(membw, "measure_copy_bytes_per_s", broken)
    assert membw.probe_bytes_per_s() == rate  # within PROBE_TTL_S: the same figure, no new probe
    membw.forget_probe()
    with pytest.raises(RuntimeError, match="no memory to probe"):
        membw.probe_bytes_per_s()
    membw.forget_probe()


# ----------------------------------------------------------------------------- scaling to the state of now


def test_half_the_bandwidth_now_doubles_the_memory_part_of_cpu_decode(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    tpot = {}
    for ratio in (0.5, 1.0, 2.0):  # time scale = reference / now
        probe(REF / ratio)
        p = _cpu_plan()
        tpot[ratio] = p.tpot_s
        assert (f"(x{ratio:.2f} memory time" if ratio != 1.0 else "(the same state: x1.00)") in p.calibration
    assert "memory state: memory probe 5.0 GB/s now vs 10.0 GB/s median at calibration (x2.00 memory time)" in p.calibration
    # at scale 0.5 half of the memory part is gone (streaming time follows the probe) ...
    memory_part = (tpot[1.0] - tpot[0.5]) / (1 - 0.5)
    # ... and at scale 2 the weights' part doubles, the KV reads (15 GB/s where the weights ran 20)
    # stream at the state's 10 GB/s: x1.33, not x2 (StateScaledEfficiency)
    assert 0.5 * memory_part < tpot[2.0] - tpot[1.0] < 1.25 * memory_part
    assert memory_part > 0.5 * tpot[1.0]  # CPU decode is mostly memory time: the scaling matters
    monkeypatch.setenv(membw.PROBE_ENV, "0")  # opt-out: the factors of the calibration's median state
    assert _cpu_plan().tpot_s == pytest.approx(tpot[1.0], rel=1e-12)


def test_a_slower_state_prices_each_op_at_most_at_its_bandwidth_and_never_faster_than_calibrated():
    """Slower now: min(own factor, the stream's best / scale) (the roofline); faster now: own
    factor / scale (streaming time follows the bandwidth the probe shows)."""
    from flexplan.estimator.efficiency import DefaultEfficiency, StateScaledEfficiency

    base = DefaultEfficiency(cpu_compute_eff=0.5, cpu_memory_eff=0.8, gpu_compute_eff=0.5, gpu_memory_eff=0.5,
                             icn_eff=0.5, cpu_overhead_s=0.0, gpu_overhead_s=0.0)
    slow = StateScaledEfficiency(base, {"cpu_memory": 2.0}, stream_best={None: 1.0, "float32": 1.0})
    assert slow.cpu_memory(1) == pytest.approx(0.5)  # 0.8 at calibration, the state's 1.0 / 2 now
    assert slow.cpu_memory(1, "float32") == pytest.approx(0.5)
    slower_op = StateScaledEfficiency(base, {"cpu_memory": 1.25}, stream_best={None: 1.0})
    assert slower_op.cpu_memory(1) == pytest.approx(0.8)  # held back at 0.8 already: the state's 0.8 allows it
    # faster now: the state's whole ratio, whatever the stream's best
    fast = StateScaledEfficiency(base, {"cpu_memory": 0.5}, stream_best={None: 0.8})
    assert fast.cpu_memory(1) == pytest.approx(1.6)
    faster = StateScaledEfficiency(base, {"cpu_memory": 0.25}, stream_best={None: 0.8, "float32": 1.6})
    assert faster.cpu_memory(1) == pytest.approx(3.2)
    # the online correction's learned elasticity moves it by how this machine's runs followed the state
    learned = StateScaledEfficiency(base, {"cpu_memory": 0.5}, stream_best={None: 0.8}, learned_elasticity=-0.5)
    assert 0.8 < learned.cpu_memory(1) < fast.cpu_memory(1)
    unknown = StateScaledEfficiency(base, {"cpu_memory": 2.0})  # no best known: the plain ratio
    assert unknown.cpu_memory(1) == pytest.approx(0.4)


def test_the_state_scales_decode_streaming_not_a_prefill_gemm():
    """A prefill's GEMMs stream their weights while they compute: their factor stays as
    calibrated; decode's rows (up to STATE_SCALED_TOKENS_MAX), the KV reads and the head scale."""
    import numpy as np

    from flexplan.estimator.efficiency import STATE_SCALED_TOKENS_MAX, DefaultEfficiency, StateScaledEfficiency

    base = DefaultEfficiency(cpu_compute_eff=0.5, cpu_memory_eff=0.8, gpu_compute_eff=0.5, gpu_memory_eff=0.5,
                             icn_eff=0.5, cpu_overhead_s=0.0, gpu_overhead_s=0.0)
    for scale in (0.5, 2.0):
        eff = StateScaledEfficiency(base, {"cpu_memory": scale})
        decode = float(eff.cpu_memory(STATE_SCALED_TOKENS_MAX))
        if scale > 1:
            assert decode == pytest.approx(0.4)  # twice the memory time: half the factor (no best known)
        else:
            assert 0.8 < decode <= 1.6  # faster, by at most the state's whole ratio
        assert eff.cpu_memory(STATE_SCALED_TOKENS_MAX + 1) == pytest.approx(0.8)
        assert eff.cpu_memory(np.array([1, 512])) == pytest.approx([decode, 0.8])
        assert eff.cpu_head_memory(1) == pytest.approx(decode)  # the head and the KV reads scale as decode's rows
        assert eff.cpu_attention(1024) / base.cpu_attention(1024) == pytest.approx(decode / 0.8)


def test_the_scale_is_clamped_and_a_failed_probe_scales_nothing(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    base = _cpu_plan().tpot_s
    probe(REF / 10)
    p = _cpu_plan()
    assert "x3.00 memory time, clamped from x10.00" in p.calibration
    probe(OSError("cannot map buffers"))
    p = _cpu_plan()
    assert "memory state: memory probe failed (OSError: cannot map buffers)" in p.calibration
    assert p.tpot_s == pytest.approx(base, rel=1e-12)


def test_the_opt_out_runs_no_probe_and_says_so(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    probe(REF / 2)
    monkeypatch.setenv(membw.PROBE_ENV, "0")
    eff = state.efficiency_now(local)
    assert probe.state["calls"] == 0
    assert "memory state: probe off ($FLEXPLAN_MEMORY_PROBE=0)" in eff.source and eff.scale("cpu_memory") == 1.0
    assert "now: off" in describe_calibration(local)
    assert probe.state["calls"] == 0


def test_a_file_without_memory_state_loads_unscaled(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    path = _write(tmp_path, local, meas, "old.yaml")
    assert "memory_state" not in store.load_calibration(path).measurements
    _use(monkeypatch, path)
    probe(REF / 2)
    eff = state.efficiency_now(local)
    assert eff.scale("cpu_memory") == 1.0 and probe.state["calls"] == 0
    assert "memory state: not recorded by this calibration" in eff.source
    p = _cpu_plan()
    assert p.tpot_s > 0 and "not recorded" in p.calibration
    assert "none recorded by this calibration" in describe_calibration(local)


def test_a_malformed_record_is_refused_with_the_file_named(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    good = _write(tmp_path, local, meas, "good.yaml")
    import yaml

    doc = yaml.safe_load(good.read_text())
    doc["measurements"]["memory_state"] = {"probe_bytes_per_s": [1e10, -3], "at_step": ["cpu_stream", "end"]}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    _use(monkeypatch, bad)
    with pytest.raises(CalibrationError, match="bad.yaml.*memory_state.*positive numbers"):
        state.efficiency_now(local)


# ----------------------------------------------------------------------------- normalising the calibration


def test_a_step_measured_in_a_slow_state_is_normalised_to_the_median_state(local, tmp_path):
    dts = _dtypes(local)
    fast = FAST.measurements("quick", dts)
    slow_rows = SLOW.measurements("quick", dts)
    # the GEMV and decode-attention steps met the slow state (the probe before them said so)
    mixed = {**fast, "cpu_gemv": slow_rows["cpu_gemv"], "cpu_attention": slow_rows["cpu_attention"]}
    slow_steps = {f"{p}[{dt}]" for dt in dts for p in ("cpu_gemv", "cpu_attention")}

    def factors(meas, name):
        return _derive(store.load_calibration(_write(tmp_path, local, meas, name)), local)

    a = factors({**fast, "memory_state": _record(local)}, "fast.yaml")
    b = factors({**mixed, "memory_state": _record(local, slow_steps)}, "mixed.yaml")
    c = factors(mixed, "mixed-unrecorded.yaml")  # the same rows, no record: the slow state bends the fit

    def predict(eff, batch):
        p = _cpu_plan(batch_size=batch, efficiency=eff)
        return p.ttft_s, p.tpot_s

    for batch in (1, 8):
        (ta, pa), (tb, pb), (tc, pc) = predict(a, batch), predict(b, batch), predict(c, batch)
        assert pb == pytest.approx(pa, rel=0.01), batch  # measured: 0.25%
        assert tb == pytest.approx(ta, rel=0.01), batch
        assert abs(pc / pa - 1) > 0.15, batch  # without the record the prediction is off


def test_normalising_leaves_compute_bound_rows_and_unrecorded_steps_alone(local):
    meas = FAST.measurements("quick", _dtypes(local))
    row_steps = [lab for lab in _record(local)["at_step"] if lab.split("[")[0] in memory_state.ROW_PARTS]
    # every sample at one state: that state is the reference, nothing changes
    same = {"probe_bytes_per_s": [REF / 2] * (len(row_steps) + 1), "at_step": row_steps + [memory_state.END]}
    assert memory_state.normalised({**meas, "memory_state": same})["cpu_gemv"] == meas["cpu_gemv"]
    # every row step at half the median (more samples at REF, taken before the other steps)
    others = ["cpu_stream", "cpu_threads", "cpu_generate_step"] * len(row_steps)
    slow = {"probe_bytes_per_s": [REF / 2] * len(row_steps) + [REF] * len(others), "at_step": row_steps + others}
    assert memory_state.reference_bytes_per_s({"memory_state": slow}) == REF
    out = memory_state.normalised({**meas, "memory_state": slow})
    gemv_ratio = [o["time_s"] / r["time_s"] for o, r in zip(out["cpu_gemv"], meas["cpu_gemv"])
                  if r["tokens"] <= 8]  # 16 bf16 tokens are compute-bound on FAST (16 x 2 FLOP per 2-byte weight)
    gemm_ratio = [o["time_s"] / r["time_s"] for o, r in zip(out["cpu_gemm"], meas["cpu_gemm"])]
    assert gemv_ratio and all(0.5 <= x < 0.56 for x in gemv_ratio), gemv_ratio  # memory-bound: nearly halved
    assert all(x > 0.85 for x in gemm_ratio[-2:]), gemm_ratio  # the largest GEMMs: compute-bound
    assert all(0.5 <= o["time_s"] / r["time_s"] <= 1 for part in memory_state.ROW_PARTS
               for o, r in zip(out[part], meas[part]))
    assert out["cpu_layer_overhead"] == meas["cpu_layer_overhead"]  # not a streaming measurement
    # a step with no sample of its own is left as measured
    no_gemv = {k: [x for x, lab in zip(v, slow["at_step"]) if not lab.startswith("cpu_gemv")]
               for k, v in slow.items()}
    assert memory_state.normalised({**meas, "memory_state": no_gemv})["cpu_gemv"] == meas["cpu_gemv"]
    assert memory_state.normalised(meas) is meas  # no record: as measured


def test_a_slower_compute_state_now_scales_the_fixed_costs_not_compute_or_memory(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _with_compute(_record(local))
    spread = (1.0, 1.06, 1.0, 0.94)  # the compute probe's own spread on this machine: ~6% between samples
    meas["memory_state"]["probe_flops_per_s"] = [REF_FLOPS * spread[i % 4]
                                                 for i in range(len(meas["memory_state"]["compute_at_step"]))]
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    same = _cpu_plan(batch_size=8)
    assert "compute probe 100 GFLOP/s now vs 100 GFLOP/s median at calibration (the same state: x1.00)" in same.calibration
    probe.state["flops_now"] = REF_FLOPS / 2
    membw.forget_probe()
    eff = state.efficiency_now(local)
    # fixed costs take the probe's whole ratio; compute time keeps its calibrated factor
    assert (eff.scale("cpu_compute"), eff.scale("overhead"), eff.scale("cpu_memory")) == pytest.approx((1.0, 2.0, 1.0))
    slow = _cpu_plan(batch_size=8)
    assert "(x2.00 fixed costs)" in slow.calibration
    assert same.ttft_s < slow.ttft_s < 1.5 * same.ttft_s  # prefill is mostly compute, which the probe leaves
    assert same.tpot_s < slow.tpot_s < 1.5 * same.tpot_s  # decode is mostly memory
    probe.state["flops_now"] = REF_FLOPS * 1.05  # within the probe's own spread: the same state
    membw.forget_probe()
    assert state.efficiency_now(local).scale("overhead") == 1.0


def test_a_step_measured_in_a_slow_compute_state_keeps_its_compute_share(local):
    """Calibration brings each row's memory-bound share to the reference memory state; the compute
    share stays as measured (a GEMM's rate is the cores' own), whatever the compute probe read."""
    meas = FAST.measurements("quick", _dtypes(local))
    record = _record(local)
    slow_steps = {lab for lab in record["at_step"] if lab.startswith("cpu_gemm")}
    out = memory_state.normalised({**meas, "memory_state": _with_compute(record, slow_steps)})
    assert out["cpu_gemm"] == memory_state.normalised({**meas, "memory_state": record})["cpu_gemm"]
    own = {**meas, "cpu_gemm": [{**r, "probe_flops_per_s": REF_FLOPS / 2} for r in meas["cpu_gemm"]]}
    out = memory_state.normalised({**own, "memory_state": _with_compute(record, slow_steps)})
    assert [o["time_s"] for o in out["cpu_gemm"]] == [r["time_s"] for r in own["cpu_gemm"]]
    assert memory_state.ROW_PROBES["compute"] in state.row_probes(_with_compute(record))


def test_explain_and_hw_say_which_state_was_used(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local, slow_steps={"cpu_stream"}, slow_rate=4e9)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    probe(8e9)
    p = _cpu_plan()
    text = format_plan(p)
    assert "memory state: memory probe 8.0 GB/s now vs 10.0 GB/s median at calibration (x1.25 memory time)" in text
    assert memory_state_of(p).startswith("memory state: memory probe 8.0 GB/s now")
    hw_text = describe_calibration(local)
    assert "memory probe min 4.0 GB/s / median 10.0 GB/s / max 10.0 GB/s" in hw_text
    assert "STREAM triad" in hw_text and "now 8.0 GB/s" in hw_text



def test_last_stats_carry_the_memory_state_of_the_plan_they_ran(local, probe, tmp_path, monkeypatch, one_thread):
    from conftest import make_model

    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    probe(REF / 2)
    lm = flexplan.load(make_model("llama"), accelerator=None)
    assert probe.state["calls"] >= 1  # load probed afresh
    import torch

    lm.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, do_sample=False)
    st = lm.last_stats
    assert st.memory_state.startswith("memory state: memory probe 5.0 GB/s now vs 10.0 GB/s") and "x2.00" in st.memory_state
    assert st.memory_state in st.summary() and st.to_dict()["memory_state"] == st.memory_state


def _loaded_at_the_calibration_state(local, tmp_path, monkeypatch):
    """A tiny Llama loaded under a calibration with memory-state samples, run once in its state:
    (model, input ids, the run's stats)."""
    import torch
    from conftest import make_model

    from flexplan import api

    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    # plans age only where a test says so (PLAN_STATE_MAX_AGE_S = 0), not by this machine's clock
    monkeypatch.setattr(api, "PLAN_STATE_MAX_AGE_S", 1e9)
    lm = flexplan.load(make_model("llama"), accelerator=None, online_correction=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    lm.generate(ids, max_new_tokens=3, do_sample=False)
    assert "x1.00" in lm.last_stats.memory_state
    return lm, ids, lm.last_stats


def test_a_loaded_model_prices_its_plan_again_for_the_state_of_now_once_it_is_old(local, probe, tmp_path, monkeypatch,
                                                                              one_thread):
    """A long-running process: a shape's plan is priced again with a new probe once it is older
    than PLAN_STATE_MAX_AGE_S, not kept at the state of the shape's first call."""
    from flexplan import api

    lm, ids, first = _loaded_at_the_calibration_state(local, tmp_path, monkeypatch)
    probe(REF / 2)  # the state flips
    lm.generate(ids, max_new_tokens=3, do_sample=False)
    assert lm.last_stats.predicted_tpot_s == first.predicted_tpot_s  # a young plan is kept
    monkeypatch.setattr(api, "PLAN_STATE_MAX_AGE_S", 0.0)
    lm.generate(ids, max_new_tokens=3, do_sample=False)
    second = lm.last_stats
    assert "5.0 GB/s now" in second.memory_state and "x2.00 memory time" in second.memory_state
    # the same choice priced again: the placement does not follow the state minute to minute
    assert (second.plan.cpu_dtype, second.plan.prefill.policy, second.plan.decode.policy) == \
        (first.plan.cpu_dtype, first.plan.prefill.policy, first.plan.decode.policy)
    assert not lm.replanned
    assert second.predicted_tpot_s > first.predicted_tpot_s  # a tiny model: mostly fixed costs


def test_refresh_state_prices_the_next_call_at_a_fresh_probe_whatever_the_plans_age(local, probe, tmp_path,
                                                                                    monkeypatch, one_thread):
    """`flexplan run` after its warm-up: the timed call is predicted at the state of its moment."""
    from conftest import make_model

    lm, ids, first = _loaded_at_the_calibration_state(local, tmp_path, monkeypatch)
    probe(REF / 2)  # the state flips; the plan is young
    lm.refresh_state()
    lm.generate(ids, max_new_tokens=3, do_sample=False)
    second = lm.last_stats
    assert "x2.00 memory time" in second.memory_state and second.predicted_tpot_s > first.predicted_tpot_s
    assert (second.plan.cpu_dtype, second.plan.decode.policy) == (first.plan.cpu_dtype, first.plan.decode.policy)
    lm.generate(ids, max_new_tokens=3, do_sample=False)  # and then young again: kept
    assert lm.last_stats.predicted_tpot_s == second.predicted_tpot_s
    # a fixed plan (`flexplan run` loads the plan it printed) is priced again too, the same choice
    fixed = flexplan.load(make_model("llama"), plan=first.plan, accelerator=None, online_correction=False)
    fixed.generate(ids, max_new_tokens=3, do_sample=False)
    assert fixed.last_stats.memory_state == first.memory_state
    fixed.refresh_state()
    fixed.generate(ids, max_new_tokens=3, do_sample=False)
    assert "x2.00 memory time" in fixed.last_stats.memory_state
    assert fixed.last_stats.predicted_tpot_s == pytest.approx(second.predicted_tpot_s)


def test_one_slow_probe_reading_is_confirmed_before_it_scales_anything(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    readings = iter([REF / 3, REF])  # a neighbour's burst, then the state as it is
    monkeypatch.setattr(membw, "measure_copy_bytes_per_s", lambda *a, **k: next(readings))
    membw.forget_probe()
    assert state.efficiency_now(local).scale("cpu_memory") == 1.0
    readings = iter([REF / 2, REF / 2])  # a state that lasts: scaled
    membw.forget_probe()
    assert state.efficiency_now(local).scale("cpu_memory") == pytest.approx(2.0)


def test_one_fast_probe_reading_must_show_twice_before_it_scales_anything(local, probe, tmp_path, monkeypatch):
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    readings = iter([REF * 1.3, REF])  # a fast burst, then the state as it is
    monkeypatch.setattr(membw, "measure_copy_bytes_per_s", lambda *a, **k: next(readings))
    membw.forget_probe()
    assert state.efficiency_now(local).scale("cpu_memory") == 1.0
    readings = iter([REF * 1.6, REF * 1.5])  # a faster state that lasts: the reading nearer the reference
    membw.forget_probe()
    assert state.efficiency_now(local).scale("cpu_memory") == pytest.approx(1 / 1.5)


def test_a_calibration_probed_in_another_thread_count_is_not_scaled(local, probe, tmp_path, monkeypatch):
    """Samples a one-thread copy took (files from before the threaded probe) are no reference for
    today's probe in another thread count: memory stays at the calibration's median, the note says why."""
    if membw.probe_threads() == 1:
        pytest.skip("this machine's probe runs one thread: every file's samples compare")
    meas = FAST.measurements("quick", _dtypes(local))
    record = _record(local)
    del record["probe_threads"]  # as files from before it
    meas["memory_state"] = record
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    probe(REF / 2)  # a reading that would double memory time
    p = _cpu_plan()
    assert "came from a copy in 1 thread" in p.calibration and "re-run `flexplan calibrate`" in p.calibration
    assert state.efficiency_now(local).scale("cpu_memory") == 1.0
    assert "not comparable with today's probe" in state.describe(meas)


def test_the_memory_probe_copies_in_threads_and_measures_the_whole_buffer():
    n = 8 * 2**20
    one, many = membw.measure_copy_bytes_per_s(n, threads=1), membw.measure_copy_bytes_per_s(n, threads=3)
    assert one > 0 and many > 0
    a, b = membw._buffers(n)
    a[:] = 0.0
    membw._copy_in_threads(a, b, 3)()
    assert (a == b).all()  # every slice copied, none twice or missed
    assert f"in {membw.probe_threads()} thread" in membw.describe_probe()


def test_a_row_timed_in_another_state_than_its_step_began_in_is_normalised_by_its_own_probe(local):
    """The state can flip within a step: a row that carries the probe taken around its own runs
    (microbench.probing_state) is brought to the reference by that, not by the step's sample, but
    never to a rate above what the rows at the reference state reached."""
    meas = FAST.measurements("quick", _dtypes(local))
    row_steps = [lab for lab in _record(local)["at_step"] if lab.split("[")[0] in memory_state.ROW_PARTS]
    record = {"probe_bytes_per_s": [REF] * (len(row_steps) + 1), "at_step": row_steps + [memory_state.END]}
    gemv = [dict(r) for r in meas["cpu_gemv"]]
    # this one row ran in the slow state (its time is SLOW's), its step began in the reference
    gemv[0] = {**SLOW.measurements("quick", _dtypes(local))["cpu_gemv"][0], "probe_bytes_per_s": REF / 2}
    out = memory_state.normalised({**meas, "cpu_gemv": gemv, "memory_state": record})["cpu_gemv"]
    assert 0.5 <= out[0]["time_s"] / gemv[0]["time_s"] < 0.56  # memory-bound: nearly halved
    assert [o["time_s"] for o in out[1:]] == [r["time_s"] for r in gemv[1:]]  # the others at the reference
    # the same probe beside a row that streamed as fast as the reference rows: the state flipped
    # between probe and row, and the row is not made faster than any row at the reference ran
    gemv[0] = {**meas["cpu_gemv"][0], "probe_bytes_per_s": REF / 2}
    out = memory_state.normalised({**meas, "cpu_gemv": gemv, "memory_state": record})["cpu_gemv"]
    rate = lambda r: memory_state.work("cpu_gemv", r)[1] / r["time_s"]  # noqa: E731  (bytes streamed / s)
    # not halved (its rate doubled): at most the best rate of the reference rows of its stream, here
    # within 1% of its own
    assert rate(gemv[0]) <= rate(out[0]) < 1.02 * rate(gemv[0])
    gemv[0]["probe_bytes_per_s"] = "fast"  # unreadable: the step's sample
    out = memory_state.normalised({**meas, "cpu_gemv": gemv, "memory_state": record})["cpu_gemv"]
    assert out[0]["time_s"] == gemv[0]["time_s"]


def test_gemvs_timed_in_a_slow_state_are_normalised_when_only_prefill_gemms_ran_in_the_reference(local):
    """A prefill GEMM's bytes per second is its compute's pace, not a streaming rate the state
    sets: with every GEMV of a dtype in the slow state and only its GEMMs in the reference one, the
    GEMVs are brought to the reference (the state flipped between the two steps)."""
    meas = FAST.measurements("quick", _dtypes(local))
    slow = SLOW.measurements("quick", _dtypes(local))
    row_steps = [lab for lab in _record(local)["at_step"] if lab.split("[")[0] in memory_state.ROW_PARTS]
    record = {"probe_bytes_per_s": [REF] * (len(row_steps) + 1), "at_step": row_steps + [memory_state.END]}
    gemv = [{**r, "probe_bytes_per_s": REF / 2} for r in slow["cpu_gemv"]]
    head = [{**r, "probe_bytes_per_s": REF / 2} for r in slow["cpu_head_gemv"]]  # GEMVs too
    gemm = [{**r, "probe_bytes_per_s": REF} for r in meas["cpu_gemm"]]
    streamed = [r for r in gemv if r["tokens"] == 1]
    assert max(memory_state.work("cpu_gemm", r)[1] / r["time_s"] for r in gemm) < \
        min(memory_state.work("cpu_gemv", r)[1] / r["time_s"] for r in streamed)  # the GEMMs' pace is slower
    out = memory_state.normalised({**meas, "cpu_gemv": gemv, "cpu_head_gemv": head, "cpu_gemm": gemm,
                                   "memory_state": record})
    ratios = [o["time_s"] / r["time_s"] for o, r in zip(out["cpu_gemv"], gemv) if r["tokens"] == 1]
    assert ratios and all(0.5 <= x < 0.56 for x in ratios), ratios  # memory-bound: nearly halved


def test_time_call_records_the_state_around_its_runs_only_while_probing():
    from flexplan.measure import microbench as mb

    readings = iter([40e9, 90e9])
    with mb.probing_state(lambda: next(readings)):
        r = mb.time_call(lambda: None, 3, 0.01)
    assert r["probe_bytes_per_s"] == pytest.approx((40e9 * 90e9) ** 0.5)
    assert mb.probed(r) == {"probe_bytes_per_s": pytest.approx(6e10)}
    assert "probe_bytes_per_s" not in mb.time_call(lambda: None, 3, 0.01)

    def failing():
        raise RuntimeError("probe failed")

    with mb.probing_state(failing):
        assert "probe_bytes_per_s" not in mb.time_call(lambda: None, 3, 0.01)


def test_a_row_reuses_the_last_rows_after_reading_only_while_it_is_fresh(monkeypatch):
    """Back-to-back rows: the second's "before" is the first's "after" (one probe saved a row);
    once that reading is older than PROBE_REUSE_S, or a new probing_state began, it probes again."""
    from flexplan.measure import microbench as mb

    readings = iter([40e9, 90e9, 60e9, 30e9, 50e9, 20e9, 80e9])
    with mb.probing_state(lambda: next(readings)):
        first = mb.time_call(lambda: None, 3, 0.01)  # probes 40, 90
        second = mb.time_call(lambda: None, 3, 0.01)  # reuses 90, probes 60
        monkeypatch.setattr(mb, "PROBE_REUSE_S", 0.0)
        third = mb.time_call(lambda: None, 3, 0.01)  # probes 30, 50
    assert [r["probe_bytes_per_s"] for r in (first, second, third)] == pytest.approx(
        [(40e9 * 90e9) ** 0.5, (90e9 * 60e9) ** 0.5, (30e9 * 50e9) ** 0.5])
    monkeypatch.setattr(mb, "PROBE_REUSE_S", 60.0)
    with mb.probing_state(lambda: next(readings)):  # another step's probes: its own readings
        assert mb.time_call(lambda: None, 3, 0.01)["probe_bytes_per_s"] == pytest.approx((20e9 * 80e9) ** 0.5)


# ----------------------------------------------------------------------------- the GEMV probe


def _with_gemv(record: dict, rate=REF * 1.5, threads=None) -> dict:
    """``record`` with GEMV probe samples beside the copy's, all at ``rate``."""
    import torch

    labels = record["at_step"]
    return {**record, "gemv_probe": "test", "gemv_probe_threads": threads or torch.get_num_threads(),
            "gemv_at_step": list(labels), "gemv_probe_bytes_per_s": [rate] * len(labels)}


def test_the_gemv_probe_reads_a_positive_rate_and_is_what_calibrate_records():
    import torch  # noqa: F401 - loaded, as in every calibration

    assert membw.gemv_probe_usable()
    rate = membw.measure_gemv_bytes_per_s()
    assert 1e8 < rate < 1e13
    record = state.new_record()
    state.record_sample(record, "cpu_stream")
    assert record["gemv_at_step"] == ["cpu_stream"] and record["gemv_probe_bytes_per_s"][0] > 0
    assert set(state.row_probes(record)) == {"probe_bytes_per_s", "gemv_probe_bytes_per_s", "probe_flops_per_s"}
    assert "GEMV" in state.describe({"memory_state": record})


def test_the_compute_probe_runs_in_torch_where_torch_is_loaded_and_numpy_where_not():
    """numpy's OpenBLAS threads spin ~0.1 s after a product and slowed the prefill that followed a
    plan 2-5x on the 2-core VM: where torch is loaded the probe is torch's own product."""
    import subprocess
    import sys

    import torch

    assert membw.compute_probe_kind() == f"torch burst, {torch.get_num_threads()} threads"
    assert "torch.nn.functional.linear" in membw.describe_compute_probe()
    assert 1e8 < membw.measure_matmul_flops_per_s() < 1e15
    record = state.new_record()
    assert record["compute_probe_kind"] == membw.compute_probe_kind()
    code = ("import sys; from flexplan.measure import membw; "
            "assert membw.compute_probe_kind() == 'numpy', membw.compute_probe_kind(); "
            "assert membw.measure_matmul_flops_per_s() > 1e8; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compute_samples_of_another_probe_kind_are_not_compared(local, probe, tmp_path, monkeypatch):
    """A file whose compute samples came from numpy (files from before torch's probe) is not
    scaled by today's torch probe, and the note says why; its memory scaling is unchanged."""
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = {**_with_compute(_record(local)), "compute_probe": "numpy float32 matmul 512 x 512 x 512"}
    assert memory_state.recorded_compute_kind(meas) == "numpy"
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    probe.state["flops_now"] = REF_FLOPS / 2
    probe(REF / 2)
    eff = state.efficiency_now(local)
    assert (eff.scale("cpu_compute"), eff.scale("cpu_memory")) == (1.0, 2.0)
    assert "compute probe: this calibration's samples came from a numpy product" in eff.source
    assert "not comparable with today's probe" in state.describe(meas)
    meas["memory_state"]["compute_probe_kind"] = membw.compute_probe_kind()  # the same kind: compared
    _use(monkeypatch, _write(tmp_path, local, meas, "cal2.yaml"))
    membw.forget_probe()
    assert state.efficiency_now(local).scale("overhead") == pytest.approx(2.0)


def test_plans_read_the_gemv_probe_where_the_calibration_recorded_it(local, probe, tmp_path, monkeypatch):
    """A file with GEMV samples is scaled by the GEMV probe (its own reference), whatever the copy
    reads; without torch loaded, or run in other threads than at calibration, by the copy."""
    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _with_gemv(_record(local))
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    monkeypatch.setattr(membw, "measure_gemv_bytes_per_s", lambda *a, **k: REF * 1.5 / 2)
    probe(REF)  # the copy reads the calibration's state; the GEMV half of its own
    p = _cpu_plan()
    assert ("memory state: memory probe (decode GEMV) 7.5 GB/s now vs 15.0 GB/s median at calibration "
            "(x2.00 memory time)") in p.calibration
    monkeypatch.setattr(membw, "gemv_probe_usable", lambda: False)
    membw.forget_probe()
    assert "memory probe 10.0 GB/s now vs 10.0 GB/s median at calibration (the same state" in _cpu_plan().calibration


def test_a_gemv_record_of_other_threads_falls_back_to_the_copy(local, probe, tmp_path, monkeypatch):
    import torch

    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _with_gemv(_record(local), threads=torch.get_num_threads() + 1)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    monkeypatch.setattr(membw, "measure_gemv_bytes_per_s", lambda *a, **k: 1.0)  # would clamp at x3
    probe(REF / 2)
    assert "memory probe 5.0 GB/s now vs 10.0 GB/s median at calibration (x2.00 memory time)" in _cpu_plan().calibration


def test_rows_are_normalised_by_the_gemv_probe_where_the_file_has_it(local):
    meas = FAST.measurements("quick", _dtypes(local))
    row_steps = [lab for lab in _record(local)["at_step"] if lab.split("[")[0] in memory_state.ROW_PARTS]
    record = _with_gemv({"probe_bytes_per_s": [REF] * (len(row_steps) + 1), "at_step": row_steps + [memory_state.END]},
                        rate=REF * 2)
    gemv = [dict(r) for r in meas["cpu_gemv"]]
    # the copy says the reference state, the GEMV probe half of it: the GEMV probe decides
    gemv[0] = {**SLOW.measurements("quick", _dtypes(local))["cpu_gemv"][0], "probe_bytes_per_s": REF,
               "gemv_probe_bytes_per_s": REF}
    out = memory_state.normalised({**meas, "cpu_gemv": gemv, "memory_state": record})["cpu_gemv"]
    assert 0.5 <= out[0]["time_s"] / gemv[0]["time_s"] < 0.56
    assert memory_state.row_probe_kind({"memory_state": record}) == "gemv"
    assert memory_state.row_probe_kind({"memory_state": _record(local)}) == "memory"


def test_time_call_records_every_probe_of_a_dict():
    from flexplan.measure import microbench as mb

    a, b, c = iter([40e9, 90e9]), iter([20e9, 80e9]), iter([100e9, 400e9])
    with mb.probing_state({"probe_bytes_per_s": lambda: next(a), "gemv_probe_bytes_per_s": lambda: next(b),
                           "probe_flops_per_s": lambda: next(c)}):
        r = mb.time_call(lambda: None, 3, 0.01)
    assert mb.probed(r) == {"probe_bytes_per_s": pytest.approx(6e10), "gemv_probe_bytes_per_s": pytest.approx(4e10),
                            "probe_flops_per_s": pytest.approx(2e11)}


def test_held_probes_reuse_a_figure_whatever_its_age(probe):
    membw.probe_bytes_per_s(max_age_s=0.0)
    calls = probe.state["calls"]
    with membw.held_probes():
        assert membw.probe_bytes_per_s(max_age_s=-1.0) == REF  # older than any age: still held
        assert probe.state["calls"] == calls
    membw.probe_bytes_per_s(max_age_s=-1.0)
    assert probe.state["calls"] > calls


def test_validate_prices_each_point_at_the_state_probed_right_before_its_runs(local, probe, tmp_path, monkeypatch,
                                                                              one_thread):
    """The grid point's predictions use the probes taken right before its timed runs (held while
    they run), and the CSV keeps those and the readings right after them."""
    from conftest import make_model

    from flexplan import validate

    meas = FAST.measurements("quick", _dtypes(local))
    meas["memory_state"] = _record(local)
    _use(monkeypatch, _write(tmp_path, local, meas, "cal.yaml"))
    make_model("llama").save_pretrained(tmp_path / "m")
    real_generate, real_readings = validate._generate, state.readings_now

    def readings_now(keep=True):
        if keep:  # the probe right before the timed runs: a slow state
            probe.state["now"] = REF / 2
        return real_readings(keep)

    def generate(lm, ids, new_tokens):  # ... which ends while they run
        st = real_generate(lm, ids, new_tokens)
        probe.state["now"] = REF
        return st

    monkeypatch.setattr(validate, "_generate", generate)
    monkeypatch.setattr(validate, "readings_now", readings_now)
    rows = validate.run_grid(tmp_path / "m", {"b": [1], "i": [4], "o": [2]}, [("cpu", "cpu")], warm=False)
    (row,) = rows
    assert row["probe_before_memory_bytes_per_s"] == REF / 2 and row["probe_after_memory_bytes_per_s"] == REF
    assert "memory probe 5.0 GB/s now" in row["sets"]["in use"]["cold"]["memory_state"]
    assert "probe_before_compute_flops_per_s" in validate.probe_columns(rows)


def test_probe_and_stream_buffers_outgrow_a_big_last_level_cache(monkeypatch):
    """On a host with a 300 MB LLC (the H200's 16-core Xeon VM) fixed 128/256 MB caps measured the
    cache; the buffers follow the LLC, within 1/64 of the host's memory."""
    from flexplan.measure import membw
    from flexplan.measure import microbench as mb

    llc = 300 * 2**20
    monkeypatch.setattr(membw, "llc_bytes", lambda: llc)
    pages = {"SC_PHYS_PAGES": (128 << 30) // 4096, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(membw.os, "sysconf", lambda k: pages[k])
    assert membw.probe_buffer_bytes() == 2 * llc
    assert membw.gemv_probe_bytes() == 4 * llc
    assert mb.stream_array_bytes(mb.MODES["probe"]) == 4 * llc
    assert mb.stream_array_bytes(mb.MODES["tiny"]) == mb.MODES["tiny"].stream_bytes
    pages["SC_PHYS_PAGES"] = (8 << 30) // 4096  # a small host keeps the fixed caps
    assert membw.probe_buffer_bytes() == membw.MAX_BUFFER_BYTES
    assert membw.gemv_probe_bytes() == 2 * membw.MAX_BUFFER_BYTES
    monkeypatch.setattr(membw, "llc_bytes", lambda: 8 * 2**20)  # a small cache: the floors
    assert membw.probe_buffer_bytes() == membw.MIN_BUFFER_BYTES
    assert mb.stream_array_bytes(mb.MODES["full"]) == mb.MODES["full"].stream_bytes


def test_the_probes_band_is_its_own_spread_on_this_machine():
    """probe_band: the median relative change between consecutive calibration samples; a few state
    changes among them do not move it; too few samples: the unmeasured band."""
    from flexplan.estimator.efficiency import UNMEASURED_PROBE_BAND
    from flexplan.factors.memory_state import probe_band

    def meas(xs):
        return {"memory_state": {"probe_bytes_per_s": list(xs), "at_step": [f"s{i}" for i in range(len(xs))]}}

    quiet = [40e9 * (1 + 0.02 * (-1) ** i) for i in range(12)]  # +-2% around one state
    assert probe_band(meas(quiet)) == pytest.approx(0.04 / 0.98, rel=0.05)
    flips = quiet[:6] + [x * 0.6 for x in quiet[6:]]  # one change of state among 11 gaps
    assert probe_band(meas(flips)) == pytest.approx(probe_band(meas(quiet)), rel=0.05)
    assert probe_band(meas(quiet[:4])) == UNMEASURED_PROBE_BAND
    assert probe_band({}) == UNMEASURED_PROBE_BAND
