"""One engine iteration under a fixed placement, priced by the estimator plan() uses.

A serving scheduler asks this every iteration (which requests to batch, on which device): no
search over policies or M, only the phase's terms (``phase_costs``) and the placed policy's
equation (``Policy.estimate``) for that batch.
"""

from __future__ import annotations

import numpy as np

from flexplan.estimator.efficiency import Efficiency
from flexplan.estimator.phase_costs import phase_costs
from flexplan.estimator.policies import REGISTRY
from flexplan.estimator.terms import Shape
from flexplan.errors import InvalidInputError
from flexplan.hardware.spec import Hardware
from flexplan.workload.model import ModelSpec


def iteration_time_s(spec: ModelSpec, hw: Hardware, eff: Efficiency, policy: str, gpu_layers: int, phase: str,
                     batch: int, tokens: int, dtype: str = "bfloat16", cpu_dtype: str = "float32",
                     weights: tuple = ()) -> float:
    """Predicted seconds of one iteration of ``policy`` with ``gpu_layers`` layers on the GPU: a
    prefill of ``batch`` prompts of ``tokens`` tokens each, or a decode step of ``batch``
    sequences attending ``tokens`` keys each (FlexInfer's TTFT / one TPOT step). ``weights``: the
    blocks the model holds (``Plan.weights``; (): its dtypes)."""
    if phase not in ("prefill", "decode"):
        raise InvalidInputError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    if policy not in REGISTRY:
        raise InvalidInputError(f"unknown policy {policy!r}; use one of {', '.join(REGISTRY)}")
    if batch < 1 or tokens < 1:
        raise InvalidInputError(f"batch and tokens must be positive, got batch={batch}, tokens={tokens}")
    # decode step k attends input_len + k keys (Shape.decode_context_lens): one step at `tokens` keys; the
    # engine's iterations run each layer's native calls over paged KV, never the executor's native stack
    shape = (Shape(spec, batch, tokens, 1, dtype, cpu_dtype, weights, native_stack=False) if phase == "prefill"
             else Shape(spec, batch, max(tokens - 1, 1), 2, dtype, cpu_dtype, weights, native_stack=False))
    pc = phase_costs(shape, hw, eff, phase)
    return float(REGISTRY[policy].estimate(pc, spec.num_layers, np.array([int(gpu_layers)])).time_s[0])


def ragged_shape(chunk_tokens, decode_context_tokens) -> tuple[str, int, int]:
    """(phase, batch, tokens) that :func:`iteration_time_s` prices one serving iteration of prefill
    chunks of ``chunk_tokens`` tokens and decodes attending ``decode_context_tokens`` keys each as.
    Decodes alone: a decode step at their mean context. With any chunk: a prefill of all its rows
    spread evenly over its segments, since the weights are read once for every row of an
    iteration; the decodes' attention is then priced as causal pairs within that span (where a
    placement streams or computes weights, the rows' linears, not the decodes' attention, set the time)."""
    chunks = [int(n) for n in chunk_tokens]
    contexts = [int(c) for c in decode_context_tokens]
    if any(n < 1 for n in chunks) or any(c < 1 for c in contexts) or not (chunks or contexts):
        raise InvalidInputError(f"an iteration needs positive token counts, got chunks {chunks} and contexts {contexts}")
    if not chunks:
        return "decode", len(contexts), -(-sum(contexts) // len(contexts))
    segments = len(chunks) + len(contexts)
    return "prefill", segments, -(-(sum(chunks) + len(contexts)) // segments)
