"""How long one estimate of an engine iteration takes (goal: at most 1 ms), beside plan().

    python benchmarks/bench_iteration_estimate.py [--hw flexinfer-server2] [--repeats 200]

For each catalog model: the plan's chosen decode policy and M, then ``iteration_time_s`` for a
decode step (batch 16, 1024 keys) and a prefill (batch 1, 512 tokens), median and p90 over the
repeats. Writes benchmarks/results/iteration_estimate.json with the machine named.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flexplan, not another install
import flexplan  # noqa: E402
from flexplan.errors import DoesNotFitError  # noqa: E402
from flexplan.estimator.efficiency import DefaultEfficiency  # noqa: E402
from flexplan.estimator.iteration import iteration_time_s  # noqa: E402
from flexplan.hardware import get_hardware  # noqa: E402
from flexplan.workload import catalog_names, resolve_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _timed_us(fn, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hw", default="flexinfer-server2")
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    hw = get_hardware(args.hw)
    eff = DefaultEfficiency.for_hardware(hw)
    rows = []
    print(f"iteration_time_s on {args.hw}, {args.repeats} calls each (microseconds)")
    print(f"{'model':<42} {'policy':<22} {'decode p50':>10} {'p90':>7} {'prefill p50':>11} {'p90':>7}")
    for name in catalog_names():
        spec = resolve_model(name)
        try:
            p = flexplan.plan(spec, hardware=hw, batch_size=16, input_len=512, output_len=32, efficiency=eff)
        except DoesNotFitError:
            continue
        pol, m, cd = p.decode.policy, p.decode.gpu_layers, p.cpu_dtype
        dec = _timed_us(lambda: iteration_time_s(spec, hw, eff, pol, m, "decode", 16, 1024, p.dtype, cd), args.repeats)
        pre = _timed_us(lambda: iteration_time_s(spec, hw, eff, p.prefill.policy, p.prefill.gpu_layers, "prefill", 1,
                                                 512, p.dtype, cd), args.repeats)
        rows.append({"model": name, "decode_policy": pol, "decode_gpu_layers": m, "decode_median_us": round(dec[0], 1),
                     "decode_p90_us": round(dec[1], 1), "prefill_policy": p.prefill.policy,
                     "prefill_median_us": round(pre[0], 1), "prefill_p90_us": round(pre[1], 1)})
        print(f"{name:<42} {pol:<22} {dec[0]:>10.0f} {dec[1]:>7.0f} {pre[0]:>11.0f} {pre[1]:>7.0f}")
    worst = max(max(r["decode_median_us"], r["prefill_median_us"]) for r in rows)
    print(f"worst median: {worst:.0f} us ({'within' if worst <= 1000 else 'OVER'} the 1 ms goal)")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "iteration_estimate.json"
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "node": platform.node(),
                               "python": platform.python_version(), "hardware_modelled": args.hw,
                               "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                               "repeats": args.repeats, "worst_median_us": worst, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
