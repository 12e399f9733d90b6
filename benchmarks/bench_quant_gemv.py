"""The compressed-weight GEMV (flexplan.quant.kernels, quant_gemv.c) per format against a float32
GEMV (torch ``F.linear``), with a STREAM triad sample beside each figure; and llama.cpp's
``llama-bench`` on the same GGUF files when it is built.

Two kinds of figure, each in interleaved rounds (every format and float32 one after the other in
a round, a triad sample before the round):

- single matrices [out, in]: SmolLM2's (576x576, 1536x576, 576x1536) and 4096x4096, 11008x4096,
  4096x11008, per kernel format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: random Gaussian weights quantised by
  gguf's reference; Q4_K, Q5_K, Q6_K: random blocks with sane scales, gguf having no K-quant
  quantiser, and only where ``in`` is a multiple of 256, as llama-quantize falls back otherwise);
  each in the file's layout and (``FORMAT/x8``, where the build has one) the interleaved layout
  that QuantLinear holds; each weight in enough copies to pass four times the last-level cache and 64 MB, cycled (decode
  streams its layers from memory, not from a cache); batch 1 (decode) and ``--prefill-rows`` rows
  (prefill);
- SmolLM2 whole: one token's linear layers (210 weights and the tied Q8_0 LM head) from each GGUF
  file as it is (the shipped Q4_1, and llama-quantize's Q4_0 / Q8_0 / Q4_K_M / Q5_K_M / Q6_K if
  given: the K files mix formats, SmolLM2's 576-wide rows falling back to Q5_0 / Q5_1 / Q8_0), GEMV after
  GEMV, both a Python call per matrix and all in one native call (``gemv_list``, the overhead a
  fused decode removes): the bytes of a token's decode over the time, beside ``llama-bench -t THREADS -p 0 -n 32``
  on the same file (llama.cpp's whole decode step, attention and norms included).

GB/s counts the weights' compressed bytes once per call. Writes ``benchmarks/results/<name>.json``.

    python benchmarks/bench_quant_gemv.py --rounds 3 --gguf /tmp/qg/smollm2-Q4_0.gguf /tmp/qg/smollm2-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from common import use_threads, write_result  # noqa: E402

LLAMA_BENCH = os.environ.get("FLEXPLAN_LLAMA_BENCH",
                             "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench")
SHAPES = ((576, 576), (1536, 576), (576, 1536), (4096, 4096), (11008, 4096), (4096, 11008))  # [out, in]
TRIAD_ARRAY_BYTES = 128 << 20  # each of the triad's 3 arrays: 8x a 16 MB L3


def _s_per_call(fn, calls: int) -> float:
    for _ in range(2):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def _triad(threads: int) -> float:
    from flexplan.measure.stream import stream_triad_bytes_per_s

    return stream_triad_bytes_per_s(TRIAD_ARRAY_BYTES, threads=threads, repeats=3)


def _cycler(items):
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]
    return nxt


def bench_matrices(native, rounds: int, threads: int, prefill_rows: int, min_bytes: int, calls: int,
                   formats: list[str]) -> list[dict]:
    import torch

    from flexplan.measure.membw import llc_bytes
    from flexplan.quant.kernels import NATIVE_FORMATS, quantize_reference, random_blocks

    out_rows = []
    g = torch.Generator().manual_seed(0)
    for out, k in SHAPES:
        w32 = torch.randn(out, k, generator=g) * 0.02
        cases = {}  # name -> (bytes per copy, a call given x)
        for name in formats:
            fmt = NATIVE_FORMATS[name]
            if k % fmt.block_weights:
                continue  # a row of whole blocks only (llama-quantize uses another type there)
            qt = random_blocks(fmt, out, k, g) if fmt.block_weights == 256 else quantize_reference(w32, fmt)
            copies = max(1, -(-max(4 * llc_bytes(), min_bytes) // qt.nbytes))
            nxt = _cycler([qt.data.clone() for _ in range(copies)])
            cases[name] = (qt.nbytes, lambda x, nxt=nxt, fmt=fmt: native.gemm(nxt(), fmt, x))
            if native.x8_layout(fmt) is not None:  # the layout QuantLinear holds, beside the file's in each round
                nxt8 = _cycler([native.x8_pack(qt.data, fmt) for _ in range(copies)])
                cases[f"{name}/x8"] = (qt.nbytes, lambda x, nxt=nxt8, fmt=fmt: native.gemm(nxt(), fmt, x, interleaved=True))
        copies = max(1, -(-max(4 * llc_bytes(), min_bytes) // (w32.numel() * 4)))
        nxt32 = _cycler([w32.clone() for _ in range(copies)])
        cases["float32"] = (w32.numel() * 4, lambda x: torch.nn.functional.linear(x, nxt32()))
        times = {(c, rows): [] for c in cases for rows in (1, prefill_rows)}
        triads, loads = [], []
        for _ in range(rounds):
            triads.append(_triad(threads))
            loads.append(os.getloadavg()[0])
            for rows in (1, prefill_rows):
                x = torch.randn(rows, k, generator=g)
                for c, (_, fn) in cases.items():
                    times[(c, rows)].append(_s_per_call(lambda: fn(x), calls if rows == 1 else max(2, calls // 16)))
        for (c, rows), ts in times.items():
            s = statistics.median(ts)
            rec = {"out": out, "in": k, "format": c, "rows": rows, "bytes": cases[c][0], "s_median": s,
                   "s_min": min(ts), "gb_per_s": cases[c][0] / s / 1e9, "triad_gb_per_s": [t / 1e9 for t in triads],
                   "loadavg_1min": loads}
            rec["fraction_of_triad"] = rec["gb_per_s"] / statistics.median(rec["triad_gb_per_s"])
            rec["gflop_per_s"] = 2 * rows * out * k / s / 1e9  # the figure that matters for prefill rows
            out_rows.append(rec)
            print(f"{out:>6}x{k:<6} {c:>7} rows={rows:<4} {s * 1e3:8.3f} ms  {rec['gb_per_s']:6.1f} GB/s "
                  f"({rec['fraction_of_triad']:.2f} of triad {statistics.median(rec['triad_gb_per_s']):.1f}) "
                  f"{rec['gflop_per_s']:6.1f} GFLOP/s", flush=True)
    return out_rows


def bench_smollm2_files(native, files: list[Path], rounds: int, threads: int) -> list[dict]:
    """One token's linear layers, from each file as it is, GEMV after GEMV (the tied embedding as the head)."""
    import torch

    from flexplan.quant.gguf_weights import read_gguf
    from flexplan.quant.kernels import NATIVE_FORMATS

    res = []
    for path in files:
        w = read_gguf(path)
        mats = [t for n, t in w.tensors.items() if t.data.dim() == 2 and t.format.name in NATIVE_FORMATS]
        skipped = sorted({t.format.name for t in w.tensors.values() if t.data.dim() == 2} - set(NATIVE_FORMATS))
        xs = {k: torch.randn(1, k) for k in {t.shape[1] for t in mats}}
        total = sum(t.nbytes for t in mats)

        def token():  # a Python call (and an OpenMP fork) per matrix
            for t in mats:
                native.gemm(t.data, t.format, xs[t.shape[1]])
        one_call = native.gemv_list([(t.data, t.format, xs[t.shape[1]][0]) for t in mats]).run  # one native call
        ts, ts_list, triads, loads = [], [], [], []
        for _ in range(rounds):
            triads.append(_triad(threads))
            loads.append(os.getloadavg()[0])
            ts.append(_s_per_call(token, 5))
            ts_list.append(_s_per_call(one_call, 5))
        s, s_list = statistics.median(ts), statistics.median(ts_list)
        rec = {"file": str(path), "formats": w.formats(), "weights_bytes": total, "matrices": len(mats),
               "not_native": skipped, "s_per_token_median": s, "s_per_token_min": min(ts),
               "gb_per_s": total / s / 1e9, "one_call_s_per_token_median": s_list,
               "one_call_s_per_token_min": min(ts_list), "one_call_gb_per_s": total / s_list / 1e9,
               "triad_gb_per_s": [t / 1e9 for t in triads], "loadavg_1min": loads}
        triad = statistics.median(rec["triad_gb_per_s"])
        rec["fraction_of_triad"] = rec["gb_per_s"] / triad
        rec["one_call_fraction_of_triad"] = rec["one_call_gb_per_s"] / triad
        print(f"{path.name}: {len(mats)} matrices, {total / 1e6:.1f} MB: a call per matrix {s * 1e3:.2f} ms/token, "
              f"{rec['gb_per_s']:.1f} GB/s ({rec['fraction_of_triad']:.2f} of triad); one call {s_list * 1e3:.2f} "
              f"ms/token, {rec['one_call_gb_per_s']:.1f} GB/s ({rec['one_call_fraction_of_triad']:.2f})", flush=True)
        res.append(rec)
    return res


