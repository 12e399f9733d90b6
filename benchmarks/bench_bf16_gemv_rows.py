"""oneDNN's bf16 GEMV at 1-8 rows, as ``cpu_linear.packed_linear`` calls it (up to
``BF16_PAD_MAX_ROWS`` rows zero-padded to ``BF16_PADDED_ROWS`` for large weights) and unpadded,
interleaved in one run.

Each shape's weight is packed in oneDNN's layout in enough copies to pass eight times the
last-level cache and 512 MB (a model's layers stream from memory, not from a cache), cycled; each
round times every row count both ways, one after the other, with a STREAM triad sample before
the round. Prints the median ms per call and the weights' GB/s, writes ``benchmarks/results/<name>.json``.

    python benchmarks/bench_bf16_gemv_rows.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import machine_description, write_result  # noqa: E402
from bench_cpu_vs_transformers import stream_sample  # noqa: E402

SHAPES = ((5632, 2048), (2048, 5632), (2048, 2048), (1536, 576), (8192, 8192))  # [out, in]


def _ms_per_call(fn, calls: int) -> float:
    for _ in range(4):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--calls", type=int, default=48, help="calls per timing")
    ap.add_argument("--min-bytes", type=int, default=512 << 20, help="weights cycled per shape, at least")
    ap.add_argument("--name", default="bench_bf16_gemv_rows")
    args = ap.parse_args()
    import torch

    from flexplan.measure.microbench import llc_bytes
    from flexplan.executor import cpu_linear

    if not cpu_linear.packing_available(torch.bfloat16):
        raise SystemExit("oneDNN cannot pack bf16 weights on this CPU: nothing to measure")
    rows_list = [int(r) for r in args.rows.split(",")]

    def unpadded(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "")

    results = []
    for out, k in SHAPES:
        copies = max(2, -(-max(8 * llc_bytes(), args.min_bytes) // (out * k * 2)))
        weights = [cpu_linear.pack(torch.randn(out, k, dtype=torch.bfloat16), None) for _ in range(copies)]
        times: dict[tuple[int, str], list[float]] = {}
        triad = []
        for _ in range(args.rounds):
            triad.append(stream_sample())
            for rows in rows_list:
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                for way, fn in (("padded", cpu_linear.packed_linear), ("unpadded", unpadded)):
                    it = iter(range(10**9))
                    times.setdefault((rows, way), []).append(
                        _ms_per_call(lambda: fn(x, weights[next(it) % copies]), args.calls))
        med = {key: statistics.median(v) for key, v in times.items()}
        print(f"\n{out} x {k} bf16, {copies} copies, triad {min(triad) / 1e9:.0f}-{max(triad) / 1e9:.0f} GB/s")
        for rows in rows_list:
            p, u = med[(rows, "padded")], med[(rows, "unpadded")]
            print(f"  {rows} rows: padded {p:.3f} ms ({out * k * 2 / p / 1e6:.1f} GB/s)  "
                  f"unpadded {u:.3f} ms ({out * k * 2 / u / 1e6:.1f} GB/s)  ratio {p / u:.2f}")
        results.append({"out": out, "in": k, "copies": copies, "stream_triad_samples_bytes_per_s": triad,
                        "ms": [{"rows": r, "way": w, "median_ms": med[(r, w)], "all_ms": times[(r, w)]}
                               for (r, w) in times]})
        weights.clear()  # free this shape's copies before the next shape's
    path = write_result(args.name, {"machine": machine_description(), "threads": torch.get_num_threads(),
                                    "pad_max_rows": cpu_linear.BF16_PAD_MAX_ROWS,
                                    "padded_rows": cpu_linear.BF16_PADDED_ROWS,
                                    "pad_min_weight_bytes": cpu_linear.BF16_PAD_MIN_WEIGHT_BYTES,
                                    "rounds": args.rounds,
                                    "shapes": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
