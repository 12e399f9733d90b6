"""Run a HuggingFace decoder under a Plan, layer by layer: FlexInfer's Inference Executor.

Rooms: ``link`` (streams, events, pinned memory, the transfer log), ``placement`` (fit checks
before allocation, on ``flexplan.placement`` and ``flexplan.memory``, which the planner reads too), ``weights`` (one flat buffer per layer
and place; the streaming double buffers), ``kv_cache`` (a transformers Cache in preallocated
buffers, ``prefetch()``/``offload()``), ``step`` (what one forward step moves), ``runner`` (the
hooks that run each step under the plan), ``loading`` (safetensors straight into place),
``families`` (which modules are embedding / layers / head), ``cpu_backend`` (threads, IPEX),
``stats`` (measured vs predicted), ``plans`` (placements fixed by hand).
"""

from flexplan.executor.link import Link
from flexplan.executor.loading import load_streaming
from flexplan.executor.placement import Placement
from flexplan.executor.plans import fixed_plan
from flexplan.executor.runner import Executor

__all__ = ["Executor", "Link", "Placement", "fixed_plan", "load_streaming"]


def __getattr__(name):
    if name == "Executor":
        return Executor
    if name == "load_streaming":
        return load_streaming
    if name == "fixed_plan":
        return fixed_plan
    raise AttributeError(f"module 'flexplan.executor' has no attribute {name!r}")
