"""Calibration's executor-layer rows: a decode step of toy Llama models run by flexplan's own
executor (``flexplan.load`` with plan cpu/cpu), so the estimator prices what the executor adds
around a bare layer (hooks, its KV cache, casts, the mask). Above ``api``: it drives the loader."""

from __future__ import annotations

import math
from dataclasses import replace
import statistics
from collections.abc import Callable

from flexplan.api import load
from flexplan.executor.plans import fixed_plan
from flexplan.measure.microbench import Sizes, _llama_config, _sig, dtype_bytes, layers, llc_bytes, time_call
from flexplan.workload.model import ModelSpec

SLOPES = 3  # executor_layers: slopes measured, their median kept


def executor_layers(sizes: Sizes, dtype: str, tick: Callable[[], None] | None = None) -> list[dict]:
    """Seconds per decoder layer of a decode step run by flexplan's executor itself (plan cpu/cpu
    in ``dtype``, batch 1, after a ``layer_kv_len``-token prompt), from toy Llamas of the first of
    ``sizes.layer_widths`` (and the widest, where ``sizes.executor_widths`` is 2) at two depths: the
    slope is one layer's cost there with everything the executor adds to the bare layer that
    ``layers`` times (its hooks, its KV cache, casts, the mask); the head, the embedding and the
    generate loop cancel; ``layer_time_s``: the bare layer of that width (``layers`` at batch 1)
    timed right after. One row per dtype and width; none where the slope comes out non-positive
    (noise swamping tiny layers on a busy host: such a row failed the whole calibration's row checks)."""
    rows = []
    for width in executor_widths(sizes):
        rows += _executor_layer(sizes, dtype, width, tick)
    return rows


def _generate(lm, ids, n: int) -> Callable[[], object]:
    """A greedy generation of exactly ``n`` tokens after ``ids`` by ``lm``: the end-of-sequence token
    one no logit names, so the loop a plain greedy request runs is timed (flexplan's own at batch 1,
    :mod:`flexplan.greedy_decode`), not one with min_new_tokens' processor in it."""
    import torch

    never = int(lm.config.vocab_size)
    return lambda: lm.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, pad_token_id=0, eos_token_id=never)


def _decode_step_s(lm, ids, steps: int, repeats: int, long_budget_s: float, short_budget_s: float) -> float:
    """One decode step of ``lm`` after ``ids``: ``steps`` + 1 tokens less one token, over ``steps``
    (the prompt and the first token taken out)."""
    return (time_call(_generate(lm, ids, steps + 1), repeats, long_budget_s)["time_s"]
            - time_call(_generate(lm, ids, 1), repeats, short_budget_s)["time_s"]) / steps


def executor_widths(sizes: Sizes) -> list[tuple[int, int, int, int, int]]:
    """The layer widths :func:`executor_layers` times: the first, and the widest where
    ``sizes.executor_widths`` is 2."""
    return list(dict.fromkeys(sizes.layer_widths[:1] + (sizes.layer_widths[-1:] if sizes.executor_widths > 1 else ())))


def _executor_layer(sizes: Sizes, dtype: str, width: tuple[int, int, int, int, int],
                    tick: Callable[[], None] | None, batch: int = 1) -> list[dict]:
    """:func:`executor_layers` at one width, at decode ``batch`` (calibration: 1; other batches
    for diagnostics)."""
    import torch
    from transformers import LlamaForCausalLM


    hidden, inter, heads, kv_heads, head_dim = width
    # both depths' weights more than twice the last-level cache, as a real model's layers and the
    # bare layers' cycled copies are (a model that fits the cache gives a slope that is not a real
    # layer's)
    spec = ModelSpec.from_config(_llama_config(hidden, inter, heads, kv_heads, head_dim))
    low = min(32, max(2, math.ceil(2 * llc_bytes() / (spec.params_per_layer * dtype_bytes(dtype)))))
    depths, steps = (low, low + 12), 16
    repeats = max(3, min(5, sizes.repeats))
    ids = torch.ones(batch, sizes.layer_kv_len, dtype=torch.long)
    lms = {}
    for depth in depths:
        model = LlamaForCausalLM(_llama_config(hidden, inter, heads, kv_heads, head_dim, layers=depth)).eval()
        lms[depth] = load(model, plan=fixed_plan(model.config, "cpu", "cpu", cpu_dtype=dtype, input_len=ids.shape[1],
                                                 output_len=steps + 1, batch_size=batch),
                          accelerator=None, online_correction=False)

    def step_s(lm) -> float:
        return _decode_step_s(lm, ids, steps, repeats, 2 * sizes.budget_s, sizes.budget_s)

    # the median of SLOPES slopes: one slope is a difference of differences, noisy enough alone to
    # price every decode step several percent off; a busy host can swamp the difference (tiny
    # layers): a non-positive slope is measured again, then given up.
    # Each slope is paired with the bare layer timed right after it, and the extra is the median of the
    # pairs' differences: at a wide layer both are memory-bound, and timed apart a memory-state flip
    # between them would land in the extra
    alone = replace(sizes, layer_widths=(width,), layer_shapes=((batch, 1),), layer_long_kv_len=None,
                    prefill_only_widths=())
    slopes, bare = [], []
    for _ in range(SLOPES + 2):
        per_layer = (step_s(lms[depths[1]]) - step_s(lms[depths[0]])) / (depths[1] - depths[0])
        if per_layer > 0:
            slopes.append(per_layer)
            bare.append(layers(alone, dtype)[0]["time_s"])  # the layer alone, right after
        if len(slopes) == SLOPES:
            break
    del lms
    for _ in depths if tick else ():
        tick()
    if not slopes:  # no row: the executor is taken to add nothing
        return []
    return [{"dtype": dtype, "hidden": hidden, "intermediate": inter, "heads": heads, "kv_heads": kv_heads,
             "head_dim": head_dim, "batch": batch, "query_len": 1, "kv_len": sizes.layer_kv_len + 1 + steps // 2,
             "depths": list(depths), "steps": steps, "slopes": len(slopes),
             "time_s": _sig(float(statistics.median(slopes))), "layer_time_s": _sig(float(statistics.median(bare))),
             "extra_s": _sig(float(statistics.median(a - b for a, b in zip(slopes, bare))))}]


