"""Does the memory-state probe follow the bandwidth decode actually gets?

    python benchmarks/bench_probe_tracking.py [--seconds 120]

For ``--seconds``, over and over: the plan-time probes of ``calibration.membw`` (the numpy copy a
torch-free ``plan()`` reads, and the GEMV probe, flexplan's CPU linear kernel over 64 MB of fp32
weights, that plans read where torch is loaded), a multi-threaded torch copy and a 64 MB STREAM
triad (alternatives), then decode's own work for the next 300 ms: the executor's fp32 blocked
GEMV at batch 1 over 6 x (5632 x 2048) weights, all threads, its mean bandwidth over the window
(what a prediction made from the probe has to match). Reports how much that bandwidth varies, how
much is left after scaling it by each probe's ratio (what ``memory_state.at_state_now`` does) and
after the best power-law scaling, and the means of 10-sample blocks. Writes
``benchmarks/results/probe_tracking.json`` (``--name`` to change).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import machine_description, write_result

TRIAD_BYTES = 64 * 2**20
WINDOW_S = 0.3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--name", default="probe_tracking")
    args = ap.parse_args()

    import torch

    from flexplan.measure import membw
    from flexplan.measure.stream import stream_triad_bytes_per_s
    from flexplan.executor.cpu_linear import LinearKernel

    lin = LinearKernel(device="cpu")
    out_f, in_f, copies = 5632, 2048, 6
    weights = [lin.prepare(torch.full((out_f, in_f), 0.01), 1) for _ in range(copies)]
    x = torch.full((1, in_f), 0.5)
    n_bytes = copies * out_f * in_f * 4
    a, b = torch.empty(8 * 2**20), torch.ones(8 * 2**20)  # 32 MB each
    a.copy_(b)

    def torch_copy() -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            a.copy_(b)
            best = min(best, time.perf_counter() - t0)
        return 2 * a.numel() * 4 / best

    def decode_window() -> float:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < WINDOW_S:
            for w in weights:
                lin(x, w)
            n += 1
        return n * n_bytes / (time.perf_counter() - t0)

    names = ["copy probe (membw, torch-free plans)", "GEMV probe (membw, plans with torch loaded)",
             f"torch copy, {torch.get_num_threads()} threads", f"STREAM triad ({TRIAD_BYTES >> 20} MB arrays)"]
    rows = []
    end = time.monotonic() + args.seconds
    with torch.inference_mode():
        while time.monotonic() < end:
            rows.append((membw.measure_copy_bytes_per_s() / 1e9, membw.measure_gemv_bytes_per_s() / 1e9,
                         torch_copy() / 1e9, stream_triad_bytes_per_s(TRIAD_BYTES) / 1e9, decode_window() / 1e9))
            time.sleep(0.3)
    r = np.array(rows)
    log = np.log(r)
    target = log[:, -1]
    probes = {}
    for i, name in enumerate(names):
        alpha = float(np.polyfit(log[:, i], target, 1)[0])
        probes[name] = {"range_gb_per_s": [round(float(r[:, i].min()), 2), round(float(r[:, i].max()), 2)],
                        "correlation_with_decode": round(float(np.corrcoef(log[:, i], target)[0, 1]), 3),
                        "log_error_after_ratio_scaling": round(float(np.std(target - log[:, i])), 4),
                        "best_power_law_exponent": round(alpha, 3),
                        "log_error_after_power_law_scaling": round(float(np.std(target - alpha * log[:, i])), 4)}
    result = {"benchmark": "probe_tracking", "machine": machine_description(),
              "command": f"python benchmarks/bench_probe_tracking.py --seconds {args.seconds:g}"
                         + (f" --name {args.name}" if args.name != "probe_tracking" else ""),
              "probes_described": {"copy": membw.describe_probe(), "gemv": membw.describe_gemv_probe()},
              "samples": len(rows),
              "decode": {"what": f"fp32 blocked GEMV, batch 1, {copies} x ({out_f} x {in_f}) weights, mean over the "
                                 f"next {WINDOW_S * 1e3:.0f} ms, {torch.get_num_threads()} threads",
                         "range_gb_per_s": [round(float(r[:, -1].min()), 2), round(float(r[:, -1].max()), 2)],
                         "std_log": round(float(np.std(target)), 4)},
              "probes": probes, "columns": names + ["decode, next 300 ms"],
              # means over blocks of 10 samples (~10 s): a memory state lasts minutes, a sample's noise not
              "block_means_gb_per_s": [[round(float(v), 2) for v in r[i:i + 10].mean(axis=0)]
                                       for i in range(0, len(r) - 9, 10)],
              "rows_gb_per_s": [[round(float(v), 2) for v in row] for row in rows]}
    print(f"{len(rows)} samples; decode {result['decode']['range_gb_per_s']} GB/s, std of log "
          f"{result['decode']['std_log']:.3f}")
    for name, p in probes.items():
        print(f"  {name}: {p['range_gb_per_s']} GB/s, corr {p['correlation_with_decode']}, log error after ratio "
              f"scaling {p['log_error_after_ratio_scaling']:.3f}, after power law (x^{p['best_power_law_exponent']}) "
              f"{p['log_error_after_power_law_scaling']:.3f}")
    print(f"wrote {write_result(args.name, result)}")


if __name__ == "__main__":
    main()
