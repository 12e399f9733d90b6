"""What flexplan's executor adds per CPU decoder layer beyond the bare layer, at decode batch 1 and 8.

Calibration's ``cpu_executor_layers`` step (``microbench.executor_layers``) times it at batch 1 only
and the estimator adds that one figure at every batch. This times it as that step does (toy Llamas
of one width at two depths past twice the last-level cache, decoded by the executor with a fixed
``cpu`` plan: the slope per layer; the bare layer, ``microbench.layers``, right after) at batch 1
and 8, round by round interleaved, and prints each round and the medians.

    python benchmarks/diag_executor_extra_by_batch.py --rounds 5 --dtype bfloat16 --width 576

Writes ``benchmarks/results/diag_executor_extra_by_batch.json``.
"""

from __future__ import annotations

import argparse
import math
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
    import torch
    from transformers import LlamaForCausalLM

    from flexplan.api import load
    from flexplan.calibration import microbench as mb
    from flexplan.executor.plans import fixed_plan
    from flexplan.workload.model import ModelSpec

    width, kv, steps = WIDTHS[args.width], 128, 16
    batches = [int(b) for b in args.batches.split(",")]
    spec = ModelSpec.from_config(mb._llama_config(*width))
    low = min(32, max(2, math.ceil(2 * mb.llc_bytes() / (spec.params_per_layer * mb.dtype_bytes(args.dtype)))))
    depths = (low, low + 12)
    lms = {d: load(LlamaForCausalLM(mb._llama_config(*width, layers=d)).eval(),
                   plan=fixed_plan(mb._llama_config(*width, layers=d), "cpu", "cpu", cpu_dtype=args.dtype,
                                   input_len=kv, output_len=steps + 1, batch_size=max(batches)),
                   accelerator=None, online_correction=False) for d in depths}

    def step_s(lm, b):
        ids = torch.ones(b, kv, dtype=torch.long)

        def gen(n):
            return lambda: lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        return (mb.time_call(gen(steps + 1), 5, 2.0)["time_s"] - mb.time_call(gen(1), 5, 1.0)["time_s"]) / steps

    rows = []
    for r in range(args.rounds):
        for b in batches:
            slope = (step_s(lms[depths[1]], b) - step_s(lms[depths[0]], b)) / (depths[1] - depths[0])
            alone = mb.replace(mb.MODES["quick"], layer_widths=(width,), layer_shapes=((b, 1),), layer_long_kv_len=None,
                               prefill_only_widths=(), layer_kv_len=kv)
            bare = mb.layers(alone, args.dtype)[0]["time_s"]
            rows.append({"round": r, "batch": b, "executor_layer_s": slope, "bare_layer_s": bare, "extra_s": slope - bare})
            print(f"round {r} batch {b}: executor {slope * 1e3:.3f} ms a layer, bare {bare * 1e3:.3f}, "
                  f"extra {(slope - bare) * 1e3:.3f}", flush=True)
    med = {b: statistics.median(x["extra_s"] for x in rows if x["batch"] == b) for b in batches}
    print("median extra per layer: " + ", ".join(f"batch {b} {v * 1e3:.3f} ms" for b, v in med.items()))
    path = write_result(args.name, {"machine": machine_description(), "dtype": args.dtype, "width": list(width),
                                    "depths": list(depths), "kv_len": kv, "rows": rows,
                                    "median_extra_s": {str(b): v for b, v in med.items()}})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
