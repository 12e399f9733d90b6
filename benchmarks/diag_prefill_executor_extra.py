"""What flexplan's executor spends on a CPU prefill beyond the bare decoder layers, against what a
calibration file prices.

Toy Llamas of SmolLM2's width (576 hidden, 49152 vocab) at two depths run `generate(max_new_tokens=1)`
on flexplan's executor (plan cpu/cpu in the CPU dtype asked): the TTFT (`last_stats.ttft_s`, as
validate measures it) slope over depth is the
executor's per-layer prefill cost, its intercept what the prefill costs outside the layers
(embedding, final norm, LM head, generate's first step). Beside them: the bare layer of that
width at the same (batch, tokens), timed as `flexplan calibrate` times it (`microbench.layers`),
and the slope and intercept the estimator predicts from CALIBRATION for the same toy models. Depths
alternate within each round (interleaved); the minimum TTFT of each depth over the rounds is kept.

    python benchmarks/diag_prefill_executor_extra.py CALIBRATION [--shapes float32:1x32,bfloat16:4x128] [--rounds 3]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from common import write_result

WIDTH = (576, 1536, 9, 3, 64)  # SmolLM2-135M's layer
VOCAB = 49152
DEPTHS = (10, 30)


def _ttft_s(lm, ids, n: int = 5) -> float:
    """The fastest TTFT of ``n`` calls as the executor reports it (``last_stats``, what validate
    measures: the call's start to the prefill's end, not the whole generate call)."""
    import torch

    best = float("inf")
    for _ in range(n):
        lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                    do_sample=False, pad_token_id=0)
        best = min(best, lm.last_stats.ttft_s)
    return best


def one_shape(cal: Path, dtype: str, batch: int, tokens: int, rounds: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    import flexplan
    from flexplan.api import load
    from flexplan.calibration import microbench as mb
    from flexplan.executor.plans import fixed_plan
    from flexplan.hardware import get_hardware
    from flexplan.validate import _cold_efficiency

    hw = get_hardware("local")
    ids = torch.ones(batch, tokens, dtype=torch.long)
    lms = {}
    for depth in DEPTHS:
        torch.manual_seed(0)
        model = LlamaForCausalLM(mb._llama_config(*WIDTH, layers=depth, vocab=VOCAB)).eval()
        lms[depth] = load(model, plan=fixed_plan(model.config, "cpu", "cpu", cpu_dtype=dtype, input_len=tokens,
                                                 output_len=1, batch_size=batch), accelerator=None,
                          online_correction=False)
        _ttft_s(lms[depth], ids, 2)  # warm-up
    measured = {d: float("inf") for d in DEPTHS}
    for _ in range(rounds):
        for depth in DEPTHS:
            measured[depth] = min(measured[depth], _ttft_s(lms[depth], ids))
    del lms
    bare = mb.layers(replace(mb.MODES["full"], layer_widths=(WIDTH,), layer_shapes=((batch, tokens),),
                             layer_long_kv_len=None), dtype)[0]
    eff = _cold_efficiency(cal, hw)
    predicted = {}
    for depth in DEPTHS:
        cfg = mb._llama_config(*WIDTH, layers=depth, vocab=VOCAB)
        predicted[depth] = flexplan.plan(cfg, hw, batch_size=batch, input_len=tokens, output_len=16, dtype="float32",
                                         prefill="cpu", decode="cpu", efficiency=eff, cpu_dtype=dtype).ttft_s
    lo, hi = DEPTHS

    def fit(t):
        slope = (t[hi] - t[lo]) / (hi - lo)
        return slope, t[lo] - lo * slope

    (ms, mi), (ps, pi) = fit(measured), fit(predicted)
    return {"dtype": dtype, "batch": batch, "tokens": tokens, "ttft_measured_s": measured, "ttft_predicted_s": predicted,
            "slope_measured_s": ms, "intercept_measured_s": mi, "slope_predicted_s": ps, "intercept_predicted_s": pi,
            "bare_layer_s": bare["time_s"], "bare_layer_copies": bare["copies"]}


def main() -> int:
    from flexplan.calibration.stream import stream_triad_bytes_per_s

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calibration", type=Path)
    ap.add_argument("--shapes", default="float32:1x32,float32:1x128,bfloat16:1x32,bfloat16:4x128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="diag_prefill_executor_extra")
    args = ap.parse_args()
    triad = [round(stream_triad_bytes_per_s(128 * 2**20, repeats=3) / 1e9, 1)]
    rows = []
    for item in args.shapes.split(","):
        dtype, shape = item.split(":")
        b, t = (int(x) for x in shape.split("x"))
        r = one_shape(args.calibration, dtype, b, t, args.rounds)
        rows.append(r)
        print(f"{dtype:8s} b{b} x{t:4d}: per layer measured {r['slope_measured_s'] * 1e3:6.3f} ms, bare "
              f"{r['bare_layer_s'] * 1e3:6.3f}, predicted {r['slope_predicted_s'] * 1e3:6.3f}; outside the layers "
              f"measured {r['intercept_measured_s'] * 1e3:5.2f} ms, predicted {r['intercept_predicted_s'] * 1e3:5.2f}; "
              f"TTFT at {DEPTHS[-1]} layers {r['ttft_measured_s'][DEPTHS[-1]] * 1e3:.1f} ms, predicted "
              f"{r['ttft_predicted_s'][DEPTHS[-1]] * 1e3:.1f}", flush=True)
    triad.append(round(stream_triad_bytes_per_s(128 * 2**20, repeats=3) / 1e9, 1))
    print(f"STREAM triad before / after: {triad[0]} / {triad[1]} GB/s")
    write_result(args.name, {"calibration": str(args.calibration), "depths": DEPTHS, "width": WIDTH, "vocab": VOCAB,
                             "rounds": args.rounds, "triad_gbs_before_after": triad, "shapes": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
