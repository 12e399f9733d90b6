"""NEO's load-aware scheduler (section 3.2) with APEX's choice between asymmetric pipelining and
asynchronous overlap (section 3.2 Inequalities 5-6, section 3.4 Algorithm 1).

Per iteration:

1. *Swap in under hysteresis* (NEO step 2, "swap in requests if there is ample space on GPU"): a
   host-KV decode moves back to the device pool only where, after it and every device request's
   next reservation, at least ``swap_in_headroom`` of the device pool (and the first waiting prompt)
   stays free, and it has not moved in the last ``min_dwell_iterations``. Swap-out happens only
   where the device pool cannot hold its reservations (FCFS's rule 1), so the free band between 0
   and the headroom keeps a request from flip-flopping; the dwell bounds what is left.
2. *Admission, reservations, swap-out, preemption* as :class:`FcfsScheduler` (NEO steps 2-3: decodes
   first, prefills kept on the device where it holds them, else in the host pool; preemption only
   where the host pool cannot take the request either).
3. *APEX's Algorithm 1*: no host decodes -> GPU-only; decode-only -> Inequality 6; mixed -> the
   modified Inequality 5 (T_overlap_with_prefill). Holds -> asymmetric pipelining, else async overlap.
4. *NEO's balance* (step 4, "Balancing and hiding CPU"): host decodes join sub-batch 1 while the CPU's
   attention hides under the GPU: T_ca1 <= T_l0 (asymmetric; NEO's second inequation, T_ca0 <=
   T_l1 + T_ga0, is void: the engine puts no CPU decodes in sub-batch 0) or T_ca1 <= the whole GPU
   iteration (async overlap: APEX 3.3 gives the CPU the whole cycle). A request that does not fit
   waits ("leave it for the next iteration"), except the one waiting longest, which always runs.
5. *NEO's greedy choice* (step 6): that schedule against GPU-only (the host decodes wait), the one
   with more requests per predicted second wins; where GPU-only beats Algorithm 1's mode, the other
   offload mode is tried before the host decodes are made to wait (a decode that waits costs its
   request a whole iteration); a host decode that waited ``max_wait_iterations`` forces Algorithm 1's
   mode so nothing starves.

Prices come from :class:`IterationCost` (the estimator's terms), times a bounded scale per mode that
``observe`` corrects from measured iteration times. No accelerator (``hw.gpu`` None) or no device
pool: FCFS's plan, ``cpu-only``.
"""

from __future__ import annotations

import dataclasses
import math

from flexplan.errors import InvalidInputError
from flexplan.serving.fcfs import FcfsScheduler
from flexplan.serving.iteration_cost import IterationCost
from flexplan.serving.kv_blocks import DEVICE, HOST
from flexplan.serving.state import EngineState, RequestState
from flexplan.serving.types import (
    MODE_ASYMMETRIC,
    MODE_ASYNC_OVERLAP,
    MODE_DEVICE_ONLY,
    IterationPlan,
)

SCALE_BOUNDS = (0.25, 4.0)  # the online correction's range: one odd iteration cannot swing the choice far
CORRECTION_RATE = 0.2  # exponential moving average weight of each measured/predicted ratio


def inequality_5_holds(n_g: float, n_c: float, t_glinear_s: float, t_gatt_s: float,
                       t_overlap_s: float | None = None) -> bool:
    """APEX Inequality 5: asymmetric pipelining's decode throughput beats GPU-only,
    (N_G T_gatt + N_C T_overlap) / (2 T_glinear + T_gatt) > N_G T_gatt / (T_glinear + T_gatt), with
    T_overlap = 2 T_glinear + T_gatt (Eq. 2) for a decode-only batch, or Algorithm 1's
    T_overlap_with_prefill for a mixed one. ``n_g``, ``n_c``: attention rates in tokens per second."""
    t_overlap_s = 2 * t_glinear_s + t_gatt_s if t_overlap_s is None else t_overlap_s
    if t_gatt_s <= 0:
        return n_c > 0  # the GPU attends nothing: any CPU attention is a gain
    return (n_g * t_gatt_s + n_c * t_overlap_s) / (2 * t_glinear_s + t_gatt_s) > n_g * t_gatt_s / (t_glinear_s + t_gatt_s)


