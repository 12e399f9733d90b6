"""The cost model's PREDICTED throughput gain of NeoApexScheduler over GPU-only serving at equal
latency, on the papers' testbeds in hwdb, beside NEO's and APEX's reported gains.

Nothing runs a model here: a discrete-event simulation of the engine's iterations (admission,
blocks, swaps, preemption as the engine carries out an IterationPlan) advances a clock by each
plan's ``predicted_s`` (flexplan's estimator terms through ``IterationCost``, uncalibrated default
factors for each testbed). Requests: the first ``--requests`` of the Azure LLM 2023 code trace
(``../shared/traces/azure_llm_2023_code.csv``: prompt and output lengths; prompts capped at
``--max-prompt`` tokens so they fit the models' contexts), Poisson arrivals at a swept rate.

Systems: GPU-only = the same scheduler with no host pool (vLLM-like: preempt when the device
pool is full); ours = NeoApexScheduler with a host pool of half the host's memory. Latency =
mean per-token latency ((finish - arrival) / output tokens, NEO section 5.2's metric); the SLO is
``--slo-x`` times GPU-only's at the lightest rate; throughput at equal latency = the highest rate
(found by bisection) whose latency meets the SLO. Gain = ours / GPU-only at that SLO.

Simplifications (say them beside the numbers): swaps cost no time (NEO swaps layer-wise, overlapped);
async overlap's host tokens count at the end of their own iteration, not one later; the H100 70B
row is one GPU of NEO's 2-GPU tensor-parallel pair (a shard: half the heads and MLP) with the
whole host; T4 prompts capped at 1024 (NEO used the shorter OSC trace there).

    python benchmarks/bench_scheduler_gains.py                      # the trace as it is
    python benchmarks/bench_scheduler_gains.py --requests 150 --output-x 8 \
        --out benchmarks/results/bench_scheduler_gains_decode_heavy.json  # outputs x 8 (NEO Fig. 9's long outputs)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import platform
import sys
import time

import numpy as np

from common import write_json  # noqa: E402
from flexplan.estimator.efficiency import DefaultEfficiency
from flexplan.hardware import get_hardware
from flexplan.serving.kv_blocks import DEVICE, HOST
from flexplan.serving.scheduler import NeoApexScheduler
from flexplan.serving.state import EngineState, RequestState
from flexplan.workload import resolve_model
from flexplan.workload.costs import d_weights

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "azure_llm_2023_code.csv")
BLOCK_TOKENS = 16
TOKEN_BUDGET = 2048  # chunked prefill: vLLM's default max_num_batched_tokens
MAX_RUNNING = 256
T4_MAX_PROMPT = 1024  # NEO ran its T4 on the shorter OSC trace; the code trace's prompts capped here
ACTIVATION_RESERVE_BYTES = 0.5e9  # one 2048-token iteration's activations, about (vLLM profiles it)

# (label, hwdb testbed, model, tensor-parallel shard, the paper's reported gain over GPU-only / vLLM)
SETUPS = [
    ("NEO T4", "neo-testbed-g4dn-4xlarge", "meta-llama/Llama-2-7b-hf", 1,
     "NEO: +563% on a trace at 1 s latency (Fig. 6), up to 7.5x by output length (Fig. 9)"),
    ("NEO A10G", "neo-testbed-g5-4xlarge", "meta-llama/Llama-3.1-8B", 1,
     "NEO: +6.4% on the code trace at 2 s (Fig. 6), up to +26% by output length (Fig. 9)"),
    ("NEO H100", "neo-testbed-hgx-h100", "meta-llama/Llama-3.1-70B", 2,
     "NEO: +14.3% on the code trace at 2 s (Fig. 6), up to +14% (Fig. 9)"),
    ("APEX T4", "apex-testbed-t4", "meta-llama/Llama-2-7b-hf", 1, "APEX: +84-96% over vLLM"),
    ("APEX A10", "apex-testbed-a10", "meta-llama/Llama-3.1-8B", 1, "APEX: +11-89% over vLLM"),
]


def shard(spec, tp: int):
    """One GPU's part of ``spec`` under ``tp``-way tensor parallelism: heads and MLP split."""
    if tp == 1:
        return spec
    return dataclasses.replace(spec, num_heads=spec.num_heads // tp, num_kv_heads=max(1, spec.num_kv_heads // tp),
                               intermediate_size=spec.intermediate_size // tp)


def load_trace(n: int, max_prompt: int, output_x: float = 1.0) -> list[tuple[int, int]]:
    """(prompt, output) tokens of the trace's first ``n`` requests; outputs times ``output_x``
    (a decode-heavy variant: the code trace's outputs, mean 28 tokens, leave the KV pools idle)."""
    with open(TRACE) as f:
        rows = list(csv.DictReader(f))[:n]
    return [(min(int(r["ContextTokens"]), max_prompt), max(1, round(int(r["GeneratedTokens"]) * output_x)))
            for r in rows]


def pool_blocks(spec, hw, dtype_bytes: int, host: bool) -> tuple[int, int]:
    """(device, host) KV blocks: the GPU's memory less its runtime reserve, the weights and
    ACTIVATION_RESERVE_BYTES; the host pool half the host's memory (0 for GPU-only)."""
    kv_per_block = spec.kv_elems_per_token * dtype_bytes * spec.num_layers * BLOCK_TOKENS
    dev = hw.gpu.memory_bytes - hw.gpu.runtime_reserved_bytes - ACTIVATION_RESERVE_BYTES - d_weights(spec, dtype_bytes) * spec.num_layers
    dev -= spec.embedding_params * dtype_bytes * (1 if spec.tie_word_embeddings else 2)
    return max(0, int(dev // kv_per_block)), (int(hw.cpu.memory_bytes * 0.5 // kv_per_block) if host else 0)


@dataclasses.dataclass
class Sim:
    rid: str
    prompt: int
    out: int
    arrival_s: float
    index: int
    computed: int = 0
    generated: int = 0
    pool: str | None = None
    finish_s: float | None = None


def prefill_left(s: Sim) -> int:
    """Tokens to compute before it decodes: 0 when its KV holds all but its last token (a decode
    feeds that one), else the rest of its prompt and generated tokens (a preempted request recomputes)."""
    if s.generated >= 1 and s.computed == s.prompt + s.generated - 1:
        return 0
    return s.prompt + s.generated - s.computed


def simulate(sched, reqs, rate_per_s: float, dev_blocks: int, host_blocks: int, seed: int = 0,
             max_iterations: int = 60000) -> tuple[float, dict]:
    """Mean per-token latency of ``reqs`` arriving as a Poisson process at ``rate_per_s``."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, len(reqs))
    sims = [Sim(f"r{i}", p, o, float(t), i) for i, ((p, o), t) in enumerate(zip(reqs, np.cumsum(gaps)))]
    now, modes, pending = 0.0, {}, list(sims)
    total = {DEVICE: dev_blocks, HOST: host_blocks}
    by_id = {s.rid: s for s in sims}
    for _ in range(max_iterations):
        live = [s for s in pending if s.finish_s is None]
        if not live:
            break
        arrived = [s for s in live if s.arrival_s <= now]
        if not arrived:
            now = min(s.arrival_s for s in live)
            continue
        used = {DEVICE: 0, HOST: 0}
        for s in arrived:
            if s.pool:
                used[s.pool] += -(-s.computed // BLOCK_TOKENS)
        view = [RequestState(s.rid, s.prompt, prefill_left(s), s.computed, s.generated, s.out, s.pool, s.index)
                for s in arrived]
        state = EngineState(waiting=tuple(v for v in view if v.pool is None),
                            running=tuple(v for v in view if v.pool is not None),
                            free_blocks={p: total[p] - used[p] for p in total}, total_blocks=total,
                            block_size_tokens=BLOCK_TOKENS, token_budget=TOKEN_BUDGET, max_running=MAX_RUNNING,
                            accelerator=True)
        plan = sched.schedule(state)
        if not plan.request_ids:
            nxt = [s.arrival_s for s in live if s.arrival_s > now]
            if not nxt or state.running:  # a prompt that fits no pool: this system cannot serve the trace
                return math.inf, modes
            now = min(nxt)
            continue
        for rid in plan.preempted:
            s = by_id[rid]
            s.pool, s.computed = None, 0
        for rid in plan.swap_out:
            by_id[rid].pool = HOST
        for rid in plan.swap_in:
            by_id[rid].pool = DEVICE
        now += max(plan.predicted_s, 1e-6)
        modes[plan.mode] = modes.get(plan.mode, 0) + 1
        for rid, n in plan.prefill:
            s = by_id[rid]
            if s.pool is None:
                s.pool = HOST if rid in plan.prefill_host else DEVICE
            s.computed += n
            if s.computed == s.prompt + s.generated:  # the prefill's last position samples the next token
                s.generated += 1
        for rid in plan.device_decodes + plan.host_decodes:
            s = by_id[rid]
            s.computed += 1
            s.generated += 1
        for s in arrived:
            if s.generated >= s.out and s.finish_s is None:
                s.finish_s, s.pool = now, None
    done = [s for s in sims if s.finish_s is not None]
    if len(done) < len(sims):
        return math.inf, modes
    return float(np.mean([(s.finish_s - s.arrival_s) / s.out for s in done])), modes


def max_rate(make_sched, reqs, slo_s: float, dev: int, host: int, lo: float, steps: int) -> float:
    """The highest Poisson rate whose mean per-token latency meets ``slo_s``: doubling from ``lo``
    (halving while ``lo`` misses it), then bisection in log rate, ``steps`` times."""
    def meets(rate):
        return simulate(make_sched(), reqs, rate, dev, host)[0] <= slo_s

    while not meets(lo) and lo > 1e-4:
        lo /= 2
    hi = lo * 2
    while meets(hi) and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def run_setup(label, hw_name, model, tp, reported, reqs, slo_x: float, steps: int) -> dict:
    hw = get_hardware(hw_name)
    if "T4" in label:  # a 16 GB T4 keeps ~1.8k tokens of KV beside Llama-2-7B: prompts scaled to fit it
        reqs = [(min(p, T4_MAX_PROMPT), o) for p, o in reqs]
    spec = shard(resolve_model(model), tp)
    eff = DefaultEfficiency.for_hardware(hw)

    def make():
        return NeoApexScheduler(spec, hw, eff)

    dtype_bytes = make().cost.dtype_bytes
    dev, host = pool_blocks(spec, hw, dtype_bytes, host=True)
    # a request the device pool cannot hold whole, GPU-only cannot serve (vLLM refuses it): outputs cut to fit
    reqs = [(p, max(1, min(o, dev * BLOCK_TOKENS - p - BLOCK_TOKENS))) for p, o in reqs]
    light = 0.02
    base_lat, _ = simulate(make(), reqs, light, dev, 0)
    if not math.isfinite(base_lat):
        raise RuntimeError(f"{label}: GPU-only cannot serve these requests at {light} req/s")
    slo = slo_x * base_lat
    r_gpu = max_rate(make, reqs, slo, dev, 0, light, steps)
    r_ours = max_rate(make, reqs, slo, dev, host, r_gpu, steps)  # both brackets a factor 2: same resolution
    _, modes = simulate(make(), reqs, r_ours, dev, host)
    return {"setup": label, "testbed": hw_name, "model": model + (f" (one GPU's shard of TP={tp})" if tp > 1 else ""),
            "max_prompt_tokens": max(p for p, _ in reqs), "max_output_tokens": max(o for _, o in reqs), "device_kv_tokens": dev * BLOCK_TOKENS, "host_kv_tokens": host * BLOCK_TOKENS,
            "slo_per_token_latency_s": slo, "gpu_only_max_rate_per_s": r_gpu, "scheduler_max_rate_per_s": r_ours,
            "predicted_gain_x": r_ours / r_gpu if r_gpu > 0 else None, "modes_at_max_rate": modes,
            "paper_reported": reported}


def simulation_arguments(doc: str, requests: int, max_prompt: int, steps: int, baseline: str, out: str,
                         argv=None) -> argparse.Namespace:
    """The options of a trace simulation (this benchmark's and bench_placed_scheduler's)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--requests", type=int, default=requests)
    ap.add_argument("--max-prompt", type=int, default=max_prompt)
    ap.add_argument("--slo-x", type=float, default=3.0, help=f"SLO = this x {baseline}'s light-load latency")
    ap.add_argument("--steps", type=int, default=steps, help="bisection steps per system (7: 2^(1/128), 0.5%%)")
    ap.add_argument("--output-x", type=float, default=1.0, help="scale the trace's output lengths")
    ap.add_argument("--only", default="", help="run only setups whose label contains this")
    ap.add_argument("--out", default=os.path.join(HERE, "results", out))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = simulation_arguments(__doc__, 300, 3072, 7, "GPU-only", "bench_scheduler_gains.json", argv)
    reqs = load_trace(args.requests, args.max_prompt, args.output_x)
    rows = []
    started = time.time()
    for label, hw_name, model, tp, reported in SETUPS:
        if args.only and args.only not in label:
            continue
        t0 = time.time()
        row = run_setup(label, hw_name, model, tp, reported, reqs, args.slo_x, args.steps)
        rows.append(row)
        gain = row["predicted_gain_x"]
        print(f"{label:9s} {row['model']:50s} GPU-only {row['gpu_only_max_rate_per_s']:.3f} req/s, "
              f"scheduler {row['scheduler_max_rate_per_s']:.3f} req/s: predicted {gain:.2f}x "
              f"({reported}) [{time.time() - t0:.0f} s]", flush=True)
    out = {"what": "cost-model PREDICTIONS (no model run): NeoApexScheduler vs GPU-only at equal mean per-token "
                   "latency, simulated with flexplan's estimator terms and uncalibrated default factors",
           "trace": f"azure_llm_2023_code.csv, first {args.requests} requests, prompts capped at {args.max_prompt}, "
                    f"outputs x {args.output_x:g}",
           "slo": f"{args.slo_x}x GPU-only's mean per-token latency at 0.02 req/s",
           "simplifications": ["swaps cost no time", "async overlap's host tokens count at their own iteration's end",
                               "H100 70B: one GPU's shard of TP=2 with the whole host",
                               "outputs cut so prompt + output fit the device pool (GPU-only could not serve more)",
                               f"T4 prompts capped at {T4_MAX_PROMPT} (NEO used the shorter OSC trace there)"],
           "machine": f"simulated on {platform.node() or 'this machine'} ({platform.processor() or platform.machine()})",
           "seconds": round(time.time() - started, 1), "rows": rows}
    print(f"wrote {write_json(args.out, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
