"""Run a HuggingFace decoder under a Plan, layer by layer: FlexInfer's Inference Executor.

Rooms: ``link`` (streams, events, pinned memory, the transfer log), ``placement`` (fit checks
before allocation, on ``flexplan.placement`` and ``flexplan.memory``, which the planner reads too), ``weights`` (one flat buffer per layer
and place; the streaming double buffers), ``kv_cache`` (a transformers Cache in preallocated
buffers, ``prefetch()``/``offload()``), ``step`` (what one forward step moves), ``runner`` (the
hooks that run each step under the plan), ``loading`` (safetensors straight into place),
``families`` (which modules are embedding / layers / head), ``cpu_backend`` (threads, IPEX),
``stats`` (measured vs predicted), ``plans`` (placements fixed by hand).
"""

# no re-exports: `flexplan.executor.plans` (torch-free) is imported by input checks and the CLI,
# which must not pay for torch; import the room you need (`flexplan.executor.runner.Executor`, ...)
