"""What one ``NeoApexScheduler.schedule(state)`` call costs (the issue asks for well under 1 ms,
every iteration), on the papers' T4 testbed with Llama-2-7B, for decode batches of 8-256 running
requests (a quarter of them with host KV) and 4 waiting prompts. A benchmark, not a timed test:
the figures depend on the machine and its load, which the JSON names.

    python benchmarks/bench_scheduler_cost.py [--calls 300]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import timeit

from common import write_json  # noqa: E402
from flexplan.estimator.efficiency import DefaultEfficiency
from flexplan.hardware import get_hardware
from flexplan.serving.kv_blocks import DEVICE, HOST
from flexplan.serving.scheduler import NeoApexScheduler
from flexplan.serving.state import EngineState, RequestState
from flexplan.workload import resolve_model

HERE = os.path.dirname(os.path.abspath(__file__))
TESTBED, MODEL = "neo-testbed-g4dn-4xlarge", "meta-llama/Llama-2-7b-hf"


def state_for(running: int) -> EngineState:
    """``running`` decodes (context 500-2000 tokens, the last quarter in the host pool), 4 waiting."""
    run = tuple(RequestState(f"r{i}", 500, 0, 500 + (i * 37) % 1500, 3, 200, HOST if i >= running * 3 // 4 else DEVICE, i)
                for i in range(running))
    wait = tuple(RequestState(f"w{i}", 900, 900, 0, 0, 200, None, running + i) for i in range(4))
    return EngineState(wait, run, {DEVICE: 40, HOST: 50000}, {DEVICE: 4000, HOST: 80000}, 16, 2048, 512, True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_scheduler_cost.json"))
    args = ap.parse_args(argv)
    hw = get_hardware(TESTBED)
    sched = NeoApexScheduler(resolve_model(MODEL), hw, DefaultEfficiency.for_hardware(hw))
    rows = []
    for running in (8, 32, 64, 128, 256):
        st = state_for(running)
        plan = sched.schedule(st)  # warms the per-token-count caches, as serving does
        best_s = min(timeit.repeat(lambda st=st: sched.schedule(st), number=args.calls, repeat=3)) / args.calls
        rows.append({"running": running, "waiting": 4, "us_per_schedule": round(best_s * 1e6, 1), "mode": plan.mode})
        print(f"{running:4d} running + 4 waiting: {best_s * 1e6:7.1f} us per schedule() ({plan.mode})", flush=True)
    out = {"what": f"NeoApexScheduler.schedule() wall time, best of 3 x {args.calls} calls ({TESTBED}, {MODEL})",
           "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, shared with other work)",
           "rows": rows}
    print(f"wrote {write_json(args.out, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
