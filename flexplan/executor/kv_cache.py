"""A transformers ``Cache`` whose per-layer KV lives where the plan says, in preallocated buffers.

Each layer's K and V are stored sequence-major, ``(capacity, batch, heads, dim)``, so the first
L tokens are one contiguous block: prefetching a layer's past (host -> accelerator), offloading
its new tokens (accelerator -> host) and moving it at the prefill/decode switch are each one
copy per tensor. Attention sees ``[batch, heads, L, dim]`` views of it, as a ``DynamicLayer``
would hand out.

Each layer has its own :class:`KVGeometry` (K and V heads and dims: GQA/MQA, an explicit
``head_dim``, MLA's differing K and V widths or its latent cache), derived from the config by
:func:`kv_geometry`. A sliding-window (or chunked) layer stores the whole context but hands
attention only what transformers' ``DynamicSlidingWindowLayer`` would (the last ``window - 1``
cached tokens plus the new ones) and reports the same mask sizes, so masks and results are
identical; the tokens it copies (prefetch, switch) stop at the window too.

The buffers come from a :class:`KVPool` that lives as long as the loaded model: they are
allocated on the first request of a shape and reused by every later request that fits, so
repeated ``generate()`` calls allocate (and pin) nothing.

Vocabulary from transformers' ``cache_utils``: ``prefetch()`` brings a streamed layer's past
into an accelerator slot, ``offload()`` sends the tokens it just produced back home.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from flexplan.errors import InvalidInputError, UnsupportedModelError
from flexplan.executor.link import ACCELERATOR, D2H, H2D, H2H, Buffer, Link
from flexplan.workload.config_fields import LATENT_KV_MODEL_TYPES

KV = tuple[torch.Tensor, torch.Tensor]


class KVGeometry(NamedTuple):
    """What one token of one sequence stores in a layer's cache: K as ``k_heads x k_dim``, V as
    ``v_heads x v_dim`` elements (the shapes of the states the attention passes to ``update``)."""

    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int

    @property
    def elements_per_token(self) -> int:
        return self.k_heads * self.k_dim + self.v_heads * self.v_dim


# attention modules that cache MLA's compressed latent (``kv_nope, k_rot = past_key_values.update(...)``):
# K is the kv_lora_rank latent, V the shared rotary key, one "head" each
_LATENT_KV = LATENT_KV_MODEL_TYPES
# Falcon's KV heads: num_kv_heads with the new decoder architecture, else 1 (multi-query) or all
_FALCON = frozenset({"falcon"})


def kv_geometry(config, spec=None) -> KVGeometry:
    """K and V heads and dims per token of one layer, from a transformers (text) config; ``spec``
    (a ModelSpec) is read first where it has the attribute (num_kv_heads, head_dim, v_head_dim)."""
    c = config
    mt = getattr(c, "model_type", None)
    heads = int(getattr(c, "num_attention_heads"))
    if mt in _LATENT_KV and getattr(c, "kv_lora_rank", None):
        return KVGeometry(1, int(c.kv_lora_rank), 1, int(c.qk_rope_head_dim))
    if mt in _FALCON:
        kv_heads = (int(c.num_kv_heads) if getattr(c, "new_decoder_architecture", False)
                    else 1 if getattr(c, "multi_query", False) else heads)
    else:
        kv_heads = getattr(spec, "num_kv_heads", None) or getattr(c, "num_key_value_heads", None) or heads
    k_dim = getattr(c, "qk_head_dim", None)
    if not k_dim and getattr(c, "qk_nope_head_dim", None) is not None and getattr(c, "qk_rope_head_dim", None):
        k_dim = int(c.qk_nope_head_dim) + int(c.qk_rope_head_dim)
    if not k_dim:
        k_dim = getattr(spec, "head_dim", None) or getattr(c, "head_dim", None) or int(c.hidden_size) // heads
    v_dim = getattr(spec, "v_head_dim", None) or getattr(c, "v_head_dim", None) or k_dim
    return KVGeometry(int(kv_heads), int(k_dim), int(kv_heads), int(v_dim))


def kv_bytes(batch: int, capacity: int, geometry: KVGeometry, dtype: torch.dtype) -> int:
    """K and V of one layer: batch x tokens x (k_heads x k_dim + v_heads x v_dim) elements."""
    return batch * capacity * geometry.elements_per_token * torch.empty((), dtype=dtype).element_size()


def kv_views(raw: torch.Tensor, batch: int, capacity: int, geometry: KVGeometry, dtype: torch.dtype) -> KV:
    """K ``(capacity, batch, k_heads, k_dim)`` and V views at the start of the byte buffer ``raw``."""
    g, elem = geometry, torch.empty((), dtype=dtype).element_size()
    nk = batch * capacity * g.k_heads * g.k_dim * elem
    nv = batch * capacity * g.v_heads * g.v_dim * elem
    return (raw[:nk].view(dtype).view(capacity, batch, g.k_heads, g.k_dim),
            raw[nk:nk + nv].view(dtype).view(capacity, batch, g.v_heads, g.v_dim))


def _direction(src_place: str, dst_place: str) -> str:
    if dst_place == ACCELERATOR and src_place != ACCELERATOR:
        return H2D
    if src_place == ACCELERATOR and dst_place != ACCELERATOR:
        return D2H
    return H2H


class KVPool:
    """Per-layer KV buffers (one per place a layer's KV uses) and the two accelerator slots of
    streamed layers; grown only when a request needs more than any earlier one."""

    def __init__(self, link: Link):
        self.link = link
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

    def raw(self, key: tuple) -> torch.Tensor:
        return self.buffers[key].tensor

    def views(self, key: tuple, batch: int, capacity: int, geometry: KVGeometry, dtype: torch.dtype) -> KV:
        return kv_views(self.buffers[key].tensor, batch, capacity, geometry, dtype)

    def free(self) -> None:
        for b in self.buffers.values():
            self.link.free(b)
        self.buffers.clear()


class FlexKVLayer(CacheLayerMixin):
    """One decoder layer's KV cache: a buffer per place, ``home`` = where the valid data is.

    ``window``: the layer's attention window (sliding or chunked layers), None for full attention;
    then ``update`` and ``get_mask_sizes`` answer as transformers' ``DynamicSlidingWindowLayer``."""

    is_compileable = False
    is_croppable = True

    def __init__(self, index: int, raws: dict[str, tuple[torch.Tensor, torch.dtype]], geometry: KVGeometry,
                 batch: int, capacity: int, home: str, link: Link, window: int | None = None):
        super().__init__()
        self.keys = self.values = None  # the attention views, made by advance() (lazily after a native step)
        self.index = index
        self.raws = raws  # place -> (byte buffer, dtype)
        self.geometry = geometry
        self.batch, self.capacity = int(batch), int(capacity)
        self.window = int(window) if window else None
        self.is_sliding = self.window is not None
        self.stores: dict[str, KV] = {}
        self._view_stores()
        self.home = home
        self.link = link
        self.length = 0
        self.active: KV | None = None
        self.active_place: object = None
        self._slot_raw: tuple[torch.Tensor, torch.dtype] | None = None
        self.pending = None  # event: the last copy into `home` (offload / switch) finished
        self._offload_from = 0
        self.is_initialized = True
        # (index, geometry) -> (new raws, the accelerator slots): set by the executor, called when the
        # first update shows more bytes per token than the config said
        self.regrow = None
        # the layer computes on the accelerator but attends on the CPU beside this (host) cache: the
        # new K, V that ``update`` appends cross the link (set by the executor for that layer's call)
        self.new_tokens_cross = False

    def _view_stores(self) -> None:
        self.stores = {p: kv_views(raw, self.batch, self.capacity, self.geometry, dt) for p, (raw, dt) in self.raws.items()}

    def _slot_views(self, slot: tuple[torch.Tensor, torch.dtype]) -> KV:
        return kv_views(slot[0], self.batch, self.capacity, self.geometry, slot[1])

    def visible_start(self, past: int) -> int:
        """First cached position that attention sees after ``past`` tokens (0 for full layers):
        a sliding layer keeps the last ``window - 1``, as DynamicSlidingWindowLayer does."""
        return max(past - self.window + 1, 0) if self.window else 0

    # ---- CacheLayerMixin ------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def _check_geometry(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The config's geometry guessed wrong (a model-specific cache layout): at the first update,
        view the buffers with the real one when it fits in them; refuse otherwise."""
        got = KVGeometry(int(key_states.shape[1]), int(key_states.shape[-1]), int(value_states.shape[1]),
                         int(value_states.shape[-1]))
        if got == self.geometry:
            return
        raws = list(self.raws.values()) + ([self._slot_raw] if self._slot_raw is not None else [])
        fits = all(kv_bytes(self.batch, self.capacity, got, dt) <= raw.numel() for raw, dt in raws)
        if self.length or (not fits and self.regrow is None):
            raise UnsupportedModelError(
                f"layer {self.index} caches K {tuple(key_states.shape[1::2])} and V {tuple(value_states.shape[1::2])} "
                f"(heads, dim) per token but its config says {tuple(self.geometry)}: this model's cache layout is not "
                "one flexplan.executor.kv_cache.kv_geometry knows")
        self.geometry = got
        if not fits:  # larger than the config said: the executor reallocates this layer's buffers (and the slots)
            self.raws, slots = self.regrow(self.index, got)
            if isinstance(self.active_place, tuple):
                self._slot_raw = slots[self.active_place[1]]
        self._view_stores()
        if self.active_place is not None:
            self.active = self._slot_views(self._slot_raw) if self.active_place not in self.stores \
                else self.stores[self.active_place]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        if self.active is None:
            self.activate(self.home)
        self._check_geometry(key_states, value_states)
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
        if self.new_tokens_cross:
            self.link.log(D2H, "new kv", self.index, sum(t.numel() * t.element_size() for t in (key_states, value_states)))
        return self.advance(q)

    def advance(self, tokens: int, views: bool = True) -> KV | None:
        """Count ``tokens`` more as written into the active buffers (by :meth:`update`, or by a
        native decode step that wrote them in place); the [batch, heads, length, d] views that
        attention reads (a sliding layer: from :meth:`visible_start` of the past on). With
        ``views=False`` (a native step, which attends by itself) the views are made only when
        :attr:`keys` or :attr:`values` is read: a native step of many layers pays for none."""
        lo = self.visible_start(self.length)
        self.length += tokens
        self._views_from = lo
        if not views:
            return None
        return self.keys, self.values

    def _views(self) -> None:
        lo, self._views_from = self._views_from, None
        if self.active is None:  # moved since: no buffer to view (the next update makes them)
            self._keys = self._values = None
            return
        k_buf, v_buf = self.active
        self._keys = k_buf[lo:self.length].permute(1, 2, 0, 3)
        self._values = v_buf[lo:self.length].permute(1, 2, 0, 3)

    @property
    def keys(self):
        if getattr(self, "_views_from", None) is not None:
            self._views()
        return self._keys

    @keys.setter
    def keys(self, value) -> None:
        self._views_from, self._keys = None, value

    @property
    def values(self):
        if getattr(self, "_views_from", None) is not None:
            self._views()
        return self._values

    @values.setter
    def values(self, value) -> None:
        self._views_from, self._values = None, value

    def cpu_f32_buffers(self) -> KV | None:
        """The active (capacity, batch, heads, dim) buffers when they are contiguous float32 host
        tensors, which a native decode step writes into directly (and reads from position 0: the
        caller checks that a sliding layer's window still holds every key); else None."""
        if self.active is None:
            return None
        k, v = self.active
        ok = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in (k, v))
        return (k, v) if ok else None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) as DynamicLayer / DynamicSlidingWindowLayer report them."""
        if not self.window:
            return self.length + query_length, 0
        kv_offset = self.visible_start(self.length)
        kv_length = (self.window - 1 if self.length >= self.window else self.length) + query_length
        return kv_length, kv_offset

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.window or -1

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
        """Move the tokens attention will still read to ``place`` (the prefill -> decode switch),
        converting the dtype if needed. The caller chooses the stream; the copy is async on CUDA
        where it crosses."""
        if place == self.home:
            return
        src, dst = self.stores[self.home], self.stores[place]
        direction = _direction(self.home, place)
        lo = self.visible_start(self.length)
        if self.length > lo:
            for s, d in zip(src, dst):
                self.link.copy(d[lo:self.length], s[lo:self.length], direction, "kv-switch", self.index)
        self.home = place
        self.active, self.active_place = None, None

    def prefetch(self, slot: tuple[torch.Tensor, torch.dtype], slot_index: int) -> None:
        """Copy the past tokens attention will read from home (pinned host) into an accelerator
        ``slot`` (a byte buffer and its dtype) and compute from there (caller is on the copy stream)."""
        home = self.stores[self.home]
        self._slot_raw = slot
        views = self._slot_views(slot)
        lo = self.visible_start(self.length)
        if self.length > lo:
            for s, d in zip(home, views):
                self.link.copy(d[lo:self.length], s[lo:self.length], H2D, "kv", self.index)
        self.active, self.active_place = views, ("slot", slot_index)
        self._offload_from = self.length

    def offload(self) -> None:
        """Send the tokens computed since ``prefetch()`` back home (caller is on the copy stream)."""
        lo, hi = self._offload_from, self.length
        if hi > lo:
            for s, d in zip(self.active, self.stores[self.home]):
                self.link.copy(d[lo:hi], s[lo:hi], D2H, "kv", self.index)
        self._offload_from = hi
        self.active, self.active_place = None, None
        self._slot_raw = None

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