def inequality_6_holds(n_g_over_n_c: float, t_glinear_s: float, t_gatt_s: float) -> bool:
    """APEX Inequality 6 (Inequality 5 rearranged for a decode-only batch):
    N_G / N_C < 2 T_glinear / T_gatt + 3 + T_gatt / T_glinear."""
    if t_gatt_s <= 0 or t_glinear_s <= 0:
        return True  # one side costs nothing on the GPU: offloading attention cannot lose
    return n_g_over_n_c < 2 * t_glinear_s / t_gatt_s + 3 + t_gatt_s / t_glinear_s


def algorithm_1(n_g: float, n_c: float, t_glinear_s: float, t_gatt_s: float, *, has_cpu_decodes: bool,
                has_prefill: bool, t_glinear_pref_s: float = 0.0, t_gatt_pref_s: float = 0.0) -> tuple[str, str]:
    """APEX Algorithm 1's strategy: (mode, why). No CPU decodes -> GPU-only; decode-only ->
    Inequality 6; mixed -> Inequality 5 with T_overlap_with_prefill = T_glinear_pref + T_glinear +
    T_gatt_pref (section 3.4: the CPU has the prefill's longer window)."""
    if not has_cpu_decodes:
        return MODE_DEVICE_ONLY, "Algorithm 1: no CPU decodes"
    if not has_prefill:
        ratio = n_g / n_c if n_c > 0 else math.inf
        holds = inequality_6_holds(ratio, t_glinear_s, t_gatt_s)
        rhs = (2 * t_glinear_s / t_gatt_s + 3 + t_gatt_s / t_glinear_s) if t_gatt_s > 0 and t_glinear_s > 0 else math.inf
        why = f"Inequality 6: N_G/N_C {ratio:.2f} {'<' if holds else '>='} {rhs:.2f}"
    else:
        t_overlap = t_glinear_pref_s + t_glinear_s + t_gatt_pref_s
        holds = inequality_5_holds(n_g, n_c, t_glinear_s, t_gatt_s, t_overlap)
        why = f"Algorithm 1 mixed: Inequality 5 with T_overlap_with_prefill {t_overlap * 1e3:.3f} ms {'holds' if holds else 'fails'}"
    return (MODE_ASYMMETRIC if holds else MODE_ASYNC_OVERLAP), why


