"""What a scheduler sees of the engine before an iteration, as data: the waiting requests, the
running ones with their context lengths and KV pool, and the free blocks per pool.

A scheduler is any object with ``schedule(state: EngineState) -> IterationPlan``; it reads only
this (no model, no tensors), so a test can build an :class:`EngineState` by hand.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestState:
    """One request as the scheduler sees it.

    ``prefill_left``: tokens still to compute before it decodes (its prompt, or for a preempted
    request its prompt and the tokens it had generated; 0 once decoding: a decode adds 1 token).
    ``context_tokens``: tokens whose KV its blocks hold. ``pool``: "device", "host" or None
    (waiting: no blocks). ``shared_blocks``: its blocks that other requests hold too (a prefix
    cache's): releasing it (preempted, or swapped to the other pool) frees the rest only."""

    request_id: str
    prompt_tokens: int
    prefill_left: int
    context_tokens: int
    output_tokens: int
    max_tokens: int
    pool: str | None
    arrival: int  # order of add_request: first come, first served
    shared_blocks: int = 0

    def releasable_blocks(self, block_size_tokens: int) -> int:
        """Blocks its release frees: those it holds that no other request holds."""
        return -(-self.context_tokens // block_size_tokens) - self.shared_blocks

    @property
    def decoding(self) -> bool:
        return self.pool is not None and self.prefill_left == 0


@dataclass(frozen=True)
class EngineState:
    """The engine before one iteration. ``waiting`` in arrival order; ``running`` = requests that
    hold blocks (prefilling or decoding), in arrival order."""

    waiting: tuple[RequestState, ...]
    running: tuple[RequestState, ...]
    free_blocks: dict[str, int]  # pool -> blocks free
    total_blocks: dict[str, int]  # pool -> blocks in the pool
    block_size_tokens: int
    token_budget: int  # new tokens (prefill chunks + decodes) one iteration may compute
    max_running: int  # requests that may hold blocks at once
    accelerator: bool  # the model runs on an accelerator (else the CPU, and a device pool, if any, stands in for it)

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_size_tokens)

    def extra_blocks(self, r: RequestState, new_tokens: int) -> int:
        """Blocks ``r`` needs beyond those it holds for ``new_tokens`` more tokens."""
        return self.blocks_for(r.context_tokens + new_tokens) - self.blocks_for(r.context_tokens)
