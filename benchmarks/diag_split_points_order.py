"""Where split-points' decode time goes on a GPU host, and whether the executor's copy order helps.

On the H100 (2026-11-26, session 6) the auto plan's split-points decode of the Llama-2-7B-shaped
model ran TPOT 201 ms against 160 predicted, about what the CPU's operators, the accelerator's
segment and the next layer's weight copy take one after the other. This script runs a shorter model
of the same layer shape (``--layers``, all but the planner's resident ones streamed and split) and:

1. times the decode with the next layer's copy issued once the segment is done (the executor's
   order) and at the start of the layer (the earlier order, ``Executor.defer_split_prefetch``),
   interleaved, ``--rounds`` each, with the plan's predicted TPOT and split points;
2. profiles one short decode of each order with torch's profiler (CPU ops and CUDA copies on one
   clock), written as chrome traces for reading off the overlap (``--out`` folder);
3. times one layer's accelerator weights (the split's copy) from pinned memory alone and while the
   CPU streams bf16 GEMVs over more than the L3 (the copy under CPU load), and those GEMVs alone and
   under the copies (the CPU under the copy: the estimator's ``cpu_under_copy``).

    python benchmarks/diag_split_points_order.py --out DIR     # needs a CUDA GPU
    python benchmarks/diag_split_points_order.py --smoke       # tiny model, CPU stand-in: the script only
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from bench_cpu_vs_transformers import timed_generate  # noqa: E402  (puts the repo on sys.path via common)

from flexplan.inputs import gib_bytes  # noqa: E402


def model_folder(layers: int, smoke: bool):
    from flexplan.synthetic import LLAMA2_7B_CONFIG, random_model_dir

    if smoke:
        cfg = dict(LLAMA2_7B_CONFIG, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=4, vocab_size=512)
        return random_model_dir(f"random-llama-tiny-{layers}l-bf16", cfg)
    return random_model_dir(f"random-llama2-7b-shaped-{layers}l-bf16", dict(LLAMA2_7B_CONFIG, num_hidden_layers=layers))


def decode_orders(lm, inputs, new_tokens: int, rounds: int) -> dict:
    """TPOT of each copy order, interleaved (deferred first in odd rounds, at-start first in even)."""
    ex = lm.executor
    out = {"deferred": [], "at_start": []}
    for r in range(rounds):
        for order in (("deferred", "at_start") if r % 2 == 0 else ("at_start", "deferred")):
            ex.defer_split_prefetch = order == "deferred"
            out[order].append(timed_generate(lm, inputs, new_tokens, 0)["tpot_s"])
    ex.defer_split_prefetch = True
    return out


def profile_order(lm, inputs, new_tokens: int, deferred: bool, path: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    lm.executor.defer_split_prefetch = deferred
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        timed_generate(lm, inputs, new_tokens, 0)
    lm.executor.defer_split_prefetch = True
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as f, gzip.open(path, "wb") as g:
        g.write(f.read())
    raw.unlink()
    copies = [e for e in prof.events() if "Memcpy HtoD" in e.name and e.device_type.name == "CUDA"]
    return {"trace": path.name, "htod_copies": len(copies),
            "htod_busy_ms": round(sum(e.time_range.elapsed_us() for e in copies) / 1e3, 2)}


def copy_and_cpu_contention(nbytes: int, hidden: int, inter: int, repeats: int = 5) -> dict:
    """One layer's accelerator weights copied from pinned memory, alone and under CPU GEMVs over
    more than the L3; the GEMVs alone and under copies."""
    import torch

    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    mats = [torch.randn(hidden, inter, dtype=torch.bfloat16) for _ in range(8)]  # 8 x down_proj, > 300 MiB L3
    x = torch.randn(1, inter, dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def copy_s() -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            a.record()
            dev.copy_(host, non_blocking=True)
            b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def gemv_round_s() -> float:
        t0 = time.perf_counter()
        for m in mats:
            torch.nn.functional.linear(x, m)
        return (time.perf_counter() - t0) / len(mats)

    copy_s(), gemv_round_s()  # warm-up
    alone_copy = [copy_s() for _ in range(repeats)]
    alone_gemv = [gemv_round_s() for _ in range(repeats)]
    stop, loaded_gemv = threading.Event(), []

    def cpu_load():
        while not stop.is_set():
            loaded_gemv.append(gemv_round_s())

    t = threading.Thread(target=cpu_load)
    t.start()
    time.sleep(0.05)
    busy_copy = [copy_s() for _ in range(repeats)]
    stop.set()
    t.join()
    with torch.cuda.stream(side):  # copies queued to outlast the GEMVs timed under them
        for _ in range(40):
            dev.copy_(host, non_blocking=True)
    busy_gemv = [gemv_round_s() for _ in range(repeats)]
    still = not side.query()
    side.synchronize()
    med = statistics.median
    return {"copy_bytes": nbytes, "copy_alone_gb_s": round(nbytes / med(alone_copy) / 1e9, 1),
            "copy_under_cpu_gemv_gb_s": round(nbytes / med(busy_copy) / 1e9, 1),
            "gemv_bytes": hidden * inter * 2, "gemv_alone_ms": round(med(alone_gemv) * 1e3, 3),
            "gemv_under_copy_ms": round(med(busy_gemv) * 1e3, 3),
            "gemv_while_copy_timed_ms": round(med(loaded_gemv) * 1e3, 3) if loaded_gemv else None,
            "copies_still_running_at_end": bool(still)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gpu-memory", type=gib_bytes, default=5 << 29, metavar="GiB",
                    help="GPU budget in GiB (default 2.5: 1 of 8 layers resident)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/diag_split_points_order")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU stand-in; checks the script, no figures")
    args = ap.parse_args(argv)
    import torch

    import flexplan

    if not args.smoke and not torch.cuda.is_available():
        print("diag_split_points_order: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    folder = model_folder(args.layers, args.smoke)
    cap = args.gpu_memory if not args.smoke else 8 << 20
    lm = flexplan.load(str(folder), plan={"prefill": "gpu-offload", "decode": "split-points"},
                       accelerator="cpu" if args.smoke else "cuda", dtype="bfloat16", gpu_memory_bytes=cap,
                       online_correction=False)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, lm.config.vocab_size, (1, args.input_len), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    timed_generate(lm, inputs, args.new_tokens, 0)  # warm-up, and the plan for this shape
    st = lm.last_stats
    sp = st.plan.decode.split_points
    res: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu stand-in",
                 "torch": torch.__version__, "model": folder.name, "gpu_budget_bytes": cap,
                 "input_len": args.input_len, "new_tokens": args.new_tokens, "placement": st.placement,
                 "predicted_tpot_s": st.predicted_tpot_s, "calibration": st.plan.calibration,
                 "split_points": dataclasses.asdict(sp) if dataclasses.is_dataclass(sp) else sp,
                 "setup_s": round(time.perf_counter() - t0, 1)}
    print(f"{res['device']}: {st.placement}; predicted TPOT {1e3 * st.predicted_tpot_s:.1f} ms", flush=True)
    lm.executor.split_prefetch_issued.clear()
    res["tpot_s"] = decode_orders(lm, inputs, args.new_tokens, args.rounds)
    res["split_prefetch_issued"] = dict(lm.executor.split_prefetch_issued)
    for order, xs in res["tpot_s"].items():
        print(f"  {order:9s} TPOT ms " + ", ".join(f"{1e3 * x:.1f}" for x in xs), flush=True)
    try:  # a diagnostic: one part failing leaves the others' figures
        res["profiles"] = {order: profile_order(lm, inputs, 4, order == "deferred", out_dir / f"trace_{order}.json.gz")
                           for order in ("deferred", "at_start")}
    except Exception as e:  # noqa: BLE001
        res["profiles"] = f"failed: {type(e).__name__}: {e}"
    print("  profiles:", res["profiles"], flush=True)
    if torch.cuda.is_available():
        cfg = lm.config
        seg = 3 * cfg.hidden_size * cfg.hidden_size + 2 * cfg.hidden_size * cfg.intermediate_size  # k,v,o,gate,up
        try:
            res["contention"] = copy_and_cpu_contention(2 * seg, cfg.hidden_size, cfg.intermediate_size)
        except Exception as e:  # noqa: BLE001
            res["contention"] = f"failed: {type(e).__name__}: {e}"
        print("  contention:", res["contention"], flush=True)
    del lm
    (out_dir / "diag_split_points_order.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {out_dir / 'diag_split_points_order.json'} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
