"""gpu-offload decode on a GPU whose budget is capped so that a Llama-2-7B-shaped model must stream.

A random-weight Llama-2-7B-shaped model in bf16 (32 layers, hidden 4096, 13.5 GB;
flexplan.synthetic.LLAMA2_7B_CONFIG, written once to the flexplan cache) with the GPU budget
capped at ``--gpu-memory`` GiB (default 6). Printed and written to
``benchmarks/results/bench_gpu_offload.json``:

1. pinned host-to-device bandwidth, measured here (256 MiB copies from pinned memory, best of 5);
2. flexplan with ``gpu-offload`` for both phases: decode weight bytes moved per second of decode,
   against (1) (target: at least 85%); and flexplan with the plan the planner picks under the
   same cap;
3. transformers + accelerate ``device_map="auto"`` with ``max_memory={0: cap, "cpu": ...}`` (the
   layers that do not fit are offloaded to the CPU and copied in per forward), same inputs;
4. TTFT / TPOT of each, and the ratio flexplan / accelerate.

Batch 1, input 128, output 32, greedy, median of ``--repeats`` runs after one warm-up.

    python benchmarks/bench_gpu_offload.py                  # needs a CUDA GPU
    python benchmarks/bench_gpu_offload.py --smoke          # tiny model, CPU stand-in: checks the script only

One run on an H200 so far (``results/gpu-h200-2026-11-26/``): the accelerate part did not finish in the
time it had there.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_cpu_vs_transformers import timed_generate  # noqa: E402  (puts the repo on sys.path via common)
from common import fmt_s, median, write_result  # noqa: E402

GIB = 1 << 30
TARGET_FRACTION_OF_PINNED_H2D = 0.85
SHAPE = dict(batch=1, input_len=128, output_len=32)
SMOKE_SHAPE = dict(batch=1, input_len=16, output_len=4)


def pinned_h2d_bytes_per_s(device: str, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return nbytes / best


def model_folder(smoke: bool):
    from flexplan.synthetic import LLAMA2_7B_CONFIG, random_model_dir

    if smoke:
        cfg = dict(LLAMA2_7B_CONFIG, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=512)
        return random_model_dir("random-llama-tiny-bf16", cfg)
    return random_model_dir("random-llama2-7b-shaped-bf16", LLAMA2_7B_CONFIG)


def run_flexplan(folder, accelerator: str, cap_bytes: int, shape: dict, repeats: int, policy: str | None) -> dict:
    """flexplan under the cap: ``policy`` for both phases, or the planner's choice (None)."""
    import torch

    import flexplan

    plan_spec = {"prefill": policy, "decode": policy} if policy else "auto"
    lm = flexplan.load(folder, plan=plan_spec, accelerator=accelerator, dtype="bfloat16", gpu_memory_bytes=cap_bytes)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, lm.config.vocab_size, (shape["batch"], shape["input_len"]), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    timed_generate(lm, inputs, shape["output_len"], 0)  # warm-up (and, with "auto", the plan for this shape)
    runs, stats = [], []
    for _ in range(repeats):
        runs.append(timed_generate(lm, inputs, shape["output_len"], 0))
        st = lm.last_stats
        dec = st.decode
        weight_bytes = sum(t.nbytes for t in lm.executor.link.transfers
                           if t.phase == "decode" and t.kind == "weights" and t.direction == "h2d")
        stats.append({"plan": st.plan.to_dict(), "placement": st.placement, "decode_time_s": dec.time_s,
                      "decode_steps": dec.steps, "decode_weight_h2d_bytes": weight_bytes,
                      "decode_h2d_bytes": dec.h2d_bytes, "predicted_ttft_s": st.predicted_ttft_s,
                      "split_prefetch_issued": dict(lm.executor.split_prefetch_issued),
                      "predicted_tpot_s": st.predicted_tpot_s,
                      "decode_weight_bytes_per_s": weight_bytes / dec.time_s if dec.time_s > 0 else float("nan")})
    out = {k: median([r[k] for r in runs]) for k in ("ttft_s", "tpot_s", "e2e_s")}
    out["decode_weight_bytes_per_s"] = median([s["decode_weight_bytes_per_s"] for s in stats])
    out["placement"] = stats[-1]["placement"]
    out["runs"], out["stats"] = runs, stats
    del lm
    return out


