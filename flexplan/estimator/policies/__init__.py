"""Policy registry: a new policy is one module plus one line here."""

from flexplan.estimator.policies.base import PhaseTime, Policy
from flexplan.estimator.policies.cpu import CPUPolicy
from flexplan.estimator.policies.gpu import GPUPolicy
from flexplan.estimator.policies.gpu_offload import GPUOffloadPartialPolicy, GPUOffloadPolicy
from flexplan.estimator.policies.splitgen import SplitGenPolicy

REGISTRY: dict[str, Policy] = {
    p.name: p for p in (CPUPolicy(), GPUPolicy(), GPUOffloadPolicy(), GPUOffloadPartialPolicy(), SplitGenPolicy())
}

__all__ = ["REGISTRY", "PhaseTime", "Policy"]
