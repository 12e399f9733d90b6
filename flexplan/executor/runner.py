"""Run a HuggingFace decoder layer by layer under a Plan: FlexInfer's Inference Executor (5.3).

``generate()`` is not reimplemented. The executor hooks the model: one forward call is one step
(its phase: prefill when the cache is empty, else decode). Before each decoder layer it makes
sure the layer's weights and KV cache are where the layer computes (rebinding views; for a
streamed layer, waiting for its prefetch and issuing the next one), moves the hidden state and,
at most once per step and device, the rotary embeddings / mask / position ids. After a layer it
offloads a streamed layer's new KV tokens and, during prefill, starts moving the KV cache to
where the decode policy needs it, overlapped with the next layers. A decode step whose every layer
computes on the CPU is prepared for all layers before the stack runs, so that the native decode
stack (``cpu_decode.FusedStack``) can run them in one call, without the per-layer hooks.

The embedding lookup runs on the host; final norm + LM head sit with the last layer; logits
come back to the host, where ``generate()`` samples.
"""

from __future__ import annotations

import collections
import functools
import time

import torch
from torch import nn
from transformers.cache_utils import Cache

from flexplan.errors import InvalidInputError, UnsupportedModelError
from flexplan.estimator.policies import placement_of
from flexplan.executor import cpu_attention, cpu_decode, cpu_experts, cpu_linear, families, native, split_layer
from flexplan.executor.cpu_backend import configure
from flexplan.executor.expert_cache import place_caches
from flexplan.executor.families import decoder_parts, layer_windows, text_config
from flexplan.executor.kv_cache import FlexCache, FlexKVLayer, KVPool, kv_bytes, kv_geometry
from flexplan.executor.link import ACCELERATOR, HOST_MEMORY, PINNED, Link
from flexplan.executor.placement import Placement, check_fits
from flexplan.executor.rebinds import rebinds
from flexplan.executor.stats import PhaseStats
from flexplan.executor.step import Step, generic_kv_to
from flexplan.executor.weights import GroupWeights, StreamSlots, torch_dtype
from flexplan.memory import (
    ALIAS,
    EXPERTS,
    LINEAR,
    PLAIN,
    TIED_EMBEDDING,
    Inventory,
    MemoryNeed,
    Tensor,
    activation_elems_per_row,
    footprint,
)
from flexplan.placement import SPLIT_POINTS, STREAMED, PhasePlacement
from flexplan.plan_types import Plan
from flexplan.workload.model import ModelSpec

PREFILL, DECODE = "prefill", "decode"


def _params(modules: dict[str, nn.Module]) -> dict[str, tuple[nn.Module, str]]:
    out: dict[str, tuple[nn.Module, str]] = {}
    for prefix, module in modules.items():
        for mname, m in module.named_modules(prefix=prefix):
            for leaf, p in m._parameters.items():
                if p is not None:
                    out[f"{mname}.{leaf}"] = (m, leaf)
    return out


def _cache_of(kwargs: dict, args: tuple = ()):
    """The cache a stack or layer call was given: ``cache`` / ``past_key_values``
    (``families.CACHE_KWARGS``), or whatever a model names it (GPT-NeoX and Falcon layers take
    ``layer_past``; GPT-2 passes it positionally)."""
    cache = families.cache_in(kwargs)
    if cache is None:
        cache = next((v for v in (*kwargs.values(), *args) if isinstance(v, Cache)), None)
    return cache


