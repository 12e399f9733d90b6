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
