"""How much of its first call's error should the online correction take? Judged on kept validations.

``flexplan validate`` records, per grid point and calibration set, the cold prediction (calibration
alone) and the warm one (after the correction learned from one call). The first update's direction
does not depend on the filter's prior, only its size, so a first step of ``g`` times today's
gives, to first order, warm predictions ``exp((1 - g) log cold + g log warm)``. This prints the
mean MAPE over every (model, set, phase, cycle) figure of kept calibration-cycles runs for a few
``g`` (0: cold; 1: the warm of the code that ran).

    python benchmarks/warm_gain.py benchmarks/results/calibration_cycles_zen4_run4-files
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from pathlib import Path

GAINS = (0.0, 0.25, 0.5, 0.75, 1.0)


def figures(folder: Path, gain: float) -> list[float]:
    """MAPE of each (CSV, set, phase) with warm taken ``gain`` of the way from cold."""
    out = []
    for path in sorted(folder.glob("cycle*-validate-*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        sets = sorted({c.split(":")[0] for c in rows[0] if c.endswith(":warm_ttft_s")})
        for s in sets:
            for meas, phase in (("measured_ttft_s", "ttft"), ("measured_tpot_s", "tpot")):
                cold, warm = f"{s}:cold_{phase}_s", f"{s}:warm_{phase}_s"
                errs = [abs(math.exp((1 - gain) * math.log(float(r[cold])) + gain * math.log(float(r[warm])))
                            / float(r[meas]) - 1) * 100 for r in rows if r.get(warm)]
                if errs:
                    out.append(statistics.fmean(errs))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", type=Path, nargs="+", help="<name>-files folders kept by bench_calibration_cycles.py")
    args = ap.parse_args()
    print("mean MAPE over the figures, warm taken g of the way from cold (g = 1: as recorded)")
    for folder in args.folders:
        by_gain = {g: figures(folder, g) for g in GAINS}
        print(f"{folder.name}: {len(by_gain[1.0])} figures  "
              + "  ".join(f"g={g:g}: {statistics.fmean(v):.2f}%" for g, v in by_gain.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
