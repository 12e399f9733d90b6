"""Predicted vs measured CPU time of each operator the ``split-points`` policies can keep on the CPU
(issue 15 item 4): the attention's input projections, the attention over a KV cache, the output
projection and the MLP of one decoder layer of ``model`` in decode, at a few batch sizes. Needs no
accelerator: each operator runs as the executor's CPU path runs it (``executor.cpu_linear``'s
kernel on weights prepared as the executor holds them, transformers' SDPA for the attention), on
random float32 weights of the model's shapes cycled through more than the last-level cache, and
its median is set beside ``estimator.split_terms.cpu_op_times_s`` under the efficiency factors in
use (the local calibration by default). Dense layers only (``--cpu-experts`` checks routed experts).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from flexplan.estimator.split_terms import OPERATORS


def _time(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def validate_split_ops(model: Any = "meta-llama/Meta-Llama-3-8B", batches=(1, 4, 8), context_len: int = 512,
                       hardware: Any = "local", efficiency=None, repeats: int = 5) -> dict[str, Any]:
    """Rows (batch, operator, predicted_s, measured_s, error %) and the MAPE over them."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flexplan.calibration.microbench import MODES, Cycle, _SDPAModule, copies_for, rotate_bytes
    from flexplan.errors import InvalidInputError
    from flexplan.estimator.split_terms import cpu_op_times_s
    from flexplan.estimator.terms import Shape, phase_work
    from flexplan.executor.cpu_linear import LinearKernel
    from flexplan.planner import _efficiency, _resolve_hardware
    from flexplan.workload import resolve_model

    m = resolve_model(model)
    if m.is_moe:
        raise InvalidInputError(f"{m.name} is an MoE model: check its routed experts with --cpu-experts, "
                                "and the split operators on a dense model (e.g. meta-llama/Meta-Llama-3-8B)")
    if m.kv_lora_rank:
        raise InvalidInputError(f"{m.name} has latent attention: this check times standard K/V caches only")
    hw = _resolve_hardware(hardware)
    eff = _efficiency(hw, efficiency)
    h, hd, vd, heads, kvh = m.hidden_size, m.head_dim, m.v_head_dim, m.num_heads, m.num_kv_heads
    inter = m.intermediate_size
    lin = LinearKernel(device="cpu")
    total = rotate_bytes(MODES["quick"])

    def weights(out_f: int, in_f: int, tokens: int) -> Cycle:
        n = copies_for(out_f * in_f * 4, total)
        return Cycle(lin.prepare(torch.full((out_f, in_f), 0.01), tokens) for _ in range(n))

    rows = []
    with torch.inference_mode():
        for b in batches:
            shape = Shape(m, b, context_len, 2, "float32", "float32")
            predicted = cpu_op_times_s(shape, hw, eff, "decode", phase_work(shape, "decode"))[0]
            w_in = weights((heads + 2 * kvh) * hd, h, b)
            w_out = weights(h, heads * vd, b)
            w_up = weights((2 if m.gated_mlp else 1) * inter, h, b)
            w_down = weights(h, inter, b)
            x, o, mid = torch.full((b, h), 0.5), torch.full((b, heads * vd), 0.5), torch.full((b, inter), 0.5)
            n_kv = copies_for(2 * b * kvh * (context_len + 1) * hd * 4, total)
            kvs = Cycle((torch.full((b, kvh, context_len + 1, hd), 0.1), torch.full((b, kvh, context_len + 1, vd), 0.2))
                        for _ in range(n_kv))
            q = torch.full((b, heads, 1, hd), 0.1)
            mask = torch.ones(b, 1, 1, context_len + 1, dtype=torch.bool)
            module = _SDPAModule(heads // kvh)

            def attention():
                k, v = kvs.next()
                return sdpa_attention_forward(module, q, k, v, mask, scaling=hd ** -0.5)

            def mlp():
                up = lin(x, w_up.next())
                if m.gated_mlp:
                    up = torch.nn.functional.silu(up[:, :inter]) * up[:, inter:]
                return lin(mid if not m.gated_mlp else up, w_down.next())

            ops = {OPERATORS[0]: lambda: lin(x, w_in.next()), OPERATORS[1]: attention,
                   OPERATORS[2]: lambda: lin(o, w_out.next()), OPERATORS[3]: mlp}
            for k, (name, fn) in enumerate(ops.items()):
                measured = _time(fn, repeats)
                p = float(predicted[k])
                rows.append({"batch": b, "operator": name, "predicted_s": p, "measured_s": measured,
                             "error_pct": 100 * abs(p - measured) / measured})
            del w_in, w_out, w_up, w_down, kvs
    return {"model": m.name, "hardware": hw.name, "calibration": eff.source, "threads": torch.get_num_threads(),
            "context_len": context_len, "rows": rows, "mape_pct": statistics.fmean(r["error_pct"] for r in rows),
            "mape_pct_by_operator": {op: statistics.fmean(r["error_pct"] for r in rows if r["operator"] == op)
                                     for op in OPERATORS}}


def format_check(s: dict[str, Any]) -> str:
    """The rows and the MAPE of :func:`validate_split_ops`, as `flexplan validate --split-ops` prints them."""
    lines = [f"CPU operators of one decode layer of {s['model']} (float32, {s['threads']} threads, "
             f"{s['context_len']} cached tokens; {s['calibration']}):",
             f"  {'batch':>5}  {'operator':<30}{'measured':>12}{'predicted':>12}{'error':>8}"]
    for r in s["rows"]:
        lines.append(f"  {r['batch']:>5}  {r['operator']:<30}{r['measured_s'] * 1e3:>10.3f}ms"
                     f"{r['predicted_s'] * 1e3:>10.3f}ms{r['error_pct']:>7.0f}%")
    lines.append("MAPE by operator: " + ", ".join(f"{k} {v:.0f}%" for k, v in s["mape_pct_by_operator"].items()))
    lines.append(f"MAPE {s['mape_pct']:.0f}%")
    return "\n".join(lines)
