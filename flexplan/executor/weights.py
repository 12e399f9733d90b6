"""Weights of each placement unit packed into flat buffers, and the streaming double buffers.

Each unit (the embedding, one decoder layer, the head) keeps one flat buffer per place it
needs (pageable host in the CPU dtype, pinned host or accelerator in the accelerator dtype),
allocated once when the model is placed. The module's parameters are views into one of them
(``bind``), so moving a layer is rebinding views, and streaming a layer is ONE contiguous copy
of its pinned buffer into an accelerator slot with the same layout.

In host memory (the CPU computes from it and never streams it) the weights of plain linears are
instead packed tensors (``cpu_linear``: blocked or oneDNN-packed), one per matrix, in place of
their slice of the flat buffer: the CPU's GEMVs then run at memory bandwidth, and there is still
one copy. Blocked ones keep a 16-bit model's dtype when the CPU computes in float32
(``flexplan.hardware.spec.cpu_weight_dtype``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from flexplan.executor import cpu_linear
from flexplan.executor.rebinds import note_rebind
from flexplan.executor.cpu_experts import block_experts_into, unblock_experts
from flexplan.executor.link import ACCELERATOR, H2D, H2H, HOST_MEMORY, PINNED, Buffer, Link

ALIGN_BYTES = 64
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    return name if isinstance(name, torch.dtype) else TORCH_DTYPES[name]


@dataclass(frozen=True)
class FlatLayout:
    """Byte offset of each tensor of a unit inside one flat buffer, for one dtype (raw bytes, a
    GGUF file's blocks, keep their own)."""

    dtype: torch.dtype
    entries: tuple[tuple[str, tuple[int, ...], int, int, torch.dtype], ...]  # (name, shape, offset, nbytes, dtype)
    nbytes: int

    @classmethod
    def of(cls, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
           own_dtypes: dict[str, torch.dtype] | None = None) -> "FlatLayout":
        entries, off = [], 0
        for name, shape in shapes:
            dt = (own_dtypes or {}).get(name, dtype)
            n = torch.empty((), dtype=dt).element_size()
            for d in shape:
                n *= d
            entries.append((name, tuple(shape), off, n, dt))
            off += -(-n // ALIGN_BYTES) * ALIGN_BYTES
        return cls(dtype, tuple(entries), off)

    @property
    def param_bytes(self) -> int:
        return sum(e[3] for e in self.entries)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[off:off + n].view(dt).view(shape) for name, shape, off, n, dt in self.entries}


@dataclass
class Storage:
    place: str
    buffer: Buffer
    layout: FlatLayout
    views: dict[str, torch.Tensor]
    packed: tuple[Buffer, ...] = ()  # packed linear weights (host only, cpu_linear), outside the flat buffer
    pack_batch: int | None = None  # the batch hint they were packed for
    weight_dtype: torch.dtype | None = None  # the dtype they were asked for in (host only)
    part: str = "all"  # which tensors it holds: "all", "rest" (all but the routed experts), "experts"

    def buffers(self) -> tuple[Buffer, ...]:
        return (self.buffer, *self.packed)


def on_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (a device-to-host copy when it lives on the accelerator)."""
    return t if t.device.type == "cpu" else t.to("cpu")


def cpu_experts_block(dense: torch.Tensor, transposed: bool, view: torch.Tensor) -> torch.Tensor:
    return block_experts_into(dense, transposed, view)


def set_param(module: nn.Module, leaf: str, tensor: torch.Tensor) -> None:
    """Point a parameter at ``tensor`` (keeps the Parameter object unless it was on meta)."""
    p = module._parameters[leaf]
    if p is None or p.device.type == "meta" or not torch._has_compatible_shallow_copy_type(p, tensor):
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        p.data = tensor
    note_rebind()


ALL, REST, EXPERTS = "all", "rest", "experts"  # the parts of a unit a storage may hold


class GroupWeights:
    """The parameters of one placement unit and the flat buffers that hold them. A decoder layer
    whose routed experts (``experts``: their parameter names) live apart from the rest of it (the
    ``cpu-experts`` policy) keeps a storage per place holding the part that lives there."""

    def __init__(self, name: str, layer: int | None, params: dict[str, tuple[nn.Module, str]],
                 host_aliases: dict[str, tuple["GroupWeights", str]] | None = None, pack_kernel: str | None = None,
                 packed_embeddings: frozenset[str] = frozenset(), experts: frozenset[str] = frozenset(),
                 blocked_experts: dict[str, bool] | None = None):
        self.name = name
        self.experts = frozenset(experts)
        # routed-expert matrices the CPU's float32 experts-only copy holds blocked (name -> stored
        # transposed, [E, in, out]); cpu_experts.blockable_experts
        self.blocked_experts = dict(blocked_experts or {})
        self.layer = layer
        self.params = params  # qualified name -> (module, leaf)
        # names whose host (CPU-dtype) copy is another unit's tensor (a tied LM head = embedding)
        self.host_aliases = host_aliases or {}
        # names whose host copy is a packed (blocked or oneDNN) tensor of its own (plain linears'
        # weights), in the layout of ``pack_kernel`` (cpu_linear.PACKING_KERNELS; None: no packing)
        self.pack_kernel = pack_kernel
        self.packed = frozenset(n for n, (m, leaf) in params.items()
                                if pack_kernel and leaf == "weight" and cpu_linear.packable(m) and n not in self.host_aliases)
        # an embedding whose weight the LM head shares: held as cpu_linear.pack_embedding gives it
        self.packed |= frozenset(packed_embeddings)
        # raw bytes (a GGUF file's blocks, flexplan.quant's QuantLinear.blocks): their own dtype in
        # every place, the host's copy the tensor as loaded (the kernels read the blocks as they are)
        self.raw = {n: m._parameters[leaf].dtype for n, (m, leaf) in params.items()
                    if not m._parameters[leaf].dtype.is_floating_point}
        self.shapes = [(n, tuple(m._parameters[leaf].shape)) for n, (m, leaf) in params.items()]
        self.shape_of = dict(self.shapes)
        self.storages: dict[str, Storage] = {}
        self.bound: object = None
        self._layouts: dict[tuple, FlatLayout] = {}

    def names(self, part: str = ALL) -> list[str]:
        return [n for n, _ in self.shapes if part == ALL or (n in self.experts) == (part == EXPERTS)]

    def layout(self, place: str, dtype: torch.dtype, part: str = ALL) -> FlatLayout:
        key = (place == HOST_MEMORY, dtype, part)
        if key not in self._layouts:
            skip = set(self.host_aliases) | self.packed | set(self.raw) if place == HOST_MEMORY else set()
            keep = set(self.names(part))
            self._layouts[key] = FlatLayout.of([s for s in self.shapes if s[0] not in skip and s[0] in keep], dtype,
                                               self.raw)
        return self._layouts[key]

    def packed_dtype(self, name: str, dtype: torch.dtype, weight_dtype: torch.dtype | None) -> torch.dtype:
        """The dtype the packed host weight ``name`` is held in when the CPU computes in ``dtype``
        and the weights are asked for in ``weight_dtype`` (None: ``dtype``): cpu_linear.stored_dtype."""
        if isinstance(self.params[name][0], nn.Embedding):
            return cpu_linear.stored_dtype(self.shape_of[name], weight_dtype or dtype, dtype, cpu_linear.KERNEL_BLOCKED,
                                           embedding=True)
        return cpu_linear.stored_dtype(self.shape_of[name], weight_dtype or dtype, dtype, self.pack_kernel)

    def packed_rows(self, name: str, dtype: torch.dtype, weight_dtype: torch.dtype | None) -> int:
        """Rows the packed host weight ``name`` holds: a tied embedding blocked for the CPU's
        ``dtype`` holds whole blocks (cpu_linear.pack_embedding), any other its own rows."""
        rows = self.shape_of[name][0]
        if isinstance(self.params[name][0], nn.Embedding) and cpu_linear.embedding_blockable(
                self.shape_of[name], self.packed_dtype(name, dtype, weight_dtype), dtype):
            return cpu_linear.blocked_rows(rows)
        return rows

    def nbytes(self, place: str, dtype: torch.dtype, weight_dtype: torch.dtype | None = None, part: str = ALL) -> int:
        """Bytes this unit's weights (``part`` of them) take in ``place`` (flat buffer plus packed
        weights, these asked for in ``weight_dtype``)."""
        n = self.layout(place, dtype, part).nbytes
        if place == HOST_MEMORY:
            n += sum(self.packed_rows(name, dtype, weight_dtype) * math.prod(self.shape_of[name][1:])
                     * self.packed_dtype(name, dtype, weight_dtype).itemsize
                     for name in self.packed if name in self.names(part))
            n += sum(math.prod(self.shape_of[name]) * dt.itemsize for name, dt in self.raw.items()
                     if name in self.names(part))
        return n

    def dense(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` (tensor ``name``) as a dense tensor: a packed linear or embedding weight, or a
        blocked routed-expert weight, reordered back; any other tensor as is."""
        if name in self.blocked_experts and t.dim() == 4:
            return unblock_experts(t, self.blocked_experts[name])
        if isinstance(self.params[name][0], (nn.Linear, nn.Embedding)):
            return cpu_linear.dense(t, self.shape_of[name][0])
        return t

    def param_tensor(self, name: str) -> torch.Tensor:
        m, leaf = self.params[name]
        return m._parameters[leaf]

    def source_from_storages(self) -> Callable[[str], torch.Tensor] | None:
        """Reads each tensor from an existing storage (for re-placement), preferring the host."""
        order = [self.storages[p] for p in (PINNED, HOST_MEMORY, ACCELERATOR) if p in self.storages]
        if not order:
            return None

        def read(name):
            st = next((st for st in order if name in st.views), None)
            return self.dense(name, st.views[name] if st is not None else self._alias_view(name))
        return read

    def _alias_view(self, name: str) -> torch.Tensor:
        other, other_name = self.host_aliases[name]
        return other.storages[HOST_MEMORY if HOST_MEMORY in other.storages else PINNED].views[other_name]

    def ensure(self, places: dict[str, torch.dtype], link: Link, source: Callable[[str], torch.Tensor] | None,
               pack_batch: int | None = None, weight_dtype: torch.dtype | None = None,
               parts: dict[str, str] | None = None) -> None:
        """Allocate and fill the storages in ``places`` that are missing (or of another dtype, or
        holding oneDNN-packed weights for another batch hint; blocked weights do not depend on
        it), then free the ones no longer needed. ``source(name)`` gives each tensor's data. The
        packed host weights are asked for in ``weight_dtype`` (None: the host dtype; see
        :meth:`packed_dtype`). ``parts``: the part of the unit each place holds (default all)."""
        any_src = source if source is not None else self.source_from_storages()
        parts = parts or {}
        for place, dtype in places.items():
            part = parts.get(place, ALL)
            # a host copy made from an accelerator tensor (a resident layer the new plan computes on
            # the CPU, a model handed over on the GPU) is packed and blocked by CPU-only kernels:
            # its data comes to host memory first
            src = any_src if any_src is None or place == ACCELERATOR else (lambda name, s=any_src: on_host(s(name)))
            cur = self.storages.get(place)
            if (cur is not None and cur.layout.dtype == dtype and cur.part == part
                    and (place != HOST_MEMORY or cur.weight_dtype == weight_dtype)
                    and not (cur.pack_batch != pack_batch and any(b.tensor.is_mkldnn for b in cur.packed))):
                continue
            layout = self.layout(place, dtype, part)
            buf = link.alloc(max(layout.nbytes, 1), place, f"{self.name} weights ({place}, {str(dtype)[6:]})")
            views = layout.views(buf.tensor)
            direction = H2D if place == ACCELERATOR else H2H
            read_into = getattr(any_src, "read_into", None)  # a file source fills host buffers directly
            blocked = self.blocked_experts if place == HOST_MEMORY and part == EXPERTS and dtype == torch.float32 else {}
            for name, view in views.items():
                with torch.no_grad():
                    if name in blocked:  # the CPU's copy of routed experts: blocked for the native GEMV, same bytes
                        view = views[name] = cpu_experts_block(self.dense(name, src(name)), blocked[name], view)
                    elif read_into is None or not read_into(name, view):
                        view.copy_(src(name))
                if place == ACCELERATOR:
                    link.log(direction, "load", self.layer, view.numel() * view.element_size())
            packed = []
            if place == HOST_MEMORY:
                for name in self.host_aliases:
                    if part != EXPERTS:
                        views[name] = self._alias_view(name)
                for name in sorted(self.packed & set(self.names(part))):
                    w = self.dense(name, src(name)).to(self.packed_dtype(name, dtype, weight_dtype))
                    if isinstance(self.params[name][0], nn.Embedding):
                        w = cpu_linear.pack_embedding(w, dtype)
                        setattr(self.params[name][0], cpu_linear.ROWS_DTYPE_ATTR, dtype)
                    else:
                        w = cpu_linear.pack(w, pack_batch, self.pack_kernel, dtype)
                    packed.append(link.adopt(w, HOST_MEMORY, f"{self.name} {name} ({cpu_linear.layout_name(w)})"))
                    views[name] = w
                for name in sorted(set(self.raw) & set(self.names(part))):  # the blocks as loaded, no copy
                    w = src(name).contiguous()
                    packed.append(link.adopt(w, HOST_MEMORY, f"{self.name} {name} (raw blocks)"))
                    views[name] = w
            old = self.storages.get(place)
            self.storages[place] = Storage(place, buf, layout, views, tuple(packed), pack_batch,
                                           weight_dtype if place == HOST_MEMORY else None, part)
            if old is not None:
                self._free(old, link)
                if self.bound == place:
                    self.bound = None  # the parameters still point at the old buffer: rebind
        for place in [p for p in self.storages if p not in places]:
            self._free(self.storages.pop(place), link)
        if self.bound not in self.storages:
            self.bound = None

    def bind(self, place: str, experts_place: str | None = None) -> None:
        """Point the module's parameters at the storage in ``place`` (the routed experts' at the one
        in ``experts_place`` when they live apart)."""
        key = place if experts_place in (None, place) else (place, experts_place)
        if self.bound == key:
            return
        views = self.storages[place].views
        if key != place:
            views = {**views, **{n: self.storages[experts_place].views[n] for n in self.experts}}
        self.bind_views(views)
        self.bound = key

    def bind_views(self, views: dict[str, torch.Tensor], tag: object = None) -> None:
        for name, (module, leaf) in self.params.items():
            set_param(module, leaf, views[name])
        self.bound = tag

    @staticmethod
    def _free(st: Storage, link: Link) -> None:
        for b in st.buffers():
            link.free(b)

    def free(self, link: Link) -> None:
        for st in self.storages.values():
            self._free(st, link)
        self.storages.clear()
        self.bound = None


