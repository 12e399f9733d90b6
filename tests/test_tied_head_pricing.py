"""A tied LM head on a CPU computing in 16 bits runs another kernel than an untied one (blocked in
its dtype, read by the native float32 GEMV: ``cpu_linear._head_blockable``); calibration times it
apart and the estimator prices a model's head by ``tie_word_embeddings``."""

from __future__ import annotations

import pytest

from flexplan.factors import _derive, store
from flexplan.measure.calibrate import calibration_doc
from flexplan.measure.microbench import MODES, head_gemv
from flexplan.executor import cpu_linear
from test_calibration_properties import IDENTITY, LLAMA_8B, SMOLLM2, predict
from synthetic_machine import HW_CPU, SyntheticMachine

MACHINE = SyntheticMachine(bytes_per_s=40e9, kv_bytes_per_s=20e9, flops_per_s={"float32": 150e9, "bfloat16": 300e9},
                           op_s=5e-6, layer_s=200e-6, step_s=1e-3, logit_s=1e-10)
DTYPES = ["bfloat16", "float32"]


def _eff(tmp_path, tied_slowdown: float | None):
    """Factors of a file whose bfloat16 head rows are joined by tied-head rows ``tied_slowdown``
    times as long (None: no tied rows, as files before them and float32 CPUs have)."""
    meas = MACHINE.measurements("quick", DTYPES)
    if tied_slowdown is not None:
        meas["cpu_head_gemv"] += [dict(r, tied=True, kernel="tied-head", time_s=r["time_s"] * tied_slowdown,
                                       time_median_s=r["time_median_s"] * tied_slowdown)
                                  for r in meas["cpu_head_gemv"] if r["dtype"] == "bfloat16"]
    doc = calibration_doc("quick", meas, {"cpu_dtypes": DTYPES, "cpu_threads": 16}, HW_CPU, IDENTITY)
    path = store.write_atomic(store.plain(doc), tmp_path / f"tied-{tied_slowdown}.yaml")
    return _derive(store.load_calibration(path), HW_CPU)


def test_a_tied_head_is_priced_by_its_own_rows_an_untied_one_by_the_others(tmp_path):
    plain, slow_tied = _eff(tmp_path, None), _eff(tmp_path, 3.0)
    assert SMOLLM2.tie_word_embeddings and not LLAMA_8B.tie_word_embeddings
    tpot = lambda eff, spec, cd: predict(eff, HW_CPU, spec, "cpu", 1, 128, 16, cd)[1]  # noqa: E731
    # the tied model's bfloat16 decode pays its slower head; float32 and the untied model do not move
    assert tpot(slow_tied, SMOLLM2, "bfloat16") > 1.05 * tpot(plain, SMOLLM2, "bfloat16")
    assert tpot(slow_tied, SMOLLM2, "float32") == pytest.approx(tpot(plain, SMOLLM2, "float32"))
    assert tpot(slow_tied, LLAMA_8B, "bfloat16") == pytest.approx(tpot(plain, LLAMA_8B, "bfloat16"))
    # without tied rows a tied head falls back to the untied head's factors
    assert plain.cpu_head_memory(1, "bfloat16", tied=True) == plain.cpu_head_memory(1, "bfloat16")
    assert slow_tied.cpu_head_memory(1, "bfloat16", tied=True) < slow_tied.cpu_head_memory(1, "bfloat16")


@pytest.mark.skipif(not cpu_linear.blocking_available(), reason="the native GEMV kernel is not built here")
def test_calibration_times_the_tied_head_kernel_where_it_differs():
    rows = head_gemv(MODES["tiny"], "bfloat16")
    tied = [r for r in rows if r.get("tied")]
    assert {r["kernel"] for r in tied} == {cpu_linear.TiedHeadKernel().name}
    assert {(r["tokens"], r["k"], r["n"]) for r in tied} == {(r["tokens"], r["k"], r["n"]) for r in rows
                                                             if not r.get("tied")}
    assert all(r["time_s"] > 0 for r in rows)
    assert not any(r.get("tied") for r in head_gemv(MODES["tiny"], "float32"))  # the same kernel as untied
