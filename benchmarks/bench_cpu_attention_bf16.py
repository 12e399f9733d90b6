"""CPU decode attention over a bfloat16 KV cache: transformers' SDPA (masked, what the executor ran
before) against flexplan's native kernel reading the bf16 cache as it is (what it runs now), and
the native kernel over a float32 cache for reference. One query per sequence, 32 query heads over
8 KV heads of 128 (Llama-3-8B's layout), caches cycled through more than the last-level cache,
the kernels interleaved round by round (the host's memory state moves between rounds), a STREAM
triad sample before each round.

    python benchmarks/bench_cpu_attention_bf16.py --rounds 5

Prints the median time and KV read rate per kernel and shape, writes
``benchmarks/results/bench_cpu_attention_bf16.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import machine_description, write_result  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = ((1, 256), (1, 1024), (1, 4096), (8, 256), (8, 1024), (8, 4096))  # (batch, keys)


def kernels(batch: int, keys: int):
    """{name: (one call, KV bytes it reads)} for one shape."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flexplan.measure.microbench import _SDPAModule, Cycle, beyond_llc_bytes, copies_for
    from flexplan.executor import native

    ops = native.decode_status()[0]
    if ops is None:
        raise SystemExit(f"bench_cpu_attention_bf16: no native decode ops ({native.decode_status()[1]})")
    scale = HEAD_DIM ** -0.5
    out = {}
    for dt in (torch.bfloat16, torch.float32):
        one = 2 * batch * KV_HEADS * keys * HEAD_DIM * torch.empty(0, dtype=dt).element_size()
        kvs = Cycle([tuple(torch.randn(keys, batch, KV_HEADS, HEAD_DIM).to(dt).permute(1, 2, 0, 3) for _ in "kv")
                     for _ in range(copies_for(one, beyond_llc_bytes(4, 64 << 20, 1 << 30)))])
        q = torch.randn(batch, HEADS, 1, HEAD_DIM).to(dt)
        q3 = q.reshape(batch, HEADS, HEAD_DIM).contiguous()
        name = "bf16" if dt == torch.bfloat16 else "fp32"
        out[f"native {name}"] = (lambda q3=q3, kvs=kvs, dt=dt: ops.decode_attention(
            q3.to(torch.float32), *kvs.next(), None, scale).to(dt), one)
        if dt == torch.bfloat16:
            mask, module = torch.ones(batch, 1, 1, keys, dtype=torch.bool), _SDPAModule(HEADS // KV_HEADS)
            out["sdpa bf16 (masked)"] = (lambda q=q, kvs=kvs, mask=mask, module=module: sdpa_attention_forward(
                module, q, *kvs.next(), mask, scaling=scale), one)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="timed calls per kernel, shape and round (median kept)")
    ap.add_argument("--name", default="bench_cpu_attention_bf16")
    args = ap.parse_args()
    import torch

    from flexplan.measure.stream import stream_triad_bytes_per_s

    built = {shape: kernels(*shape) for shape in SHAPES}
    times: dict = {shape: {k: [] for k in ks} for shape, ks in built.items()}
    triads = []
    for r in range(args.rounds):
        triads.append(stream_triad_bytes_per_s() / 1e9)
        for shape, ks in built.items():
            for name, (fn, _) in ks.items():
                fn()
                per = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    fn()
                    per.append(time.perf_counter() - t0)
                times[shape][name].append(statistics.median(per))
    rows = []
    for shape, ks in built.items():
        line = []
        for name, (_, nbytes) in ks.items():
            t = statistics.median(times[shape][name])
            rows.append({"batch": shape[0], "keys": shape[1], "kernel": name, "time_s": t,
                         "kv_bytes_per_s": nbytes / t, "rounds_s": times[shape][name]})
            line.append(f"{name} {t * 1e3:.3f} ms ({nbytes / t / 1e9:.1f} GB/s)")
        sdpa = statistics.median(times[shape]["sdpa bf16 (masked)"])
        nat = statistics.median(times[shape]["native bf16"])
        print(f"b{shape[0]} keys {shape[1]}: " + ", ".join(line) + f"; native bf16 / SDPA {nat / sdpa:.2f}")
    print(f"STREAM triad before each round: {', '.join(f'{x:.1f}' for x in triads)} GB/s")
    path = write_result(args.name, {"machine": machine_description(), "threads": torch.get_num_threads(),
                                    "layout": [HEADS, KV_HEADS, HEAD_DIM], "triad_gb_per_s": triads, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
