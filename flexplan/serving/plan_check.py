"""Whether the engine can carry out a scheduler's plan, checked before anything changes: every
request it names is held, each decode is a decoding request in the pool the plan says (after the
plan's swaps), and the pools' free blocks cover its swaps and allocations. A scheduler's bug then
leaves the engine as it was, with a message that says where the plan fell short."""

from __future__ import annotations

from flexplan.errors import FlexplanError
from flexplan.serving.kv_blocks import DEVICE, HOST, BlockManager
from flexplan.serving.request import Request
from flexplan.serving.types import IterationPlan


def check_plan(plan: IterationPlan, blocks: BlockManager, running: dict[str, Request], waiting: set[str]) -> None:
    if not isinstance(plan, IterationPlan):
        raise FlexplanError(f"the scheduler returned {type(plan).__name__}, not an IterationPlan")
    known = waiting | set(running)
    unknown = [rid for rid in plan.request_ids + plan.swap_out + plan.swap_in + plan.preempted if rid not in known]
    if unknown:
        raise FlexplanError(f"the scheduler's plan names requests the engine does not hold: {unknown[:5]}")
    bm = blocks
    free = bm.usage()[1]
    pool = {rid: bm.pool_of(rid) for rid in running}
    held = {rid: len(bm.tables[rid].blocks) if rid in bm.tables else 0 for rid in running}
    freed = {rid: held[rid] - bm.shared_blocks(rid) for rid in running}  # blocks others share stay held
    for rid in plan.preempted:
        free[pool.pop(rid)] += freed[rid]
    for rid, to in [(r, HOST) for r in plan.swap_out] + [(r, DEVICE) for r in plan.swap_in]:
        if pool.get(rid) not in (None, to):
            free[pool[rid]] += freed[rid]
            free[to] -= held[rid]
            pool[rid] = to
    for rid, where in [(r, DEVICE) for r in plan.device_decodes] + [(r, HOST) for r in plan.host_decodes]:
        r = running.get(rid)
        if r is None or not r.decoding or pool.get(rid) != where:
            raise FlexplanError(f"the scheduler's plan decodes {rid!r} in the {where} pool; after its swaps it "
                                f"is {'decoding' if r is not None and r.decoding else 'not decoding'} in the "
                                f"{pool.get(rid)} pool; nothing was changed")
    tokens = {rid: bm.num_tokens(rid) for rid in pool}
    new = [(rid, n) for rid, n in plan.prefill]
    new += [(rid, 1) for rid in plan.device_decodes + plan.host_decodes]
    for rid, n in new:
        if rid not in pool:  # admitted now
            pool[rid] = HOST if rid in plan.prefill_host or not bm.pools[DEVICE].num_blocks else DEVICE
            held[rid], tokens[rid] = 0, 0
        need = max(0, bm.blocks_for(tokens[rid] + n) - held[rid])
        free[pool[rid]] -= need
        held[rid], tokens[rid] = held[rid] + need, tokens[rid] + n
    short = {p: -f for p, f in free.items() if f < 0}
    if short:
        raise FlexplanError(f"the scheduler's plan needs more KV blocks than the pools have free (short by "
                            f"{short}); nothing was changed: a scheduler should count EngineState.free_blocks")
