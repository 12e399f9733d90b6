"""Calibrated on first use (issue 14, item 4; flexplan/measure/first_use.py).

tests/conftest.py turns the automatic probe off for every test; these turn it back on, with the
calibration folders pointed at a temporary directory (no checkout or shipped file visible), and
with the probe's grid shrunk to the tiny mode's shapes (its parts unchanged) so each plan measures
in about a second. One test runs the real ``flexplan calibrate --probe`` in a subprocess.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from flexplan.estimator.efficiency import unwrapped

from flexplan import plan
from flexplan.factors import calibration_for, efficiency_for, store
from flexplan.measure import state
from flexplan.measure.first_use import describe_calibration
from flexplan.measure import first_use
from flexplan.measure import microbench as mb
from flexplan.factors.efficiency import CalibratedEfficiency
from flexplan.estimator.efficiency import DefaultEfficiency
from flexplan.hardware import get_hardware

REPO = Path(__file__).resolve().parent.parent
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a catalog id: planned from its config, nothing downloaded


@pytest.fixture
def probe_env(tmp_path, monkeypatch):
    """The probe on, writing to tmp_path/cal; only tmp folders looked up; a fresh process state."""
    monkeypatch.setenv(first_use.ENV, "1")
    monkeypatch.setenv(store.DIR_ENV, str(tmp_path / "cal"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(store.FILE_ENV, raising=False)
    monkeypatch.setattr(store, "source_checkout_dir", lambda: None)
    monkeypatch.setattr(store, "shipped_dir", lambda: None)
    monkeypatch.setitem(mb.MODES, "probe", replace(mb.MODES["tiny"], parts=mb.MODES["probe"].parts,
                                                   generate_shapes=((128, 1), (512, 2)), generate_steps=2))
    first_use.reset()
    yield tmp_path
    first_use.reset()


@pytest.fixture
def synthetic_probe(probe_env, monkeypatch):
    """The probe writes, through the real writer, a file of synthetic measurements of the probe
    mode's shapes (tests/synthetic_machine.py) instead of measuring: for the tests of where its file
    goes and when it runs, not of what it measures (test_first_local_plan_... runs the real one)."""
    from flexplan.measure import calibrate as cli
    from synthetic_machine import SyntheticMachine

    machine = SyntheticMachine(bytes_per_s=40e9, kv_bytes_per_s=20e9, flops_per_s={"float32": 150e9, "bfloat16": 50e9},
                               op_s=5e-6, layer_s=100e-6, step_s=0.5e-3, logit_s=1e-10)

    def calibrate(mode, out, progress=True, **kw):
        assert mode == first_use.MODE and not kw
        hw = get_hardware("local")
        dtypes = list(dict.fromkeys([hw.cpu.compute_dtype, "float32"]))
        doc = cli.calibration_doc(mode, machine.measurements(mode, dtypes),
                                  {"cpu_dtypes": dtypes, "cpu_threads": hw.cpu.cores, "cpu_linear_kernel": "synthetic"},
                                  hw, store.local_identity())
        return cli.Result(store.write_atomic(store.plain(doc), Path(out)), doc, {}, 0.0)

    use_calibrate(monkeypatch, calibrate)
    return probe_env


def use_calibrate(monkeypatch, fake) -> None:
    """``fake`` runs where the first-use probe calls ``calibrate`` (imported into first_use, or
    looked up in flexplan.measure.calibrate at the call)."""
    from flexplan.measure import calibrate as cli

    monkeypatch.setattr(cli, "calibrate", fake)
    monkeypatch.setattr(first_use, "calibrate", fake, raising=False)


def _probe_files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*.yaml") if not p.name.startswith("."))


def test_first_local_plan_measures_once_caches_and_says_so_in_one_line(probe_env, capsys):
    assert describe_calibration(get_hardware("local")).startswith("calibration: none yet: the first local plan")
    assert _probe_files(probe_env) == []  # `flexplan hw` does not measure
    p = plan(MODEL, hardware="local", batch_size=1, input_len=32, output_len=8, efficiency=first_use.measured_efficiency(get_hardware("local")))
    err = capsys.readouterr().err.strip().splitlines()
    files = _probe_files(probe_env)
    assert [f.parent for f in files] == [probe_env / "cal"] and files[0].name == store.file_name(store.local_identity())
    assert len(err) == 1 and err[0].startswith("flexplan: no calibration of this machine; measured a ")
    assert "first-use probe" in err[0] and files[0].name in err[0] and "flexplan calibrate" in err[0]
    assert files[0].name in p.calibration
    cal = store.load_calibration(files[0])
    assert cal.doc["mode"] == "probe" and cal.doc["machine"]["isa"] == store.local_identity().isa
    # later plans find the file: nothing measured again, nothing printed, even in a new "process"
    mtime = files[0].stat().st_mtime_ns
    plan(MODEL, hardware="local", batch_size=4, input_len=64, output_len=8, efficiency=first_use.measured_efficiency(get_hardware("local")))
    first_use.reset()
    assert isinstance(unwrapped(first_use.measured_efficiency(get_hardware("local"))), CalibratedEfficiency)
    assert capsys.readouterr().err == "" and _probe_files(probe_env) == files
    assert files[0].stat().st_mtime_ns == mtime
    assert describe_calibration(get_hardware("local")).startswith("calibration in use:")


def test_without_calibration_dir_the_probe_goes_to_the_user_cache(synthetic_probe, monkeypatch, capsys):
    monkeypatch.delenv(store.DIR_ENV)
    eff = first_use.measured_efficiency(get_hardware("local"))
    files = _probe_files(synthetic_probe)
    assert isinstance(unwrapped(eff), CalibratedEfficiency)
    assert [f.parent for f in files] == [synthetic_probe / "xdg" / "flexplan" / "calibration"]
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_later_full_or_quick_calibration_supersedes_the_probe(synthetic_probe, capsys):
    first_use.measured_efficiency(get_hardware("local"))
    probe_file = _probe_files(synthetic_probe)[0]
    doc = store.load_calibration(probe_file).doc
    later = {**doc, "mode": "quick", "created_utc": "2099-01-01T00:00:00Z"}
    other = store.write_atomic(later, synthetic_probe / "xdg" / "flexplan" / "calibration" / probe_file.name)
    assert store.find_calibration().path == other
    assert calibration_for(get_hardware("local")).doc["mode"] == "quick"


def test_opt_out_gives_the_defaults_saying_how_to_calibrate(probe_env, monkeypatch, capsys):
    monkeypatch.setenv(first_use.ENV, "0")
    eff = first_use.measured_efficiency(get_hardware("local"))
    assert isinstance(eff, DefaultEfficiency)
    assert "FLEXPLAN_AUTO_CALIBRATE=0" in eff.source and "flexplan calibrate" in eff.source
    assert _probe_files(probe_env) == [] and capsys.readouterr().err == ""
    assert describe_calibration(get_hardware("local")) == "calibration: none: run `flexplan calibrate --quick`"
    assert "FLEXPLAN_AUTO_CALIBRATE=0" in plan(MODEL, hardware="local", efficiency=first_use.measured_efficiency(get_hardware("local"))).calibration


def test_a_failing_probe_gives_the_defaults_with_the_reason_once(probe_env, monkeypatch, capsys):
    calls = []

    def broken(**kw):
        calls.append(kw)
        raise ImportError("No module named 'torch'")

    use_calibrate(monkeypatch, broken)
    eff = first_use.measured_efficiency(get_hardware("local"))
    assert isinstance(eff, DefaultEfficiency)
    assert "first-use probe failed (ImportError: No module named 'torch')" in eff.source
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "probe failed" in err[0] and "default factors" in err[0]
    assert describe_calibration(get_hardware("local")).startswith("calibration: none: the first-use probe failed")
    p = plan(MODEL, hardware="local", efficiency=first_use.measured_efficiency(get_hardware("local")))  # no second attempt in this process
    assert len(calls) == 1 and "probe failed" in p.calibration and capsys.readouterr().err == ""
    assert _probe_files(probe_env) == []


def test_lookups_from_inside_the_probe_do_not_probe_again(synthetic_probe, monkeypatch):
    from flexplan.measure import calibrate as cli

    real, inner = getattr(first_use, "calibrate", cli.calibrate), []

    def calibrate_that_plans(**kw):  # the calibration asks for this machine's factors itself
        inner.append(first_use.measured_efficiency(get_hardware("local")))
        return real(**kw)

    use_calibrate(monkeypatch, calibrate_that_plans)
    assert isinstance(unwrapped(first_use.measured_efficiency(get_hardware("local"))), CalibratedEfficiency)
    assert len(inner) == 1 and isinstance(inner[0], DefaultEfficiency)
    assert len(_probe_files(synthetic_probe)) == 1


def test_hwdb_hardware_never_probes(probe_env, capsys):
    eff = first_use.measured_efficiency(get_hardware("flexinfer-server2"))
    assert isinstance(eff, DefaultEfficiency) and "not calibrated" in eff.source
    assert _probe_files(probe_env) == [] and capsys.readouterr().err == ""


@pytest.fixture(scope="module")
def real_probe(tmp_path_factory):
    """``flexplan calibrate --probe`` with the real probe grid, in a fresh process."""
    d = tmp_path_factory.mktemp("probe")
    env = {**os.environ, store.DIR_ENV: str(d), "PYTHONPATH": str(REPO)}
    env.pop(store.FILE_ENV, None)
    r = subprocess.run([sys.executable, "-m", "flexplan.cli", "calibrate", "--probe", "--no-progress"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    return d, r


@pytest.mark.slow
def test_cli_calibrate_probe_writes_a_probe_file_with_finite_positive_factors(real_probe):
    d, r = real_probe
    assert r.returncode == 0, r.stderr
    files = _probe_files(d)
    assert len(files) == 1 and "probe run" in r.stdout
    cal = store.load_calibration(files[0])
    assert cal.doc["mode"] == "probe"
    assert set(cal.measurements) - {"memory_state"} <= mb.MODES["probe"].parts  # memory_state: every mode
    assert {"cpu_stream", "cpu_gemv", "cpu_gemm", "cpu_layer_overhead"} <= set(cal.measurements)
    from flexplan.factors import efficiency_from_file

    hw = get_hardware("local")
    eff = unwrapped(efficiency_from_file(files[0], hw))
    assert isinstance(eff, CalibratedEfficiency)
    for dtype in eff.cpu:
        for tokens in (1, 4, 8, 32, 256, 1024, 4096):
            for f in (eff.cpu_compute, eff.cpu_memory, eff.cpu_head_compute, eff.cpu_head_memory):
                v = f(tokens, dtype)
                assert math.isfinite(v) and v > 0, (f.__name__, dtype, tokens, v)
        for ctx in (16, 1024, 32768):
            v = float(eff.cpu_attention(ctx, dtype))
            assert math.isfinite(v) and v > 0
        for tokens in (1, 512):
            v = eff.cpu_layer_overhead_s(tokens, dtype, 2e7)
            assert math.isfinite(v) and v >= 0
    assert math.isfinite(eff.cpu_step_overhead_s(4, 49152)) and eff.cpu_step_overhead_s(4, 49152) > 0
    p = plan(MODEL, hardware=hw, efficiency=eff, batch_size=4, input_len=128, output_len=16)
    assert math.isfinite(p.ttft_s) and p.ttft_s > 0 and math.isfinite(p.tpot_s) and p.tpot_s > 0


@pytest.mark.slow
def test_a_calibration_run_measures_no_first_use_probe_inside_it(probe_env, capsys):
    """`flexplan calibrate`'s executor-layer step loads toy models on this machine: with no file yet,
    their plans measured a first-use probe in the middle of the full calibration (8 s) and cached it.
    Inside a calibration lookups get none; after it the probe is on again."""
    with first_use.measuring():
        assert isinstance(first_use.measured_efficiency(get_hardware("local")), DefaultEfficiency)
    assert _probe_files(probe_env) == [] and capsys.readouterr().err == ""
    from flexplan.measure.calibrate import calibrate

    res = calibrate(mode="tiny", out=probe_env / "cal" / "tiny.yaml", progress=False)
    assert _probe_files(probe_env) == [res.path] and "first-use probe" not in capsys.readouterr().err
    assert isinstance(unwrapped(first_use.measured_efficiency(get_hardware("local"))), CalibratedEfficiency)
