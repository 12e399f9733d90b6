"""The engine's default scheduler: first come, first served, as vLLM's v1 scheduler without
priorities. NEO's and APEX's load-aware choice lives in ``scheduler.py`` and answers the same
``schedule(state) -> IterationPlan``.

Per iteration, within the token budget:

1. every decoding request decodes one token; where its pool has no block left for it, the
   latest-arrived request of that pool gives way (moved to the host pool when that holds it,
   else preempted: its KV freed and recomputed later), so the earliest always progresses;
2. requests part-way through their prefill continue it, in arrival order;
3. waiting requests are admitted in arrival order while blocks and budget last (a chunk of the
   prompt where the budget is short: chunked prefill), into the device pool while it has room,
   else the host pool; admission stops at the first that does not fit (no overtaking).

The mode is ``cpu-only`` without a device pool, ``asymmetric`` when some decodes attend on the
host beside a device pool, else ``device-only``.
"""

from __future__ import annotations

from flexplan.serving.kv_blocks import DEVICE, HOST
from flexplan.serving.state import EngineState, RequestState
from flexplan.serving.types import (
    MODE_ASYMMETRIC,
    MODE_CPU_ONLY,
    MODE_DEVICE_ONLY,
    IterationPlan,
)


class FcfsScheduler:
    """First come, first served (see the module's docstring)."""

    def schedule(self, state: EngineState) -> IterationPlan:
        free = dict(state.free_blocks)
        running = sorted(state.running, key=lambda r: r.arrival)
        pool = {r.request_id: r.pool for r in running}
        preempted: list[str] = []
        swap_out: list[str] = []

        def blocks_held(r: RequestState) -> int:
            return state.blocks_for(r.context_tokens)

        # 1. decodes, making room by moving or preempting the latest arrivals of a full pool
        for name in (DEVICE, HOST):
            while True:
                members = [r for r in running if pool[r.request_id] == name and r.request_id not in preempted]
                need = sum(state.extra_blocks(r, 1) for r in members if r.decoding)
                if need <= free[name] or not members:
                    break
                victim = members[-1]
                free[name] += blocks_held(victim)
                extra = state.extra_blocks(victim, 1) if victim.decoding else 0
                if name == DEVICE and blocks_held(victim) + extra <= free[HOST]:
                    free[HOST] -= blocks_held(victim)
                    pool[victim.request_id] = HOST
                    swap_out.append(victim.request_id)
                else:
                    preempted.append(victim.request_id)
        live = [r for r in running if r.request_id not in preempted]
        budget = state.token_budget
        device_decodes, host_decodes = [], []
        for r in live:
            if r.decoding and budget > 0:
                free[pool[r.request_id]] -= state.extra_blocks(r, 1)
                (device_decodes if pool[r.request_id] == DEVICE else host_decodes).append(r.request_id)
                budget -= 1

        # 2. prefills under way; 3. admissions
        prefill: list[tuple[str, int]] = []
        prefill_host: list[str] = []

        def fit(r: RequestState, where: str, want: int) -> int:
            """Tokens of ``want`` that the free blocks of ``where`` hold for ``r``."""
            room = (blocks_held(r) + free[where]) * state.block_size_tokens - r.context_tokens
            return max(0, min(want, room))

        for r in live:
            if not r.decoding and budget > 0:
                n = fit(r, pool[r.request_id], min(r.prefill_left, budget))
                if n:
                    free[pool[r.request_id]] -= state.extra_blocks(r, n)
                    prefill.append((r.request_id, n))
                    budget -= n
        holding = len(live)
        for r in sorted(state.waiting, key=lambda r: r.arrival):
            if budget <= 0 or holding >= state.max_running:
                break
            want = min(r.prefill_left, budget)
            where = DEVICE if state.total_blocks.get(DEVICE, 0) and fit(r, DEVICE, want) else HOST
            n = fit(r, where, want)
            if n == 0:
                break
            free[where] -= state.extra_blocks(r, n)
            prefill.append((r.request_id, n))
            if where == HOST:
                prefill_host.append(r.request_id)
            budget -= n
            holding += 1

        if not (prefill or device_decodes or host_decodes) and len(live) > 1:
            preempted.append(live[-1].request_id)  # prefills stuck on each other's blocks: the latest gives way
        if not state.total_blocks.get(DEVICE, 0):
            mode = MODE_CPU_ONLY
        elif host_decodes or prefill_host:
            mode = MODE_ASYMMETRIC
        else:
            mode = MODE_DEVICE_ONLY
        return IterationPlan(mode=mode, prefill=tuple(prefill), device_decodes=tuple(device_decodes),
                             host_decodes=tuple(host_decodes), swap_out=tuple(swap_out),
                             preempted=tuple(preempted), prefill_host=tuple(prefill_host),
                             why="first come, first served")
