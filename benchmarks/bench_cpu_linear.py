"""CPU GEMV/GEMM: stock ``F.linear`` against oneDNN-packed and blocked weights (flexplan/executor/cpu_linear.py).

The seven linears of a TinyLlama-shaped decoder layer (hidden 2048, KV 512, intermediate
5632), 8 layers of them (1.41 GB fp32, more than the last-level cache), run back to back as
one decode step would, at batch 1 and 8 (decode) and 512 tokens (prefill), in fp32 and bf16. Kernels: ``F.linear`` on dense
weights; packed with batch hint 1 (what flexplan uses for batch-1 decode plans); packed with
no hint (the generic layout, used for larger batches); for fp32, flexplan's blocked layout
(flexplan/executor/native_gemv.c, for every batch; the default where the native kernel builds); and
what split-points' CPU operators run on their dense pinned weights (``split_layer.cpu_operator_linear``:
the native dense kernel, widening bf16: its row kernel up to 32 rows, packed panels above); with
``--dense-source FILE``, also the dense kernel compiled from another ``native_gemv.c`` (an older
revision: ``git show REV:flexplan/executor/native_gemv.c > old.c``), so old and new run in one
process. Each round times every kernel once, interleaved, so this
VM's bandwidth swings hit all alike; the median over ``--rounds`` is reported (GB/s of weights
and GFLOP/s) next to a STREAM triad sample taken before each round, with the median over rounds of
each kernel's rate as a fraction of that round's triad, and the largest difference of each
kernel's output from ``F.linear``'s.

    python benchmarks/bench_cpu_linear.py            # writes results/bench_cpu_linear.json
    python benchmarks/bench_cpu_linear.py --rounds 5 --batches 1,4,8,512 --name bench_cpu_linear_avx2_split_dense
    python benchmarks/bench_cpu_linear.py --rounds 5 --batches 1,4,8,16,32,64,128,512 --dtypes float32 \
        --dense-source old.c --name bench_cpu_linear_avx512_dense_panels
"""

from __future__ import annotations

import argparse
import sys
import time

from common import median, write_result  # noqa: E402  (also puts the repo on sys.path)

HIDDEN, KV, INTER, LAYERS = 2048, 512, 5632, 8
SHAPES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTER, HIDDEN), (INTER, HIDDEN),
          (HIDDEN, INTER)]  # (out, in): q, k, v, o, gate, up, down


def _compiled(source: str):
    """The dense and blocked kernels of another ``native_gemv.c``, compiled as flexplan compiles its own."""
    import ctypes
    import subprocess
    import tempfile
    from pathlib import Path

    from flexplan.executor.native import CFLAGS, NativeGemv, _compiler

    lib = Path(tempfile.mkdtemp()) / "other_gemv.so"
    subprocess.run([_compiler(), *CFLAGS, source, "-o", str(lib)], check=True)
    return NativeGemv(ctypes.CDLL(str(lib)), lib)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", default="1,8,512", help="rows of x: decode batches and prefill tokens")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--name", default="bench_cpu_linear", help="results/<name>.json")
    ap.add_argument("--dense-source", help="another native_gemv.c whose dense kernel runs beside this one's")
    args = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from flexplan.measure.stream import stream_triad_bytes_per_s
    from flexplan.executor import cpu_linear, native
    from flexplan.executor.split_layer import cpu_operator_linear

    results = []
    for dtype_name in args.dtypes.split(","):
        dt = getattr(torch, dtype_name)
        dense = [torch.randn(o, i).to(dt) for _ in range(LAYERS) for o, i in SHAPES]
        nbytes = sum(w.numel() * w.element_size() for w in dense)
        kernels = {"F.linear": (dense, F.linear)}
        if cpu_linear.packing_available(dt):  # oneDNN packs bf16 only where the CPU has bf16 instructions
            kernels["packed, hint 1"] = ([cpu_linear.pack(w, 1) for w in dense], cpu_linear.packed_linear)
            kernels["packed, no hint"] = ([cpu_linear.pack(w, None) for w in dense], cpu_linear.packed_linear)
        if dt == torch.float32 and cpu_linear.blocking_available():
            kernels["blocked"] = ([cpu_linear.block(w) for w in dense], cpu_linear.blocked_linear)
        if native.available():  # split-points' CPU operators: dense weights (native dense GEMV up to 32 rows)
            kernels["split dense"] = (dense, lambda x, w: cpu_operator_linear(x, w, None, torch.float32))
            if args.dense_source:
                other = _compiled(args.dense_source)
                kernels["split dense (--dense-source)"] = (
                    dense, lambda x, w, o=other: o.dense_gemv(w, x.reshape(-1, x.shape[-1]).float().contiguous(),
                                                None).reshape(*x.shape[:-1], -1))
        for batch in (int(b) for b in args.batches.split(",")):
            xs = {k: torch.randn(batch, 1, k).to(dt) for k in (HIDDEN, INTER)}
            rates = {name: [] for name in kernels}
            of_stream = {name: [] for name in kernels}
            stream = []
            for r in range(args.rounds + 1):  # round 0 warms up
                s = stream_triad_bytes_per_s(threads=torch.get_num_threads())
                for name, (weights, fn) in kernels.items():
                    t0 = time.perf_counter()
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                    if r:
                        rates[name].append(nbytes / (time.perf_counter() - t0))
                        of_stream[name].append(rates[name][-1] / s)
                if r:
                    stream.append(s)
            flops = 2.0 * batch * nbytes / dense[0].element_size()
            w, k = dense[-1], dense[-1].shape[1]
            diff = {name: float((fn(xs[k], ws[-1]) - F.linear(xs[k], w)).abs().max())
                    for name, (ws, fn) in kernels.items() if name != "F.linear"}
            row = {"dtype": dtype_name, "batch": batch, "weight_bytes": nbytes, "stream_triad_bytes_per_s": stream,
                   "rates_bytes_per_s": rates, "median_bytes_per_s": {k: median(v) for k, v in rates.items()},
                   "median_flops_per_s": {k: flops / nbytes * median(v) for k, v in rates.items()},
                   "median_fraction_of_stream_triad": {k: median(v) for k, v in of_stream.items()},
                   "max_abs_diff_from_F_linear": diff}
            results.append(row)
            cells = "  ".join(f"{k} {median(v) / 1e9:5.1f} GB/s ({median(of_stream[k]):.0%}) "
                              f"{flops / nbytes * median(v) / 1e9:4.0f} GFLOP/s" for k, v in rates.items())
            print(f"{dtype_name:<9} batch {batch:>3}: {cells}  (STREAM triad median {median(stream) / 1e9:.1f} GB/s; "
                  f"max |kernel - F.linear| {max(diff.values()):.1e})", flush=True)
        del dense, kernels
    path = write_result(args.name, {"threads": torch.get_num_threads(), "layers": LAYERS, "dense_source": args.dense_source,
                                             "shapes_out_in": SHAPES, "rounds": args.rounds, "rows": results})
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