class StreamSlots:
    """Two accelerator buffers that streamed layers take turns in (double buffering): while
    layer i computes from one, layer i+1 is copied into the other on the copy stream."""

    def __init__(self, link: Link, nbytes: int):
        self.nbytes = int(nbytes)
        self.buffers = [link.alloc(max(self.nbytes, 1), ACCELERATOR, f"weight slot {s}") for s in (0, 1)]
        self.ready = [link.event(), link.event()]  # copy into the slot finished
        self.free = [link.event(), link.event()]  # last computation reading the slot finished
        self.used = [False, False]
        self._views: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def views(self, group: GroupWeights, slot: int) -> dict[str, torch.Tensor]:
        key = (group.name, slot)
        if key not in self._views:
            layout = group.storages[PINNED].layout
            self._views[key] = layout.views(self.buffers[slot].tensor)
        return self._views[key]

    def load(self, group: GroupWeights, slot: int, link: Link) -> None:
        """Copy ``group``'s pinned weights into ``slot`` (caller is on the copy stream)."""
        st = group.storages[PINNED]
        n = st.layout.nbytes
        link.copy(self.buffers[slot].tensor[:n], st.buffer.tensor[:n], H2D, "weights", group.layer)

    def release(self, link: Link) -> None:
        for b in self.buffers:
            link.free(b)
        self.buffers = []
