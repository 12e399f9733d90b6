"""Predicted vs measured CPU time of each operator the ``split-points`` policy can leave on the CPU:
the C array of ``estimator.operator_terms`` (q/k/v projections, the attention
core over a KV cache, the output projection, the MLP's projections) against each operator timed on
this CPU as the split executor runs it there: ``executor.split_layer.cpu_operator_linear`` (the native dense
kernel) on weights in host memory; the decode attention core as ``validate --cpu-attention`` times it
(flexplan's native kernel for float32, over KV caches cycled through DRAM), the prefill core by
transformers' SDPA. Needs no accelerator (the
prediction borrows a hwdb GPU and link only to build the terms; the CPU's terms do not read them).
Random float32 weights of the model's shapes, cycled through more than the last-level cache; decode
at a few batch sizes, and a prefill of one prompt. Dense layers only (``--cpu-experts`` checks routed experts).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from flexplan.errors import InvalidInputError
from flexplan.estimator.operator_terms import operator_costs
from flexplan.estimator.terms import Shape
from flexplan.executor.split_layer import cpu_operator_linear
from flexplan.hardware import get_hardware
from flexplan.measure.microbench import MODES, Cycle, _SDPAModule, copies_for, rotate_bytes
from flexplan.planner import _efficiency, _resolve_hardware
from flexplan.validate_cpu_attention import measure as measure_decode_attention
from flexplan.workload import resolve_model
from flexplan.workload.operators import ATTENTION, LINEAR, layer_operators, why_not_split


def _time(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def validate_split_ops(model: Any = "meta-llama/Meta-Llama-3-8B", batches=(1, 4, 8), context_len: int = 512,
                       prefill_tokens=(128,),
                       hardware: Any = "local", efficiency=None, repeats: int = 5,
                       gpu_of: str = "flexinfer-server2") -> dict[str, Any]:
    """Rows (phase, batch, tokens, operator, predicted_s, measured_s, error %), the MAPE, and the MAPE
    per operator and per phase: decode steps at ``batches`` over ``context_len`` cached tokens, and
    prefills of one sequence of each of ``prefill_tokens`` (the attention core SDPA causal over the prompt)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward


    m = resolve_model(model)
    if m.is_moe:
        raise InvalidInputError(f"{m.name} is an MoE model: check its routed experts with --cpu-experts, "
                                "and the split operators on a dense model (e.g. meta-llama/Meta-Llama-3-8B)")
    why = why_not_split(m)
    if why:
        raise InvalidInputError(f"{m.name}: {why}")
    hw = _resolve_hardware(hardware)
    eff = _efficiency(hw, efficiency)
    donor = get_hardware(gpu_of)
    terms_hw = dataclasses.replace(hw, gpu=hw.gpu or donor.gpu, link=hw.link or donor.link)
    ops = layer_operators(m)
    hd, vd, heads, kvh = m.head_dim, m.v_head_dim, m.num_heads, m.num_kv_heads
    total = rotate_bytes(MODES["quick"])
    rows = []

    def linear(op, b, tokens):
        n_copies = copies_for(int(op.weight_params) * 4, total)
        ws = Cycle(torch.full((op.out_elems, op.in_elems), 0.01) for _ in range(n_copies))
        x = torch.full((b, tokens, op.in_elems), 0.5)
        return lambda: cpu_operator_linear(x, ws.next(), None, torch.float32)

    def attention(b, q_len, kv_len):  # decode: one query over kv_len keys; prefill: causal over the prompt
        n_copies = copies_for(2 * b * kvh * kv_len * max(hd, vd) * 4, total)
        ws = Cycle((torch.full((b, kvh, kv_len, hd), 0.1), torch.full((b, kvh, kv_len, vd), 0.2))
                   for _ in range(n_copies))
        q = torch.full((b, heads, q_len, hd), 0.1)
        mask = torch.ones(b, 1, 1, kv_len, dtype=torch.bool) if q_len == 1 else None
        module = _SDPAModule(heads // kvh)
        module.is_causal = q_len > 1

        def fn():
            key, value = ws.next()
            return sdpa_attention_forward(module, q, key, value, mask, scaling=hd ** -0.5)
        return fn

    points = [("decode", b, 1) for b in batches] + [("prefill", 1, t) for t in prefill_tokens]
    with torch.inference_mode():
        warm, start = linear(next(o for o in ops if o.kind == LINEAR), batches[0], 1), time.perf_counter()
        while time.perf_counter() - start < 0.5:  # threads and clocks up before the first timed operator
            warm()  # (once, the first operator of the first point was measured 2-5x slow)
        del warm
        for phase, b, tokens in points:
            shape = Shape(m, b, context_len if phase == "decode" else tokens, 2, "float32", "float32")
            predicted = operator_costs(shape, terms_hw, eff, phase).cpu_s[0]
            for k, op in enumerate(ops):
                if op.kind == LINEAR:
                    fn = linear(op, b, tokens)
                elif op.kind == ATTENTION and phase == "decode" and hd == vd:  # what the executor runs there
                    fn = None
                    measured = measure_decode_attention((heads, kvh, hd), b, context_len + 1, repeats=repeats)[0]
                elif op.kind == ATTENTION:
                    fn = attention(b, tokens, context_len + 1 if phase == "decode" else tokens)
                else:
                    continue
                if fn is not None:
                    measured = _time(fn, repeats)
                p = float(predicted[k])
                rows.append({"phase": phase, "batch": b, "tokens": b * tokens, "operator": op.name, "predicted_s": p,
                             "measured_s": measured, "error_pct": 100 * abs(p - measured) / measured})
                del fn
    names = list(dict.fromkeys(r["operator"] for r in rows))
    return {"model": m.name, "hardware": hw.name, "calibration": eff.source, "threads": torch.get_num_threads(),
            "context_len": context_len, "rows": rows, "mape_pct": statistics.fmean(r["error_pct"] for r in rows),
            "mape_pct_by_phase": {ph: statistics.fmean(r["error_pct"] for r in rows if r["phase"] == ph)
                                  for ph in dict.fromkeys(r["phase"] for r in rows)},
            "mape_pct_by_operator": {op: statistics.fmean(r["error_pct"] for r in rows if r["operator"] == op)
                                     for op in names}}


def format_check(s: dict[str, Any]) -> str:
    """The rows and the MAPE of :func:`validate_split_ops`, as `flexplan validate --split-ops` prints them."""
    lines = [f"CPU operators of one layer of {s['model']} (float32, the split executor's CPU kernels, "
             f"{s['threads']} threads; decode over {s['context_len']} cached tokens; {s['calibration']}):",
             f"  {'phase':<8}{'batch':>5}{'tokens':>7}  {'operator':<12}{'measured':>12}{'predicted':>12}{'error':>8}"]
    for r in s["rows"]:
        lines.append(f"  {r.get('phase', 'decode'):<8}{r['batch']:>5}{r.get('tokens', r['batch']):>7}  {r['operator']:<12}"
                     f"{r['measured_s'] * 1e3:>10.3f}ms{r['predicted_s'] * 1e3:>10.3f}ms{r['error_pct']:>7.0f}%")
    lines.append("MAPE by operator: " + ", ".join(f"{k} {v:.0f}%" for k, v in s["mape_pct_by_operator"].items()))
    if "mape_pct_by_phase" in s:
        lines.append("MAPE by phase: " + ", ".join(f"{k} {v:.0f}%" for k, v in s["mape_pct_by_phase"].items()))
    lines.append(f"MAPE {s['mape_pct']:.0f}%")
    return "\n".join(lines)