STACK_DEPTHS = (2, 26)  # toy depths of stack_overhead: the slope over 24 layers, the intercept near zero
STACK_BATCHES = (1, 8)  # decode batches of stack_overhead: validate's smallest and largest
# its toy layers: hidden, intermediate, heads, kv heads, head dim; every projection's rows a multiple of
# the native block (cpu_linear: 64), which the stack needs; 160 KB of weights a layer, all of them within
# the last-level cache, read in a microsecond or two (a layer's reads are priced by the factors)
STACK_WIDTH = (64, 128, 4, 4, 16)


def stack_overhead(sizes: Sizes, dtype: str, tick: Callable[[], None] | None = None) -> list[dict]:
    """Seconds a decode step run by the executor's native stack (``executor.cpu_decode.FusedStack``:
    every layer in one native call) spends beyond its layers' arithmetic and reads: toy Llamas of
    small layers (:data:`STACK_WIDTH`) at two depths, plan cpu/cpu in
    ``dtype``, each decode batch of :data:`STACK_BATCHES`. ``layer_s``: the slope, one layer's fixed
    costs in the stack; ``step_s``: the intercept, the step without layers (generate's loop at a
    128-token vocabulary, the executor's hooks, the stack's own Python). ``native_stack``: whether
    the stack ran those steps (False: a dtype or machine it does not run on; the estimator then
    prices the layer calls). A slope or intercept that comes out non-positive is measured again, then
    given up (no row for that batch)."""
    import torch
    from transformers import LlamaForCausalLM

    steps, repeats = 16, max(3, min(5, sizes.repeats))
    lms = {}
    for depth in STACK_DEPTHS:
        model = LlamaForCausalLM(_llama_config(*STACK_WIDTH, layers=depth)).eval()
        lms[depth] = load(model, plan=fixed_plan(model.config, "cpu", "cpu", cpu_dtype=dtype, input_len=16,
                                                 output_len=steps + 1, batch_size=max(STACK_BATCHES)),
                          accelerator=None, online_correction=False)
    rows = []
    for batch in STACK_BATCHES:
        ids = torch.ones(batch, 16, dtype=torch.long)

        _generate(lms[STACK_DEPTHS[-1]], ids, 3)()
        native = lms[STACK_DEPTHS[-1]].last_stats.native_stack_steps > 0
        for _ in range(3):
            shallow, deep = (_decode_step_s(lms[d], ids, steps, repeats, sizes.budget_s, sizes.budget_s)
                             for d in STACK_DEPTHS)
            layer_s = (deep - shallow) / (STACK_DEPTHS[1] - STACK_DEPTHS[0])
            base_s = shallow - STACK_DEPTHS[0] * layer_s
            if layer_s > 0 and base_s > 0:
                rows.append({"dtype": dtype, "batch": batch, "depths": list(STACK_DEPTHS), "steps": steps,
                             "layer_s": _sig(layer_s), "step_s": _sig(base_s),
                             "native_stack": bool(native), "hidden_size": STACK_WIDTH[0], "vocab": 128})
                break
        if tick:
            tick()
    return rows
