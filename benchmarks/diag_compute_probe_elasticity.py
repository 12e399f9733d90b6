"""How much does a prefill move with the compute probe? Read off kept validation runs.

Every CSV row of ``benchmarks/results/calibration_cycles_*-files/cycle*-validate-*.csv`` is one grid
point measured once, with the compute probe read right before and right after its timed runs. Per
(model, batch, input) point, over all kept runs: the slope of log TTFT against log probe (each
point's logs centred), i.e. the elasticity a plan should scale compute time by, and its
correlation. No measuring: it reads what ``bench_calibration_cycles.py`` kept.

    python benchmarks/diag_compute_probe_elasticity.py
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys

import numpy as np
from common import RESULTS_DIR, write_result  # noqa: E402
from rederive_cycles import readings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--glob", default="calibration_cycles_*-files/cycle*-validate-*.csv",
                    help="CSVs under benchmarks/results/")
    ap.add_argument("--name", default=None, help="write benchmarks/results/<name>.json")
    args = ap.parse_args()
    points: dict = collections.defaultdict(list)  # (model, batch, input) -> [(ttft, probe)]
    files = sorted(RESULTS_DIR.glob(args.glob))
    for path in files:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                flops = readings(row, "", "mean").get("compute")  # geometric mean of before and after
                if flops:
                    points[(row["model"], int(row["batch_size"]), int(row["input_len"]))].append(
                        (float(row["measured_ttft_s"]), flops))
    if not points:
        raise SystemExit(f"no rows with compute probe readings in {RESULTS_DIR}/{args.glob}")
    out, pooled_x, pooled_y = [], [], []
    for (model, batch, inp), v in sorted(points.items()):
        t = np.log([a for a, _ in v])
        x = np.log([b for _, b in v])
        t, x = t - t.mean(), x - x.mean()
        pooled_x += list(x)
        pooled_y += list(t)
        if len(v) < 5:
            continue
        slope = -float(np.polyfit(x, t, 1)[0])
        corr = float(np.corrcoef(x, t)[0, 1])
        out.append({"model": model, "batch": batch, "input_len": inp, "points": len(v), "elasticity": round(slope, 3),
                    "correlation": round(corr, 3), "ttft_spread_pct": round(100 * float(np.std(t)), 1),
                    "probe_spread_pct": round(100 * float(np.std(x)), 1)})
        print(f"{model:<24} b{batch} i{inp:<4} n={len(v):<3} elasticity {slope:5.2f}  corr {corr:5.2f}  "
              f"TTFT spread {out[-1]['ttft_spread_pct']:4.1f}%  probe spread {out[-1]['probe_spread_pct']:4.1f}%")
    pooled = -float(np.polyfit(pooled_x, pooled_y, 1)[0])
    print(f"pooled over {len(pooled_x)} points of {len(files)} CSVs: elasticity {pooled:.2f}")
    if args.name:
        payload = {"command": " ".join(["python", *sys.argv]), "csvs": len(files), "points": out,
                   "pooled_elasticity": round(pooled, 3)}
        print(f"wrote {write_result(args.name, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
