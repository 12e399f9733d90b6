"""The serving engine over a model placed by a flexplan plan (FlexInfer under load, issue 39 item 4).

The executor's hooks (:mod:`flexplan.executor.runner`) place and move each layer's weights per
phase exactly as in ``FlexModel.generate()`` (resident, streamed through the double-buffer slots,
on the CPU, SplitGen's split, experts on the CPU); the KV cache stays the engine's paged pools.
The executor does not manage KV for these forwards ("KV managed by the caller"): the engine's
:class:`~flexplan.serving.model_runner.PagedCache` is not a ``FlexCache``, so the executor's step
has no cache (``Step.cache=None``: no KV moves, no fused native decode stack, which needs it), its
``generic_kv_to`` finds no layers to move, and the engine's attention function (registered over
cpu_attention's routing on each module's config) receives q/k/v on the layer's compute device
and reads and writes the pools wherever they live, copying across as it does for any model.

Which placement an iteration runs under: the one its plan names (``IterationPlan.placement``; the
default scheduler, :mod:`placed_scheduler`, names the one the estimator prices lower), else the
phase rule (:func:`phase_of`): an iteration with any multi-token segment (a prefill chunk) runs
under the PREFILL placement, one of single-token segments only (decodes) under the DECODE one:
the plan's prefill placement is the one chosen for many tokens per weight read (streaming pays
there), the decode placement for one token per request.
"""

from __future__ import annotations

import threading

import torch

from flexplan import api
from flexplan.errors import UnsupportedModelError
from flexplan.executor.runner import DECODE, PREFILL
from flexplan.serving.kv_blocks import activation_reserve_bytes, blocks_in_bytes
from flexplan.serving.placed_scheduler import PlacementScheduler
from flexplan.serving.ragged_batch import RaggedBatch
from flexplan.smollm import default_model_dir


def load(path, plan, accelerator, gpu_memory_bytes, dtype: torch.dtype, cpu_linear_kernel, weights: str | None = None):
    """``flexplan.load`` of a checkpoint (None: the embedded SmolLM2) or a .gguf file under ``plan``."""
    path = str(path) if path is not None else str(default_model_dir(verbose=False))
    return api.load(path, plan=plan, accelerator=accelerator, gpu_memory_bytes=gpu_memory_bytes,
                    dtype=str(dtype).removeprefix("torch."), cpu_linear_kernel=cpu_linear_kernel,
                    weights=None if weights == "auto" else weights)


def device_pool_blocks(flexmodel, device_memory_bytes: int, block_size_tokens: int, token_budget: int,
                       max_running: int, kv_dtype: torch.dtype | None = None) -> int:
    """The device KV pool within ``device_memory_bytes``: less what the plan holds on the accelerator
    in its larger phase (resident layers, weight slots and its own KV at the planned shape, as the
    memory model counts them) and an iteration's activations; blocks of ``kv_dtype`` (default: the
    model's dtype)."""
    plan, config, dtype = flexmodel.plan, flexmodel.model.config, next(flexmodel.model.parameters()).dtype
    held = max(plan.prefill.gpu_memory_bytes, plan.decode.gpu_memory_bytes)
    free = device_memory_bytes - held - activation_reserve_bytes(config, token_budget, max_running, dtype)
    return blocks_in_bytes(max(0, free), config, kv_dtype or dtype, block_size_tokens)


def is_flexmodel(model) -> bool:
    """What the engine reads of a FlexModel: a ``.model`` run under an ``.executor``."""
    return hasattr(model, "executor") and hasattr(model, "model")


def accelerator(flexmodel) -> torch.device:
    """Where the engine's device pool lives: the plan's accelerator (the CPU standing in for it)."""
    return flexmodel.executor.link.device


def phase_of(batch: RaggedBatch) -> str:
    """The executor phase an iteration runs under (the rule above)."""
    return DECODE if all(g.decode for g in batch.groups) else PREFILL  # a group: one-token segments or not


def default_scheduler(flexmodel) -> PlacementScheduler | None:
    """FCFS's batches, each under the placement the estimator prices lower; None (the engine's
    FCFS under :func:`phase_of`) where the machine has no hardware model to price with."""
    return PlacementScheduler.for_flexmodel(flexmodel)


def unwrap(flexmodel, asymmetric_pipelining: bool | None):
    """The transformers model under the FlexModel's hooks, and its tokenizer. The executor keeps
    one step's state at a time, so sub-batches may not run on threads at once over it."""
    if asymmetric_pipelining:
        raise UnsupportedModelError(
            "asymmetric pipelining runs sub-batches on threads at once; a FlexModel's executor places one "
            "forward's layers at a time: leave asymmetric_pipelining out (sub-batches then run in turn)")
    return flexmodel.model, getattr(flexmodel, "tokenizer", None)


def attach(engine, flexmodel) -> None:
    """Make the engine's forwards name their phase to the executor, one forward at a time: the
    executor keeps one step's state, so APEX's asynchronous overlap (a forward on a thread beside
    the next) runs its two forwards in turn, correct but without the overlap."""
    engine.flexmodel = flexmodel
    runner = engine.runner
    runner.phase_rule = phase_of
    lock, forward = threading.Lock(), runner.forward

    def one_at_a_time(segments, phase=None):
        with lock:
            return forward(segments, phase)

    runner.forward = one_at_a_time


def detach(engine) -> None:
    """The caller's placement as generate() leaves it: idle streamed layers back at their home."""
    fm = getattr(engine, "flexmodel", None)
    if fm is not None:
        fm.executor.end_run()
