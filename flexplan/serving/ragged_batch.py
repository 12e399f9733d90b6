"""One forward pass's batch, as the model runner hands it to the model: every request's new tokens
flattened into one sequence, where each token's K/V goes in the pools, and the groups of requests
attended together.

A group is the requests of one pool that are all decodes (one query each) or all prefill chunks;
each keeps its queries' rows in the flattened sequence, its keys' slots in the pool (padded to the
longest), its block table (what the paged kernel reads) and, built on first use per window, the
mask that says which key each query attends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexplan.serving.kv_blocks import BlockManager, BlockPool


@dataclass(frozen=True)
class Segment:
    """One request's share of an iteration: ``token_ids`` at positions ``start..``; its KV pool
    already holds room for them (``BlockManager.append``); ``logits``: whether its last token's
    next-token logits are wanted (a finished prefill, a decode)."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    logits: bool = True


@dataclass
class Group:
    """Requests of one pool attended together: padded query rows and key slots per request."""

    pool: BlockPool
    q_index: torch.Tensor  # [N, maxQ] token indices into the flattened batch (model device)
    q_valid: torch.Tensor  # [N, maxQ] bool (model device)
    q_pos: torch.Tensor  # [N, maxQ] positions (pool device)
    kv_slots: torch.Tensor  # [N, maxK] slots in the pool (pool device)
    kv_len: torch.Tensor  # [N] keys each request attends (pool device)
    decode: bool  # one query per request
    tables: torch.Tensor  # [N, max_blocks] block ids (CPU, int64): what the paged kernel reads
    masks: dict

    def __post_init__(self):
        self.rows = self.q_index[self.q_valid]  # the group's tokens in the flattened batch, row by row

    def kv_lo(self, window: int | None) -> torch.Tensor:
        """[N] the first key a decode's query attends: its window's start (0 without one)."""
        if ("lo", window) not in self.masks:
            lo = (self.kv_len.cpu() - window).clamp(min=0) if window else torch.zeros_like(self.kv_len.cpu())
            self.masks[("lo", window)] = lo.contiguous()
        return self.masks[("lo", window)]

    def mask(self, window: int | None) -> torch.Tensor:
        """[N, 1, maxQ, maxK] bool, True = attend: the request's own keys up to its query's
        position, within the window (transformers' ``kv > q - window``)."""
        if window not in self.masks:
            j = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            m = (j[None, None, :] < self.kv_len[:, None, None]) & (j[None, None, :] <= self.q_pos[:, :, None])
            if window:
                m &= j[None, None, :] > self.q_pos[:, :, None] - window
            m[:, :, 0] |= ~self.q_valid.to(m.device)  # a padded query row attends key 0: no NaN row
            self.masks[window] = m[:, None]
        return self.masks[window]


class RaggedBatch:
    """The flattened tokens of ``segments`` (``ids``, ``positions``, ``keep``: the rows whose
    logits are wanted), per pool the K/V destinations (``writes``: token rows, slots), and the
    attention groups."""

    def __init__(self, segments: list[Segment], blocks: BlockManager, device: torch.device):
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.keep: list[int] = []
        by_pool: dict[str, list[tuple[Segment, int]]] = {}
        for s in segments:
            by_pool.setdefault(blocks.pool_of(s.request_id), []).append((s, len(self.ids)))
            self.ids.extend(s.token_ids)
            self.positions.extend(range(s.start, s.start + len(s.token_ids)))
            if s.logits:
                self.keep.append(len(self.ids) - 1)
        self.writes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.groups: list[Group] = []
        for name, members in by_pool.items():
            pool = blocks.pools[name]
            tok = torch.cat([torch.arange(o, o + len(s.token_ids)) for s, o in members])
            slots = torch.cat([blocks.slots(s.request_id, s.start, s.start + len(s.token_ids)) for s, _ in members])
            self.writes[name] = (tok.to(device), slots.to(pool.device))
            for decode in (True, False):
                part = [(s, o) for s, o in members if (len(s.token_ids) == 1) == decode]
                if part:
                    self.groups.append(_group(blocks, pool, part, decode, device))


def _group(blocks: BlockManager, pool: BlockPool, members: list[tuple[Segment, int]], decode: bool,
           device: torch.device) -> Group:
    n = len(members)
    max_q = max(len(s.token_ids) for s, _ in members)
    kv_len = [s.start + len(s.token_ids) for s, _ in members]
    max_k = max(kv_len)
    q_index = torch.zeros(n, max_q, dtype=torch.long)
    q_valid = torch.zeros(n, max_q, dtype=torch.bool)
    q_pos = torch.zeros(n, max_q, dtype=torch.long)
    kv_slots = torch.zeros(n, max_k, dtype=torch.long)
    tables = torch.zeros(n, blocks.blocks_for(max_k), dtype=torch.long)
    for r, (s, o) in enumerate(members):
        held = blocks.tables[s.request_id].blocks
        tables[r, :len(held)] = torch.tensor(held, dtype=torch.long)
        q = len(s.token_ids)
        q_index[r, :q] = torch.arange(o, o + q)
        q_valid[r, :q] = True
        q_pos[r, :q] = torch.arange(s.start, s.start + q)
        kv_slots[r, :kv_len[r]] = blocks.slots(s.request_id, 0, kv_len[r])
    pd = pool.device
    return Group(pool, q_index.to(device), q_valid.to(device), q_pos.to(pd), kv_slots.to(pd),
                 torch.tensor(kv_len, device=pd), decode, tables, {})