def run_accelerate(folder, cap_bytes: int, shape: dict, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    host = int(0.9 * _mem_available_bytes())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="auto",
                                                 max_memory={0: cap_bytes, "cpu": host}).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (shape["batch"], shape["input_len"]), generator=g).to("cuda")
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    timed_generate(model, inputs, shape["output_len"], 0)
    runs = [timed_generate(model, inputs, shape["output_len"], 0) for _ in range(repeats)]
    placement = {}
    for where in getattr(model, "hf_device_map", {}).values():
        placement[str(where)] = placement.get(str(where), 0) + 1
    out = {k: median([r[k] for r in runs]) for k in ("ttft_s", "tpot_s", "e2e_s")}
    out["device_map_counts"], out["runs"] = placement, runs
    del model
    torch.cuda.empty_cache()
    return out


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 64 * GIB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-memory", type=float, default=6.0, help="GPU budget in GiB for both sides (default 6)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-accelerate", action="store_true",
                    help="skip the accelerate comparison (it did not finish in 150 s on an H200 host)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU stand-in; checks the script, no figures")
    args = ap.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu_offload needs a CUDA GPU (or --smoke to check the script on the CPU stand-in)", file=sys.stderr)
        return 2
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    cap = int((0.01 if args.smoke else args.gpu_memory) * GIB)
    accelerator = "cpu" if args.smoke else "cuda"
    folder = model_folder(args.smoke)
    print(f"{folder.name}: GPU budget {cap / GIB:.2f} GiB, batch {shape['batch']}, input {shape['input_len']}, "
          f"output {shape['output_len']}, {accelerator}", flush=True)
    result = {"model": folder.name, "gpu_budget_bytes": cap, "shape": shape, "smoke": args.smoke,
              "accelerator": accelerator}
    h2d = pinned_h2d_bytes_per_s("cuda") if not args.smoke else float("nan")
    result["pinned_h2d_bytes_per_s"] = h2d
    t0 = time.perf_counter()
    parts = [("flexplan_gpu_offload", lambda: run_flexplan(folder, accelerator, cap, shape, args.repeats, "gpu-offload")),
             ("flexplan_auto", lambda: run_flexplan(folder, accelerator, cap, shape, args.repeats, None)),
             ("accelerate", lambda: None if args.smoke or args.no_accelerate else run_accelerate(folder, cap, shape,
                                                                                              args.repeats))]
    for key, run in parts:  # each part printed and written as it ends: a run cut short keeps what it measured
        result[key] = run()
        result["wall_s"] = time.perf_counter() - t0
        if result[key]:
            r = result[key]
            print(f"  {key}: TTFT {fmt_s(r['ttft_s'])}, TPOT {fmt_s(r['tpot_s'])}, E2E {fmt_s(r['e2e_s'])}", flush=True)
        write_result("bench_gpu_offload" + ("_smoke" if args.smoke else ""), result)

    print(f"  pinned H2D measured: {h2d / 1e9:.1f} GB/s")
    print(f"  {'':<26}{'TTFT':>11}{'TPOT':>11}{'E2E':>11}")
    for key in ("flexplan_gpu_offload", "flexplan_auto", "accelerate"):
        r = result[key]
        if r:
            print(f"  {key:<26}{fmt_s(r['ttft_s']):>11}{fmt_s(r['tpot_s']):>11}{fmt_s(r['e2e_s']):>11}")
    fx = result["flexplan_gpu_offload"]
    frac = fx["decode_weight_bytes_per_s"] / h2d
    result["decode_weight_fraction_of_pinned_h2d"] = frac
    print(f"  flexplan gpu-offload decode moves weights at {fx['decode_weight_bytes_per_s'] / 1e9:.1f} GB/s = "
          f"{100 * frac:.0f}% of pinned H2D (target {100 * TARGET_FRACTION_OF_PINNED_H2D:.0f}%)")
    print(f"  flexplan auto placement: {result['flexplan_auto']['placement']}")
    if result["accelerate"]:
        acc = result["accelerate"]
        for key in ("flexplan_gpu_offload", "flexplan_auto"):
            result[f"tpot_ratio_{key}_over_accelerate"] = result[key]["tpot_s"] / acc["tpot_s"]
            print(f"  TPOT ratio {key} / accelerate: {result[key]['tpot_s'] / acc['tpot_s']:.2f}")
        print(f"  accelerate device map (modules per device): {acc['device_map_counts']}")
    path = write_result("bench_gpu_offload" + ("_smoke" if args.smoke else ""), result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