class Executor:
    """Places a model's weights for a plan and runs its forward passes layer by layer."""

    def __init__(self, model: nn.Module, plan: Plan, link: Link, *, source=None,
                 accelerator_budget_bytes: int | None = None, pinned_budget_bytes: int | None = None,
                 cpu_cores: int | None = None, use_ipex: bool = True, cpu_linear_kernel: str | None = None):
        self.model = model.eval()
        self.parts = decoder_parts(model)
        self.spec = ModelSpec.from_config(model.config)
        self.link = link
        self.num_layers = len(self.parts.layers)
        self.accelerator_budget_bytes = accelerator_budget_bytes
        self.pinned_budget_bytes = pinned_budget_bytes
        self.backend = configure(cpu_cores, use_ipex, cpu_linear_kernel)
        pack = self.backend.linear_kernel if self.backend.packs_weights else None
        tied = self._tied_embedding()
        # a tied embedding is packed too (blocked, so the LM head's GEMV streams like the others)
        tied_packed = frozenset({tied}) if tied and pack == cpu_linear.KERNEL_BLOCKED else frozenset()
        self.embed = GroupWeights("embedding", None, _params(self.parts.embedding), packed_embeddings=tied_packed)
        prefix = self.parts.layers_prefix
        # each MoE layer's routed experts module: its parameters may live apart from the layer (cpu-experts)
        self.expert_modules: list[tuple[nn.Module, cpu_experts.ExpertsPlace] | None] = []
        expert_names, blocked = [], []
        for i, layer in enumerate(self.parts.layers):
            found = cpu_experts.find_routed_experts(layer, self.spec.num_experts)
            if found is None:
                self.expert_modules.append(None)
                expert_names.append(frozenset())
                blocked.append({})
                continue
            blocked.append({f"{prefix}.{i}.{found[0]}.{leaf}": t for leaf, t in cpu_experts.blockable_experts(found[1]).items()}
                           if pack == cpu_linear.KERNEL_BLOCKED else {})
            self.expert_modules.append((found[1], cpu_experts.ExpertsPlace(i)))
            expert_names.append(frozenset(_params({f"{prefix}.{i}.{found[0]}": found[1]})))
            cpu_experts.install(found[1], self.expert_modules[-1][1])
        self.layers = [GroupWeights(f"layer {i}", i, _params({f"{prefix}.{i}": layer}), pack_kernel=pack,
                                    experts=expert_names[i], blocked_experts=blocked[i])
                       for i, layer in enumerate(self.parts.layers)]
        self.head = GroupWeights("head", None, _params(self.parts.head),
                                 {"lm_head.weight": (self.embed, tied)} if tied else None, pack_kernel=pack)
        self._packed_linears = [m for g in (*self.layers, self.head) for n, (m, _) in g.params.items() if n in g.packed]
        if tied_packed:
            self._packed_linears.append(self.parts.lm_head)
        for m in self._packed_linears:
            cpu_linear.install(m)
        self._packed_embeddings = [self.embed.params[n][0] for n in tied_packed]
        for m in self._packed_embeddings:
            cpu_linear.install_embedding(m)
        # per decoder layer: its attention window (None: full) and what one token stores in its KV cache
        self.windows = layer_windows(model.config)
        geometry = kv_geometry(text_config(model.config), self.spec)
        self.kv_geometry = [geometry] * self.num_layers
        # the native CPU decode ops, per layer where they cover it (cpu_decode.covered_layer)
        self._fused, self.fused_layers, native_attention = (
            cpu_decode.install(self.parts.layers, list(self.parts.head.values()))
            if self.backend.ipex is None else ([], [], []))
        self.native_attention = frozenset(native_attention)  # layers whose decode attention is native
        self._stack = (cpu_decode.install_stack(self.parts.stack, self.parts.layers)
                       if len(self.fused_layers) == self.num_layers else None)
        if self._stack is not None:
            self._fused.append(self.parts.stack)
        self._cpu_ready: tuple | None = None  # (link step, (placement, cache, rebinds)) of the last ready step
        self.cpu_decode_ops = (cpu_decode.describe(len(self.fused_layers), self.num_layers) if self._fused else
                               f"transformers' ops ({'IPEX' if self.backend.ipex is not None else self.parts.family})")
        covered = {id(m._parameters[leaf]) for g in (self.embed, *self.layers, self.head) for m, leaf in g.params.values()}
        missing = [n for n, p in model.named_parameters() if id(p) not in covered]
        if missing:
            raise UnsupportedModelError(
                f"model_type {self.parts.family!r} has parameters outside its embedding, decoder layers and head "
                f"({', '.join(missing[:5])}): the executor cannot place them, so it cannot run it layer by layer")
        # buffers inside decoder layers (a per-layer rotary table, a causal-mask buffer): a copy per
        # device, rebound to where the layer computes (module, name) -> {device: tensor}
        self._layer_buffers = [{(m, n): {b.device: b} for m in layer.modules() for n, b in m._buffers.items()
                                if b is not None} for layer in self.parts.layers]
        self.slots: StreamSlots | None = None
        self._cpu_attention_modules: list[nn.Module] = []  # attention modules routed to attend_beside_kv
        self.split = split_layer.SplitLayers(link)  # layers cut by split points (split-points policies)
        self.split.segment_done = lambda: self._deferred_prefetch("segment_done")
        # False: a split layer issues the next layer's copy at its start (Park & Egger's order), kept
        # so that both orders can be timed in one process
        self.defer_split_prefetch = True
        # where split layers issued the next layer's copy: segment_done / end_of_layer (the fallback) /
        # at_start (defer_split_prefetch False); benchmarks record it beside their timings
        self.split_prefetch_issued: collections.Counter[str] = collections.Counter()
        self.cpu_attention_calls: collections.Counter[str] = collections.Counter()  # by kernel: native / transformers
        self.kv_pool = KVPool(link)
        self._cache: FlexCache | None = None  # the last request's cache (its layers learnt the real KV geometry)
        self.plan: Plan | None = None
        self.placement: Placement | None = None
        self.runs_since_place = 0  # generate() runs since the weights were last placed (api: the first is not learned from)
        self.pack_batch: int | None = None  # batch hint of the packed CPU weights (cpu_linear)
        self.phase_stats: dict[str, PhaseStats] = {}
        self.prefill_end_s: float | None = None
        self._step: Step | None = None
        self._t_top: float | None = None
        self._stack_steps_before = 0
        self.place(plan, source)
        self._hooks = self._install_hooks()

    def _tied_embedding(self) -> str | None:
        """The embedding weight's name when the LM head shares it."""
        lm = self.parts.lm_head
        for prefix, module in self.parts.embedding.items():
            for name, m in module.named_modules(prefix=prefix):
                if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight is lm.weight:
                    return f"{name}.weight"
        return None

    def _untie_head(self) -> None:
        """Give the LM head its own Parameter: it may live on the accelerator while the embedding
        stays on the host (on the host both stay views of one buffer)."""
        if self._tied_embedding() is not None:
            self.parts.lm_head.weight = nn.Parameter(self.parts.lm_head.weight.data, requires_grad=False)

    # ---- placement --------------------------------------------------------------------------
    def _dtype(self, place: str, placement: Placement | None = None) -> torch.dtype:
        return torch_dtype((placement or self.placement).place_dtype(place))

    @functools.cached_property
    def inventory(self) -> Inventory:
        """The tensors of each placement unit as loaded (flexplan.memory sizes them)."""
        def tensors(g: GroupWeights, prefix: str = "") -> tuple[Tensor, ...]:
            out = []
            for name, shape in g.shapes:
                if name in g.host_aliases:
                    kind = ALIAS
                elif name in g.experts:
                    kind = EXPERTS
                elif name in g.packed:
                    kind = TIED_EMBEDDING if isinstance(g.params[name][0], nn.Embedding) else LINEAR
                elif name in g.raw:  # raw blocks: their bytes in every place
                    out.append(Tensor(name.removeprefix(prefix), tuple(shape), LINEAR, float(g.raw[name].itemsize)))
                    continue
                else:
                    kind = PLAIN
                out.append(Tensor(name.removeprefix(prefix), tuple(shape), kind))
            return tuple(out)

        prefix = f"{self.parts.stack_prefix}.layers"
        s = self.spec
        return Inventory(tensors(self.embed), tuple(tensors(g, f"{prefix}.{i}.") for i, g in enumerate(self.layers)),
                         tensors(self.head), s.num_kv_heads, s.head_dim, activation_elems_per_row(s),
                         s.vocab_size, kv_elems_per_token=self._kv_elems_per_token)

    @property
    def _kv_elems_per_token(self) -> int:
        """K + V elements one token stores in the largest layer cache (kv_cache.KVGeometry)."""
        return max(g.elements_per_token for g in self.kv_geometry)

    def memory_need(self, placement: Placement, batch: int | None = None, capacity: int | None = None,
                    input_len: int | None = None) -> MemoryNeed:
        """flexplan.memory.footprint of ``placement`` for this model as loaded (None: weights only)."""
        kernel = self.backend.linear_kernel if self.backend.packs_weights else None
        if self.inventory.kv_elems_per_token != self._kv_elems_per_token:  # a first update corrected the geometry
            self.__dict__.pop("inventory")
        return footprint(self.inventory, placement, batch, input_len or capacity, capacity, kernel)

    def check(self, placement: Placement, batch: int, capacity: int, input_len: int | None = None,
              plan: Plan | None = None) -> None:
        need = self.memory_need(placement, batch, capacity, input_len)
        cache = getattr(plan or self.plan, "expert_cache", None)
        if cache is not None:  # the routed experts the plan caches on the accelerator (executor.expert_cache)
            elem = torch.empty(0, dtype=self._dtype(ACCELERATOR, placement)).element_size()
            nbytes = cache.num_experts * self.spec.expert_params * elem
            need = MemoryNeed({**need.accelerator, "expert cache": nbytes}, need.pinned, need.host)
        check_fits(need, placement, self.accelerator_budget_bytes, self.pinned_budget_bytes,
                   f"batch {batch} x {capacity} tokens")

    def place(self, plan: Plan, source=None) -> None:
        """Put every unit's weights where ``plan`` needs them (refusing before any allocation
        when it does not fit). A no-op when the placement is unchanged."""
        placement = self._splittable(placement_of(plan, self.num_layers), plan)
        self.check(placement, plan.batch_size, plan.input_len + plan.output_len, plan.input_len, plan)
        pack_batch = cpu_linear.pack_batch_hint(plan.batch_size) if self.backend.packs_weights else None
        if placement == self.placement and pack_batch == self.pack_batch and source is None:
            if getattr(plan, "expert_cache", None) != getattr(self.plan, "expert_cache", None):
                self._place_expert_cache(plan)
            self.plan = plan
            return
        self.placement, self.plan, self.pack_batch = placement, plan, pack_batch
        self.runs_since_place = 0
        self._untie_head()
        for p in self.model.parameters():
            p.requires_grad_(False)

        def fill(group: GroupWeights, places, parts=None) -> None:
            src = source
            if src is None and not group.storages:  # first placement of a loaded model: its own tensors
                src = lambda name, g=group: g.dense(name, g.param_tensor(name).detach())  # noqa: E731
            group.ensure({p: self._dtype(p) for p in places}, self.link, src, pack_batch,
                         torch_dtype(placement.cpu_weight_dtype), parts)

        streamed = placement.streamed_layers
        slot_bytes = max((self.layers[i].nbytes(PINNED, self._dtype(PINNED)) for i in streamed), default=0)
        if self.slots is not None and self.slots.nbytes != slot_bytes:
            self.slots.release(self.link)
            self.slots = None
        fill(self.embed, [HOST_MEMORY])
        self.embed.bind(HOST_MEMORY)
        for i, g in enumerate(self.layers):  # unit by unit: a loaded model's tensors are freed as we go
            parts = placement.unit_parts(i) if g.experts else None
            fill(g, list(parts) if parts else placement.layer_places(i), parts)
            self._bind_layer(i, PREFILL)
        fill(self.head, placement.head_places())
        self.head.bind(placement.head_place(PREFILL))
        self._place_expert_cache(plan)
        if streamed and self.slots is None:
            self.slots = StreamSlots(self.link, slot_bytes)
        beside = sorted({i for ph in placement.phases for i in placement.attention_on_cpu(ph)})
        # layers the CPU computes whole in decode whose attention the native kernel covers: their calls
        # come here too where the fused float32 forward does not take them (a bfloat16 CPU dtype)
        cpu_decode_layers = [i for i in sorted(self.native_attention) if i not in beside and DECODE in placement.phases
                             and placement.modes[DECODE][i].on_cpu
                             and cpu_attention.attention_modules(self.parts.layers[i])]
        cpu_attention.uninstall(self._cpu_attention_modules)
        routed = {i: self.parts.layers[i] for i in beside + cpu_decode_layers}
        self._cpu_attention_modules = cpu_attention.install(
            routed, self.attend_beside_kv, self._attends_beside_kv) if routed else []
        self.split.uninstall()
        self.split.cpu_dtype = self._dtype(HOST_MEMORY, placement)  # what its CPU operators compute in
        for ph, pp in placement.phases.items():
            for i, m in enumerate(pp.modes):
                if m == SPLIT_POINTS and i not in self.split.layers:
                    self.split.install(i, self.parts.layers[i], self.layers[i].params,
                                       plan.phases[ph].split_points.operators)
        if self.backend.ipex is not None:
            for i in range(self.num_layers):
                if all(placement.modes[ph][i].on_cpu for ph in (PREFILL, DECODE)):
                    self.backend.optimize(self.parts.layers[i], self._dtype(HOST_MEMORY))

    def _place_expert_cache(self, plan: Plan) -> None:
        """The routed experts ``plan.expert_cache`` names, copied onto the accelerator (executor.expert_cache)."""

        place_caches(self.expert_modules, self.layers, self.placement, getattr(plan, "expert_cache", None), self.link,
                     self._dtype(ACCELERATOR))

    def expert_cache_hit_rates(self) -> dict[int, float]:
        """Layer -> measured share of its routed (token, choice) pairs the expert cache served, over
        the calls since the cache was placed (the plan's ExpertCache.hit_rate is the prediction)."""
        return {p.layer: p.cache_hit_rate for m in self.expert_modules if m is not None
                for p in (m[1],) if p.cache_hit_rate is not None}

    def _splittable(self, placement: Placement, plan: Plan) -> Placement:
        """``placement`` with each layer whose attention cannot be routed to the CPU (it does not
        call transformers' attention interface: cpu_attention.attention_modules), or which split
        points cannot cut (split_layer.operator_modules), streamed whole, its KV cache with it, as
        gpu-offload streams it; said in ``cpu_decode_ops``."""

        phases, kept = {}, []
        for ph, pp in placement.phases.items():
            modes = list(pp.modes)
            split = plan.phases[ph].split_points
            if split is None and SPLIT_POINTS in modes:
                raise InvalidInputError(f"the {ph} policy {plan.phases[ph].policy} cuts layers at split points but the "
                                        "plan names none; plan it with flexplan.plan(...) or executor.fixed_plan(...)")
            for i, m in enumerate(modes):
                layer = self.parts.layers[i]
                if ((m.attention_on_cpu and not cpu_attention.attention_modules(layer))
                        or (m == SPLIT_POINTS and split_layer.operator_modules(layer, split.operators) is None)):
                    modes[i] = STREAMED
                    kept.append(i)
            phases[ph] = PhasePlacement.from_modes(modes, pp.head) if modes != list(pp.modes) else pp
        if not kept:
            return placement
        note = (f"; layers {', '.join(map(str, sorted(set(kept))))} streamed with their KV cache (their attention "
                "does not go through transformers' attention interface, so it cannot run beside the host KV cache, "
                "or their modules are not the plan's split-point operators)")
        if note not in self.cpu_decode_ops:
            self.cpu_decode_ops += note
        return Placement.of(phases, placement.dtype, placement.cpu_dtype, placement.policies)

    def _bind_layer(self, i: int, phase: str) -> None:
        """Layer i's parameters where it computes from in ``phase`` (its routed experts where they
        compute from: the host copy when the policy keeps them on the CPU), and its experts module
        told whether it computes on the CPU."""
        pl, g = self.placement, self.layers[i]
        g.bind(pl.layer_place(i, phase), pl.expert_place(i, phase) if g.experts else None)
        if self.expert_modules[i] is not None:
            place = self.expert_modules[i][1]
            place.on_cpu, place.link = pl.experts_on_cpu(i, phase), self.link

    def new_cache(self, batch_size: int, max_tokens: int, input_len: int | None = None) -> FlexCache:
        """A cache for one request of ``batch_size`` sequences x ``max_tokens`` (prompt + new)
        tokens, its buffers taken from the pool (allocated only when no earlier request was as
        large); refused before any allocation when it does not fit (with prefill activations for
        ``input_len`` prompt tokens; None: ``max_tokens``)."""
        pl, batch, capacity = self.placement, batch_size, max_tokens
        if self._cache is not None:  # geometries a previous request's first update corrected
            self.kv_geometry = [kv.geometry for kv in self._cache.layers]
        self.check(pl, batch, capacity, input_len)
        geo = self.kv_geometry
        needs = {}
        for i in range(self.num_layers):
            for place in pl.layer_places(i):
                where = PINNED if place == HOST_MEMORY and pl.kv_host_pinned(i) else place
                needs[(i, place)] = (where, kv_bytes(batch, capacity, geo[i], self._dtype(place)))
        acc = self._dtype(ACCELERATOR)
        if pl.kv_streamed_layers:
            for s in (0, 1):
                needs[("slot", s)] = (ACCELERATOR, max(kv_bytes(batch, capacity, geo[i], acc) for i in pl.kv_streamed_layers))
        self.kv_pool.ensure(needs)
        layers = []
        for i in range(self.num_layers):
            raws = {p: (self.kv_pool.raw((i, p)), self._dtype(p)) for p in pl.layer_places(i)}
            layers.append(FlexKVLayer(i, raws, geo[i], batch, capacity, pl.layer_place(i, PREFILL), self.link,
                                      window=self.windows[i]))
        cache = FlexCache(layers)
        cache.slots = [(self.kv_pool.raw(("slot", s)), acc) for s in (0, 1)] if pl.kv_streamed_layers else []
        for kv in layers:
            kv.regrow = functools.partial(self._regrow_kv, cache)
        self._cache = cache
        return cache

    def _regrow_kv(self, cache: FlexCache, i: int, geometry) -> tuple[dict, list]:
        """Layer i's first update stored more per token than its config said (a model-specific cache
        layout): check the request still fits, then reallocate that layer's KV buffers (and the
        streaming slots if they are now too small). Later requests are sized right from the start."""
        self.kv_geometry[i] = geometry
        pl, kv = self.placement, cache.layers[i]
        batch, capacity = kv.batch, kv.capacity
        self.check(pl, batch, capacity)
        self.link.synchronize()
        needs = {k: (b.where, b.nbytes) for k, b in self.kv_pool.buffers.items()}
        for place in pl.layer_places(i):
            where = PINNED if place == HOST_MEMORY and pl.kv_host_pinned(i) else place
            needs[(i, place)] = (where, kv_bytes(batch, capacity, geometry, self._dtype(place)))
        acc = self._dtype(ACCELERATOR)
        if cache.slots:
            for s in (0, 1):
                needs[("slot", s)] = (ACCELERATOR, max(needs[("slot", s)][1], kv_bytes(batch, capacity, geometry, acc)))
        self.kv_pool.ensure(needs)
        if cache.slots:
            cache.slots = [(self.kv_pool.raw(("slot", s)), acc) for s in (0, 1)]
        return {p: (self.kv_pool.raw((i, p)), self._dtype(p)) for p in pl.layer_places(i)}, cache.slots

    # ---- hooks ------------------------------------------------------------------------------
    def _install_hooks(self) -> list:
        h = [self.model.register_forward_pre_hook(self._before_model, with_kwargs=True),
             self.model.register_forward_hook(self._after_model, with_kwargs=True),
             self.parts.stack.register_forward_pre_hook(self._before_stack, with_kwargs=True),
             self.parts.stack.register_forward_hook(self._after_stack, with_kwargs=True)]
        for i, layer in enumerate(self.parts.layers):
            h.append(layer.register_forward_pre_hook(functools.partial(self._before_layer, i), with_kwargs=True))
            h.append(layer.register_forward_hook(functools.partial(self._after_layer, i), with_kwargs=True))
        for m in self.parts.head.values():
            h.append(m.register_forward_pre_hook(self._before_head))
        h.append(self.parts.lm_head.register_forward_hook(self._after_lm_head))
        return h

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for m in (*self._packed_linears, *self._packed_embeddings):
            cpu_linear.uninstall(m)
        cpu_decode.uninstall(self._fused)
        for found in self.expert_modules:
            if found is not None:
                cpu_experts.uninstall(found[0])
        self._fused, self._stack = [], None
        cpu_attention.uninstall(self._cpu_attention_modules)
        self._cpu_attention_modules = []
        self.split.uninstall()

    def _before_model(self, module, args, kwargs):
        self._t_top = time.perf_counter()

    def _after_model(self, module, args, kwargs, output):
        self._end_step()
        self._t_top = None

    def _before_stack(self, module, args, kwargs):
        cache = _cache_of(kwargs, args)
        x = kwargs.get("input_ids")
        x = x if x is not None else kwargs.get("inputs_embeds")
        x = x if x is not None else args[0]
        past = cache.get_seq_length() if cache is not None else 0
        # KV managed by the caller (the serving engine's paged pools, flexplan.serving.placed): its
        # cache names the phase, since a flattened ragged batch has no one past length
        phase = getattr(cache, "flexplan_phase", None) or (PREFILL if past == 0 else DECODE)
        self.link.phase = phase
        self.link.step += 1
        self.link.note(phase, self.link.step)
        st = self._step = Step(phase, int(x.shape[0]), int(x.shape[1]), int(past),
                                self._t_top if self._t_top is not None else time.perf_counter(),
                                cache=cache if isinstance(cache, FlexCache) else None)
        self.head.bind(self.placement.head_place(phase))
        streamed = self.placement.streamed(phase)
        if streamed:
            self._prefetch(streamed[0], st)
        if self._stack is not None:
            self._stack.armed = self._cpu_step_ready(st)

    @property
    def decodes_natively(self) -> bool:
        """Every decode step runs in the native stack's one call: all layers on the CPU, each covered."""
        return self._stack is not None and all(m.on_cpu for m in self.placement.modes[DECODE])

    def _cpu_step_ready(self, st: Step) -> bool:
        """For a decode step whose every layer computes on the CPU, with flexplan's cache: do
        now what the per-layer hooks would (weights bound to host memory, each KV cache moved to
        and activated there), so the native stack may run every layer in one call; else False."""
        if st.phase != DECODE or st.cache is None or not self.decodes_natively:
            return False
        # the step right after a ready one, with the same placement, cache and no parameter rebound
        # since: every layer is still bound and its KV still home (only a step or a rebind moves them)
        key = (id(self.placement), id(st.cache), rebinds())
        if self._cpu_ready == (self.link.step - 1, key):
            self._cpu_ready = (self.link.step, key)
            return True
        for i, g in enumerate(self.layers):
            place = self.placement.layer_place(i, DECODE)
            self._bind_layer(i, DECODE)
            self._kv_to(st.cache.layers[i], place, False)
        self._cpu_ready = (self.link.step, (id(self.placement), id(st.cache), rebinds()))  # after the binds' own
        return True

    def _after_stack(self, module, args, kwargs, output):
        if self._t_top is None:  # the stack was called on its own
            self._end_step()

    def _end_step(self) -> None:
        st = self._step
        if st is None:
            return
        self.link.synchronize()
        now = time.perf_counter()
        ps = self.phase_stats.setdefault(st.phase, PhaseStats(st.phase))
        ps.time_s += now - st.t0
        ps.steps += 1
        ps.tokens += st.batch * st.query_len
        ps.count_step(self.spec, st.batch, st.query_len, st.past_len)
        if st.phase == PREFILL:
            self.prefill_end_s = now
        self._step = None
        if self._stack is not None:
            self._stack.armed = False

    def _prefetch(self, j: int, st: Step) -> None:
        """Start copying streamed layer j's weights (and past KV) into the next free slot."""
        slot = st.next_slot
        st.next_slot ^= 1
        st.slot_of[j] = slot
        self.link.note("prefetch", j)
        kv = st.cache.layers[j] if st.cache is not None and self.placement.modes[st.phase][j].streams_kv else None
        if kv is not None and kv.home != PINNED:  # a CPU-dtype host copy: convert on the host first
            kv.wait_home_on_host()
            kv.migrate(PINNED)
        with self.link.on_copy_stream():
            if self.slots.used[slot]:
                self.link.wait(self.slots.free[slot], on_copy_stream=True)
            if self.placement.modes[st.phase][j] == SPLIT_POINTS:  # only the accelerator operators' weights
                self.split.load(self.slots.buffers[slot].tensor, self.layers[j], j,
                                self.plan.phases[st.phase].split_points.points)
            else:
                self.slots.load(self.layers[j], slot, self.link)
            if kv is not None:
                kv.prefetch(st.cache.slots[slot], slot)
            self.link.record(self.slots.ready[slot], on_copy_stream=True)

    def _deferred_prefetch(self, where: str) -> None:
        """Issue the prefetch a split layer deferred (``Step.deferred_prefetch``): called when its
        accelerator operators are done (``SplitLayers.segment_done``), else at the end of the layer.
        Issued at the start of the layer, the next layer's weights held the copy engine while the
        segment's inputs waited behind them (host-to-device copies run in issue order)."""
        st = self._step
        if st is not None and st.deferred_prefetch is not None:
            j, st.deferred_prefetch = st.deferred_prefetch, None
            self.split_prefetch_issued[where] += 1
            self._prefetch(j, st)

    def _kv_to(self, kv: FlexKVLayer, place: str, on_acc: bool) -> None:
        """Compute layer KV from ``place``: move it there first if the switch has not yet."""
        if kv.home != place:
            kv.wait_home_on_host()
            if ACCELERATOR in (kv.home, place):
                self.link.copy_stream_waits_compute()
                with self.link.on_copy_stream():
                    kv.migrate(place)
                    kv.pending = self.link.event()
                    self.link.record(kv.pending, on_copy_stream=True)
            else:
                kv.migrate(place)
        kv.activate(place)
        if kv.pending is not None:
            if on_acc:
                self.link.wait(kv.pending)
            else:
                kv.pending.synchronize()
            kv.pending = None

    def _before_layer(self, i: int, module, args, kwargs):
        st = self._step
        if st is None:
            return None
        mode = self.placement.modes[st.phase][i]
        split = mode == SPLIT_POINTS  # hidden state and glue on the host, in the pinned (accelerator) dtype
        on_acc = not mode.on_cpu and not split
        dtype = self._dtype(ACCELERATOR if on_acc or split else HOST_MEMORY)
        g = self.layers[i]
        cache = _cache_of(kwargs, args)
        kv = cache.layers[i] if isinstance(cache, FlexCache) else None
        if mode.streamed:
            slot = st.slot_of[i]
            self.link.wait(self.slots.ready[slot])
            if split:
                self.split.begin(i, self.plan.phases[st.phase].split_points.points, g, g.storages[PINNED].views,
                                 self.slots.views(g, slot), ("split", slot))
            else:
                g.bind_views(self.slots.views(g, slot), tag=("slot", slot))
            if self.expert_modules[i] is not None:
                self.expert_modules[i][1].on_cpu = False
            nxt = next((j for j in self.placement.streamed(st.phase) if j > i), None)
            if nxt is not None and split and self.defer_split_prefetch:  # once its accelerator operators
                st.deferred_prefetch = nxt  # are done (estimator policies/split_points.py, Eq. 5: in-order copies)
            elif nxt is not None:
                if split:
                    self.split_prefetch_issued["at_start"] += 1
                self._prefetch(nxt, st)
            if mode.attention_on_cpu and kv is not None:  # the KV cache stays home, in host memory
                self._kv_to(kv, self.placement.layer_place(i, st.phase), False)
                kv.new_tokens_cross = not split  # a split layer appends its new K, V on the host
        else:
            place = self.placement.layer_place(i, st.phase)
            self._bind_layer(i, st.phase)
            if kv is not None:
                self._kv_to(kv, place, on_acc)
        device = self.link.device if on_acc else torch.device("cpu")
        if kv is None and cache is not None:
            generic_kv_to(cache, i, device, dtype)
        for (m, name), copies in self._layer_buffers[i].items():
            if device not in copies:
                copies[device] = next(iter(copies.values())).to(device)
            m._buffers[name] = copies[device]
        self.link.note("compute", i)
        if args:
            hidden, rest = args[0], tuple(v if v is cache else st.aux_to(self.link, v, on_acc, dtype) for v in args[1:])
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        hidden = st.hidden_to(self.link, hidden, on_acc, dtype, i)
        kwargs = {k: (v if v is cache else st.aux_to(self.link, v, on_acc, dtype)) for k, v in kwargs.items()}
        if (not on_acc and st.query_len == 1 and kwargs.get("attention_mask", 0) is None
                and not (i in self.native_attention and dtype == torch.float32)  # fp32: the fused ops attend unmasked
                and getattr(self.model.config, "_attn_implementation", None) == "sdpa"
                and hasattr(cache, "get_mask_sizes")):
            kwargs["attention_mask"] = st.cpu_decode_mask(cache.get_mask_sizes(st.query_len, i)[0])
        if not args:
            kwargs["hidden_states"] = hidden
            return rest, kwargs
        return (hidden,) + rest, kwargs

    def _after_layer(self, i: int, module, args, kwargs, output):
        st = self._step
        if st is None:
            return None
        mode = self.placement.modes[st.phase][i]
        cache = _cache_of(kwargs, args)
        kv = cache.layers[i] if isinstance(cache, FlexCache) else None
        if mode.streamed:
            self._deferred_prefetch("end_of_layer")  # a split layer whose segment did not say it was done
            slot = st.slot_of[i]
            self.link.record(self.slots.free[slot])
            self.slots.used[slot] = True
            if kv is not None and mode.attention_on_cpu:
                kv.new_tokens_cross = False
            elif kv is not None:
                with self.link.on_copy_stream():
                    self.link.wait(self.slots.free[slot], on_copy_stream=True)
                    kv.offload()
                    kv.pending = self.link.event()
                    self.link.record(kv.pending, on_copy_stream=True)
        elif st.phase == PREFILL and kv is not None:
            target = self.placement.layer_place(i, DECODE)
            if kv.home != target and ACCELERATOR in (kv.home, target):
                # the switch, overlapped: move this layer's KV while the next layers compute
                done = self.link.event()
                self.link.record(done)
                with self.link.on_copy_stream():
                    self.link.wait(done, on_copy_stream=True)
                    kv.migrate(target)
                    kv.pending = self.link.event()
                    self.link.record(kv.pending, on_copy_stream=True)
        self.split.end(i)
        st.hidden_on_acc = not mode.on_cpu and mode != SPLIT_POINTS
        self.link.note("computed", i)
        return None

    def attend_beside_kv(self, i: int, module, inner, query, key, value, attention_mask, **kwargs):
        """Layer i's attention call (cpu_attention routes it here): in a phase that places its
        attention on the CPU, q crosses to the host, the CPU attends over the host KV cache the
        cache's ``update`` just appended to (the native kernel where it covers the layer,
        transformers' own function otherwise) and the output crosses back. A decode step of a layer
        the CPU computes whole: the native kernel where it covers the layer and reads its cache (a
        bfloat16 one: the fused float32 forward takes the others). Else ``inner`` as is."""
        st = self._step
        if not self._attends_beside_kv(i):
            if st is not None and st.phase == DECODE and self.placement.modes[DECODE][i].on_cpu:
                out = self._native_attention(i, module, query, key, value, attention_mask, kwargs)
                if out is not None:
                    return out, None
            return inner(module, query, key, value, attention_mask, **kwargs)
        core_on_acc = self.split.attention_on_acc(i)  # None: not a layer cut by split points
        if core_on_acc:  # cut by split points, the core on the accelerator: q and the KV the cache returned cross
            return self.split.attend(i, module, inner, query, key, value, attention_mask, st.moved, **kwargs)
        if core_on_acc is False:  # cut, the core on the CPU: q, the cache and the mask are on the host already
            out = self._native_attention(i, module, query, key, value, attention_mask, kwargs)
            self.cpu_attention_calls["native" if out is not None else "transformers"] += 1
            if out is not None:
                return out, None
            return inner(module, query, key, value, self._cpu_decode_mask(query, key, attention_mask), **kwargs)
        dtype = key.dtype if key.device.type == "cpu" else query.dtype
        q = self.link.move(query, False, dtype, "q", i)
        if key.device.type != "cpu":  # a cache that is not flexplan's kept the keys on the accelerator
            key, value = (self.link.move(t, False, dtype, "kv", i) for t in (key, value))
        mask = attention_mask
        if isinstance(mask, torch.Tensor) and mask.device.type != "cpu":
            k = ("mask to host", id(mask))
            if k not in st.moved:
                st.moved[k] = (mask, self.link.move(mask, False, None, "aux"))
            mask = st.moved[k][1]
        out = self._native_attention(i, module, q, key, value, mask, kwargs)
        weights = None
        self.cpu_attention_calls["native" if out is not None else "transformers"] += 1
        if out is None:
            out, weights = inner(module, q, key, value, self._cpu_decode_mask(q, key, mask), **kwargs)
        return self.link.move(out, True, query.dtype, "attention output", i), weights

    def _cpu_decode_mask(self, q, keys, mask):
        """``mask``, or for one query position with none under SDPA the step's all-true mask over
        ``keys``' keys (``Step.cpu_decode_mask``: the same attention) for a layer the native kernel
        does not attend: PyTorch's unmasked CPU SDPA takes a far slower path than its masked one
        on a bf16 grouped-query cache (several times, at thousands of keys)."""
        if (mask is not None or q.shape[2] != 1 or self._step is None
                or getattr(self.model.config, "_attn_implementation", None) != "sdpa"):
            return mask
        return self._step.cpu_decode_mask(keys.shape[2])

    def _attends_beside_kv(self, i: int) -> bool:
        st = self._step
        return st is not None and self.placement.modes[st.phase][i].attention_on_cpu

    def _native_attention(self, i: int, module, q, keys, values, mask, kwargs):
        """flexplan's native decode attention for one query per sequence, [b, 1, heads, d], where it
        covers the layer (cpu_decode.covered_attention) and reads this cache (float32 or bfloat16)
        and mask; else None."""
        ops = native.decode_status()[0] if i in self.native_attention else None
        return cpu_decode.native_decode_attention(ops, module, q, keys, values, mask, kwargs)

    def _before_head(self, module, args):
        st = self._step
        if st is None or not args:
            return None
        on_acc = not self.placement.head_mode(st.phase).on_cpu
        dtype = self._dtype(ACCELERATOR if on_acc else HOST_MEMORY)
        x = st.hidden_to(self.link, args[0], on_acc, dtype, None)
        if module is self.parts.lm_head and x.dim() == 3 and x.stride(0) != x.shape[1] * x.stride(1):
            # generate() keeps the last position: a [b, 1, h] slice whose batch stride is s*h. matmul
            # cannot fold such a view into one GEMM and copies the expanded weight for a bmm instead
            # (55 ms for SmolLM2's 49152 x 576 bf16 head on the CPU); a compact copy of b rows avoids it.
            x = x.clone(memory_format=torch.contiguous_format)
        return (x,) + tuple(args[1:])

    def _after_lm_head(self, module, args, output):
        st = self._step
        if st is None or not st.hidden_on_acc:
            return None
        return self.link.move(output, False, None, "logits")

    # ---- runs ------------------------------------------------------------------------------
    def begin_run(self) -> None:
        self.link.reset_log()
        self.phase_stats = {}
        self.prefill_end_s = None
        self._stack_steps_before = self._stack.steps if self._stack is not None else 0

    @property
    def native_stack_steps(self) -> int:
        """Decode steps of this run that the native stack ran (all layers in one call)."""
        return self._stack.steps - self._stack_steps_before if self._stack is not None else 0

    def end_run(self) -> None:
        """Wait for every copy, and point idle streamed layers back at their pinned home."""
        self.link.synchronize()
        self.runs_since_place += 1
        self._step = None
        for i in range(self.num_layers):
            self._bind_layer(i, PREFILL)
