"""Paged KV pools and the block tables of the requests that use them (NEO's ``DeviceBlockManager``,
vLLM's block manager).

A pool is two preallocated tensors on its device, K ``[layers, num_blocks, block_size_tokens,
k_heads, k_dim]`` and V ``[layers, num_blocks, block_size_tokens, v_heads, v_dim]`` (MLA's latent
cache has K and V of different widths). Each request holds a block table in exactly one pool
(``"device"``: the accelerator's, or the CPU standing in for it; ``"host"``: CPU memory, attended
on the CPU beside it). Token ``t`` of a request lives in block ``table[t // block_size_tokens]``
at offset ``t % block_size_tokens``, so its flat *slot* ``block * block_size_tokens + offset``
indexes the ``[layers, num_blocks * block_size_tokens, heads, dim]`` views :attr:`BlockPool.k_slots`
and :attr:`BlockPool.v_slots`: one ``index_copy_`` writes an iteration's new tokens, one
``index_select`` gathers a request's past.

Prefix caching (vLLM's automatic prefix caching): a block whose tokens are all computed is named
by a digest of its tokens and every token before it (:func:`block_key`), and a new request's
prompt takes the blocks its leading whole blocks name (:meth:`BlockManager.match_prefix`) instead of
computing them again: a shared system prompt, a conversation's earlier turns, a preempted request's
own KV. Blocks count the requests that hold them; a full block no request holds stays cached and is
taken back, least recently released first, only when no free block is left. Only full blocks are
named, and a request writes only its last, partly filled block, so a shared block is never written.

Pool sizes come from bytes (:func:`blocks_in_bytes`): the accelerator's free memory after the
weights, or a host budget; the geometry of one token's K and V is the executor's
:func:`flexplan.executor.kv_cache.kv_geometry`, the same the planner's memory model prices.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flexplan.errors import DoesNotFitError, InvalidInputError
from flexplan.executor.kv_cache import KVGeometry, kv_geometry

DEVICE = "device"  # the accelerator's pool (or the CPU standing in for it)
HOST = "host"  # host memory: its requests' attention runs on the CPU beside it
POOLS = (DEVICE, HOST)
BLOCK_SIZE_TOKENS = 16  # vLLM's and NEO's default page
DEFAULT_HOST_POOL_BYTES = 2 * 2**30  # the host pool's cap unless given: KV is committed memory
HOST_POOL_SHARE = 0.25  # ... and at most this share of the memory available now
DEVICE_POOL_SHARE = 0.8  # of the accelerator's free memory after the weights: the rest for activations


def block_key(parent: bytes, token_ids) -> bytes:
    """A full block's name in the prefix cache: a digest of its tokens chained to its parent's name
    (b"" for a request's first block), so equal names mean equal tokens from the request's start
    (16 bytes of BLAKE2b: no collision to fear, as vLLM's sha256 option)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def text_config(config):
    """The decoder's config of a multimodal wrapper (Gemma 3), else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def block_bytes(config, dtype: torch.dtype, block_size_tokens: int = BLOCK_SIZE_TOKENS) -> int:
    """Bytes of one block across all layers: layers x tokens x (K + V elements) x element size."""
    g = kv_geometry(text_config(config))
    layers = int(text_config(config).num_hidden_layers)
    return layers * block_size_tokens * g.elements_per_token * torch.empty((), dtype=dtype).element_size()


def blocks_in_bytes(nbytes: int, config, dtype: torch.dtype, block_size_tokens: int = BLOCK_SIZE_TOKENS) -> int:
    """How many whole blocks of this model's KV fit in ``nbytes``."""
    return max(0, int(nbytes) // block_bytes(config, dtype, block_size_tokens))


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (1 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**30


def activation_reserve_bytes(config, token_budget: int, max_running: int, dtype: torch.dtype) -> int:
    """What one iteration's activations take beside the weights and the KV: the token budget's
    rows through the widest layer (hidden states, q/k/v, the MLP's gate, up and product) and the
    float32 logits of every running request. An upper estimate: the pool gets the rest."""
    c = text_config(config)
    hidden = int(c.hidden_size)
    inter = int(getattr(c, "intermediate_size", None) or 4 * hidden)
    rows = token_budget * (8 * hidden + 3 * inter) * torch.empty((), dtype=dtype).element_size()
    return rows + max_running * int(c.vocab_size) * 4


def pool_blocks(model, *, device: torch.device, block_size_tokens: int, token_budget: int, max_running: int,
                device_memory_bytes: int | None = None, host_memory_bytes: int | None = None,
                kv_dtype: torch.dtype | None = None) -> tuple[int, int]:
    """(device blocks, host blocks) where not given. The device pool: ``device_memory_bytes`` less
    the weights on the device and an iteration's activations (:func:`activation_reserve_bytes`;
    on the CPU such a budget makes a pool that stands in for an accelerator's), else 80% of an
    accelerator's free memory after the weights, else none. The host pool: ``host_memory_bytes``,
    else a quarter of the memory available now, at most 2 GiB. Blocks hold ``kv_dtype`` (default:
    the model's dtype)."""
    config = model.config
    dtype = next(model.parameters()).dtype
    kv = kv_dtype or dtype
    if device_memory_bytes is not None:
        weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                      if t.device == device)
        free = device_memory_bytes - weights - activation_reserve_bytes(config, token_budget, max_running, dtype)
        device_blocks = blocks_in_bytes(max(0, free), config, kv, block_size_tokens)
    elif device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] * DEVICE_POOL_SHARE
        device_blocks = blocks_in_bytes(free, config, kv, block_size_tokens)
    else:
        device_blocks = 0
    if host_memory_bytes is None:
        host_memory_bytes = min(DEFAULT_HOST_POOL_BYTES, available_host_bytes() * HOST_POOL_SHARE)
    return device_blocks, blocks_in_bytes(host_memory_bytes, config, kv, block_size_tokens)


class BlockPool:
    """One pool's K and V tensors, its free blocks (a stack: the most recently freed block is reused
    first, while it is still in the CPU's cache), how many requests hold each block, and its prefix
    cache: full blocks by name, those no request holds evictable, least recently released first."""

    def __init__(self, name: str, num_blocks: int, block_size_tokens: int, layers: int, geometry: KVGeometry,
                 dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False):
        if num_blocks < 0:
            raise InvalidInputError(f"{name} pool: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = int(num_blocks)
        self.block_size_tokens = block_size_tokens
        self.device = torch.device(device)
        g = geometry
        try:  # zeros, not empty: a padded key slot is masked, but NaN garbage would still poison 0 x NaN
            self.k = torch.zeros((layers, self.num_blocks, block_size_tokens, g.k_heads, g.k_dim), dtype=dtype,
                                 device=self.device, pin_memory=pin_memory)
            self.v = torch.zeros((layers, self.num_blocks, block_size_tokens, g.v_heads, g.v_dim), dtype=dtype,
                                 device=self.device, pin_memory=pin_memory)
        except (RuntimeError, MemoryError) as e:  # the allocator's own words, with what was asked
            nbytes = self.num_blocks * block_size_tokens * layers * g.elements_per_token * dtype.itemsize
            raise DoesNotFitError(f"{name} KV pool of {self.num_blocks} blocks ({nbytes / 2**20:.0f} MiB on "
                                  f"{self.device}) could not be allocated ({e}); give it fewer blocks") from None
        slots = self.num_blocks * block_size_tokens
        self.k_slots = self.k.view(layers, slots, g.k_heads, g.k_dim)
        self.v_slots = self.v.view(layers, slots, g.v_heads, g.v_dim)
        self._free = list(range(self.num_blocks - 1, -1, -1))  # held by none, named by none
        self._holders = [0] * self.num_blocks  # requests holding each block
        self._cached: dict[bytes, int] = {}  # name -> block
        self._name_of: dict[int, bytes] = {}  # block -> name
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named blocks no request holds, LRU first
        self.names_forgotten = 0  # names dropped from the cache so far (a name is only ever dropped by take())

    @property
    def free_blocks(self) -> int:
        """Blocks a request may take: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def take(self, n: int) -> list[int]:
        if n > self.free_blocks:
            raise DoesNotFitError(f"{self.name} KV pool: {n} blocks asked, {self.free_blocks} free of "
                                  f"{self.num_blocks}; the scheduler should ask can_allocate first")
        out = []
        for _ in range(n):  # free blocks first; a cached one only when none is left (its name forgotten)
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._cached[self._name_of.pop(b)]
                self.names_forgotten += 1
            self._holders[b] = 1
            out.append(b)
        return out

    def give_back(self, blocks: list[int]) -> None:
        """One holder fewer for each block; a block no one holds is free, or evictable when named
        (a request's last blocks released first: the least likely to be asked for again)."""
        for b in reversed(blocks):
            self._holders[b] -= 1
            if self._holders[b] == 0:
                if b in self._name_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def holders(self, block: int) -> int:
        return self._holders[block]

    def lookup(self, name: bytes) -> int | None:
        return self._cached.get(name)

    def hold(self, block: int) -> None:
        """One holder more for a cached block (out of the evictable ones if it was there)."""
        if self._holders[block] == 0:
            self._evictable.pop(block, None)
        self._holders[block] += 1

    def register(self, block: int, name: bytes) -> None:
        """Name a held, full block in the cache (a name another block already has keeps that one)."""
        if name not in self._cached and block not in self._name_of:
            self._cached[name] = block
            self._name_of[block] = name


@dataclass
class BlockTable:
    """A request's blocks in one pool and how many of their token slots are filled."""

    pool: str
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    names: list[bytes] = field(default_factory=list)  # names of its leading full blocks (matched or committed)


class BlockManager:
    """The device and host pools of one model, and a block table per request."""

    def __init__(self, config, *, device_blocks: int, host_blocks: int, dtype: torch.dtype,
                 device: torch.device | str, block_size_tokens: int = BLOCK_SIZE_TOKENS, prefix_caching: bool = True):
        if not isinstance(block_size_tokens, int) or block_size_tokens < 1:
            raise InvalidInputError(f"block_size_tokens must be a positive integer (16 is usual), "
                                    f"got {block_size_tokens!r}")
        if device_blocks + host_blocks < 1:
            raise InvalidInputError("the KV pools hold no block: give device_blocks or host_blocks >= 1")
        self.block_size_tokens = block_size_tokens
        self.geometry = kv_geometry(text_config(config))
        self.layers = int(text_config(config).num_hidden_layers)
        device = torch.device(device)
        pin = device.type != "cpu" and torch.cuda.is_available()  # host blocks cross the link: pinned
        self.pools = {
            DEVICE: BlockPool(DEVICE, device_blocks, block_size_tokens, self.layers, self.geometry, dtype, device),
            HOST: BlockPool(HOST, host_blocks, block_size_tokens, self.layers, self.geometry, dtype, "cpu", pin),
        }
        self.tables: dict[str, BlockTable] = {}
        self.prefix_caching = bool(prefix_caching)
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # ... and found there (not computed again)

    # ---- questions the scheduler asks ----
    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size_tokens)

    def extra_blocks(self, request_id: str, new_tokens: int) -> int:
        """Blocks a request needs beyond its own to hold ``new_tokens`` more tokens."""
        t = self.tables.get(request_id)
        have_tokens, have_blocks = (t.num_tokens, len(t.blocks)) if t else (0, 0)
        return max(0, self.blocks_for(have_tokens + new_tokens) - have_blocks)

    def can_allocate(self, pool: str, request_id: str, new_tokens: int) -> bool:
        return self.extra_blocks(request_id, new_tokens) <= self.pool(pool).free_blocks

    def pool(self, name: str) -> BlockPool:
        if name not in self.pools:
            raise InvalidInputError(f"unknown KV pool {name!r}; the pools are {', '.join(POOLS)}")
        return self.pools[name]

    def pool_of(self, request_id: str) -> str | None:
        t = self.tables.get(request_id)
        return t.pool if t else None

    def num_tokens(self, request_id: str) -> int:
        t = self.tables.get(request_id)
        return t.num_tokens if t else 0

    def shared_blocks(self, request_id: str) -> int:
        """Its blocks other requests hold too: releasing it frees the rest only. Only named blocks
        (its leading ones, :attr:`BlockTable.names`) can be shared: the rest are not scanned (the
        engine asks for every running request each iteration)."""
        t = self.tables.get(request_id)
        if t is None:
            return 0
        pool = self.pools[t.pool]
        return sum(1 for b in t.blocks[:len(t.names)] if pool.holders(b) > 1)

    # ---- the prefix cache ----
    def match_prefix(self, request_id: str, token_ids: list[int], pool: str) -> int:
        """For a request about to be admitted into ``pool``: its longest prefix of whole blocks that
        the pool's cache holds, never its last token (whose logits it must compute), taken as its
        first blocks. Returns the tokens matched (computed already)."""
        if not self.prefix_caching or request_id in self.tables:
            return 0
        p, bs = self.pool(pool), self.block_size_tokens
        names, blocks = [], []
        for name in self.prefix_names(token_ids):
            b = p.lookup(name)
            if b is None:
                break
            names.append(name)
            blocks.append(b)
        for b in blocks:
            p.hold(b)
        self.prefix_query_tokens += len(token_ids)
        self.prefix_hit_tokens += len(blocks) * bs
        if blocks:
            self.tables[request_id] = BlockTable(p.name, blocks, len(blocks) * bs, names)
        return len(blocks) * bs

    def prefix_names(self, token_ids: list[int]) -> list[bytes]:
        """The names of the whole blocks of ``token_ids`` that a request admitted with them could take
        from the cache (:meth:`match_prefix`'s: never the block of its last token)."""
        bs, names, parent = self.block_size_tokens, [], b""
        for i in range((len(token_ids) - 1) // bs):
            parent = block_key(parent, token_ids[i * bs:(i + 1) * bs])
            names.append(parent)
        return names

    def cached(self, name: bytes) -> bool:
        """Whether a pool's cache holds a block of this name."""
        return any(p.lookup(name) is not None for p in self.pools.values())

    @property
    def names_forgotten(self) -> int:
        """Names the pools' caches have dropped so far: while it stays, a name found cached still is."""
        return sum(p.names_forgotten for p in self.pools.values())

    def commit(self, request_id: str, token_ids: list[int], computed: int) -> None:
        """Name in the cache the request's blocks that its first ``computed`` tokens fill (their KV
        written by the forward that just ran)."""
        t = self.tables.get(request_id)
        if not self.prefix_caching or t is None:
            return
        bs, p = self.block_size_tokens, self.pools[t.pool]
        for i in range(len(t.names), min(computed, len(token_ids), t.num_tokens) // bs):
            name = block_key(t.names[-1] if t.names else b"", token_ids[i * bs:(i + 1) * bs])
            p.register(t.blocks[i], name)
            t.names.append(name)

    # ---- changes ----
    def append(self, request_id: str, new_tokens: int, pool: str | None = None) -> None:
        """Room for ``new_tokens`` more tokens of a request (its first call names the pool)."""
        t = self.tables.get(request_id)
        if t is None:
            if pool is None:
                raise InvalidInputError(f"request {request_id!r} has no blocks yet: name the pool to allocate in")
            t = BlockTable(self.pool(pool).name)
        elif pool is not None and pool != t.pool:
            raise InvalidInputError(f"request {request_id!r} holds blocks in the {t.pool} pool, not {pool}: "
                                    "move them first (swap)")
        extra = self.extra_blocks(request_id, new_tokens)
        t.blocks.extend(self.pools[t.pool].take(extra))  # raises before the table changes when full
        t.num_tokens += new_tokens
        self.tables[request_id] = t

    def free(self, request_id: str) -> None:
        t = self.tables.pop(request_id, None)
        if t is not None:
            self.pools[t.pool].give_back(t.blocks)

    def swap(self, request_id: str, to_pool: str) -> None:
        """Move a request's blocks to another pool (``offload()`` device -> host, ``prefetch()``
        host -> device): one gather and one scatter of its slots across all layers."""
        t = self.tables.get(request_id)
        if t is None:
            raise InvalidInputError(f"request {request_id!r} holds no KV blocks to move")
        if t.pool == to_pool:
            return
        src, dst = self.pools[t.pool], self.pool(to_pool)
        new_blocks = dst.take(len(t.blocks))
        old = torch.tensor(t.blocks, dtype=torch.long, device=src.device)
        new = torch.tensor(new_blocks, dtype=torch.long, device=dst.device)
        for a, b in ((src.k, dst.k), (src.v, dst.v)):
            b.index_copy_(1, new, a.index_select(1, old).to(dst.device))
        src.give_back(t.blocks)
        t.pool, t.blocks = dst.name, new_blocks

    # ---- what the model runner reads ----
    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot indices (int64, CPU) of tokens ``start..end-1`` of a request in its pool."""
        t = self.tables[request_id]
        bs = self.block_size_tokens
        first, last = start // bs, -(-end // bs)
        blocks = torch.tensor(t.blocks[first:last], dtype=torch.long)
        flat = (blocks[:, None] * bs + torch.arange(bs)).flatten()
        return flat[start - first * bs:end - first * bs]

    def usage(self) -> tuple[dict[str, int], dict[str, int]]:
        """(blocks used, blocks free) per pool."""
        return ({n: p.used_blocks for n, p in self.pools.items()}, {n: p.free_blocks for n, p in self.pools.items()})
