"""A transformers ``Cache`` whose per-layer KV lives where the plan says, in preallocated buffers.

Each layer's K and V are stored sequence-major, ``(capacity, batch, kv_heads, head_dim)``, so
the first L tokens are one contiguous block: prefetching a layer's past (host -> accelerator),
offloading its new tokens (accelerator -> host) and moving it at the prefill/decode switch are
each one copy per tensor. Attention sees ``[batch, heads, L, head_dim]`` views of it, as a
``DynamicLayer`` would hand out.

The buffers come from a :class:`KVPool` that lives as long as the loaded model: they are
allocated on the first request of a shape and reused by every later request that fits, so
repeated ``generate()`` calls allocate (and pin) nothing.

Vocabulary from transformers' ``cache_utils``: ``prefetch()`` brings a streamed layer's past
into an accelerator slot, ``offload()`` sends the tokens it just produced back home.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from flexplan.errors import InvalidInputError
from flexplan.executor.link import ACCELERATOR, D2H, H2D, H2H, Buffer, Link

KV = tuple[torch.Tensor, torch.Tensor]


def kv_bytes(batch: int, capacity: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one layer: 2 x batch x tokens x kv_heads x head_dim elements."""
    return 2 * batch * capacity * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _direction(src_place: str, dst_place: str) -> str:
    if dst_place == ACCELERATOR and src_place != ACCELERATOR:
        return H2D
    if src_place == ACCELERATOR and dst_place != ACCELERATOR:
        return D2H
    return H2H


class KVPool:
    """Per-layer KV buffers (one per place a layer's KV uses) and the two accelerator slots of
    streamed layers; grown only when a request needs more than any earlier one."""

    def __init__(self, link: Link, kv_heads: int, head_dim: int):
        self.link = link
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.buffers: dict[tuple, Buffer] = {}

    def ensure(self, needs: dict[tuple, tuple[str, int]]) -> None:
        """``needs``: key -> (where, nbytes). Frees what is not needed, (re)allocates what is
        missing or too small, keeps the rest."""
        for key in [k for k in self.buffers if k not in needs]:
            self.link.free(self.buffers.pop(key))
        for key, (where, nbytes) in needs.items():
            cur = self.buffers.get(key)
            if cur is not None and cur.where == where and cur.nbytes >= nbytes:
                continue
            if cur is not None:
                self.link.free(cur)
            self.buffers[key] = self.link.alloc(max(nbytes, 1), where, f"KV {key}")

    def views(self, key: tuple, batch: int, capacity: int, dtype: torch.dtype) -> KV:
        shape = (capacity, batch, self.kv_heads, self.head_dim)
        n = kv_bytes(batch, capacity, self.kv_heads, self.head_dim, dtype) // 2
        t = self.buffers[key].tensor
        return t[:n].view(dtype).view(shape), t[n:2 * n].view(dtype).view(shape)

    def free(self) -> None:
        for b in self.buffers.values():
            self.link.free(b)
        self.buffers.clear()


class FlexKVLayer(CacheLayerMixin):
    """One decoder layer's KV cache: a buffer per place, ``home`` = where the valid data is."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, index: int, stores: dict[str, KV], home: str, link: Link):
        super().__init__()
        self.index = index
        self.stores = stores
        self.home = home
        self.link = link
        k = next(iter(stores.values()))[0]
        self.capacity, self.batch = int(k.shape[0]), int(k.shape[1])
        self.length = 0
        self.active: KV | None = None
        self.active_place: object = None
        self.pending = None  # event: the last copy into `home` (offload / switch) finished
        self._offload_from = 0
        self.is_initialized = True

    # ---- CacheLayerMixin ------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        if self.active is None:
            self.activate(self.home)
        k_buf, v_buf = self.active
        start, q = self.length, key_states.shape[-2]
        if start + q > self.capacity:
            raise InvalidInputError(
                f"the KV cache holds {self.capacity} tokens per sequence but this step needs {start + q}; "
                "pass max_new_tokens (or max_length) to generate() so the cache is sized for the whole request")
        if key_states.shape[0] != self.batch:
            raise InvalidInputError(f"the KV cache was sized for batch {self.batch}, got {key_states.shape[0]}")
        k_buf[start:start + q].copy_(key_states.permute(2, 0, 1, 3))
        v_buf[start:start + q].copy_(value_states.permute(2, 0, 1, 3))
        return self.advance(q)

    def advance(self, tokens: int) -> KV:
        """Count ``tokens`` more as written into the active buffers (by :meth:`update`, or by a
        native decode step that wrote them in place); the [batch, heads, length, d] views."""
        k_buf, v_buf = self.active
        self.length += tokens
        self.keys = k_buf[:self.length].permute(1, 2, 0, 3)
        self.values = v_buf[:self.length].permute(1, 2, 0, 3)
        return self.keys, self.values

    def cpu_f32_buffers(self) -> KV | None:
        """The active (capacity, batch, kv_heads, head_dim) buffers when they are contiguous
        float32 host tensors, which a native decode step writes into directly; else None."""
        if self.active is None:
            return None
        k, v = self.active
        ok = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in (k, v))
        return (k, v) if ok else None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.length == 0:
            return
        self.wait_home_on_host()
        for t in self.stores[self.home]:
            t[:self.length] = t[:self.length].index_select(1, beam_idx.to(t.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the flexplan KV cache has a fixed batch; expand inputs before generate()")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the flexplan KV cache has a fixed batch")

    # ---- placement --------------------------------------------------------------------------
    def activate(self, place: str) -> None:
        """Compute from the buffer in ``place`` (which must be home)."""
        if place != self.home:
            self.migrate(place)
        self.active, self.active_place = self.stores[place], place

    def migrate(self, place: str) -> None:
        """Move the valid tokens to ``place`` (the prefill -> decode switch), converting the dtype
        if needed. The caller chooses the stream; the copy is async on CUDA where it crosses."""
        if place == self.home:
            return
        src, dst = self.stores[self.home], self.stores[place]
        direction = _direction(self.home, place)
        if self.length:
            for s, d in zip(src, dst):
                self.link.copy(d[:self.length], s[:self.length], direction, "kv-switch", self.index)
        self.home = place
        self.active, self.active_place = None, None

    def prefetch(self, slot: KV, slot_index: int) -> None:
        """Copy the past tokens from home (pinned host) into an accelerator ``slot`` and compute
        from there (caller is on the copy stream)."""
        home = self.stores[self.home]
        if self.length:
            for s, d in zip(home, slot):
                self.link.copy(d[:self.length], s[:self.length], H2D, "kv", self.index)
        self.active, self.active_place = slot, ("slot", slot_index)
        self._offload_from = self.length

    def offload(self) -> None:
        """Send the tokens computed since ``prefetch()`` back home (caller is on the copy stream)."""
        lo, hi = self._offload_from, self.length
        if hi > lo:
            for s, d in zip(self.active, self.stores[self.home]):
                self.link.copy(d[lo:hi], s[lo:hi], D2H, "kv", self.index)
        self._offload_from = hi
        self.active, self.active_place = None, None

    def wait_home_on_host(self) -> None:
        if self.pending is not None:
            self.pending.synchronize()
            self.pending = None


class FlexCache(Cache):
    """The request's cache: one :class:`FlexKVLayer` per decoder layer, buffers from a KVPool."""

    def __init__(self, layers: list[FlexKVLayer]):
        super().__init__(layers=layers)

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity if self.layers else 0

