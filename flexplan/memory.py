"""How many bytes a placement occupies in accelerator, pinned and pageable host memory: ONE pure
function, :func:`footprint`, that the planner calls (vectorised over its candidate M) and the
executor's fit check calls (before it allocates anything).

Sizes are what the executor allocates (``executor/weights.py``, ``executor/kv_cache.py``):

- each placement unit (embedding, decoder layer, head) is one flat buffer per place, each tensor
  in it padded to 64 bytes (``ALIGN_BYTES``); pinned and accelerator buffers hold the
  accelerator dtype, host buffers the CPU dtype;
- in host memory, plain linear weights are packed tensors of their own (no padding) when the CPU
  linear kernel packs (``flexplan-blocked`` or ``onednn-packed``), held in the weight dtype where
  the blocked kernel reads it (a 16-bit model under float32 compute: spec.cpu_weight_dtype) and in
  the CPU dtype otherwise; a tied embedding is blocked likewise (any vocabulary: its last block
  zero-filled) and the LM head's host copy IS it;
- a GGUF file's blocks (weights held compressed) keep their bytes in every place: on the host the
  tensor as loaded, in pinned and accelerator buffers a linear's blocks as they are (the
  accelerator dequantises them per call);
- one KV buffer per place a layer's KV uses, in that place's dtype; a host copy is pinned when the
  layer is also accelerator-resident (it crosses the link at the phase switch);
- two accelerator weight slots and two KV slots when any layer is streamed (double buffering);
- transient activations of one layer step and the fp32 logits (not allocated through the link),
  one layer's KV in transit to the accelerator where split points cut layers (its attention may
  compute there), and the accelerator runtime's reserve the caller gives.

What the model holds comes as an :class:`Inventory` (tensor shapes of each unit): from a
:class:`ModelSpec` for the planner, from the loaded modules for the executor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Mapping

import numpy as np

from flexplan.hardware.spec import DTYPE_BYTES, cpu_weight_dtype
from flexplan.workload import weight_formats
from flexplan.placement import (
    ACCELERATOR,
    HOST,
    ON_ACCELERATOR,
    PINNED,
    SPLIT_POINTS,
    PhasePlacement,
    Placement,
)

ALIGN_BYTES = 64  # executor.weights.FlatLayout: each tensor's offset in a flat buffer
CPU_MEMORY_USABLE_FRACTION = 0.90  # leave 10% of host memory to the OS and the Python process
KERNEL_BLOCKED, KERNEL_PACKED = "flexplan-blocked", "onednn-packed"  # executor.cpu_linear's names
BLOCK = 64  # rows per block of the blocked layout (native_gemv.c's BLOCK; executor.cpu_linear reads it here)
BLOCKED_WEIGHT_DTYPES = ("float32", "bfloat16", "float16")  # what the native GEMV reads

# Tensor kinds, for how the host holds them.
PLAIN = "plain"  # in the unit's flat buffer everywhere
LINEAR = "linear"  # a plain nn.Linear weight: packed on the host when the CPU kernel packs
TIED_EMBEDDING = "tied embedding"  # an embedding the LM head shares: blocked on the host when it can be
ALIAS = "alias"  # the LM head's host copy is the tied embedding's (no host bytes of its own)
EXPERTS = "routed experts"  # an MoE layer's routed expert weights: a split mode may keep them apart from the layer
TRANSIENT = ("activations", "runtime reserve", "KV in transit")  # parts not allocated through the executor's link


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    kind: str = PLAIN
    # held as a GGUF file's blocks: on the host as loaded (a buffer of its own); elsewhere a linear's
    # blocks sit in the flat buffer as they are (the link and the accelerator carry them); 0: the place's dtype
    bytes_per_weight: float = 0.0


@dataclass(frozen=True)
class Inventory:
    """The tensors of each placement unit, and the sizes activations and the KV cache need."""

    embedding: tuple[Tensor, ...]
    layers: tuple[tuple[Tensor, ...], ...]
    head: tuple[Tensor, ...]
    kv_heads: int
    head_dim: int
    activation_elems_per_row: int  # hidden, residual, q/k/v/attention output, MLP intermediates
    vocab_size: int
    v_head_dim: int = 0  # value head width when it differs from the key's (0: head_dim)
    kv_elems_per_token: int = 0  # K + V elements a token stores per layer (0: kv_heads x (head_dim + v_head_dim))
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def memo(self, key, make, limit: int | None = None):
        """``make()``, kept under ``key`` for the life of this inventory (what depends on the
        model alone, asked for many requests); ``limit``: at most that many entries share the
        key's first element, the oldest dropped first."""
        if limit is None:
            if key not in self._cache:
                self._cache[key] = make()
            return self._cache[key]
        group = self._cache.setdefault(key[0], {})
        if key not in group:
            if len(group) >= limit:
                group.pop(next(iter(group)))
            group[key] = make()
        return group[key]

    @cached_property
    def homogeneous(self) -> bool:
        return len(set(self.layers)) <= 1

    @classmethod
    def from_spec(cls, spec, weights: tuple = ()) -> "Inventory":
        """What the executor would hold for ``spec`` (workload.ModelSpec), unit by unit: each
        layer's projections as the linears transformers builds (packed on the host), routed experts
        as the fused 3-D tensors transformers 5 holds them in (never packed), and what else a layer
        holds (norms, QK-norms, sinks, biases) as one plain tensor per group of the size the spec
        counts. Layers differ where the spec says they do (dense and MoE layers). ``weights``: the
        (group, format, parameters) triples of a GGUF file whose blocks the host keeps
        (workload.weight_formats): each group's tensors at its bytes per weight."""
        per_group = weight_formats.group_bytes_per_weight(tuple(weights)) if weights else {}

        def held(group, tensors):
            if group not in per_group:
                return list(tensors)
            return [replace(t, bytes_per_weight=per_group[group]) if t.kind != ALIAS else t for t in tensors]

        h, q, kvd = spec.hidden_size, spec.q_dim, spec.num_kv_heads * (spec.v_head_dim or spec.head_dim)
        kd = spec.num_kv_heads * spec.head_dim
        emb = spec.word_embed_proj_dim or h
        vo = spec.num_heads * (spec.v_head_dim or spec.head_dim)

        def norm(name, width=h):
            if not spec.norm_affine:
                return []
            return [Tensor(f"{name}.weight", (width,))] + ([Tensor(f"{name}.bias", (width,))] if spec.norm == "layer" else [])

        def linear(name, out, inp, bias):
            return [Tensor(f"{name}.weight", (out, inp), LINEAR)] + ([Tensor(f"{name}.bias", (out,))] if bias else [])

        def rest(name, tensors, params):
            """A plain tensor for what a group holds beyond ``tensors`` (spec.layer_group_params)."""
            left = params - sum(math.prod(t.shape) for t in tensors)
            return tensors + ([Tensor(name, (left,))] if left > 0 else [])

        def mlp(name, width, bias):
            if spec.gated_mlp:
                return linear(f"{name}.gate", width, h, bias) + linear(f"{name}.up", width, h, bias) + \
                    linear(f"{name}.down", h, width, bias)
            return linear(f"{name}.fc1", width, h, bias) + linear(f"{name}.fc2", h, width, bias)

        if spec.kv_lora_rank:  # DeepSeek MLA: low-rank projections
            r, qr, rope, hd = spec.kv_lora_rank, spec.q_lora_rank, spec.qk_rope_head_dim, spec.head_dim
            attn = (linear("q_a", qr, h, spec.qkv_bias) + linear("q_b", q, qr, False)) if qr else linear("q", q, h, False)
            attn += linear("kv_a", r + rope, h, spec.qkv_bias) + linear("kv_b", spec.num_heads * (hd - rope) + vo, r, False)
        else:
            attn = linear("q", q, h, spec.qkv_bias) + linear("k", kd, h, spec.qkv_bias) + linear("v", kvd, h, spec.qkv_bias)
        attn += linear("o", h, vo, spec.o_bias)
        layers = []
        for i in range(spec.num_layers):
            g = spec.layer_group_params(i)
            layer = held("attention", rest("attention.rest", list(attn), g["attention"])) + held(
                "norms", rest("norms", norm("attn_norm") + norm("mlp_norm"), g["norms"]))
            if g["mlp"]:
                layer += held("mlp", rest("mlp.rest", mlp("mlp", spec.intermediate_size, spec.mlp_bias), g["mlp"]))
            if g["router"]:
                layer += held("router", [Tensor("router.weight", (g["router"],))])
            if g["experts"]:  # transformers 5 fuses the experts into 3-D parameters: held as they are
                layer += held("experts", [Tensor("experts", (g["experts"],), EXPERTS)])
            if g["shared_experts"]:
                layer += held("shared_experts", rest("shared.rest", mlp("shared", spec.shared_expert_intermediate_size,
                                                                         spec.mlp_bias), g["shared_experts"]))
            layers.append(tuple(layer))
        tied = spec.tie_word_embeddings
        embedding = [Tensor("embed_tokens.weight", (spec.vocab_size, emb), TIED_EMBEDDING if tied else PLAIN)]
        if spec.learned_pos_embeddings:
            embedding.append(Tensor("embed_positions.weight", (spec.learned_pos_embeddings, h)))
        if spec.word_embed_proj_dim:
            embedding.append(Tensor("project_in.weight", (h, emb)))  # the embedding unit packs nothing
        # spec.embedding_params counts OPT's project_out too; it sits in the head
        embedding = rest("embedding.rest", embedding, spec.embedding_params - (emb * h if spec.word_embed_proj_dim else 0))
        head = norm("final_norm") if spec.final_norm else []
        if spec.word_embed_proj_dim:
            head.append(Tensor("project_out.weight", (emb, h), LINEAR))
        head = held("final_norm", rest("head.rest", head, spec.final_norm_params + (emb * h if spec.word_embed_proj_dim else 0)))
        if weights:  # the head holds blocks of its own (the embedding's where tied) beside the float32 embedding
            head.append(Tensor("lm_head.weight", (spec.vocab_size, emb), LINEAR, weight_formats.head_bytes_per_weight(weights)))
            embedding = [replace(t, kind=PLAIN) if t.kind == TIED_EMBEDDING else t for t in embedding]
        else:
            head.append(Tensor("lm_head.weight", (spec.vocab_size, emb), ALIAS if tied else LINEAR))
        if getattr(spec, "lm_head_bias", False):
            head.append(Tensor("lm_head.bias", (spec.vocab_size,)))
        embedding = held("embedding", embedding)
        return cls(tuple(embedding), tuple(layers), tuple(head), spec.num_kv_heads, spec.head_dim,
                   activation_elems_per_row(spec),
                   spec.vocab_size, v_head_dim=spec.v_head_dim or spec.head_dim,
                   kv_elems_per_token=spec.kv_elems_per_token)


