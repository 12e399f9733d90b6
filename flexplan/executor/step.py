"""What one forward step carries between the executor's hooks, and how activations move.

The model computes rotary embeddings, the attention mask and position ids once per step on
the host (where the embedding lookup runs). Each is moved to the accelerator, and cast to the
compute dtype, at most once per step and (device, dtype); the hidden state moves only when
consecutive layers compute on different sides of the link.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flexplan.executor.kv_cache import FlexCache
from flexplan.executor.link import Link


@dataclass
class Step:
    phase: str  # "prefill" (empty cache) or "decode"
    batch: int
    query_len: int
    past_len: int
    t0: float
    moved: dict = field(default_factory=dict)  # (id, on_acc, dtype) -> (original, moved)
    slot_of: dict = field(default_factory=dict)  # streamed layer -> double-buffer slot it was prefetched into
    next_slot: int = 0
    deferred_prefetch: int | None = None  # the streamed layer whose copy waits for a split layer's segment
    hidden_on_acc: bool = False  # where the hidden state is now
    cache: FlexCache | None = None

    def hidden_to(self, link: Link, t: torch.Tensor, on_acc: bool, dtype: torch.dtype, layer) -> torch.Tensor:
        if self.hidden_on_acc != on_acc:
            t = link.move(t, on_acc, dtype, "hidden", layer)
        elif t.dtype != dtype:
            t = t.to(dtype)
        self.hidden_on_acc = on_acc
        return t

    def cpu_decode_mask(self, keys: int) -> torch.Tensor:
        """An all-true [batch, 1, 1, keys] mask for one decode step on the CPU over a layer's
        ``keys`` keys (a sliding layer sees fewer). With no mask, transformers sends grouped-query
        attention to PyTorch's unmasked CPU SDPA kernel, which reads a bf16 KV cache ~10x slower
        (1.2 vs 12 GB/s measured) than the masked path; the result is the same attention."""
        key = ("cpu_decode_mask", keys)
        if key not in self.moved:
            self.moved[key] = torch.ones(self.batch, 1, 1, keys, dtype=torch.bool)
        return self.moved[key]

    def aux_to(self, link: Link, v, on_acc: bool, dtype: torch.dtype):
        """Rotary embeddings, masks, position ids (host tensors) where and as a layer needs them."""
        if isinstance(v, (tuple, list)):
            return type(v)(self.aux_to(link, x, on_acc, dtype) for x in v)
        if not isinstance(v, torch.Tensor):
            return v
        cast = dtype if v.is_floating_point() and v.dtype != dtype else None
        if not on_acc and cast is None:
            return v
        key = (id(v), on_acc, cast)
        if key not in self.moved:
            out = v
            if cast is not None and torch.finfo(cast).max < torch.finfo(v.dtype).max:
                out = out.clamp(torch.finfo(cast).min, torch.finfo(cast).max)  # a finite mask stays finite
            out = link.move(out, True, cast, "aux") if on_acc else out.to(cast)
            self.moved[key] = (v, out)  # holding v keeps its id unique within the step
        return self.moved[key][1]


def generic_kv_to(cache, i: int, device: torch.device, dtype: torch.dtype) -> None:
    """A cache that is not ours (e.g. the DynamicCache of a direct ``model.generate`` call): keep
    layer i's tensors on the device and in the dtype the layer computes in."""
    layers = getattr(cache, "layers", None)
    if layers is None or i >= len(layers) or getattr(layers[i], "keys", None) is None:
        return
    cl = layers[i]
    if cl.keys.numel() and (cl.keys.device != device or cl.keys.dtype != dtype):
        cl.keys, cl.values = cl.keys.to(device, dtype), cl.values.to(device, dtype)
        cl.device, cl.dtype = device, dtype
