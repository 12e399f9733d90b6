"""Routed experts on a GGUF file's blocks (flexplan/quant/quant_experts.py) against the float32
experts the loader made of them before (dequantised at load, run by the executor's fused native
call: cpu_experts.routed_experts_forward on blocked copies).

Qwen3-30B-A3B-shaped experts (hidden 2048, expert width 768, 8 of E experts per token; E = 32 per
layer here, not 128, and 4 layers, so the float32 copies fit a small machine: a step's bytes and
shapes are the real model's), routed uniformly at random. Each round samples the STREAM triad,
then times one decode step of each variant through the 4 layers' experts, in an order rotated each
round: float32 (fused native call), QuantExperts on Q4_K, Q8_0 and MXFP4 blocks (llama.cpp's int8
activations; one native call a layer), and the Q4_K modules with ``fused=False`` (a Python loop of
two quantised GEMMs per selected expert). Reported per batch and variant: milliseconds a step, the experts' bytes read a step
(distinct experts picked x their bytes) over that time, as GB/s and as a share of the triad, and
the memory each variant holds for the 4 layers' experts.

    python benchmarks/bench_quant_experts.py            # writes results/bench_quant_experts.json
"""

from __future__ import annotations

import argparse
import time

from bench_cpu_experts import EXPERTS, HIDDEN, LAYERS, TOP_K, WIDTH  # the same shapes

QUANT = ("Q4_K", "Q8_0", "MXFP4")  # the experts' block formats timed (MXFP4: gpt-oss's files)
from common import machine_description, median, write_result  # noqa: E402  (also puts the repo on sys.path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--name", default="bench_quant_experts", help="results/<name>.json")
    args = ap.parse_args(argv)
    import torch
    import transformers

    from flexplan.executor import cpu_experts, native
    from flexplan.executor.host_allocator import keep_freed_memory
    from flexplan.measure.stream import stream_triad_bytes_per_s
    from flexplan.quant import kernels
    from flexplan.quant.quant_experts import QuantExperts

    if not native.available() or kernels.status()[0] is None:
        print(f"native kernels unavailable: {native.status()[1]} / {kernels.status()[1]}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = keep_freed_memory()
    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
                                      num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64)
    experts_cls = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts
    g = torch.Generator().manual_seed(0)
    variants: dict[str, list] = {"float32": [], "Q4_K": [], "Q8_0": [], "MXFP4": [], "Q4_K per expert": []}
    for _ in range(LAYERS):
        m = experts_cls(cfg)
        with torch.no_grad():
            for name, transposed in cpu_experts.blockable_experts(m).items():
                dense = torch.randn(m._parameters[name].shape, generator=g) * 0.02
                m._parameters[name] = torch.nn.Parameter(
                    cpu_experts.block_experts_into(dense, transposed, torch.empty(dense.numel())), requires_grad=False)
        variants["float32"].append(m)
        for fmt_name in QUANT:
            fmt = kernels.NATIVE_FORMATS[fmt_name]
            gu = kernels.random_blocks(fmt, EXPERTS * 2 * WIDTH, HIDDEN, g, scale=0.02).data
            dn = kernels.random_blocks(fmt, EXPERTS * HIDDEN, WIDTH, g, scale=0.02).data
            variants[fmt_name].append(QuantExperts(experts_cls(cfg), (gu.view(EXPERTS, 2 * WIDTH, -1), fmt),
                                                   (dn.view(EXPERTS, HIDDEN, -1), fmt), hidden=HIDDEN, intermediate=WIDTH))
    variants["Q4_K per expert"] = variants["Q4_K"]  # the same modules, fused=False: a Python loop over the experts
    per_expert = {"float32": 3 * HIDDEN * WIDTH * 4.0,
                  **{f: 3 * HIDDEN * WIDTH * kernels.NATIVE_FORMATS[f].bytes_per_weight for f in QUANT}}
    per_expert["Q4_K per expert"] = per_expert["Q4_K"]
    held = {k: LAYERS * EXPERTS * v for k, v in per_expert.items()}

    def step(name, x, idx, w):
        with torch.no_grad():
            for m in variants[name]:
                if name == "float32":
                    cpu_experts.routed_experts_forward(m, x, idx, w)
                else:
                    m.fused = name != "Q4_K per expert"
                    m(x, idx, w)

    out = []
    for b in (int(v) for v in args.batches.split(",")):
        seconds: dict[str, list[float]] = {k: [] for k in variants}
        triads, distinct = [], []
        for r in range(args.rounds):
            triads.append(stream_triad_bytes_per_s())
            x = torch.randn(b, HIDDEN, generator=g)
            idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(b)])
            w = torch.rand(b, TOP_K, generator=g)
            distinct.append(int(torch.unique(idx).numel()))
            names = list(variants)
            for name in names[r % len(names):] + names[:r % len(names)]:
                t0 = time.perf_counter()
                step(name, x, idx, w)
                seconds[name].append(time.perf_counter() - t0)
        triad, picked = median(triads), median(distinct)
        row = {"batch": b, "distinct_experts": picked, "triad_gb_per_s": triad / 1e9, "variants": {}}
        for name, s in seconds.items():
            t = median(s)
            rate = LAYERS * picked * per_expert[name] / t
            row["variants"][name] = {"ms_per_step": t * 1e3, "gb_per_s": rate / 1e9, "share_of_triad": rate / triad,
                                     "held_gb": held[name] / 1e9}
        out.append(row)
        print(f"batch {b:3d} ({picked:.0f} experts a layer, triad {triad / 1e9:.0f} GB/s): " + "; ".join(
            f"{n} {v['ms_per_step']:.2f} ms ({v['gb_per_s']:.1f} GB/s, {100 * v['share_of_triad']:.0f}% of triad, "
            f"holds {v['held_gb']:.2f} GB)" for n, v in row["variants"].items()))
    path = write_result(args.name, {"machine": machine_description(), "shape": dict(
        hidden=HIDDEN, width=WIDTH, experts=EXPERTS, top_k=TOP_K, layers=LAYERS), "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(), "host_allocator": allocator, "rows": out})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
