"""What flexplan's executor adds per CPU decoder layer beyond the bare layer, at decode batch 1 and 8.

Calibration's ``cpu_executor_layers`` step (``microbench.executor_layers``) times it at batch 1 only
and the estimator adds that one figure at every batch. This runs that step's own measurement
(``microbench._executor_layer``: toy Llamas of one width at two depths past twice the last-level
cache decoded by the executor, the median of its slopes less the bare layer timed beside each) at
each batch, round by round interleaved, and prints each round and the medians.

    python benchmarks/diag_executor_extra_by_batch.py --rounds 7 --dtype bfloat16 --width 576

Writes ``benchmarks/results/diag_executor_extra_by_batch.json``.
"""

from __future__ import annotations

import argparse
import statistics

from common import machine_description, write_result  # noqa: E402

WIDTHS = {576: (576, 1536, 9, 3, 64), 2048: (2048, 5632, 32, 8, 64)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--width", type=int, default=576, choices=sorted(WIDTHS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--name", default="diag_executor_extra_by_batch")
    args = ap.parse_args()
    from flexplan.calibration import microbench as mb

    sizes, width = mb.MODES["quick"], WIDTHS[args.width]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for r in range(args.rounds):
        for b in batches:
            for row in mb._executor_layer(sizes, args.dtype, width, None, b):
                rows.append({"round": r, **row})
                print(f"round {r} batch {b}: executor {row['time_s'] * 1e3:.3f} ms a layer, bare "
                      f"{row['layer_time_s'] * 1e3:.3f}, extra {row['extra_s'] * 1e3:.3f}", flush=True)
    med = {b: statistics.median(x["extra_s"] for x in rows if x["batch"] == b) for b in batches}
    print("median extra per layer: " + ", ".join(f"batch {b} {v * 1e3:.3f} ms" for b, v in med.items()))
    path = write_result(args.name, {"machine": machine_description(), "dtype": args.dtype, "width": list(width),
                                    "rows": rows, "median_extra_s": {str(b): v for b, v in med.items()}})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
