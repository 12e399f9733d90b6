"""Does the memory-state probe follow the bandwidth decode actually gets?

    python benchmarks/bench_probe_tracking.py [--seconds 150]

For ``--seconds``, over and over: the plan-time memory probe (``calibration.membw``: a one-thread
numpy copy), a multi-threaded torch copy and a 64 MB STREAM triad (the alternatives), and the executor's fp32 blocked GEMV
at batch 1 over 6 x (5632 x 2048) weights (the decode path, all threads). Reports how much the
GEMV's bandwidth varies, how much is left after scaling it by each probe's ratio (what
``memory_state.at_state_now`` does), and after the best power-law scaling, and the means of
10-sample blocks (a memory state lasts minutes: does a probe's block mean move with the GEMV's?). Writes
``benchmarks/results/probe_tracking.json``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import machine_description, write_result


TRIAD_BYTES = 64 * 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=150.0)
    args = ap.parse_args()

    import torch

    from flexplan.calibration.membw import describe_probe, measure_copy_bytes_per_s
    from flexplan.calibration.stream import stream_triad_bytes_per_s
    from flexplan.executor.cpu_linear import LinearKernel

    lin = LinearKernel(device="cpu")
    out_f, in_f, copies = 5632, 2048, 6
    weights = [lin.prepare(torch.full((out_f, in_f), 0.01), 1) for _ in range(copies)]
    x = torch.full((1, in_f), 0.5)
    a, b = torch.empty(8 * 2**20), torch.ones(8 * 2**20)  # 32 MB each
    a.copy_(b)

    def best_of_3(fn) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    def gemv():
        for w in weights:
            lin(x, w)

    from concurrent.futures import ThreadPoolExecutor

    n_threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(n_threads)
    ta, tb = np.zeros(TRIAD_BYTES // 8), np.ones(TRIAD_BYTES // 8)
    np.copyto(ta, tb)
    parts = np.array_split(np.arange(ta.size), n_threads)
    spans = [(int(p[0]), int(p[-1]) + 1) for p in parts]

    def threaded_copy() -> float:  # numpy releases the GIL in copyto: one slice per thread
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            list(pool.map(lambda se: np.copyto(ta[se[0]:se[1]], tb[se[0]:se[1]]), spans))
            best = min(best, time.perf_counter() - t0)
        return 2 * ta.nbytes / best

    rows = []
    end = time.monotonic() + args.seconds
    with torch.inference_mode():
        while time.monotonic() < end:
            rows.append((measure_copy_bytes_per_s() / 1e9,
                         2 * a.numel() * 4 / best_of_3(lambda: a.copy_(b)) / 1e9,
                         copies * out_f * in_f * 4 / best_of_3(gemv) / 1e9,
                         stream_triad_bytes_per_s(TRIAD_BYTES) / 1e9,
                         threaded_copy() / 1e9))
            time.sleep(0.5)
    r = np.array(rows)
    log = np.log(r)
    cv = lambda v: float(np.std(v) / np.mean(v))  # noqa: E731
    probes = {}
    for i, name in ((0, "numpy copy, 1 thread (the plan-time probe)"), (1, f"torch copy, {torch.get_num_threads()} threads"),
                    (3, f"STREAM triad ({TRIAD_BYTES >> 20} MB arrays, {torch.get_num_threads()} threads)"),
                    (4, f"numpy copy, {torch.get_num_threads()} Python threads")):
        alpha = float(np.polyfit(log[:, i], log[:, 2], 1)[0])
        probes[name] = {"range_gb_per_s": [round(float(r[:, i].min()), 2), round(float(r[:, i].max()), 2)],
                        "correlation_with_gemv": round(float(np.corrcoef(r[:, i], r[:, 2])[0, 1]), 3),
                        "gemv_cv_after_ratio_scaling": round(cv(r[:, 2] / r[:, i]), 4),
                        "best_power_law_exponent": round(alpha, 3),
                        "gemv_cv_after_power_law_scaling": round(float(np.std(log[:, 2] - alpha * log[:, i])), 4)}
    result = {"benchmark": "probe_tracking", "machine": machine_description(),
              "command": f"python benchmarks/bench_probe_tracking.py --seconds {args.seconds:g}",
              "plan_time_probe": describe_probe(), "samples": len(rows),
              "gemv": {"what": f"fp32 blocked GEMV, batch 1, {copies} x ({out_f} x {in_f}) weights, best of 3, "
                               f"{torch.get_num_threads()} threads",
                       "range_gb_per_s": [round(float(r[:, 2].min()), 2), round(float(r[:, 2].max()), 2)],
                       "cv": round(cv(r[:, 2]), 4)},
              "probes": probes,
              "columns": ["plan-time probe", "torch copy", "gemv", "triad", "numpy copy in threads"],
              # means over blocks of 10 samples (~10 s): a memory state lasts minutes, a sample's noise not
              "block_means_gb_per_s": [[round(float(v), 2) for v in r[i:i + 10].mean(axis=0)]
                                       for i in range(0, len(r) - 9, 10)],
              "rows_gb_per_s": [[round(float(v), 2) for v in row] for row in rows]}
    print(f"{len(rows)} samples; GEMV {result['gemv']['range_gb_per_s']} GB/s, cv {result['gemv']['cv']:.1%}")
    print("means of 10 samples (probe, torch copy, GEMV, triad, threaded numpy copy):", result["block_means_gb_per_s"])
    for name, p in probes.items():
        print(f"  {name}: {p['range_gb_per_s']} GB/s, corr {p['correlation_with_gemv']}, GEMV cv after ratio "
              f"scaling {p['gemv_cv_after_ratio_scaling']:.1%}, after power law (x^{p['best_power_law_exponent']}) "
              f"{p['gemv_cv_after_power_law_scaling']:.1%}")
    print(f"wrote {write_result('probe_tracking', result)}")


if __name__ == "__main__":
    main()
