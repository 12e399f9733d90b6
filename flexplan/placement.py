"""Where every decoder layer's operators keep their weights and where they compute: one
description that policies build, the estimator and memory model cost, the planner searches
over, ``explain`` prints and the executor runs (in the spirit of FlexGen's ``Policy``).

A phase's placement is stored compactly as *runs*: consecutive decoder layers in one
:class:`LayerMode` (``((CPU, N - M), (RESIDENT, M))`` is SplitGen with M GPU layers). Run
lengths may be numpy arrays, so the planner can describe every candidate M of a policy at once;
the per-layer view (``modes``, ``groups(i)``) is computed on demand for a concrete placement.

A layer mode says, for each operator group of the layer (attention projections, attention with
its KV cache, the MLP or routed experts, shared experts), where its weights live (pageable
``host`` memory in the CPU's dtype, ``pinned`` host memory in the accelerator's dtype, or
``accelerator`` memory) and where it computes (``cpu`` or ``accelerator``). The three modes the
policies use today place all groups of a layer alike:

- ``cpu``: weights and KV in host memory, computed by the CPU;
- ``streamed``: weights and KV in pinned host memory, copied into one of two accelerator double
  buffers before the layer computes there;
- ``resident``: weights and KV in accelerator memory.

Two modes split a layer: ``cpu experts`` (``CPU_EXPERTS``) is resident except for the routed
experts of an MoE layer (its ``mlp`` group), which live in host memory and compute on the CPU.
:meth:`Placement.expert_places` and :meth:`Placement.unit_parts` tell the memory model and the
executor where that part lives. ``split points`` (``SPLIT_POINTS``) keeps the layer's weights and KV
in pinned host memory and cuts its operators between CPU and accelerator where the plan's
``split_points`` say (Park & Egger). Other split modes are refused (``SPLIT_MODES``).

The final norm and LM head compute with the last layer unless a phase says otherwise; the
embedding lookup runs on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Mapping

from flexplan.hardware.spec import cpu_weight_dtype

# Where weights / KV live.
HOST = "host"  # pageable host memory, the CPU's dtype
PINNED = "pinned"  # page-locked host memory, the accelerator's dtype (source of async copies)
ACCELERATOR = "accelerator"
# Where an operator computes.
ON_CPU = "cpu"
ON_ACCELERATOR = "accelerator"
# Operator groups of a decoder layer.
GROUPS = ("attention projections", "attention", "mlp", "shared experts")
PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class Where:
    """One operator group: where its weights live and where it computes."""

    weights: str
    computes: str


@dataclass(frozen=True)
class LayerMode:
    """How one decoder layer runs in one phase: a name and the place of each operator group."""

    name: str
    weights: str  # home of the layer's weights and KV cache
    computes: str
    # operator groups placed otherwise than the layer, ((group, Where), ...): the unit the next
    # policies need (decode attention on the CPU, experts on the CPU). The memory model and the
    # executor place whole layers, and the routed experts apart in the modes of ``SPLIT_MODES``.
    overrides: tuple[tuple[str, Where], ...] = ()

    @property
    def uniform(self) -> bool:
        """Every operator group of the layer lives and computes where the layer does."""
        return all(w == Where(self.weights, self.computes) for _, w in self.overrides)

    @property
    def on_cpu(self) -> bool:
        return self.computes == ON_CPU

    # the questions below are cached per mode (a handful of modes answer them for every plan's
    # layers: the planner asks them thousands of times a plan)
    @cached_property
    def streamed(self) -> bool:
        """Weights live off the accelerator but compute on it: copied in before each use."""
        return self.computes == ON_ACCELERATOR and self.weights != ACCELERATOR

    @cached_property
    def attention_on_cpu(self) -> bool:
        """A layer computing on the accelerator whose decode attention runs on the CPU beside a
        KV cache kept in host memory (:data:`STREAMED_CPU_ATTENTION`)."""
        a = dict(self.overrides).get("attention")
        return self.computes == ON_ACCELERATOR and a is not None and a.computes == ON_CPU and a.weights != ACCELERATOR

    @cached_property
    def streams_kv(self) -> bool:
        """Its KV cache is copied into an accelerator slot before the layer computes."""
        return self.streamed and not self.attention_on_cpu

    @property
    def runnable(self) -> bool:
        """The memory model and the executor place this mode: whole layers, or a streamed layer
        whose attention alone computes on the CPU beside its host KV cache."""
        return self.uniform or (self.streamed and self.attention_on_cpu and len(self.overrides) == 1)

    def groups(self) -> Mapping[str, Where]:
        return self._groups

    @cached_property
    def _groups(self) -> Mapping[str, Where]:
        w = Where(self.weights, self.computes)
        return MappingProxyType({**{g: w for g in GROUPS}, **dict(self.overrides)})

    @cached_property
    def computes_on_cpu_in_part(self) -> bool:
        """Some of the layer computes on the CPU: all of it, its attention or its routed experts."""
        return self.computes == ON_CPU or self.attention_on_cpu or self._groups[EXPERT_GROUP].computes == ON_CPU

    def __str__(self) -> str:
        return self.name


CPU = LayerMode("cpu", HOST, ON_CPU)
STREAMED = LayerMode("streamed", PINNED, ON_ACCELERATOR)
RESIDENT = LayerMode("resident", ACCELERATOR, ON_ACCELERATOR)
# Streamed weights, but the KV cache stays in pinned host memory and decode attention computes on
# the CPU beside it (FlexGen's cpu_cache_compute, NEO's attention offload): the link carries the
# weights and, per step, q/k/v of the new token and the attention output instead of the KV cache.
STREAMED_CPU_ATTENTION = LayerMode("streamed (attention on CPU)", PINNED, ON_ACCELERATOR,
                                   (("attention", Where(PINNED, ON_CPU)),))
# Park & Egger's split points (policies/split_points.py): weights and KV in pinned host memory, the
# hidden state and the glue between operators on the host; which operators compute on the accelerator
# (from weights copied into the double buffer) is the plan's ``split_points``, the rest computes on the
# CPU from host memory. Placed as STREAMED_CPU_ATTENTION is (KV at home, no KV slots).
SPLIT_POINTS = LayerMode("split points", PINNED, ON_ACCELERATOR, (("attention", Where(PINNED, ON_CPU)),))
MODES = (CPU, STREAMED, RESIDENT)
# llama.cpp's --n-cpu-moe / KTransformers: the layer resident on the accelerator with its KV cache,
# its routed experts ("mlp" of an MoE layer) in host memory, computed by the CPU. A layer without
# routed experts (a dense layer of an MoE model) in this mode is simply resident.
CPU_EXPERTS = LayerMode("cpu experts", ACCELERATOR, ON_ACCELERATOR, (("mlp", Where(HOST, ON_CPU)),))
EXPERT_GROUP = "mlp"  # the operator group that holds an MoE layer's routed experts
# the split modes the memory model and the executor place (others are refused by estimator.policies.placement_of)
SPLIT_MODES = (CPU_EXPERTS, SPLIT_POINTS)


@dataclass(frozen=True)
class PhasePlacement:
    """One phase: decoder layers as runs of one mode each (first layer first), and the head.

    Run lengths are ints, or numpy arrays of equal shape (one entry per candidate M). ``head``:
    the mode of the final norm + LM head; None = with the last layer."""

    runs: tuple[tuple[LayerMode, object], ...]
    head: LayerMode | None = None

    @classmethod
    def of(cls, *runs: tuple[LayerMode, object], head: LayerMode | None = None) -> "PhasePlacement":
        return cls(tuple(runs), head)

    @classmethod
    def from_modes(cls, modes, head: LayerMode | None = None) -> "PhasePlacement":
        return cls.merged(((m, 1) for m in modes), head)

    @classmethod
    def merged(cls, runs, head: LayerMode | None = None) -> "PhasePlacement":
        """From (mode, int count) runs: empty ones dropped, neighbours of one mode joined (one
        placement has one such form)."""
        out: list[list] = []
        for m, c in runs:
            if int(c) and out and out[-1][0] == m:
                out[-1][1] += int(c)
            elif int(c):
                out.append([m, int(c)])
        return cls(tuple((m, c) for m, c in out), head)

    @property
    def num_layers(self):
        return sum(c for _, c in self.runs)

    def count(self, predicate) -> object:
        """Layers (per candidate, if run lengths are arrays) whose mode satisfies ``predicate``."""
        return sum((c for m, c in self.runs if predicate(m)), 0)

    # ---- the per-layer view (concrete placements only) -----------------------------------
    @cached_property
    def modes(self) -> tuple[LayerMode, ...]:
        return tuple(m for m, c in self.runs for _ in range(int(c)))

    def layer(self, i: int) -> LayerMode:
        return self.modes[i]

    def groups(self, i: int) -> Mapping[str, Where]:
        return self.modes[i].groups()

    @cached_property
    def head_mode(self) -> LayerMode:
        if self.head is not None:
            return self.head
        for m, c in reversed(self.runs):
            if int(c):
                return RESIDENT if m.computes == ON_ACCELERATOR else CPU
        return CPU

    def head_on_accelerator(self):
        """Whether the head computes on the accelerator (bool array for array run lengths)."""
        if self.head is not None:
            return self.head.computes == ON_ACCELERATOR
        out, decided = False, False
        for m, c in reversed(self.runs):
            take = (c > 0) & (decided ^ True)
            if m.computes == ON_ACCELERATOR:
                out = out | take
            decided = decided | take
        return out

    @property
    def uses_accelerator(self) -> bool:
        return any(m.computes != ON_CPU and int(c) for m, c in self.runs) or self.head_mode.computes != ON_CPU

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for m, c in self.runs:
            if int(c):
                counts[m.name] = counts.get(m.name, 0) + int(c)
        return ", ".join(f"{v} {k}" for k, v in counts.items())


def _experts_weights(m: LayerMode) -> str:
    """Where a layer in mode ``m`` keeps its routed experts."""
    for g, w in m.overrides:
        if g == EXPERT_GROUP:
            return w.weights
    return m.weights


def segments(a: PhasePlacement, b: PhasePlacement):
    """(mode in a, mode in b, number of layers) along the layers of two placements of one model."""
    ra, rb = [[m, int(c)] for m, c in a.runs if c], [[m, int(c)] for m, c in b.runs if c]
    i = j = 0
    while i < len(ra) and j < len(rb):
        n = min(ra[i][1], rb[j][1])
        yield ra[i][0], rb[j][0], n
        ra[i][1] -= n
        rb[j][1] -= n
        i += ra[i][1] == 0
        j += rb[j][1] == 0


def prefill_beside(prefill: PhasePlacement, decode: PhasePlacement) -> PhasePlacement:
    """The prefill placement the executor runs beside ``decode`` (FlexInfer section 5.3): a layer
    prefill would stream and decode keeps resident is resident in prefill too (``prefill`` itself
    when no layer is). Concrete placements (int run lengths) only."""
    if not any(a.streamed and b is RESIDENT for a, b, _ in segments(prefill, decode)):
        return prefill
    return PhasePlacement.merged(((RESIDENT if a.streamed and b is RESIDENT else a, n)
                                  for a, b, n in segments(prefill, decode)), prefill.head)


@dataclass(frozen=True)
class Placement:
    """A whole request: the placement of each phase it runs (both, for the executor; one, for a
    planner candidate), the dtypes, and the policy names (for messages only).

    FlexInfer section 5.3: when decode keeps a layer resident and prefill would stream it, the
    layer is resident during prefill too (its weights are not streamed and its KV cache is
    produced where decode reads it); :meth:`of` applies that rule."""

    phases: Mapping[str, PhasePlacement]
    dtype: str  # accelerator / pinned dtype (canonical name)
    cpu_dtype: str  # what the CPU stores and computes its layers in
    policies: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, phases: Mapping[str, PhasePlacement], dtype: str, cpu_dtype: str,
           policies: Mapping[str, str] | None = None) -> "Placement":
        phases = dict(phases)
        if "prefill" in phases and "decode" in phases:
            phases["prefill"] = prefill_beside(phases["prefill"], phases["decode"])
        return cls(MappingProxyType(phases), dtype, cpu_dtype, MappingProxyType(dict(policies or {})))

    def __hash__(self):
        return hash((tuple(self.phases.items()), self.dtype, self.cpu_dtype))

    def __eq__(self, other):
        return (isinstance(other, Placement) and dict(self.phases) == dict(other.phases)
                and (self.dtype, self.cpu_dtype) == (other.dtype, other.cpu_dtype)
                and dict(self.policies) == dict(other.policies))


    @property
    def num_layers(self) -> int:
        return int(next(iter(self.phases.values())).num_layers)

    @property
    def modes(self) -> Mapping[str, tuple[LayerMode, ...]]:
        return MappingProxyType({ph: pp.modes for ph, pp in self.phases.items()})

    # ---- questions the executor and the memory model ask ------------------------------
    @property
    def uses_accelerator(self) -> bool:
        return any(pp.uses_accelerator for pp in self.phases.values())

    @property
    def same_dtype(self) -> bool:
        return self.dtype == self.cpu_dtype

    def head_mode(self, phase: str) -> LayerMode:
        return self.phases[phase].head_mode

    def streamed(self, phase: str) -> list[int]:
        return [i for i, m in enumerate(self.phases[phase].modes) if m.streamed]

    def _raw_places(self, modes) -> frozenset[str]:
        raw = frozenset(m.weights for m in modes)
        if self.same_dtype and HOST in raw and PINNED in raw:
            raw = raw - {HOST}  # one pinned copy serves the CPU and the stream
        return raw

    def layer_places(self, i: int) -> frozenset[str]:
        """Where layer i's weights (and KV cache) are stored over the whole request."""
        return self._places_of_layers[i][0]

    @cached_property
    def _places_of_layers(self) -> tuple[tuple[frozenset[str], frozenset[str]], ...]:
        """(layer places, expert places) of every layer, computed once per distinct mode combination."""
        memo: dict[tuple, tuple[frozenset[str], frozenset[str]]] = {}
        out = []
        for modes in zip(*(pp.modes for pp in self.phases.values())):
            if modes not in memo:
                memo[modes] = (self._raw_places(modes),
                               self._raw_places([Where(_experts_weights(m), ON_CPU) for m in modes]))
            out.append(memo[modes])
        return tuple(out)

    def layer_place(self, i: int, phase: str) -> str:
        """Which of those places the layer computes from (streamed: the pinned home) in ``phase``."""
        p = self.phases[phase].modes[i].weights
        return PINNED if p == HOST and p not in self.layer_places(i) else p

    def expert_places(self, i: int) -> frozenset[str]:
        """Where layer i's routed experts are stored over the request (its ``mlp`` group: the
        layer's places unless a split mode puts them elsewhere)."""
        return self._places_of_layers[i][1]

    def expert_place(self, i: int, phase: str) -> str:
        """Which of :meth:`expert_places` layer i's routed experts compute from in ``phase``."""
        p = self.phases[phase].modes[i].groups()[EXPERT_GROUP].weights
        return PINNED if p == HOST and p not in self.expert_places(i) else p

    def unit_parts(self, i: int) -> dict[str, str]:
        """Place -> which part of layer i's weights it stores: "all", "rest" (all but the routed
        experts) or "experts" (executor.weights.GroupWeights)."""
        rest, exp = self.layer_places(i), self.expert_places(i)
        return {p: "all" if p in rest and p in exp else "rest" if p in rest else "experts" for p in rest | exp}

    def experts_on_cpu(self, i: int, phase: str) -> bool:
        """Whether layer i's routed experts compute on the CPU apart from the rest of the layer."""
        m = self.phases[phase].modes[i]
        return not m.on_cpu and m.groups()[EXPERT_GROUP].computes == ON_CPU

    def expert_census(self) -> dict[tuple[frozenset, frozenset], object]:
        """(places of a layer, places of its routed experts) -> how many layers, for the layers
        whose experts live apart from the rest in some phase (run lengths may be arrays when the
        placement has one phase)."""
        out: dict[tuple[frozenset, frozenset], object] = {}
        pps = list(self.phases.values())
        if not any(_experts_weights(m) != m.weights for pp in pps for m, _ in pp.runs):
            return out  # no split mode: the common case, answered without walking the layers
        if len(pps) == 1:
            for m, c in pps[0].runs:
                e = _experts_weights(m)
                if e != m.weights:
                    key = (frozenset({m.weights}), frozenset({e}))
                    out[key] = out.get(key, 0) + c
            return out
        for a, b, n in segments(pps[0], pps[1]):
            key = (frozenset(self._raw_places((a, b))),
                   frozenset(self._raw_places([Where(_experts_weights(m), ON_CPU) for m in (a, b)])))
            if key[0] != key[1]:
                out[key] = out.get(key, 0) + n
        return out

    def head_places(self) -> frozenset[str]:
        return frozenset(pp.head_mode.weights for pp in self.phases.values())

    def head_place(self, phase: str) -> str:
        return self.phases[phase].head_mode.weights

    def place_dtype(self, place: str) -> str:
        return self.cpu_dtype if place == HOST else self.dtype

    @property
    def cpu_weight_dtype(self) -> str:
        """What the CPU's packed linear weights are asked for in (spec.cpu_weight_dtype)."""

        return cpu_weight_dtype(self.dtype, self.cpu_dtype)

    def kv_host_pinned(self, i: int) -> bool:
        """A host KV copy in the CPU dtype is pinned when it crosses the link at the switch."""
        return ACCELERATOR in self.layer_places(i)

    def attention_on_cpu(self, phase: str) -> list[int]:
        """Layers of ``phase`` whose attention computes on the CPU beside their host KV cache."""
        return [i for i, m in enumerate(self.phases[phase].modes) if m.attention_on_cpu]

    @property
    def kv_streamed_layers(self) -> list[int]:
        """Layers whose KV cache is streamed into an accelerator slot in at least one phase."""
        return sorted({i for pp in self.phases.values() for i, m in enumerate(pp.modes) if m.streams_kv})

    @property
    def streamed_layers(self) -> list[int]:
        """Layers streamed in at least one phase."""
        return sorted({i for ph in self.phases for i in self.streamed(ph)})

    @cached_property
    def _census(self) -> dict[tuple[frozenset, bool], object]:
        return self.census()

    def census(self) -> dict[tuple[frozenset, bool], object]:
        """(places of a layer over the request, any phase streams it) -> how many layers; run
        lengths may be arrays when the placement has one phase."""
        out: dict[tuple[frozenset, bool], object] = {}
        if len(self.phases) == 1:
            for m, c in next(iter(self.phases.values())).runs:
                key = (frozenset({m.weights}), m.streamed)
                out[key] = out.get(key, 0) + c
            return out
        pps = list(self.phases.values())
        segs = [(frozenset(self._raw_places((a, b))), a.streamed or b.streamed, n)
                for a, b, n in segments(pps[0], pps[1])]
        for places, streamed, n in segs:
            out[(places, streamed)] = out.get((places, streamed), 0) + n
        return out

    def describe(self) -> str:
        return "; ".join(f"{ph} {self.policies.get(ph, '?')} ({pp.describe()})" for ph, pp in self.phases.items())
