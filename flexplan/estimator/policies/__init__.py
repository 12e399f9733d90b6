"""The policy registry: the only place a policy is named. A new policy is one module (a
:class:`Policy` subclass: placement rule, M options, estimator formula) plus one line below, or a
call to :func:`register` at run time."""

from __future__ import annotations

from flexplan.estimator.policies.base import PhaseTime, Policy
from flexplan.estimator.policies.cpu import CPUPolicy
from flexplan.estimator.policies.cpu_attention import CPUAttentionPartialPolicy, CPUAttentionPolicy
from flexplan.estimator.policies.gpu import GPUPolicy
from flexplan.estimator.policies.gpu_offload import GPUOffloadPartialPolicy, GPUOffloadPolicy
from flexplan.estimator.policies.moe_cpu_experts import CPUExpertsPolicy
from flexplan.estimator.policies.split_points import SplitPointsPolicy
from flexplan.estimator.policies.splitgen import SplitGenPolicy

REGISTRY: dict[str, Policy] = {}


def register(name: str, policy: Policy) -> Policy:
    """Make ``policy`` known as ``name`` to the planner, ``explain`` and the executor."""
    if name in REGISTRY:
        raise ValueError(f"policy {name!r} is already registered")
    policy.name = name
    REGISTRY[name] = policy
    return policy


def unregister(name: str) -> None:
    REGISTRY.pop(name, None)


register("cpu", CPUPolicy())
register("gpu", GPUPolicy())
register("gpu-offload", GPUOffloadPolicy())
register("gpu-offload-partial", GPUOffloadPartialPolicy())
register("splitgen", SplitGenPolicy())
register("cpu-experts", CPUExpertsPolicy())
register("cpu-attention", CPUAttentionPolicy())
register("cpu-attention-partial", CPUAttentionPartialPolicy())
register("split-points", SplitPointsPolicy())

__all__ = ["REGISTRY", "PhaseTime", "Policy", "register", "unregister"]
