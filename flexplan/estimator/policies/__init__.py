"""The policy registry: the only place a policy is named. A new policy is one module (a
:class:`Policy` subclass: placement rule, M options, estimator formula) plus one line below, or a
call to :func:`register` at run time."""

from __future__ import annotations

from typing import Iterator, Sequence

from flexplan.errors import InvalidInputError
from flexplan.estimator.policies.base import PhaseTime, Policy
from flexplan.estimator.policies.cpu import CPUPolicy
from flexplan.estimator.policies.cpu_attention import CPUAttentionPartialPolicy, CPUAttentionPolicy
from flexplan.estimator.policies.gpu import GPUPolicy
from flexplan.estimator.policies.gpu_offload import GPUOffloadPartialPolicy, GPUOffloadPolicy
from flexplan.estimator.policies.moe_cpu_experts import CPUExpertsPolicy
from flexplan.estimator.policies.split_points import SplitPointsPolicy
from flexplan.estimator.policies.splitgen import SplitGenPolicy
from flexplan.placement import SPLIT_MODES, Placement

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

def _registry():
    return REGISTRY


class _PolicyNames(Sequence):
    """The registered policy names, read live from the registry (a policy registered at run time
    appears here at once)."""

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_registry()))

    def __len__(self) -> int:
        return len(_registry())

    def __getitem__(self, i):
        return tuple(_registry())[i]

    def __contains__(self, name) -> bool:
        return name in _registry()

    def __repr__(self) -> str:
        return repr(tuple(self))


POLICIES: Sequence[str] = _PolicyNames()


def placement_of(plan, num_layers: int) -> Placement:
    """Both phases of ``plan`` (a :class:`~flexplan.plan_types.Plan`), checked against a model of
    ``num_layers`` decoder layers: the placement the plan carries, or (a plan read back from JSON)
    each phase's from its policy's placement rule."""

    if plan.num_layers != num_layers:
        raise InvalidInputError(
            f"the plan is for a {plan.num_layers}-layer model but this model has {num_layers} decoder layers; "
            f"plan for this model (flexplan.plan(model, ...)) or pass plan='auto'")
    if plan.placement is not None:
        return plan.placement
    phases = {}
    for ph, c in plan.phases.items():
        if c.policy not in REGISTRY:
            raise InvalidInputError(f"unknown policy {c.policy!r}; use one of {', '.join(REGISTRY)}")
        if not 0 <= c.gpu_layers <= num_layers:
            raise InvalidInputError(
                f"gpu_layers must be between 0 and {num_layers} for a {num_layers}-layer model, got {c.gpu_layers}")
        phases[ph] = REGISTRY[c.policy].placement(num_layers, int(c.gpu_layers), ph)
        if phases[ph].num_layers != num_layers:
            raise InvalidInputError(f"policy {c.policy} placed {phases[ph].num_layers} of {num_layers} layers")
        split = [m.name for m, n in phases[ph].runs if n and not m.runnable and m not in SPLIT_MODES]
        if split:
            raise InvalidInputError(f"policy {c.policy} places operator groups of a layer apart ({split[0]}); "
                                    "the memory model and the executor place whole layers, or streamed layers "
                                    "with their attention on the CPU")
    return Placement.of(phases, plan.dtype, plan.cpu_dtype, {ph: c.policy for ph, c in plan.phases.items()})


__all__ = ["POLICIES", "REGISTRY", "PhaseTime", "Policy", "placement_of", "register", "unregister"]
