"""Predicted vs measured time of the ``cpu-experts`` policy's CPU part on this machine: the routed
experts of one MoE layer, on the CPU, at the batch sizes decode routing
produces. Needs no accelerator: it runs the executor's CPU expert path
(``executor.cpu_experts.routed_experts_forward`` on blocked float32 copies, as the executor holds
them) on random weights of the model's expert shape, with uniform random routing, and compares
the median time with the estimator's ``expert_terms.t_cpu_experts_s`` under the efficiency factors
given (the local calibration by default). Reports the absolute percentage error per batch and
their mean (MAPE).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from flexplan.errors import InvalidInputError
from flexplan.estimator.expert_terms import t_cpu_experts_s
from flexplan.executor import cpu_experts, cpu_linear
from flexplan.executor.cpu_experts import routed_experts_forward
from flexplan.planner import _efficiency, _resolve_hardware
from flexplan.workload import costs, resolve_model


def _experts_module(m, seed: int):
    """A transformers-interface experts module of ``m``'s expert shape, blocked as the executor holds it."""
    import torch
    from torch import nn


    g = torch.Generator().manual_seed(seed)
    mod = nn.Module()
    e, h, i = m.num_experts, m.hidden_size, m.expert_intermediate_size
    w_in = (2 * i if m.gated_mlp else i)
    shapes = {"gate_up_proj" if m.gated_mlp else "up_proj": (e, w_in, h), "down_proj": (e, h, i)}
    for name, shape in shapes.items():
        dense = torch.randn(shape, generator=g) * 0.02
        if shape[1] % cpu_linear.BLOCK == 0 and cpu_linear.blocking_available():
            dense = cpu_experts.block_experts_into(dense, False, torch.empty(dense.numel()))
        mod.register_parameter(name, nn.Parameter(dense, requires_grad=False))
    mod.has_gate, mod.is_transposed = m.gated_mlp, False
    mod.act_fn = torch.nn.functional.silu
    mod._apply_gate = lambda x: torch.nn.functional.silu(x[..., :i]) * x[..., i:]
    return mod


def validate_cpu_experts(model: Any, batches=(1, 2, 4, 8, 16), hardware: Any = "local", efficiency=None,
                         repeats: int = 5, seed: int = 0, max_experts: int | None = None) -> dict[str, Any]:
    """Rows (batch, distinct experts, predicted_s, measured_s, error %) and the MAPE, for the
    routed experts of one MoE layer of ``model`` (a catalog id, config or ModelSpec) computed in
    float32 on this CPU; ``max_experts`` caps the experts held (the expert shape stays)."""
    import torch


    m = resolve_model(model)
    if not m.is_moe:
        raise InvalidInputError(f"{m.name} is a dense model: it has no routed experts to validate")
    if max_experts is not None and m.num_experts > max_experts:
        import dataclasses

        m = dataclasses.replace(m, num_experts=max(max_experts, m.experts_per_token))
    hw = _resolve_hardware(hardware)
    eff = _efficiency(hw, efficiency)
    mod = _experts_module(m, seed)

    g = torch.Generator().manual_seed(seed + 1)
    rows = []
    for b in batches:
        times = []
        for _ in range(repeats):
            x = torch.randn(b, m.hidden_size, generator=g)
            idx = torch.stack([torch.randperm(m.num_experts, generator=g)[:m.experts_per_token] for _ in range(b)])
            w = torch.rand(b, m.experts_per_token, generator=g)
            t0 = time.perf_counter()
            with torch.no_grad():
                routed_experts_forward(mod, x, idx, w)
            times.append(time.perf_counter() - t0)
        measured = statistics.median(times)
        predicted = t_cpu_experts_s(m, b, hw.cpu, eff, "float32", 4, 4)
        rows.append({"batch": b, "distinct_experts": costs.expected_experts_read(m, b), "predicted_s": predicted,
                     "measured_s": measured, "error_pct": 100 * abs(predicted - measured) / measured})
    return {"model": m.name, "hardware": hw.name, "calibration": eff.source, "threads": torch.get_num_threads(),
            "num_experts": m.num_experts, "rows": rows, "mape_pct": statistics.fmean(r["error_pct"] for r in rows)}


def format_check(s: dict[str, Any]) -> str:
    """The rows and the MAPE of :func:`validate_cpu_experts`, as `flexplan validate --cpu-experts` prints them."""
    lines = [f"CPU routed experts of one MoE layer of {s['model']} ({s['num_experts']} experts held, float32, "
             f"{s['threads']} threads; {s['calibration']}):",
             f"  {'batch':>5}{'experts':>9}{'measured':>12}{'predicted':>12}{'error':>8}"]
    for r in s["rows"]:
        lines.append(f"  {r['batch']:>5}{r['distinct_experts']:>9.1f}{r['measured_s'] * 1e3:>10.3f}ms"
                     f"{r['predicted_s'] * 1e3:>10.3f}ms{r['error_pct']:>7.0f}%")
    lines.append(f"MAPE {s['mape_pct']:.0f}%")
    return "\n".join(lines)
