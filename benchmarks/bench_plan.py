"""How long flexplan.plan() takes (target: median under 10 ms for a catalog model).

    python benchmarks/bench_plan.py [--hw flexinfer-server2] [--repeats 50]

Prints the median and p90 per model and writes benchmarks/results/plan_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flexplan, not another install
import flexplan  # noqa: E402
from flexplan.workload import catalog_names  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hw", default="flexinfer-server2")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("-b", type=int, default=16)
    ap.add_argument("-i", type=int, default=512)
    ap.add_argument("-o", type=int, default=32)
    args = ap.parse_args()
    rows = []
    print(f"flexplan.plan() on {args.hw}, batch {args.b}, input {args.i}, output {args.o}, {args.repeats} calls each")
    print(f"{'model':<42} {'median ms':>10} {'p90 ms':>8}")
    def one() -> bool:
        """One plan() call; False when the model fits no placement (the planner's answer, timed too)."""
        try:
            flexplan.plan(name, args.hw, batch_size=args.b, input_len=args.i, output_len=args.o)
            return True
        except flexplan.DoesNotFitError:
            return False

    for name in catalog_names():
        fits = one()  # warm caches
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            one()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        med, p90 = statistics.median(times), times[int(0.9 * (len(times) - 1))]
        rows.append({"model": name, "median_ms": med, "p90_ms": p90, "fits": fits})
        print(f"{name:<42} {med:>10.2f} {p90:>8.2f}{'' if fits else '  (fits no placement)'}")
    worst = max(r["median_ms"] for r in rows)
    print(f"worst median: {worst:.2f} ms ({'under' if worst < 10 else 'OVER'} the 10 ms target)")
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": "plan_speed", "hardware_planned_for": args.hw, "batch_size": args.b, "input_len": args.i,
           "output_len": args.o, "repeats": args.repeats, "rows": rows, "worst_median_ms": worst,
           "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
           "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    path = RESULTS / "plan_speed.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
