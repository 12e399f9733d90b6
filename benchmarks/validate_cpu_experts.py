"""Predicted vs measured time of cpu-experts' CPU part (flexplan/validate_experts.py) on this machine:
Qwen3-30B-A3B's expert shape (hidden 2048, width 768, 8 experts per token) with 32 experts per layer
(not 128, so that the fp32 copy, 600 MB, fits a small machine), decode batches 1-16, under the
local calibration. Writes results/validate_cpu_experts.json (rows and MAPE).

    python benchmarks/validate_cpu_experts.py [--threads N]

Under the calibration in use, scaled to the memory state of the moment (``flexplan hw`` says which).
Committed: ``validate_cpu_experts.json``, the shipped calibration of the AVX-512 VM (taken in its fast
memory state) with the VM between states (probe 55 GB/s against 65.8), and ``validate_cpu_experts_same_state.json``, a
calibration taken in the slow state (``FLEXPLAN_CALIBRATION_FILE=... --name ..._same_state``), both
with 2 threads on the idle VM. Rerun on an idle machine: with other jobs on the cores OpenMP
barriers stall and the measured times are those of the contention.
"""

from __future__ import annotations

import argparse
import dataclasses

from common import write_result  # noqa: E402  (also puts the repo on sys.path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--name", default="validate_cpu_experts", help="results/<name>.json")
    args = ap.parse_args(argv)
    import torch

    from flexplan.validate_experts import validate_cpu_experts
    from flexplan.workload import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = dataclasses.replace(resolve_model("Qwen/Qwen3-30B-A3B"), num_experts=32)
    out = validate_cpu_experts(spec, batches=(1, 2, 4, 8, 16), repeats=args.repeats)
    for r in out["rows"]:
        print(f"batch {r['batch']:3d}: {r['distinct_experts']:5.1f} experts, predicted {1e3 * r['predicted_s']:7.2f} ms, "
              f"measured {1e3 * r['measured_s']:7.2f} ms ({r['error_pct']:.0f}%)")
    print(f"MAPE {out['mape_pct']:.0f}% ({out['calibration']}, {out['threads']} threads)")
    print(f"wrote {write_result(args.name, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
