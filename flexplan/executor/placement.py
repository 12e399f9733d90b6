"""The executor's questions about a placement, and its fit check before any allocation.

What runs where is :class:`flexplan.placement.Placement` (built from a Plan by each phase's
policy rule, FlexInfer 5.3 applied); how many bytes that takes is :func:`flexplan.memory.footprint`,
the same function the planner uses. Here: refusing a placement that does not fit, or that needs an
accelerator that is not there, with a message that says what would work.
"""

from __future__ import annotations

from flexplan.errors import DeviceUnavailableError, DoesNotFitError
from flexplan.memory import MemoryNeed
from flexplan.placement import ACCELERATOR, CPU, HOST, MODES, PHASES, PINNED, RESIDENT, STREAMED, Placement

__all__ = ["ACCELERATOR", "CPU", "HOST", "MODES", "PINNED", "RESIDENT", "STREAMED", "MemoryNeed", "Placement",
           "check_fits", "require_accelerator"]
GiB = 1 << 30


def require_accelerator(placement: Placement, has_accelerator: bool, cuda_built: bool) -> None:
    """A plan that computes anything on an accelerator needs one."""
    if placement.uses_accelerator and not has_accelerator:
        need = ", ".join(f"{ph} {placement.policies.get(ph, '?')}" for ph in PHASES
                         if placement.phases[ph].uses_accelerator)
        why = "torch was built without CUDA" if not cuda_built else "no CUDA device is visible"
        raise DeviceUnavailableError(
            f"the plan uses an accelerator ({need}) but {why}; use plan='auto' (plans for what exists), "
            "the 'cpu' policy for both phases, or accelerator='cpu' to run every path on the CPU stand-in")


def _gib(x: float) -> str:
    return f"{x / GiB:.3f} GiB" if x >= GiB / 100 else f"{x / (1 << 20):.2f} MiB"


def _parts(d) -> str:
    return " + ".join(f"{k} {_gib(v)}" for k, v in d.items() if v)


def check_fits(need: MemoryNeed, placement: Placement, accelerator_budget_bytes: int | None,
               pinned_budget_bytes: int | None, shape: str) -> None:
    """Refuse (before any allocation) a placement that exceeds the accelerator memory or the
    pinned-memory budget; the message gives the numbers and what would fit instead."""
    what = f"plan ({placement.describe()}) for {shape}"
    if accelerator_budget_bytes is not None and need.accelerator_bytes > accelerator_budget_bytes:
        raise DoesNotFitError(
            f"{what} needs {_gib(need.accelerator_bytes)} of accelerator memory ({_parts(need.accelerator)}) "
            f"but gpu_memory_bytes is {_gib(accelerator_budget_bytes)}; use fewer gpu_layers, a streaming "
            "policy (gpu-offload), a smaller batch or shorter sequences, or plan='auto'")
    if pinned_budget_bytes is not None and need.pinned_bytes > pinned_budget_bytes:
        raise DoesNotFitError(
            f"{what} needs {_gib(need.pinned_bytes)} of pinned host memory ({_parts(need.pinned)}) but "
            f"pinned_memory_budget_bytes is {_gib(pinned_budget_bytes)}; raise the budget, keep more layers "
            "resident (gpu_layers) or compute them on the CPU (splitgen, cpu), or use a smaller batch")
