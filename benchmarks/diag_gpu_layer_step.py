"""Where a tiny decoder layer's decode step spends its time on the GPU: the calibration's
per-layer overhead measurement (one layer, and the slope over a stack of 8), then one layer's
step with its KV cache growing a key per step (as the measurement ran before 7f5b18c), each
synchronised, and torch's profiler over 10 such steps (top ops by CPU time). The first-use probe on
an H200 host (2026-11-26) read 36 ms for one step where the executor's whole 7-layer decode step
took 14-20 ms.

    python benchmarks/diag_gpu_layer_step.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/diag_gpu_layer_step.json")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("diag_gpu_layer_step: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    from flexplan.calibration import microbench as mb
    from flexplan.calibration import microbench_gpu as gb

    sizes = mb.MODES["probe"]
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "threads": torch.get_num_threads()}
    for threads in (torch.get_num_threads(), 1):  # the calibration runs with every core's thread
        with mb.torch_threads(threads):
            t0 = time.perf_counter()
            out[f"layer_overhead_threads_{threads}"] = gb.layer_overhead(sizes, "bfloat16")
            out[f"layer_overhead_threads_{threads}"]["wall_s"] = round(time.perf_counter() - t0, 2)
        print(f"threads {threads}:", out[f"layer_overhead_threads_{threads}"], flush=True)

    step = mb.tiny_decode_step("bfloat16", "cuda")  # the KV cache grows a key per step, as before the fix
    with torch.inference_mode():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        each = []
        for _ in range(10):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            each.append(time.perf_counter() - t0)
        out["one_step_each_s"] = [round(t, 6) for t in each]
        print("one step, each synchronized (s):", out["one_step_each_s"], flush=True)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=20)
    print(table, flush=True)
    out["profile_top_by_cpu_time"] = table
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