class NeoApexScheduler:
    """NEO's load-aware scheduler with APEX's Algorithm 1 (see the module's docstring).

    ``cost``: any object with IterationCost's terms (``num_layers``, ``t_l_s``, ``t_ga_s``,
    ``t_ca_s``, ``t_pa_s``, ``t_iteration_overhead_s``), for a test's hand-made model; else built
    from ``spec``, ``hw``, ``eff``."""

    def __init__(self, spec=None, hw=None, eff=None, *, cost=None, swap_in_headroom: float = 0.10,
                 min_dwell_iterations: int = 8, max_wait_iterations: int = 16):
        # a bad knob is refused at construction, saying what would work (not mid-serving)
        if not 0.0 <= swap_in_headroom < 1.0:
            raise InvalidInputError(f"swap_in_headroom={swap_in_headroom}: give a fraction of the device pool in "
                                    "[0, 1), e.g. 0.10")
        if min_dwell_iterations < 0 or max_wait_iterations < 1:
            raise InvalidInputError(f"min_dwell_iterations={min_dwell_iterations}, max_wait_iterations="
                                    f"{max_wait_iterations}: give dwell >= 0 and wait >= 1 iterations (e.g. 8 and 16)")
        if cost is None and hw is not None and hw.gpu is not None:
            if spec is None or eff is None:
                raise InvalidInputError(f"{hw.name}: an accelerator's costs need spec= (a ModelSpec) and eff= (e.g. "
                                        "DefaultEfficiency.for_hardware(hw)), or cost= (an IterationCost)")
            cost = IterationCost(spec, hw, eff)
        self.cost = cost  # None: no accelerator, FCFS's cpu-only plans
        self.fcfs = FcfsScheduler()
        self.swap_in_headroom = swap_in_headroom
        self.min_dwell_iterations = min_dwell_iterations
        self.max_wait_iterations = max_wait_iterations
        self.scale = {MODE_DEVICE_ONLY: 1.0, MODE_ASYMMETRIC: 1.0, MODE_ASYNC_OVERLAP: 1.0}
        self.iteration = 0
        self._last_moved: dict[str, int] = {}  # request -> iteration of its last swap
        self._last_decoded: dict[str, int] = {}  # host request -> iteration it last decoded
        self._last_plan: IterationPlan | None = None
        self._last_raw_s = 0.0

    # ---- the online correction ----
    def observe(self, plan: IterationPlan, seconds: float) -> None:
        """Move the plan's mode's scale toward measured / predicted (EMA, bounded by SCALE_BOUNDS)."""
        raw = self._last_raw_s if plan is self._last_plan else 0.0
        if plan.mode not in self.scale or raw <= 0 or seconds <= 0:
            return
        s = (1 - CORRECTION_RATE) * self.scale[plan.mode] + CORRECTION_RATE * seconds / raw
        self.scale[plan.mode] = min(max(s, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])

    # ---- prices of one iteration (whole model), NEO section 3.2's T ----
    def price_device_only_s(self, rows0: int, dev_ctx, chunks) -> float:
        """GPU-only: L (T_l(x) + T_ga + prefill attention) + T_prl + T_pol."""
        c = self.cost
        return (c.num_layers * (c.t_l_s(rows0) + c.t_ga_s(dev_ctx) + c.t_pa_s(chunks))
                + c.t_iteration_overhead_s(rows0))

    def price_asymmetric_s(self, rows0: int, dev_ctx, chunks, host_ctx) -> float:
        """NEO's T_tr = L (max{T_l0, T_ca1} + max{T_l1 + T_ga0, T_ca0}), T_ca0 = 0 (no CPU decodes in
        sub-batch 0), the prefill attention counted in T_ga0; plus the head over both sub-batches."""
        c = self.cost
        n1 = len(host_ctx)
        t_tr = max(c.t_l_s(rows0), c.t_ca_s(host_ctx)) + c.t_l_s(n1) + c.t_ga_s(dev_ctx) + c.t_pa_s(chunks)
        return c.num_layers * t_tr + c.t_iteration_overhead_s(rows0 + n1)

    def price_async_overlap_s(self, rows0: int, dev_ctx, chunks, host_ctx) -> float:
        """APEX 3.3: one unified linear pass over both sub-batches on the GPU, the CPU's attention over
        the whole cycle: max{L (T_l(x0 + x1) + T_ga0 + prefill attention), L T_ca1} + head."""
        c = self.cost
        n1 = len(host_ctx)
        gpu = c.num_layers * (c.t_l_s(rows0 + n1) + c.t_ga_s(dev_ctx) + c.t_pa_s(chunks))
        return max(gpu, c.num_layers * c.t_ca_s(host_ctx)) + c.t_iteration_overhead_s(rows0 + n1)

    # ---- the schedule ----
    def schedule(self, state: EngineState) -> IterationPlan:
        self.iteration += 1
        if self.cost is None or not state.total_blocks.get(DEVICE, 0):
            plan = self.fcfs.schedule(state)
            return dataclasses.replace(plan, why="no accelerator: first come, first served on the CPU")
        live = {r.request_id for r in state.running}
        if len(self._last_moved) + len(self._last_decoded) > 4 * len(live) + 64:  # forget finished requests
            self._last_moved = {k: v for k, v in self._last_moved.items() if k in live}
            self._last_decoded = {k: v for k, v in self._last_decoded.items() if k in live}
        state, swap_in = self._swap_in(state)
        base = self.fcfs.schedule(state)
        # FCFS moved out (or preempted) one this rule moved in: it never left the host, no swap either way
        asked, gone = set(swap_in), set(base.swap_out) | set(base.preempted)
        swap_in = [r for r in swap_in if r not in gone]
        swap_out = [r for r in base.swap_out if r not in asked]
        for rid in swap_in + swap_out:
            self._last_moved[rid] = self.iteration
        plan = self._choose(state, base)
        plan = dataclasses.replace(plan, swap_in=tuple(swap_in), swap_out=tuple(swap_out))
        for rid in plan.host_decodes + plan.device_decodes:  # a request swapped out later has not waited
            self._last_decoded[rid] = self.iteration
        self._last_plan = plan
        return plan

    def _swap_in(self, state: EngineState) -> tuple[EngineState, list[str]]:
        """Rule 1 of the module's docstring; the state as FCFS should see it after the swaps."""
        dev_total = state.total_blocks.get(DEVICE, 0)
        first_wait = min(state.waiting, key=lambda r: r.arrival, default=None)
        headroom = math.ceil(self.swap_in_headroom * dev_total)
        headroom += state.blocks_for(first_wait.prefill_left + 1) if first_wait is not None else 0
        reserve = sum(state.extra_blocks(r, 1 if r.decoding else r.prefill_left)
                      for r in state.running if r.pool == DEVICE)
        free_dev = state.free_blocks.get(DEVICE, 0) - reserve
        moved, running, free = [], [], dict(state.free_blocks)
        for r in sorted(state.running, key=lambda r: r.arrival):
            if (r.pool == HOST and r.decoding
                    and self.iteration - self._last_moved.get(r.request_id, -10**9) >= self.min_dwell_iterations):
                need = state.blocks_for(r.context_tokens) + state.extra_blocks(r, 1)
                if free_dev - need >= headroom:
                    free_dev -= need
                    free[DEVICE] -= state.blocks_for(r.context_tokens)
                    free[HOST] += r.releasable_blocks(state.block_size_tokens)
                    moved.append(r.request_id)
                    r = dataclasses.replace(r, pool=DEVICE)
            running.append(r)
        if not moved:
            return state, []
        return dataclasses.replace(state, running=tuple(running), free_blocks=free), moved

    def _choose(self, state: EngineState, base: IterationPlan) -> IterationPlan:
        """Rules 3-5 of the module's docstring on FCFS's batch."""
        req = {r.request_id: r for r in state.running + state.waiting}
        chunks = [(req[rid].context_tokens, n) for rid, n in base.prefill]
        rows0 = sum(n for _, n in base.prefill) + len(base.device_decodes)
        dev_ctx = [req[r].context_tokens + 1 for r in base.device_decodes]
        gpu_only_s = self.price_device_only_s(rows0, dev_ctx, chunks)
        host_prefill = bool(base.prefill_host) or any(req[r].pool == HOST for r, _ in base.prefill if r in req)
        # a prefill writing the host pool runs beside it as FCFS runs it: an (empty) second sub-batch
        gpu_mode = MODE_ASYMMETRIC if host_prefill else MODE_DEVICE_ONLY
        gpu_only = dataclasses.replace(base, mode=gpu_mode, host_decodes=(),
                                       predicted_s=gpu_only_s * self.scale[gpu_mode])
        if not base.host_decodes:
            self._last_raw_s = gpu_only_s
            return dataclasses.replace(gpu_only, why="Algorithm 1: no CPU decodes, GPU-only")
        c = self.cost
        host = [req[r] for r in base.host_decodes]
        for r in host:  # first seen: as if it decoded just before, so it queues behind none that waited
            self._last_decoded.setdefault(r.request_id, self.iteration - 1)
        all_ctx = dev_ctx + [r.context_tokens + 1 for r in host]
        n_all = len(all_ctx)
        t_glinear, t_gatt, t_catt = c.t_l_s(n_all), c.t_ga_s(all_ctx), c.t_ca_s(all_ctx)
        n_g = n_all / t_gatt if t_gatt > 0 else math.inf  # attention rates over the same decodes
        n_c = n_all / t_catt if t_catt > 0 else math.inf
        pref_rows = sum(n for _, n in base.prefill)
        mode, why = algorithm_1(n_g, n_c, t_glinear, t_gatt, has_cpu_decodes=True, has_prefill=bool(base.prefill),
                                t_glinear_pref_s=c.t_l_s(pref_rows + len(dev_ctx)),
                                t_gatt_pref_s=c.t_ga_s(dev_ctx) + c.t_pa_s(chunks))
        x0 = len(base.prefill) + len(base.device_decodes)
        gpu_s = gpu_only_s * self.scale[gpu_mode]
        gpu_rate = x0 / gpu_s if gpu_s > 0 else 0.0
        starving = any(self.iteration - self._last_decoded[r.request_id] > self.max_wait_iterations for r in host)
        # NEO step 6 (Greed): Algorithm 1's mode if it beats GPU-only in requests per second, else the other
        # offload mode if that does (a host decode need not wait for the mode the inequality named), else
        # GPU-only; a starving host decode forces Algorithm 1's mode
        other = MODE_ASYNC_OVERLAP if mode == MODE_ASYMMETRIC else MODE_ASYMMETRIC
        rates = []
        for m in (mode, other):
            chosen = self._balance(m, host, rows0, dev_ctx, chunks)
            price = self.price_asymmetric_s if m == MODE_ASYMMETRIC else self.price_async_overlap_s
            raw = price(rows0, dev_ctx, chunks, [r.context_tokens + 1 for r in chosen])
            offload_s = raw * self.scale[m]
            rate = (x0 + len(chosen)) / offload_s if offload_s > 0 else math.inf
            rates.append(rate)
            if (starving and m == mode) or rate > gpu_rate:
                self._last_raw_s = raw
                reason = ("a host decode waited too long" if starving else
                          f"{m} {rate:.1f} > GPU-only {gpu_rate:.1f} req/s")
                return dataclasses.replace(base, mode=m, host_decodes=tuple(r.request_id for r in chosen),
                                           predicted_s=offload_s,
                                           why=f"{why}; NEO balance: {len(chosen)}/{len(host)} host decodes; {reason}")
        self._last_raw_s = gpu_only_s
        return dataclasses.replace(gpu_only, why=f"{why}; NEO greed: GPU-only {gpu_rate:.1f} >= "
                                                 f"{max(rates):.1f} req/s offloading")

    def _balance(self, mode: str, host: list[RequestState], rows0: int, dev_ctx, chunks) -> list[RequestState]:
        """NEO step 4: host decodes, longest-waiting first, join sub-batch 1 while the CPU's attention
        hides under the GPU's work (T_ca1 <= T_l0, or the whole GPU iteration under async overlap);
        one that does not fit is skipped, except the first, which always runs (progress)."""
        c = self.cost
        order = sorted(host, key=lambda r: (self._last_decoded[r.request_id], r.arrival))
        each = getattr(c, "t_ca_each_s", None)  # T_ca is a sum over requests: price each once
        t_each = list(each([r.context_tokens + 1 for r in order])) if each else [
            c.t_ca_s([r.context_tokens + 1]) for r in order]
        t_ga0, t_pa0 = c.t_ga_s(dev_ctx), c.t_pa_s(chunks)
        chosen: list[RequestState] = []
        t_ca1 = 0.0
        for r, t in zip(order, t_each):
            if mode == MODE_ASYMMETRIC:
                window = c.t_l_s(rows0)
            else:
                window = c.t_l_s(rows0 + len(chosen) + 1) + t_ga0 + t_pa0
            if not chosen or t_ca1 + t <= window:
                chosen.append(r)
                t_ca1 += t
        return sorted(chosen, key=lambda r: r.arrival)
