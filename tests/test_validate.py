"""validate's pure parts: grid parsing, MAPE / p90 / regret, atomic outputs."""

import json
import math

import pytest

from flexplan.errors import InvalidInputError
from flexplan.validate import parse_grid, parse_pairs, summarize, write_outputs


def row(p, d, b, i, o, mt, pt, mp, pp, me=None, pe=None):
    return dict(model="m", hardware="h", prefill_policy=p, decode_policy=d, prefill_gpu_layers=0, decode_gpu_layers=0,
                batch_size=b, input_len=i, output_len=o, cpu_dtype="float32", cpu_threads=2,
                measured_ttft_s=mt, measured_tpot_s=mp, measured_e2e_s=me if me is not None else mt + (o - 1) * mp,
                predicted_ttft_s=pt, predicted_tpot_s=pp, predicted_e2e_s=pe if pe is not None else pt + (o - 1) * pp,
                default_predicted_ttft_s=2 * pt, default_predicted_tpot_s=2 * pp, default_predicted_e2e_s=0.0,
                calibration="test")


def test_parse_grid_and_pairs():
    assert parse_grid("b=1,4 i=32 o=16,64") == {"b": [1, 4], "i": [32], "o": [16, 64]}
    assert parse_pairs("cpu,gpu-offload:splitgen") == [("cpu", "cpu"), ("gpu-offload", "splitgen")]
    for bad in ("b=1 i=2", "b=0 i=2 o=4", "b=x i=2 o=4", "b=1 i=2 o=1", "q=1 b=1 i=2 o=4"):
        with pytest.raises(InvalidInputError):
            parse_grid(bad)
    with pytest.raises(InvalidInputError, match="unknown policy"):
        parse_pairs("cpu:fast")


def test_mape_p90_and_regret():
    rows = [row("cpu", "cpu", 1, 32, 16, 1.0, 1.1, 0.1, 0.09), row("cpu", "cpu", 1, 64, 16, 2.0, 1.8, 0.2, 0.2)]
    s = summarize(rows)
    assert s["mape"]["prefill"]["cpu"] == pytest.approx(10.0)
    assert s["mape"]["decode"]["cpu"] == pytest.approx(5.0)
    assert s["mape_default"]["prefill"]["cpu"] == pytest.approx((120 + 80) / 2)  # 2.2 vs 1, 3.6 vs 2
    assert s["p90"]["prefill"]["cpu"] == pytest.approx(10.0)
    assert s["regret"] == 1.0  # one pair per point
    # two pairs at one point: the planner prefers the one predicted faster, which measured slower
    rows = [row("cpu", "cpu", 1, 32, 16, 1, 1, 0.1, 0.1, me=3.0, pe=1.0), row("gpu", "gpu", 1, 32, 16, 1, 1, 0.1, 0.1, me=2.0, pe=2.0)]
    assert summarize(rows)["regret"] == pytest.approx(1.5)


def test_outputs_written(tmp_path):
    rows = [row("cpu", "cpu", b, 32, 16, 1.0 * b, 1.1 * b, 0.1, 0.09) for b in (1, 2)]
    paths = write_outputs(rows, summarize(rows), tmp_path, {"model": "m"}, plot=True)
    assert paths["plot"].stat().st_size > 1000
    d = json.loads(paths["summary"].read_text())
    assert d["model"] == "m" and math.isclose(d["mape"]["decode"]["cpu"], 10.0)
    assert paths["csv"].read_text().count("\n") == 3
    assert not list(tmp_path.glob("*.tmp*"))


def test_calibration_sets_cold_and_warm_are_summarised_per_set(tmp_path):
    from flexplan.validate import set_columns

    rows = []
    for b, meas_tpot in ((1, 0.10), (4, 0.20)):
        r = row("cpu", "cpu", b, 32, 16, 1.0, 1.0, meas_tpot, meas_tpot)
        r["sets"] = {"full": {"cold": {"ttft_s": 1.1, "tpot_s": meas_tpot * 1.2, "e2e_s": 3.0},
                              "warm": {"ttft_s": 1.0, "tpot_s": meas_tpot * 1.02, "e2e_s": 3.0}},
                     "probe": {"cold": {"ttft_s": 2.0, "tpot_s": meas_tpot * 0.5, "e2e_s": 3.0}}}
        rows.append(r)
    s = summarize(rows)["sets"]
    assert s["full"]["cold"]["mape"]["decode"]["cpu"] == pytest.approx(20.0)
    assert s["full"]["warm"]["mape"]["decode"]["cpu"] == pytest.approx(2.0)
    assert s["full"]["cold"]["mape"]["prefill"]["cpu"] == pytest.approx(10.0)
    assert s["probe"]["cold"]["mape"]["prefill"]["cpu"] == pytest.approx(100.0)
    assert "warm" not in s["probe"]
    assert "full:warm_tpot_s" in set_columns(rows) and "probe:warm_tpot_s" not in set_columns(rows)
    paths = write_outputs(rows, summarize(rows), tmp_path, {"model": "m"}, plot=False)
    header = paths["csv"].read_text().splitlines()[0].split(",")
    assert "full:cold_ttft_s" in header and "sets" not in header


def test_calibration_sets_parse_and_refuse(tmp_path):
    from flexplan.validate import calibration_sets

    assert calibration_sets(None) == {"in use": None}
    f = tmp_path / "a.yaml"
    f.write_text("x")
    assert calibration_sets(f"full={f}") == {"full": f}
    for bad, match in ((f"full{f}", "name=path"), (f"full={tmp_path / 'none.yaml'}", "no file"),
                       (f"a={f},a={f}", "twice")):
        with pytest.raises(InvalidInputError, match=match):
            calibration_sets(bad)


def test_default_output_folder_is_in_the_cache_not_the_cwd(tmp_path, monkeypatch):
    from flexplan.validate import default_out_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_out_dir("m", "20260101T000000Z") == tmp_path / "flexplan" / "validate" / "m-20260101T000000Z"
