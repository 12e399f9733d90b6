"""The engine's default scheduler: first come, first served, as vLLM's v1 scheduler without
priorities. NEO's and APEX's load-aware choice lives in ``scheduler.py`` and answers the same
``schedule(state) -> IterationPlan``.

Blocks are reserved for what each running request must compute next: one token for a decode,
the rest of its prompt for a request part-way through its prefill (so chunks never wait on
blocks a later decode took). Per iteration:

1. where a pool cannot hold its requests' reservations, the latest-arrived request of that pool
   gives way: moved to the host pool when that holds it, else preempted (its KV freed, recomputed
   later); the earliest always progresses;
2. within the token budget, every decoding request decodes one token, then requests part-way
   through their prefill continue it (chunked prefill where the budget is short), in arrival order;
3. waiting requests are admitted in arrival order into the device pool when it holds their whole
   prompt and first token, else the host pool; admission stops at the first that fits nowhere
   (no overtaking).

The mode is ``cpu-only`` without a device pool, ``asymmetric`` when some requests attend beside
the host pool next to a device pool, else ``device-only``.
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

        def held(r: RequestState) -> int:  # what its release frees (blocks others share stay held)
            return r.releasable_blocks(state.block_size_tokens)

        def reserve(r: RequestState) -> int:
            """Blocks beyond its own that ``r`` needs for what it computes next."""
            return state.extra_blocks(r, 1 if r.decoding else r.prefill_left)

        def members(name: str) -> list[RequestState]:
            return [r for r in running if pool[r.request_id] == name and r.request_id not in preempted]

        # 1. reservations, the latest arrivals giving way where a pool falls short
        for name in (DEVICE, HOST):
            while members(name) and sum(map(reserve, members(name))) > free[name]:
                victim = members(name)[-1]
                free[name] += held(victim)
                host_room = free[HOST] - sum(map(reserve, members(HOST)))
                moved = state.blocks_for(victim.context_tokens)  # a swap copies every block it holds
                if name == DEVICE and moved + reserve(victim) <= host_room:
                    free[HOST] -= moved
                    pool[victim.request_id] = HOST
                    swap_out.append(victim.request_id)
                else:
                    preempted.append(victim.request_id)
        for name in (DEVICE, HOST):
            free[name] -= sum(map(reserve, members(name)))

        # 2. decodes, then prefills under way, within the budget
        live = [r for r in running if r.request_id not in preempted]
        budget = state.token_budget
        device_decodes, host_decodes, prefill = [], [], []
        for r in live:
            if r.decoding and budget > 0:
                (device_decodes if pool[r.request_id] == DEVICE else host_decodes).append(r.request_id)
                budget -= 1
        for r in live:
            if not r.decoding and budget > 0:
                n = min(r.prefill_left, budget)
                prefill.append((r.request_id, n))
                budget -= n

        # 3. admissions: the whole prompt and its first token reserved in one pool
        prefill_host: list[str] = []
        holding = len(live)
        for r in sorted(state.waiting, key=lambda r: r.arrival):
            if budget <= 0 or holding >= state.max_running:
                break
            whole = state.blocks_for(r.prefill_left + 1)
            where = next((p for p in (DEVICE, HOST) if state.total_blocks.get(p, 0) and whole <= free[p]), None)
            if where is None:
                break
            free[where] -= state.blocks_for(r.prefill_left)
            n = min(r.prefill_left, budget)
            prefill.append((r.request_id, n))
            if where == HOST:
                prefill_host.append(r.request_id)
            budget -= n
            holding += 1

        on_host = host_decodes or prefill_host or any(pool[r] == HOST for r, _ in prefill if r in pool)
        if not state.total_blocks.get(DEVICE, 0):
            mode = MODE_CPU_ONLY
        elif on_host:
            mode = MODE_ASYMMETRIC
        else:
            mode = MODE_DEVICE_ONLY
        return IterationPlan(mode=mode, prefill=tuple(prefill), device_decodes=tuple(device_decodes),
                             host_decodes=tuple(host_decodes), swap_out=tuple(swap_out),
                             preempted=tuple(preempted), prefill_host=tuple(prefill_host),
                             why="first come, first served")
