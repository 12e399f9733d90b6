"""The CPU expert path of ``cpu-experts`` (flexplan/executor/cpu_experts.py): decode bandwidth as a
share of the STREAM triad, next to the dense blocked GEMV's share (bench_cpu_linear.py's measure).

Qwen3-30B-A3B-shaped experts (hidden 2048, expert width 768, 8 of E experts per token; E = 32 per
layer here, not 128, so that 4 layers of fp32 experts, 2.4 GB, fit a small machine: a step's bytes
and the GEMV shapes are those of the real model), routed uniformly at random. Each round times, for
each decode batch b, one step through the 4 layers' routed experts (routed_experts_forward on
blocked float32 copies, as the executor holds them: Qwen3-MoE's SiLU gate makes each layer one
native call), the same step with the activation in torch between two grouped native calls
(``fused=False``, eager's result bit for bit), with one native call per expert and projection
(``grouped=False``), then a batch-1 step's bytes as dense blocked GEMVs of the same
shapes (the top-k experts' gate_up stacked, their down side by side), and a
STREAM triad sample (the variants in an order rotated each round: the first one after the triad
writes back its dirty lines). Reported per batch: GB/s of expert weights read (the distinct
experts the step's tokens picked x 3 x 2048 x 768 x 4 bytes), their median share of the triad,
and the other variants' shares. A shared or busy machine moves every figure; compare shares, not rates.

    python benchmarks/bench_cpu_experts.py            # writes results/bench_cpu_experts.json

    python benchmarks/bench_cpu_experts.py --baseline-source old_cpu_experts.py   # old vs new, same rounds

The committed result: ``--rounds 31 --baseline-source`` f221cff's cpu_experts.py, on the idle 2-core
AVX-512 VM with 2 threads (README). With other jobs running, OpenMP barriers stall behind them and
every small GEMV (dense or expert) drops to a few GB/s: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import time

from common import median, write_result  # noqa: E402  (also puts the repo on sys.path)

HIDDEN, WIDTH, EXPERTS, TOP_K, LAYERS = 2048, 768, 32, 8, 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--name", default="bench_cpu_experts", help="results/<name>.json")
    ap.add_argument("--baseline-source", default=None,
                    help="another cpu_experts.py (e.g. from `git show REV:flexplan/executor/cpu_experts.py`) timed "
                         "in the same rounds as a fourth variant, for an old-vs-new comparison in one run")
    args = ap.parse_args(argv)
    import torch
    import transformers

    from flexplan.measure.stream import stream_triad_bytes_per_s
    from flexplan.executor import cpu_experts, cpu_linear, native

    if not native.available():
        print(f"native kernel unavailable: {native.status()[1]}")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    from flexplan.executor.host_allocator import keep_freed_memory

    allocator = keep_freed_memory()  # as the executor sets malloc: scratch is not mapped afresh each call
    baseline = None
    if args.baseline_source:
        import importlib.util

        spec = importlib.util.spec_from_file_location("baseline_cpu_experts", args.baseline_source)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    cfg = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
                                      num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64)
    layers = []
    g = torch.Generator().manual_seed(0)
    for _ in range(LAYERS):
        m = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
        with torch.no_grad():
            for name, transposed in cpu_experts.blockable_experts(m).items():
                dense = torch.randn(m._parameters[name].shape, generator=g) * 0.02
                m._parameters[name] = torch.nn.Parameter(
                    cpu_experts.block_experts_into(dense, transposed, torch.empty(dense.numel())), requires_grad=False)
        layers.append(m)
    expert_bytes = 3 * HIDDEN * WIDTH * 4
    # the dense reference: per layer, the top-k experts' projections as two dense matrices of the same
    # shapes (gate_up stacked: 2 x 768 x 8 by 2048; down side by side: 2048 by 768 x 8), the bytes of a
    # batch-1 step
    dense_w = [cpu_linear.block(torch.randn(2 * WIDTH * TOP_K, HIDDEN, generator=g)) for _ in range(LAYERS)]
    dense_w += [cpu_linear.block(torch.randn(HIDDEN, WIDTH * TOP_K, generator=g)) for _ in range(LAYERS)]
    dense_bytes = sum(w.numel() * 4 for w in dense_w)
    out = []
    for b in (int(x) for x in args.batches.split(",")):
        rates, shares, dense_shares, distinct, loop_shares, base_shares, triads = [], [], [], [], [], [], []
        unfused_shares = []
        for _ in range(args.rounds):
            triad = stream_triad_bytes_per_s()
            triads.append(triad)
            x = torch.randn(b, HIDDEN, generator=g)
            idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(b)])
            w = torch.rand(b, TOP_K, generator=g)
            picked = int(torch.unique(idx).numel())
            def experts_step(grouped, x=x, idx=idx, w=w, impl=cpu_experts, **kw):
                with torch.no_grad():
                    for m in layers:
                        impl.routed_experts_forward(m, x, idx, w, grouped=grouped, **kw)

            def dense_step(x=x, h=torch.randn(b, WIDTH * TOP_K, generator=g)):
                for wd in dense_w:
                    cpu_linear.blocked_linear(x if wd.shape[1] == HIDDEN else h, wd)

            runs = [("grouped", lambda: experts_step(True)), ("per expert", lambda: experts_step(False)),
                    ("dense", dense_step), ("activation in torch", lambda: experts_step(True, fused=False))]
            if baseline is not None:
                runs.append(("baseline", lambda: experts_step(True, impl=baseline)))
            k = len(distinct) % len(runs)  # rotated each round: the first after the triad meets its dirty lines
            seconds = {}
            for name, fn in runs[k:] + runs[:k]:
                t0 = time.perf_counter()
                fn()
                seconds[name] = time.perf_counter() - t0
            dt, dt_loop, dt_dense = seconds["grouped"], seconds["per expert"], seconds["dense"]
            loop_shares.append(LAYERS * picked * expert_bytes / dt_loop / triad)
            unfused_shares.append(LAYERS * picked * expert_bytes / seconds["activation in torch"] / triad)
            rate = LAYERS * picked * expert_bytes / dt
            rates.append(rate)
            shares.append(rate / triad)
            dense_shares.append(dense_bytes / dt_dense / triad)
            distinct.append(picked)
            if baseline is not None:
                base_shares.append(LAYERS * picked * expert_bytes / seconds["baseline"] / triad)
        row = {"batch": b, "distinct_experts": median(distinct), "expert_gb_per_s": median(rates) / 1e9,
               "expert_share_of_triad": median(shares), "dense_gemv_share_of_triad": median(dense_shares),
               "per_expert_calls_share_of_triad": median(loop_shares),
               "activation_in_torch_share_of_triad": median(unfused_shares),
               "triad_gb_per_s": median(triads) / 1e9}
        if baseline is not None:
            row["baseline_share_of_triad"] = median(base_shares)
        out.append(row)
        print(f"batch {b:3d}: {row['distinct_experts']:.0f} experts/layer, {row['expert_gb_per_s']:.1f} GB/s, "
              f"{100 * row['expert_share_of_triad']:.0f}% of triad (dense blocked GEMV "
              f"{100 * row['dense_gemv_share_of_triad']:.0f}%; activation in torch between two grouped calls: "
              f"{100 * row['activation_in_torch_share_of_triad']:.0f}%; one call per expert and projection: "
              f"{100 * row['per_expert_calls_share_of_triad']:.0f}%"
              + (f"; baseline {100 * row['baseline_share_of_triad']:.0f}%" if baseline is not None else "")
              + f"; triad {row['triad_gb_per_s']:.0f} GB/s)")
    path = write_result(args.name, {"shape": dict(hidden=HIDDEN, width=WIDTH, experts=EXPERTS, top_k=TOP_K,
                                                             layers=LAYERS), "rounds": args.rounds,
                                                  "torch_threads": torch.get_num_threads(), "host_allocator": allocator,
                                                  "baseline_source": args.baseline_source, "rows": out})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
