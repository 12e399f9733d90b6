"""PREDICTED gpu-offload decode with compressed weights: does TPOT follow the blocks' bytes over the link?

Nothing runs a model: for the papers' testbeds in hwdb (NEO's T4 and A10G, its H100) and Llama-3
8B / 70B from the catalog, the estimator (uncalibrated default factors for each testbed) prices
``gpu-offload`` forced for both phases with the decoder and head linears in bfloat16, Q8_0, Q4_0,
Q4_K and int4 (= Q4_1, quantised at load), and the planner's free choice in each format. Per cell:
the predicted TPOT, the bytes over the link per decode step, the ratio to bfloat16, and one
streamed layer's terms: its weights over the link (t_load), its time on the accelerator
(t_gpu_layer, which includes D) and D alone, the blocks dequantised every call by one compiled
kernel (``quant/fused_dequant.py``, priced by ``estimator/dequant_terms.py``). Issue 40's goal:
4-bit gpu-offload TPOT <= 0.3 x bfloat16's (Q4_0 is 4.5 bits a weight = 0.28 of 16; Q4_1 5 bits =
0.31). Default shape: batch 1, prompt 512, 32 new tokens (Park & Egger's).

    python benchmarks/predict_compressed_offload.py
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's flexplan

from common import write_result  # noqa: E402
from flexplan import plan  # noqa: E402
from flexplan.errors import DoesNotFitError  # noqa: E402
from flexplan.estimator.efficiency import DefaultEfficiency  # noqa: E402
from flexplan.estimator.phase_costs import phase_costs  # noqa: E402
from flexplan.estimator.terms import Shape  # noqa: E402
from flexplan.hardware import get_hardware  # noqa: E402
from flexplan.planner import _kept_weights  # noqa: E402
from flexplan.workload import resolve_model  # noqa: E402

TESTBEDS = (("T4", "neo-testbed-g4dn-4xlarge"), ("A10G", "neo-testbed-g5-4xlarge"), ("H100", "neo-testbed-hgx-h100"))
MODELS = ("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-70B")
FORMATS = (("bfloat16", None), ("Q8_0", "Q8_0"), ("Q4_0", "Q4_0"), ("Q4_K", "Q4_K"), ("int4 (Q4_1)", "int4"))
FORCED = {"prefill": "gpu-offload", "decode": "gpu-offload"}
GOAL = 0.3  # issue 40: 4-bit gpu-offload TPOT <= 0.3 x bfloat16's (predicted)


def layer_terms(model: str, hw_name: str, weights: str | None, b: int, i: int, o: int) -> dict:
    """One streamed decode layer's terms (mean over steps), at the testbed's default factors."""
    spec, hw = resolve_model(model), get_hardware(hw_name)
    shape = Shape(spec, b, i, o, "bfloat16", "float32", _kept_weights(spec, weights))
    pc = phase_costs(shape, hw, DefaultEfficiency.for_hardware(hw), "decode")
    return {"layer_link_bytes": pc.weight_bytes_gpu, "t_load_weights_s": pc.t_load_weights_s,
            "t_gpu_layer_s": float(np.mean(pc.t_gpu_layer_s)), "t_gpu_dequant_s": pc.t_gpu_dequant_s}


def cell(model: str, hw_name: str, weights: str | None, b: int, i: int, o: int) -> dict:
    out = {"weights": weights or "bfloat16", **layer_terms(model, hw_name, weights, b, i, o)}
    try:
        p = plan(model, hw_name, batch_size=b, input_len=i, output_len=o, dtype="bfloat16", weights=weights,
                 **FORCED)
        out.update(offload_tpot_s=p.tpot_s, offload_link_bytes_per_step=p.decode.pcie_bytes)
    except DoesNotFitError as e:
        out.update(offload_tpot_s=None, offload_link_bytes_per_step=None, offload_why=str(e).splitlines()[0])
    try:
        f = plan(model, hw_name, batch_size=b, input_len=i, output_len=o, dtype="bfloat16", weights=weights)
        out.update(free=f"{f.prefill.policy}/{f.decode.policy} M={f.decode.gpu_layers}", free_tpot_s=f.tpot_s,
                   free_e2e_s=f.e2e_s)
    except DoesNotFitError:
        out.update(free=None, free_tpot_s=None, free_e2e_s=None)
    return out


def _ms(x) -> str:
    return f"{x * 1e3:8.1f}" if x is not None else "       -"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-b", "--batch-size", type=int, default=1)
    ap.add_argument("-i", "--input-len", type=int, default=512)
    ap.add_argument("-o", "--output-len", type=int, default=32)
    ap.add_argument("--name", default="predict_compressed_offload")
    args = ap.parse_args()
    b, i, o = args.batch_size, args.input_len, args.output_len
    rows = []
    print(f"PREDICTED (default factors, no run), batch {b}, {i}/{o}; gpu-offload forced for both phases; "
          "per layer: link = its weights over the link, gpu = its time on the accelerator incl. D, D = dequantisation")
    print(f"{'testbed':6} {'model':12} {'weights':12} {'TPOT ms':>8} {'x bf16':>7} {'GB/step':>8} "
          f"{'link ms':>8} {'gpu ms':>8} {'D ms':>8}  free choice (TPOT ms)")
    for label, hw_name in TESTBEDS:
        for model in MODELS:
            base = None
            for name, weights in FORMATS:
                c = cell(model, hw_name, weights, b, i, o)
                c.update(testbed=label, hardware=hw_name, model=model, format=name)
                if weights is None:
                    base = c["offload_tpot_s"]
                c["ratio_to_bfloat16"] = (c["offload_tpot_s"] / base if base and c["offload_tpot_s"] else None)
                rows.append(c)
                ratio = f"{c['ratio_to_bfloat16']:7.3f}" if c["ratio_to_bfloat16"] else "      -"
                gb = f"{c['offload_link_bytes_per_step'] / 1e9:8.2f}" if c["offload_link_bytes_per_step"] else "       -"
                print(f"{label:6} {model.split('/')[-1].replace('Meta-', ''):12} {name:12} {_ms(c['offload_tpot_s'])} {ratio} {gb} "
                      f"{_ms(c['t_load_weights_s'])} {_ms(c['t_gpu_layer_s'])} {_ms(c['t_gpu_dequant_s'])}  "
                      f"{c['free'] or 'does not fit'} ({_ms(c['free_tpot_s']).strip()})")
    four_bit = [r for r in rows if r["format"] in ("Q4_0", "Q4_K", "int4 (Q4_1)") and r["ratio_to_bfloat16"]]
    met = [r for r in four_bit if r["ratio_to_bfloat16"] <= GOAL]
    print(f"goal 4-bit <= {GOAL} x bfloat16: met in {len(met)} of {len(four_bit)} 4-bit cells with a bfloat16 baseline")
    path = write_result(args.name, {"predicted": True, "factors": "DefaultEfficiency.for_hardware (not calibrated)",
                                    "shape": {"batch": b, "input_len": i, "output_len": o}, "goal": GOAL,
                                    "goal_met": f"{len(met)} of {len(four_bit)}", "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