def llama_bench(files: list[Path], threads: int, reps: int) -> list[dict]:
    if not Path(LLAMA_BENCH).exists():
        return [{"skipped": f"{LLAMA_BENCH} not built"}]
    out = []
    for path in files:
        for p, n in ((0, 32), (128, 0)):
            cmd = [LLAMA_BENCH, "-m", str(path), "-t", str(threads), "-p", str(p), "-n", str(n), "-r", str(reps),
                   "-o", "json"]
            t_triad = _triad(threads)
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode:
                out.append({"file": str(path), "cmd": " ".join(cmd), "error": r.stderr[-500:]})
                continue
            for row in json.loads(r.stdout):
                rec = {"file": str(path), "test": f"pp{p}" if p else f"tg{n}", "threads": row.get("n_threads"),
                       "tokens_per_s": row.get("avg_ts"), "tokens_per_s_stddev": row.get("stddev_ts"),
                       "ms_per_token": 1e3 / row["avg_ts"] if row.get("avg_ts") else None,
                       "model_size_bytes": row.get("model_size"), "triad_gb_per_s": t_triad / 1e9,
                       "build": row.get("build_commit")}
                print(f"llama-bench {path.name} {rec['test']}: {rec['tokens_per_s']:.1f} tok/s "
                      f"({rec['ms_per_token']:.2f} ms/token), triad {t_triad / 1e9:.1f} GB/s", flush=True)
                out.append(rec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=32, help="GEMV calls per timing (prefill: a 16th)")
    ap.add_argument("--prefill-rows", type=int, default=64)
    ap.add_argument("--min-bytes", type=int, default=64 << 20, help="each weight cycled in copies of this much at least")
    ap.add_argument("--gguf", nargs="*", default=[],
                    help="more GGUF files of SmolLM2 (llama-quantize's Q4_0, Q8_0, Q4_K_M, Q5_K_M, Q6_K)")
    ap.add_argument("--formats", nargs="*", default=None, help="kernel formats of the single matrices (default: all)")
    ap.add_argument("--no-matrices", action="store_true")
    ap.add_argument("--no-llama-bench", action="store_true")
    ap.add_argument("--note", default="", help="the machine's state (shared, loaded, ...)")
    ap.add_argument("--name", default="bench_quant_gemv")
    args = ap.parse_args()
    use_threads(args.threads)
    from flexplan.quant.kernels import NATIVE_FORMATS, status
    from flexplan.smollm import gguf_path

    native, why = status()
    if native is None:
        raise SystemExit(f"no native quantised kernel: {why}")
    print(why, flush=True)
    files = [gguf_path(), *map(Path, args.gguf)]
    load = {"loadavg_before": os.getloadavg()}
    matrices = [] if args.no_matrices else bench_matrices(native, args.rounds, args.threads, args.prefill_rows,
                                                          args.min_bytes, args.calls, args.formats or list(NATIVE_FORMATS))
    smollm2 = bench_smollm2_files(native, files, args.rounds, args.threads)
    llama = [] if args.no_llama_bench else llama_bench(files, args.threads, args.rounds)
    load["loadavg_after"] = os.getloadavg()
    path = write_result(args.name, {"isa": native.isa, "threads": args.threads, "rounds": args.rounds,
                                    "note": args.note, "load": load, "matrices": matrices,
                                    "smollm2_token_gemvs": smollm2, "llama_bench": llama})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
