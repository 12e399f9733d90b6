"""Plans the caller fixed by hand: a :class:`Plan` with the policies and M given, no estimate.

The executor never guesses. When a caller forces the placement (tests, ``{"prefill": ...}``
overrides while the planner cannot estimate), this builds the Plan that says exactly that,
with NaN predictions and a reason that says so.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from flexplan.errors import InvalidInputError
from flexplan.estimator.policies import REGISTRY, placement_of
from flexplan.hardware.spec import canonical_dtype
from flexplan.plan_types import PhaseChoice, Plan
from flexplan.workload.model import ModelSpec

_OVERRIDE_KEYS = {"prefill", "decode", "gpu_layers", "prefill_gpu_layers", "decode_gpu_layers",
                  "batch_size", "input_len", "output_len", "dtype", "cpu_dtype"}


def gpu_layers_for(policy: str, num_layers: int, gpu_layers: int | None) -> int:
    """M a forced ``policy`` runs with (the policy's rule: its only option, or the caller's M)."""

    if policy not in REGISTRY:
        raise InvalidInputError(f"unknown policy {policy!r}; use one of {', '.join(REGISTRY)}")
    return REGISTRY[policy].gpu_layers_for(num_layers, gpu_layers)


def _split(policy: str, spec: ModelSpec):
    """The policy's split for a plan fixed by hand (a split-points policy: its documented default)."""

    return REGISTRY[policy].fixed_split(spec)


def check_overrides(overrides: dict[str, Any]) -> None:
    unknown = set(overrides) - _OVERRIDE_KEYS
    if unknown:
        raise InvalidInputError(f"unknown plan override(s) {sorted(unknown)}; use {sorted(_OVERRIDE_KEYS)}")


def fixed_plan(model: Any, prefill: str, decode: str, gpu_layers: int | None = None, *,
               prefill_gpu_layers: int | None = None, decode_gpu_layers: int | None = None,
               dtype: str = "float32", cpu_dtype: str = "float32", batch_size: int = 1, input_len: int = 128,
               output_len: int = 32, gpu_memory_bytes: int = 0, cpu_memory_bytes: int = 0,
               hardware: str = "unspecified") -> Plan:
    """A Plan that runs ``prefill`` then ``decode`` with the given M, no predictions."""
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_config(getattr(model, "config", model))
    n = spec.num_layers
    m_p = gpu_layers_for(prefill, n, prefill_gpu_layers if prefill_gpu_layers is not None else gpu_layers)
    m_d = gpu_layers_for(decode, n, decode_gpu_layers if decode_gpu_layers is not None else gpu_layers)
    nan = math.nan
    plan = Plan(
        model=spec.name, hardware=hardware, batch_size=int(batch_size), input_len=int(input_len),
        output_len=int(output_len), dtype=canonical_dtype(dtype), cpu_dtype=canonical_dtype(cpu_dtype), num_layers=n,
        gpu_memory_bytes=int(gpu_memory_bytes), cpu_memory_bytes=int(cpu_memory_bytes),
        prefill=PhaseChoice(prefill, m_p, nan, 0, 0, nan, _split(prefill, spec)),
        decode=PhaseChoice(decode, m_d, nan, 0, 0, nan, _split(decode, spec)),
        ttft_s=nan, tpot_s=nan, load_s=nan, switch_s=nan, e2e_s=nan,
        reason="placement fixed by the caller; no estimate", calibration="none")
    return replace(plan, placement=placement_of(plan, n))
