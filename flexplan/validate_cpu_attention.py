"""`flexplan validate --cpu-attention`: the CPU part of the ``cpu-attention`` policies, predicted
vs measured, on this machine (no accelerator needed).

For each head layout (query heads, KV heads, head dim: MHA, GQA, MQA), batch and context it
times the decode attention the executor runs beside a host KV cache (flexplan's native kernel for
float32 when it is built, transformers' SDPA otherwise; one query per sequence over a KV cache in
the executor's ``(tokens, batch, heads, dim)`` layout, read through strided views) and compares it
with the estimator's term, :func:`flexplan.estimator.terms.t_cpu_attention_s`, under this machine's
calibration. It reports the MAPE per head layout and over all points. The new K, V append and
the link transfers are not timed here (they are the link's and the cache's, not the CPU's
attention).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flexplan.estimator.terms import Shape, t_cpu_attention_s
from flexplan.executor.weights import torch_dtype
from flexplan.factors import efficiency_for
from flexplan.hardware import get_hardware
from flexplan.hardware.spec import canonical_dtype
from flexplan.measure.microbench import cpu_decode_attention_call, llc_bytes, time_call
from flexplan.workload.model import ModelSpec

# (query heads, KV heads, head dim): MHA, GQA 4:1, MQA
LAYOUTS = ((32, 32, 128), (32, 8, 128), (16, 1, 64))
BATCHES = (1, 8)
CONTEXTS = (256, 1024, 4096)


def _layout_spec(heads: int, kv_heads: int, head_dim: int):
    return ModelSpec.from_config(dict(model_type="llama", hidden_size=heads * head_dim, intermediate_size=1,
                                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                                      num_hidden_layers=1, vocab_size=128))


def measure(layout: tuple[int, int, int], batch: int, context: int, dtype: str = "float32", repeats: int = 5,
            budget_s: float = 0.5) -> tuple[float, str]:
    """(seconds per call, kernel) of the executor's CPU decode attention for one layer."""
    import torch


    heads, kv_heads, d = layout
    dt = torch_dtype(canonical_dtype(dtype))
    fn, kernel = cpu_decode_attention_call(heads, kv_heads, d, batch, context, dt, 4 * llc_bytes())
    with torch.inference_mode():
        return float(time_call(fn, repeats, budget_s)["time_median_s"]), kernel


def predict(layout: tuple[int, int, int], batch: int, context: int, hw, eff, dtype: str = "float32") -> float:
    """The estimator's CPU attention term for one layer attending over ``context`` keys."""

    shape = Shape(_layout_spec(*layout), batch, context, 2, dtype, dtype)
    return float(t_cpu_attention_s(shape, hw, eff, np.array([float(context)]))[0])


def run_check(hardware: str = "local", dtype: str = "float32", layouts=LAYOUTS, batches=BATCHES,
              contexts=CONTEXTS, progress=None) -> dict[str, Any]:
    """Rows (layout, batch, context, measured, predicted, kernel) and the MAPE per layout and overall."""

    hw = get_hardware(hardware)
    eff = efficiency_for(hw)
    rows = []
    for layout in layouts:
        for b in batches:
            for ctx in contexts:
                t, kernel = measure(layout, b, ctx, dtype)
                p = predict(layout, b, ctx, hw, eff, dtype)
                rows.append({"heads": layout[0], "kv_heads": layout[1], "head_dim": layout[2], "batch": b,
                             "context": ctx, "measured_s": t, "predicted_s": p, "kernel": kernel,
                             "error_pct": abs(p - t) / t * 100})
                if progress:
                    progress(rows[-1])
    mape = {f"{h}:{kv}:{d}": float(np.mean([r["error_pct"] for r in rows if (r["heads"], r["kv_heads"], r["head_dim"])
                                             == (h, kv, d)])) for h, kv, d in layouts}
    return {"rows": rows, "mape_by_layout": mape, "mape": float(np.mean([r["error_pct"] for r in rows])),
            "calibration": eff.source, "dtype": dtype}


def format_check(s: dict[str, Any]) -> str:
    lines = [f"CPU decode attention beside the KV cache ({s['dtype']}; {s['calibration']}):",
             f"  {'heads:kv:dim':<14}{'batch':>6}{'context':>8}{'measured':>12}{'predicted':>12}{'error':>8}  kernel"]
    for r in s["rows"]:
        lines.append(f"  {r['heads']}:{r['kv_heads']}:{r['head_dim']:<8}{r['batch']:>6}{r['context']:>8}"
                     f"{r['measured_s'] * 1e3:>10.3f}ms{r['predicted_s'] * 1e3:>10.3f}ms{r['error_pct']:>7.0f}%  {r['kernel']}")
    lines.append("MAPE by head layout: " + ", ".join(f"{k} {v:.0f}%" for k, v in s["mape_by_layout"].items())
                 + f"; overall {s['mape']:.0f}%")
    return "\n".join(lines)
