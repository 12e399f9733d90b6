"""The cost model's PREDICTED gain of pricing each iteration's placement (PlacementScheduler) over
the fixed phase rule, for models larger than the accelerator served under a flexplan plan.

Nothing runs a model here: bench_scheduler_gains' discrete-event simulation of the engine (FCFS's
admission, blocks, chunked prefill) advances a clock by each iteration's ``predicted_s``:
``iteration_time_s`` (flexplan's estimator, uncalibrated default factors for each testbed) of the
batch under the placement the scheduler chose. The plan: ``plan()`` for the model on the testbed's
accelerator at batch 1, 512-token prompts, 32 outputs (what ``flexplan serve --accelerator`` loads
with). Systems: the rule = a prefill chunk runs under the plan's prefill placement, a decode-only
iteration under its decode placement (the engine before PlacementScheduler); priced = each
iteration under the placement the estimator prices lower. Requests: the Azure LLM 2023 code trace
(lengths; prompts capped at ``--max-prompt``), Poisson arrivals. Latency = mean per-token latency;
the SLO is ``--slo-x`` times the rule's at the lightest rate; throughput at equal latency = the
highest rate meeting it (bisection). The KV pools: the accelerator's budget less the plan's bytes
(device), half the host's memory (host); where the plan's placement reads the KV is the
estimator's, whichever pool holds it.

    python benchmarks/bench_placed_scheduler.py
"""

from __future__ import annotations

import math
import os
import platform
import time

from bench_scheduler_gains import BLOCK_TOKENS, load_trace, max_rate, simulate, simulation_arguments  # noqa: E402
from common import write_json  # noqa: E402
from flexplan.estimator.efficiency import DefaultEfficiency
from flexplan.estimator.iteration import ragged_shape
from flexplan.hardware import get_hardware
from flexplan.planner import plan as plan_fn
from flexplan.serving.placed_scheduler import PlacementScheduler
from flexplan.workload import resolve_model

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30
# (label, hwdb testbed, model, the accelerator's budget in GiB): models that do not fit it
SETUPS = [
    ("T4 8B", "neo-testbed-g4dn-4xlarge", "meta-llama/Llama-3.1-8B", 14),
    ("A10G 30B-A3B", "neo-testbed-g5-4xlarge", "Qwen/Qwen3-30B-A3B", 22),
    ("server2 70B", "flexinfer-server2", "meta-llama/Llama-3.1-70B", 22),
    ("H100 70B", "neo-testbed-hgx-h100", "meta-llama/Llama-3.1-70B", 76),
]


class RulePlacement(PlacementScheduler):
    """The engine's phase rule (any chunk: the prefill placement), priced as it runs."""

    def schedule(self, state):
        plan = super().schedule(state)
        if not plan.request_ids:
            return plan
        rule = "prefill" if plan.prefill else "decode"
        context = {r.request_id: r.context_tokens for r in state.running}
        shape = ragged_shape([n for _, n in plan.prefill],
                             [context[r] + 1 for r in plan.device_decodes + plan.host_decodes])
        return plan.__class__(**{**plan.__dict__, "placement": rule, "predicted_s": self.price_s(rule, *shape)})


def run_setup(label, hw_name, model, budget_gib, reqs, slo_x: float, steps: int) -> dict:
    hw = get_hardware(hw_name)
    spec = resolve_model(model)
    eff = DefaultEfficiency.for_hardware(hw)
    p = plan_fn(spec, hardware=hw, gpu_memory_bytes=budget_gib * GIB, batch_size=1, input_len=512, output_len=32,
                efficiency=eff, include_initial_load=False)
    kv_block = spec.kv_elems_per_token * 2 * spec.num_layers * BLOCK_TOKENS
    held = max(p.prefill.gpu_memory_bytes, p.decode.gpu_memory_bytes)
    dev = max(0, int((budget_gib * GIB - held) // kv_block))
    host = int(hw.cpu.memory_bytes * 0.5 // kv_block)

    def rule():
        return RulePlacement.for_plan(p, spec, hw, eff)

    def priced():
        return PlacementScheduler.for_plan(p, spec, hw, eff)

    light = 0.002
    base_lat, _ = simulate(rule(), reqs, light, dev, host)
    if not math.isfinite(base_lat):
        raise RuntimeError(f"{label}: the rule cannot serve these requests at {light} req/s")
    slo = slo_x * base_lat
    r_rule = max_rate(rule, reqs, slo, dev, host, light, steps)
    r_priced = max_rate(priced, reqs, slo, dev, host, r_rule, steps)
    placements = {}
    s = priced()
    inner = s.schedule

    def counted(state):
        out = inner(state)
        placements[out.placement] = placements.get(out.placement, 0) + 1
        return out

    s.schedule = counted
    lat_priced, _ = simulate(s, reqs, r_rule, dev, host)
    lat_rule, _ = simulate(rule(), reqs, r_rule, dev, host)
    return {"setup": label, "testbed": hw_name, "model": model, "gpu_budget_gib": budget_gib,
            "plan": f"prefill {p.prefill.policy} M={p.prefill.gpu_layers}, decode {p.decode.policy} "
                    f"M={p.decode.gpu_layers}, {p.dtype}",
            "device_kv_tokens": dev * BLOCK_TOKENS, "host_kv_tokens": host * BLOCK_TOKENS,
            "slo_per_token_latency_s": slo, "rule_max_rate_per_s": r_rule, "priced_max_rate_per_s": r_priced,
            "predicted_gain_x": r_priced / r_rule if r_rule > 0 else None,
            "at_rule_max_rate": {"rule_latency_s": lat_rule, "priced_latency_s": lat_priced,
                                 "priced_placements": placements}}


def main(argv=None) -> int:
    args = simulation_arguments(__doc__, 200, 2048, 6, "the rule", "bench_placed_scheduler.json", argv)
    reqs = load_trace(args.requests, args.max_prompt, args.output_x)
    rows, started = [], time.time()
    for label, hw_name, model, budget in SETUPS:
        if args.only and args.only not in label:
            continue
        t0 = time.time()
        row = run_setup(label, hw_name, model, budget, reqs, args.slo_x, args.steps)
        rows.append(row)
        at = row["at_rule_max_rate"]
        print(f"{label:13s} {row['plan']:60s} rule {row['rule_max_rate_per_s']:.4f} req/s, priced "
              f"{row['priced_max_rate_per_s']:.4f} req/s: predicted {row['predicted_gain_x']:.2f}x; at the rule's "
              f"rate latency {at['rule_latency_s']:.3g} vs {at['priced_latency_s']:.3g} s/token, placements "
              f"{at['priced_placements']} [{time.time() - t0:.0f} s]", flush=True)
    out = {"what": "cost-model PREDICTIONS (no model run): PlacementScheduler vs the fixed phase rule at equal mean "
                   "per-token latency, simulated with flexplan's estimator and uncalibrated default factors",
           "trace": f"azure_llm_2023_code.csv, first {args.requests} requests, prompts capped at {args.max_prompt}, "
                    f"outputs x {args.output_x:g}",
           "slo": f"{args.slo_x}x the rule's mean per-token latency at 0.002 req/s",
           "simplifications": ["an iteration costs the estimator's price of its batch's ragged shape under the "
                               "placement run (the same model prices and simulates: a prediction, not a measurement)",
                               "switching placements costs no time (each phase's resident layers stay put)"],
           "machine": f"simulated on {platform.node() or 'this machine'} ({platform.processor() or platform.machine()})",
           "seconds": round(time.time() - started, 1), "rows": rows}
    print(f"wrote {write_json(args.out, out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
