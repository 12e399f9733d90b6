"""The planner's choices over a grid of catalog cases, to compare two versions of the code.

    python benchmarks/plan_choices.py --out new.json                 # in one checkout
    python benchmarks/plan_choices.py --out old.json                 # in another
    python benchmarks/plan_choices.py --compare old.json new.json    # what changed

Cases: every catalog model x hardware (two FlexInfer servers and a Xeon 8480+ with an H200) x GPU
budget (8, 24, 80 GiB) x shape (b1 128/32, b16 512/32, b4 2048/256). Each case keeps the chosen
prefill and decode policies, their GPU layers and the predicted E2E (None: fits nowhere).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's flexplan

HARDWARE = ("flexinfer-server1", "flexinfer-server2", "xeon-8480plus+h200-sxm-141gb")
GPU_GIB = (8, 24, 80)
SHAPES = ((1, 128, 32), (16, 512, 32), (4, 2048, 256))


def choices() -> dict[str, list | None]:
    import flexplan
    from flexplan.errors import DoesNotFitError
    from flexplan.workload import catalog_names

    out: dict[str, list | None] = {}
    for hw in HARDWARE:
        for model in catalog_names():
            for gib in GPU_GIB:
                for b, i, o in SHAPES:
                    key = f"{hw}|{model}|{gib} GiB|b{b} {i}/{o}"
                    try:
                        p = flexplan.plan(model, hw, batch_size=b, input_len=i, output_len=o,
                                          gpu_memory_bytes=gib << 30)
                        out[key] = [p.prefill.policy, p.prefill.gpu_layers, p.decode.policy, p.decode.gpu_layers,
                                    round(p.e2e_s, 9)]
                    except DoesNotFitError:
                        out[key] = None
    return out


def compare(old: dict, new: dict) -> None:
    both = [k for k in old if k in new]
    changed = [k for k in both if (old[k] is None) != (new[k] is None) or (old[k] and old[k][:4] != new[k][:4])]
    ratios = [new[k][4] / old[k][4] for k in both if old[k] and new[k]]
    print(f"{len(both)} cases; choice changed in {len(changed)}; predicted E2E new/old: min {min(ratios):.3f}, "
          f"median {statistics.median(ratios):.3f}, max {max(ratios):.3f}")
    for k in changed:
        print(f"  {k}: {old[k]} -> {new[k]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write this checkout's choices here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="print what changed between two files")
    args = ap.parse_args()
    if args.compare:
        compare(*(json.loads(Path(f).read_text()) for f in args.compare))
        return 0
    if not args.out:
        ap.error("give --out FILE or --compare OLD NEW")
    Path(args.out).write_text(json.dumps(choices(), indent=0) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
