"""FlexInfer under load (issue 39 item 4): which of a placed model's two placements runs each
iteration, priced by the estimator ``plan()`` uses.

The planner chose the prefill placement for a prompt's many tokens per weight read (streaming the
layers pays there) and the decode placement for one token per request at the plan's batch. Under
load an iteration need look like neither: a short prompt's chunk beside a few decodes may cost less
under the decode placement (nothing streamed for a few rows), and a decode batch of dozens less
under the prefill placement (the streamed weights serve every row at the accelerator's speed where
the decode placement computes them on the CPU). So per iteration:

1. the base scheduler (FCFS) chooses the batch: which requests, which chunks, which KV pools;
2. the batch is priced under both placements: the plan's policy and M for that phase, the model's
   blocks, the factors of now (``estimator.iteration``: ``ragged_shape`` then ``iteration_time_s``),
   each price times a bounded per-placement scale that ``observe`` moves toward measured / predicted
   (the online correction, as ``NeoApexScheduler`` corrects per mode);
3. the iteration runs under the cheaper (the engine's rule, ``placed.phase_of``, on a tie).

Switching placements between iterations moves no weights: the executor holds each phase's resident
layers where the plan put them (its memory check covers both phases) and the engine keeps the KV.
Prices are memoised by (placement, phase, batch, tokens), the decodes' mean context rounded up to a
KV block, so a steady batch looks its prices up.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from flexplan.errors import FlexplanError
from flexplan.estimator.iteration import iteration_time_s, ragged_shape
from flexplan.plan_types import PHASES
from flexplan.serving.fcfs import FcfsScheduler
from flexplan.serving.scheduler import CORRECTION_RATE, SCALE_BOUNDS
from flexplan.serving.state import EngineState
from flexplan.serving.types import IterationPlan

CONTEXT_ROUND_TOKENS = 16  # decode contexts priced at this granularity (a KV block): prices repeat


class PlacementScheduler:
    """The base scheduler's batch, run under the placement the estimator prices lower (the module's
    docstring). ``price_s(placement, phase, batch, tokens)``: seconds of an iteration shaped as
    ``iteration_time_s`` takes it under the plan's ``placement`` ("prefill" or "decode"); a test
    passes its own numbers, :meth:`for_flexmodel` the estimator's."""

    def __init__(self, price_s, base=None):
        self._price_s = lru_cache(maxsize=8192)(price_s)
        self.base = base if base is not None else FcfsScheduler()
        self.scale = dict.fromkeys(PHASES, 1.0)
        self._last_plan: IterationPlan | None = None
        self._last_raw_s = 0.0

    @classmethod
    def for_flexmodel(cls, flexmodel, base=None) -> PlacementScheduler | None:
        """Priced as ``plan()`` prices ``flexmodel``'s plan; None where the machine has no hardware model."""
        inputs = flexmodel.estimator_inputs()
        return None if inputs is None else cls.for_plan(flexmodel.plan, *inputs, base=base)

    @classmethod
    def for_plan(cls, plan, spec, hw, eff, base=None) -> PlacementScheduler:
        """Each placement priced by ``iteration_time_s`` with ``plan``'s policy and M for it, its
        dtypes and blocks, on ``hw`` with factors ``eff``."""

        def price_s(placement: str, phase: str, batch: int, tokens: int) -> float:
            choice = plan.phases[placement]
            return iteration_time_s(spec, hw, eff, choice.policy, choice.gpu_layers, phase, batch, tokens,
                                    plan.dtype, plan.cpu_dtype, plan.weights)

        return cls(price_s, base)

    def price_s(self, placement: str, phase: str, batch: int, tokens: int) -> float:
        """The raw price (no correction); infinite where the estimator cannot price that placement."""
        if phase == "decode":
            tokens = -(-tokens // CONTEXT_ROUND_TOKENS) * CONTEXT_ROUND_TOKENS
        try:
            return float(self._price_s(placement, phase, int(batch), int(tokens)))
        except (FlexplanError, ValueError, ZeroDivisionError):
            return float("inf")

    def observe(self, plan: IterationPlan, seconds: float) -> None:
        """Move the plan's placement's scale toward measured / predicted (EMA, bounded by SCALE_BOUNDS)."""
        raw = self._last_raw_s if plan is self._last_plan else 0.0
        if plan.placement not in self.scale or raw <= 0 or raw == float("inf") or seconds <= 0:
            return
        s = (1 - CORRECTION_RATE) * self.scale[plan.placement] + CORRECTION_RATE * seconds / raw
        self.scale[plan.placement] = min(max(s, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])

    def schedule(self, state: EngineState) -> IterationPlan:
        plan = self.base.schedule(state)
        context = {r.request_id: r.context_tokens for r in state.running}
        chunks = [n for _, n in plan.prefill]
        contexts = [context[rid] + 1 for rid in plan.device_decodes + plan.host_decodes]
        if not (chunks or contexts):
            return plan
        phase, batch, tokens = ragged_shape(chunks, contexts)
        raw = {p: self.price_s(p, phase, batch, tokens) for p in PHASES}
        cost = {p: raw[p] * self.scale[p] for p in PHASES}
        best = min(PHASES, key=lambda p: (cost[p], p != phase))  # the engine's rule on a tie
        other = next(p for p in PHASES if p != best)
        why = (f"{plan.why}; {best} placement {cost[best] * 1e3:.3g} ms <= {other} {cost[other] * 1e3:.3g} ms "
               f"(estimator, {phase} of {batch} x {tokens})")
        self._last_plan = dataclasses.replace(plan, placement=best, predicted_s=cost[best], why=why)
        self._last_raw_s = raw[best]
        return self._last_plan