def activation_elems_per_row(spec) -> int:
    """Transient elements of one layer step per token: hidden, residual, q/k/v/attention output and
    the MLP intermediates (gate, up, product) of the widest MLP a token runs (MoE: k experts + shared)."""
    h, q = spec.hidden_size, spec.q_dim
    kd, kvd = spec.num_kv_heads * spec.head_dim, spec.num_kv_heads * (spec.v_head_dim or spec.head_dim)
    width = spec.intermediate_size if not spec.is_moe else max(
        spec.intermediate_size if not all(spec.moe_layers) else 0,
        spec.experts_per_token * spec.expert_intermediate_size + spec.shared_expert_intermediate_size)
    return 4 * h + q + kd + kvd + 3 * width


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _packed(t: Tensor, kernel: str | None) -> bool:
    if t.kind == LINEAR:
        return kernel in (KERNEL_BLOCKED, KERNEL_PACKED)
    if t.kind == TIED_EMBEDDING:
        return kernel == KERNEL_BLOCKED
    return False


def blocked_rows(rows: int) -> int:
    """Rows a blocked weight of ``rows`` rows holds: whole blocks, the last one zero-filled
    (executor.cpu_linear.block)."""
    return -(-int(rows) // BLOCK) * BLOCK


def _packed_rows(t: Tensor, kernel: str | None) -> int:
    """Rows of a packed host weight: a tied embedding is blocked in whole blocks, the last one
    zero-filled past its vocabulary (cpu_linear.pack_embedding); a linear holds its own rows."""
    return blocked_rows(t.shape[0]) if t.kind == TIED_EMBEDDING and kernel == KERNEL_BLOCKED else t.shape[0]


def packed_dtype(t: Tensor, weight_dtype: str, cpu_dtype: str, kernel: str | None) -> str:
    """cpu_linear.stored_dtype: the weight dtype where the blocked kernel reads it, else the CPU's."""
    if (kernel == KERNEL_BLOCKED and len(t.shape) == 2 and (t.kind == TIED_EMBEDDING or t.shape[0] % BLOCK == 0)
            and cpu_dtype == "float32" and weight_dtype in BLOCKED_WEIGHT_DTYPES):
        return weight_dtype
    return cpu_dtype


def unit_bytes(tensors: tuple[Tensor, ...], place: str, dtype: str, cpu_dtype: str, kernel: str | None) -> int:
    """Bytes of one unit's weights in ``place``: its flat buffer (64-byte aligned tensors), plus
    on the host its packed weights (GroupWeights.nbytes)."""
    if place != HOST:  # the flat buffer: blocks (a linear's or the experts' bytes per weight) as they are, the rest in the dtype
        return max(1, sum(_padded(math.ceil(math.prod(t.shape) * t.bytes_per_weight) if t.bytes_per_weight
                                  and t.kind in (LINEAR, EXPERTS) else math.prod(t.shape) * DTYPE_BYTES[dtype])
                          for t in tensors))
    wdt = cpu_weight_dtype(dtype, cpu_dtype)
    flat = packed = 0
    for t in tensors:
        if t.kind == ALIAS:
            continue
        if t.bytes_per_weight:  # a GGUF file's blocks, one buffer each as loaded
            packed += math.ceil(math.prod(t.shape) * t.bytes_per_weight)
        elif _packed(t, kernel):
            packed += _packed_rows(t, kernel) * math.prod(t.shape[1:]) * DTYPE_BYTES[packed_dtype(t, wdt, cpu_dtype, kernel)]
        else:
            flat += _padded(math.prod(t.shape) * DTYPE_BYTES[cpu_dtype])
    return max(1, flat) + packed  # a flat buffer is allocated even when empty (Link.alloc(max(n, 1)))


def kv_bytes(inv: Inventory, batch: int, capacity: int, dtype: str) -> int:
    """K and V of one layer: batch x tokens x K + V elements per token (kv_cache.kv_bytes)."""
    elems = inv.kv_elems_per_token or inv.kv_heads * (inv.head_dim + (inv.v_head_dim or inv.head_dim))
    return batch * capacity * elems * DTYPE_BYTES[dtype]


def activation_bytes(inv: Inventory, rows: int, dtype: str, batch: int) -> int:
    """Peak transient activations of one layer step over ``rows`` tokens, plus fp32 logits of the
    last position of each sequence."""
    return rows * inv.activation_elems_per_row * DTYPE_BYTES[dtype] + batch * inv.vocab_size * 4


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes by memory, each with its parts (name -> bytes; arrays for a vectorised placement)."""

    accelerator: Mapping[str, object]
    pinned: Mapping[str, object]
    host: Mapping[str, object]

    @property
    def accelerator_bytes(self):
        return _total(self.accelerator)

    @property
    def pinned_bytes(self):
        return _total(self.pinned)

    @property
    def host_bytes(self):
        return _total(self.host)

    @property
    def host_total_bytes(self):
        """Pinned plus pageable host memory."""
        return self.pinned_bytes + self.host_bytes

    def allocated(self, where: str):
        """Bytes of ``where`` ('accelerator', 'pinned', 'host') the executor allocates through its
        link (the transient parts left out)."""
        return _total({k: v for k, v in getattr(self, where).items() if k not in TRANSIENT})


def _total(d: Mapping[str, object]):
    t = sum(d.values(), 0)
    return t if isinstance(t, np.ndarray) else int(t)


def _units(inv: Inventory, dtype: str, cpu_dtype: str, kernel: str | None) -> dict:
    def make() -> dict:
        places = {HOST: cpu_dtype, PINNED: dtype, ACCELERATOR: dtype}
        layers = inv.layers[:1] if inv.homogeneous else inv.layers
        return dict(
            layers=[{p: unit_bytes(ts, p, dtype, cpu_dtype, kernel) for p in places} for ts in layers],
            head={p: unit_bytes(inv.head, p, dtype, cpu_dtype, kernel) for p in places},
            experts=[{p: _expert_bytes(ts, p, dtype, cpu_dtype) for p in places} for ts in layers],
            embedding=unit_bytes(inv.embedding, HOST, dtype, cpu_dtype, kernel),
        )

    return inv.memo(("units", dtype, cpu_dtype, kernel), make)


def _expert_bytes(tensors: tuple[Tensor, ...], place: str, dtype: str, cpu_dtype: str) -> int:
    """Bytes of a layer's routed-expert tensors in ``place`` (0 for a layer without them): blocks
    (QuantExperts) as they are in every memory, float experts in the place's dtype."""
    dt = cpu_dtype if place == HOST else dtype
    return sum(math.ceil(math.prod(t.shape) * t.bytes_per_weight) if t.bytes_per_weight
               else _padded(math.prod(t.shape) * DTYPE_BYTES[dt]) for t in tensors if t.kind == EXPERTS)


@dataclass(frozen=True)
class Layout:
    """What :func:`footprint` needs of a placement apart from the request's size: weight bytes by
    part, how many layers keep their KV in each memory, and which phases compute where. Ints, or
    arrays of one shape for a vectorised placement. The request's size enters linearly (KV bytes
    per layer, activation bytes per phase), so one layout serves every batch and length."""

    accelerator_weights: Mapping[str, object]  # "resident weights", "head", "weight double buffers"
    pinned_weights: object  # streamed weights' pinned home
    host_weights: object  # embedding, CPU layers and the head's host copy
    kv_layers: Mapping[str, object]  # memory -> layers whose KV it holds ("pinned host": a host copy in the CPU dtype)
    kv_double: object  # two accelerator KV slots (a streamed layer's attention reads its KV there)
    kv_transit: object  # one layer's KV in transit (split points)
    phase_flags: tuple  # (phase, computes on the accelerator, computes on the CPU) per phase
    uses_accelerator: object
    shape: tuple | None  # the run lengths' array shape (one entry per candidate); None: concrete


def layout(inv: Inventory, placement: Placement, kernel: str | None = KERNEL_BLOCKED) -> Layout:
    """The :class:`Layout` of ``placement``; a concrete placement's is kept in the inventory's
    cache (it depends on the model and the placement only: the planner asks it for many requests)."""
    vec = any(isinstance(c, np.ndarray) for pp in placement.phases.values() for _, c in pp.runs)
    if vec:
        return _layout(inv, placement, kernel, True)
    return inv.memo(("layout", placement, kernel), lambda: _layout(inv, placement, kernel, False),
                    LAYOUT_CACHE_ENTRIES)


LAYOUT_CACHE_ENTRIES = 4096  # per model: a plan asks for a few hundred pair placements


def _layout(inv: Inventory, placement: Placement, kernel: str | None, vec: bool) -> Layout:
    dt, cdt = placement.dtype, placement.cpu_dtype
    if vec and not inv.homogeneous:  # layers differ (dense and MoE): one concrete placement per candidate
        return _per_candidate(inv, placement, kernel)
    u = _units(inv, dt, cdt, kernel)
    acc = {"resident weights": 0, "head": 0, "weight double buffers": 0}
    pinned = {"streamed weights": 0}
    host = {"CPU weights": u["embedding"]}
    kv_n = {ACCELERATOR: 0, PINNED: 0, "pinned host": 0, HOST: 0}

    def add(places, n, w):
        for place in places:
            if place == ACCELERATOR:
                acc["resident weights"] = acc["resident weights"] + n * w[place]
                kv_n[ACCELERATOR] = kv_n[ACCELERATOR] + n
            elif place == PINNED:
                pinned["streamed weights"] = pinned["streamed weights"] + n * w[place]
                kv_n[PINNED] = kv_n[PINNED] + n
            else:
                host["CPU weights"] = host["CPU weights"] + n * w[place]
                where = "pinned host" if ACCELERATOR in places else HOST
                kv_n[where] = kv_n[where] + n

    where = np.where if vec else (lambda c, x, y: x if c else y)
    any_streamed = False
    if inv.homogeneous:
        w = u["layers"][0] if u["layers"] else {HOST: 0, PINNED: 0, ACCELERATOR: 0}
        for (places, streamed), n in placement.census().items():
            add(places, n, w)
            if streamed:
                any_streamed = any_streamed | (n > 0)
        slot = w[PINNED]
    else:
        for i in range(placement.num_layers):
            add(placement.layer_places(i), 1, u["layers"][i])
        streamed = placement.streamed_layers
        any_streamed = bool(streamed)
        slot = max((u["layers"][i][PINNED] for i in streamed), default=0)
    # split layers (routed experts apart from the rest, e.g. on the CPU): move their experts' bytes
    if inv.homogeneous:
        for (places, e_places), n in placement.expert_census().items():
            _move_experts(acc, pinned, host, places, e_places, n, u["experts"][0] if u["experts"] else {})
    elif placement.expert_census():
        for i in range(placement.num_layers):
            if not u["experts"][i][ACCELERATOR]:
                continue  # a layer without routed experts (a dense first layer)
            places, e_places = placement.layer_places(i), placement.expert_places(i)
            if places != e_places:
                _move_experts(acc, pinned, host, places, e_places, 1, u["experts"][i])
    acc["weight double buffers"] = where(any_streamed, 2 * slot, 0)
    kv_streamed = False  # KV slots only where a streamed layer's attention reads its KV on the accelerator
    for pp in placement.phases.values():
        kv_streamed = kv_streamed | (pp.count(lambda m: m.streams_kv) > 0)
    # a layer cut by split points whose attention computes on the accelerator sends it the KV it reads
    split = sum((pp.count(lambda m: m == SPLIT_POINTS) for pp in placement.phases.values()), 0)

    head_acc, head_cpu, uses_acc = False, False, False
    flags = []
    for ph, pp in placement.phases.items():
        on_acc = pp.head_on_accelerator()
        head_acc = head_acc | on_acc
        head_cpu = head_cpu | (on_acc ^ True)
        phase_acc = (pp.count(lambda m: m.computes == ON_ACCELERATOR) > 0) | on_acc
        phase_cpu = (pp.count(lambda m: m.computes_on_cpu_in_part) > 0) | (on_acc ^ True)
        uses_acc = uses_acc | phase_acc
        flags.append((ph, phase_acc, phase_cpu))
    acc["head"] = where(head_acc, u["head"][ACCELERATOR], 0)
    host["CPU weights"] = host["CPU weights"] + where(head_cpu, u["head"][HOST], 0)
    return Layout(acc, pinned["streamed weights"], host["CPU weights"], kv_n, kv_streamed, split > 0,
                  tuple(flags), uses_acc, _runs_shape(placement) if vec else None)


def footprint(inv: Inventory, placement: Placement, batch: int | None = None, input_len: int | None = None,
              capacity: int | None = None, kernel: str | None = KERNEL_BLOCKED,
              reserved_bytes: float = 0) -> MemoryNeed:
    """Accelerator / pinned / pageable host bytes of ``placement`` for a request of ``batch``
    sequences of ``input_len`` prompt tokens and ``capacity`` tokens in all (None: weights only),
    with the CPU's linears held as ``kernel`` holds them (``flexplan-blocked``, ``onednn-packed``,
    None or ``F.linear``: unpacked). ``reserved_bytes``: the accelerator runtime's own reserve,
    counted when the placement uses the accelerator. A placement of one phase whose run lengths
    are arrays gives arrays."""
    lay = layout(inv, placement, kernel)
    return _need(lay, *_size_terms(lay, inv, placement.dtype, placement.cpu_dtype, batch, input_len, capacity),
                 reserved_bytes)


def _size_terms(lay: Layout, inv: Inventory, dtype: str, cpu_dtype: str, batch: int | None, input_len: int | None,
                capacity: int | None) -> tuple:
    """(KV bytes of a layer in the accelerator dtype, in the CPU dtype, activation bytes on the
    accelerator and on the host of each of the layout's phases) of the request."""
    if not batch:
        return 0, 0, tuple(0 for _ in lay.phase_flags), tuple(0 for _ in lay.phase_flags)
    rows = [batch * (input_len if ph == "prefill" else 1) for ph, _, _ in lay.phase_flags]
    return (kv_bytes(inv, batch, capacity, dtype), kv_bytes(inv, batch, capacity, cpu_dtype),
            tuple(activation_bytes(inv, r, dtype, batch) for r in rows),
            tuple(activation_bytes(inv, r, cpu_dtype, batch) for r in rows))


def _need(lay: Layout, kv_acc, kv_host, act_acc_by_phase, act_host_by_phase, reserved_bytes) -> MemoryNeed:
    vec = lay.shape is not None
    where = np.where if vec else (lambda c, x, y: x if c else y)
    maximum = np.maximum if vec else max
    n = lay.kv_layers
    acc = {**lay.accelerator_weights, "KV cache": n[ACCELERATOR] * kv_acc,
           "KV double buffers": where(lay.kv_double, 2 * kv_acc, 0), "activations": 0, "runtime reserve": 0,
           "KV in transit": where(lay.kv_transit, kv_acc, 0)}
    pinned = {"streamed weights": lay.pinned_weights, "KV cache": n[PINNED] * kv_acc + n["pinned host"] * kv_host}
    host = {"CPU weights": lay.host_weights, "KV cache": n[HOST] * kv_host, "activations": 0}
    act_acc, act_host = 0, 0
    for (_, phase_acc, phase_cpu), a_acc, a_host in zip(lay.phase_flags, act_acc_by_phase, act_host_by_phase):
        act_acc = maximum(act_acc, where(phase_acc, a_acc, 0))
        act_host = maximum(act_host, where(phase_cpu, a_host, 0))
    acc["activations"], host["activations"] = act_acc, act_host
    acc["runtime reserve"] = where(lay.uses_accelerator, reserved_bytes, 0)
    if not vec:
        return MemoryNeed(*({k: int(v) for k, v in d.items()} for d in (acc, pinned, host)))
    # the layout's arrays share one shape: every figure is brought to it
    shape = lay.shape
    zeros = np.zeros(shape)

    def fix(d):
        return {k: v.astype(float, copy=False) if isinstance(v, np.ndarray) and v.shape == shape else zeros + v
                for k, v in d.items()}

    return MemoryNeed(fix(acc), fix(pinned), fix(host))


@dataclass(frozen=True, eq=False)
class LinearTotals:
    """Accelerator and host (pinned + pageable) totals of layouts as functions of the request's
    size: counts times bytes (a constant, KV bytes of a layer in the accelerator dtype and in the
    CPU dtype, the runtime reserve: linear) plus the largest of the phases' activations (each
    phase's flag times its activation bytes, as :func:`_need` takes the max over phases). The
    coefficients, found once per layout by evaluating it at the basis, serve every request.
    Columns: the candidates (one per layout, or a vectorised layout's)."""

    phases: tuple[str, ...]
    accelerator: np.ndarray  # [4 + phases, candidates]: constant, KV acc dtype, KV CPU dtype, reserve; a flag per phase
    host: np.ndarray  # the same rows

    @classmethod
    def of(cls, lays: "Layout | list[Layout]") -> "LinearTotals":
        """Of one layout (vectorised or not), or of a list of concrete ones of the same phases."""
        many = lays if isinstance(lays, list) else [lays]
        phases = tuple(ph for ph, _, _ in many[0].phase_flags)
        if any(tuple(ph for ph, _, _ in x.phase_flags) != phases for x in many):
            raise ValueError("LinearTotals: layouts of the same phases only")
        k = len(phases)

        def at(x: Layout, kv_acc=0, kv_host=0, reserve=0, act_acc=None, act_host=None) -> np.ndarray:
            need = _need(x, kv_acc, kv_host, act_acc or (0,) * k, act_host or (0,) * k, reserve)
            return np.array([need.accelerator_bytes, need.host_total_bytes], float)  # [2] or [2, candidates]

        def unit(j: int) -> tuple:
            return tuple(int(j == i) for i in range(k))

        def coefficients(x: Layout) -> np.ndarray:  # [2, 4 + k] or [2, 4 + k, candidates]
            base = at(x)
            rows = [base, at(x, kv_acc=1) - base, at(x, kv_host=1) - base, at(x, reserve=1) - base]
            flags = [at(x, act_acc=unit(j), act_host=unit(j)) - base for j in range(k)]
            return np.stack(rows + flags, axis=1)

        c = (np.stack([coefficients(x) for x in many], axis=-1) if isinstance(lays, list)
             else coefficients(lays).reshape(2, 4 + k, -1))
        return cls(phases, c[0], c[1])

    def totals(self, inv: Inventory, dtype: str, cpu_dtype: str, batch: int, input_len: int, capacity: int,
               reserved_bytes: float) -> tuple[np.ndarray, np.ndarray]:
        """(accelerator bytes, host bytes) per candidate, for ``batch`` sequences of ``input_len``
        prompt tokens and ``capacity`` tokens in all."""
        v = np.array([1.0, kv_bytes(inv, batch, capacity, dtype), kv_bytes(inv, batch, capacity, cpu_dtype),
                      reserved_bytes])
        out = []
        for coef, dt in ((self.accelerator, dtype), (self.host, cpu_dtype)):
            act = 0.0
            for j, ph in enumerate(self.phases):
                rows = batch * (input_len if ph == "prefill" else 1)
                act = np.maximum(act, coef[4 + j] * activation_bytes(inv, rows, dt, batch))
            out.append(v @ coef[:4] + act)
        return out[0], out[1]

    @cached_property
    def _columns(self) -> tuple[list[float], list[float]]:
        return self.accelerator[:, 0].tolist(), self.host[:, 0].tolist()

    def one(self, inv: Inventory, dtype: str, cpu_dtype: str, batch: int, input_len: int, capacity: int,
            reserved_bytes: float) -> tuple[float, float]:
        """:meth:`totals` of the first candidate in floats, without array overhead (the planner
        sizes hundreds of pairs per plan one at a time)."""
        v = (1.0, float(kv_bytes(inv, batch, capacity, dtype)), float(kv_bytes(inv, batch, capacity, cpu_dtype)),
             float(reserved_bytes))
        out = []
        for coef, dt in zip(self._columns, (dtype, cpu_dtype)):
            act = 0.0
            for j, ph in enumerate(self.phases):
                rows = batch * (input_len if ph == "prefill" else 1)
                act = max(act, coef[4 + j] * activation_bytes(inv, rows, dt, batch))
            out.append(v[0] * coef[0] + v[1] * coef[1] + v[2] * coef[2] + v[3] * coef[3] + act)
        return out[0], out[1]


def _move_experts(acc: dict, pinned: dict, host: dict, places, e_places, n, w: Mapping[str, int]) -> None:
    """Layers whose routed experts live in ``e_places`` rather than in the rest's ``places``: their
    experts' bytes leave the places only the rest uses and join those only the experts use."""
    parts = {ACCELERATOR: (acc, "resident weights"), PINNED: (pinned, "streamed weights"), HOST: (host, "CPU weights")}
    for p in places - e_places:
        d, k = parts[p]
        d[k] = d[k] - n * w.get(p, 0)
    for p in e_places - places:
        d, k = parts[p]
        d[k] = d[k] + n * w.get(p, 0)


def _runs_shape(placement: Placement) -> tuple:
    return np.broadcast_shapes(*(np.shape(c) for pp in placement.phases.values() for _, c in pp.runs))


def _per_candidate(inv: Inventory, placement: Placement, kernel) -> Layout:
    """:func:`layout` of a vectorised placement over layers that differ, one candidate at a time."""
    shape = _runs_shape(placement)
    lays = []
    for k in np.ndindex(shape):
        phases = {ph: PhasePlacement(tuple((m, int(np.broadcast_to(c, shape)[k])) for m, c in pp.runs), pp.head)
                  for ph, pp in placement.phases.items()}
        lays.append(layout(inv, Placement.of(phases, placement.dtype, placement.cpu_dtype), kernel))

    def stack(get):
        return np.array([get(x) for x in lays], dtype=float).reshape(shape)

    first = lays[0]
    return Layout({k: stack(lambda x: x.accelerator_weights[k]) for k in first.accelerator_weights},
                  stack(lambda x: x.pinned_weights), stack(lambda x: x.host_weights),
                  {k: stack(lambda x: x.kv_layers[k]) for k in first.kv_layers},
                  stack(lambda x: x.kv_double).astype(bool), stack(lambda x: x.kv_transit).astype(bool),
                  tuple((ph, stack(lambda x: x.phase_flags[j][1]).astype(bool),
                         stack(lambda x: x.phase_flags[j][2]).astype(bool))
                        for j, (ph, _, _) in enumerate(first.phase_flags)),
                  stack(lambda x: x.uses_accelerator).astype(bool), shape)
