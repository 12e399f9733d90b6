"""The planner's output: a frozen, serialisable :class:`Plan`.

A plan names one policy and its M (``gpu_layers``) per phase; what that means layer by layer
(where each operator group's weights live and where it computes) is the policy's placement
rule, ``flexplan.placement`` (read by estimator, planner, explain and executor alike); the plan
carries it (``placement``), built by the policies of the registry,
``flexplan.estimator.policies`` (``placement_of``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from flexplan.estimator.efficiency import FactorSource

if TYPE_CHECKING:  # pragma: no cover
    from flexplan.placement import Placement

PHASES = ("prefill", "decode")


def _num(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


@dataclass(frozen=True)
class Candidate:
    """One policy for one phase as the estimator sees it."""

    phase: str
    policy: str
    gpu_layers: int
    time_s: float  # TTFT (prefill) or mean TPOT over decode steps (decode); inf when infeasible
    gpu_memory_bytes: int
    cpu_memory_bytes: int
    pcie_bytes: float  # whole prefill, or mean per decode step
    feasible: bool
    reason: str = ""  # why not feasible, empty when feasible
    terms: Mapping[str, float] = field(default_factory=dict)  # time breakdown (s)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time_s"] = _num(self.time_s)
        d["terms"] = {k: _num(v) for k, v in self.terms.items()}
        return d


# ---- split points inside a streamed layer (estimator/policies/split_points.py) ---------------------
@dataclass(frozen=True)
class SplitPoints:
    """Where Park & Egger's split points cut each streamed layer of a phase: the CPU computes
    operators [0, i) and [j, n), the accelerator [i, j) (``points`` = (i, j); j = n: one split point).
    ``timeline``: one layer at the mean step, (operator, lane, start_s, end_s) with lanes ``cpu``,
    ``accelerator``, ``h2d``, ``d2h`` (predictions; NaN / empty in a plan fixed by hand)."""

    operators: tuple[str, ...]  # the layer's operators in call order (workload.operators)
    points: tuple[int, int]
    layer_s: float  # Eq. 5: one streamed layer
    cpu_s: float  # Eq. 6 (under the copy's slowdown, glue included)
    h2d_s: float  # Eq. 7 plus the activations sent to the accelerator
    timeline: tuple[tuple[str, str, float, float], ...] = ()
    candidates: int = 0  # Eq. 13: pairs searched

    def __post_init__(self):
        object.__setattr__(self, "operators", tuple(self.operators))
        object.__setattr__(self, "points", tuple(int(x) for x in self.points))
        object.__setattr__(self, "timeline",
                           tuple((str(a), str(b), float(c), float(d)) for a, b, c, d in self.timeline))
        i, j = self.points
        if not 1 <= i < j <= len(self.operators):
            raise ValueError(f"split points must satisfy 1 <= i < j <= {len(self.operators)}, got {self.points}")

    @property
    def on_cpu(self) -> tuple[str, ...]:
        i, j = self.points
        return self.operators[:i] + self.operators[j:]

    @property
    def on_accelerator(self) -> tuple[str, ...]:
        i, j = self.points
        return self.operators[i:j]

    def to_dict(self) -> dict[str, Any]:
        return {"operators": list(self.operators), "points": list(self.points), "layer_s": _num(self.layer_s),
                "cpu_s": _num(self.cpu_s), "h2d_s": _num(self.h2d_s), "candidates": self.candidates,
                "timeline": [{"operator": a, "lane": b, "start_s": c, "end_s": d} for a, b, c, d in self.timeline],
                # derived, for readers of `flexplan explain --json` (ignored by from_dict)
                "on_cpu": list(self.on_cpu), "on_accelerator": list(self.on_accelerator)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SplitPoints":
        nan = lambda x: math.nan if x is None else float(x)  # noqa: E731
        return cls(tuple(d["operators"]), tuple(d["points"]), nan(d.get("layer_s")), nan(d.get("cpu_s")),
                   nan(d.get("h2d_s")), tuple((e["operator"], e["lane"], e["start_s"], e["end_s"])
                                              for e in d.get("timeline", ())), int(d.get("candidates", 0)))


@dataclass(frozen=True)
class PhaseChoice:
    policy: str
    gpu_layers: int
    time_s: float
    gpu_memory_bytes: int
    cpu_memory_bytes: int
    pcie_bytes: float
    split_points: SplitPoints | None = None  # a split-points policy: where its layers are cut

    @classmethod
    def of(cls, c: Candidate, split_points: SplitPoints | None = None) -> "PhaseChoice":
        return cls(c.policy, c.gpu_layers, c.time_s, c.gpu_memory_bytes, c.cpu_memory_bytes, c.pcie_bytes,
                   split_points)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "placement"}
        d["split_points"] = self.split_points.to_dict() if self.split_points is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PhaseChoice":
        d = dict(d)
        if d.get("split_points") is not None:
            d["split_points"] = SplitPoints.from_dict(d["split_points"])
        return cls(**d)


# ---- the expert cache of a cpu-experts plan (flexplan.plan_expert_cache) -------------------------
@dataclass(frozen=True)
class ExpertCache:
    """The most-used routed experts of the layers whose experts compute on the CPU, kept on the
    accelerator as a cache: chosen from a routing profile (flexplan.routing_profile) and the memory
    the plan leaves in the accelerator budget; priced by flexplan.estimator.expert_cache."""

    experts: Mapping[int, tuple[int, ...]]  # MoE layer -> expert ids resident on the accelerator (ascending)
    hit_rate: Mapping[int, float]  # MoE layer -> predicted share of its (token, choice) pairs the cache serves
    accelerator_bytes: int  # what the cached experts occupy (accelerator dtype)
    saved_s: float  # predicted E2E below the same plan without the cache
    profile: str = ""  # the profile it was planned from (its model and prompts)

    def __post_init__(self):
        object.__setattr__(self, "experts", MappingProxyType(
            {int(k): tuple(sorted(int(e) for e in v)) for k, v in sorted(self.experts.items())}))
        object.__setattr__(self, "hit_rate", MappingProxyType({int(k): float(v) for k, v in sorted(self.hit_rate.items())}))

    @property
    def num_experts(self) -> int:
        return sum(len(v) for v in self.experts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"experts": {str(k): list(v) for k, v in self.experts.items()},
                "hit_rate": {str(k): v for k, v in self.hit_rate.items()},
                "accelerator_bytes": self.accelerator_bytes, "saved_s": self.saved_s, "profile": self.profile,
                # derived, for readers of `flexplan explain --json` (ignored by from_dict)
                "cached_per_layer": {str(k): len(v) for k, v in self.experts.items()},
                "mean_hit_rate": sum(self.hit_rate.values()) / len(self.hit_rate) if self.hit_rate else 0.0}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExpertCache":
        return cls({int(k): tuple(v) for k, v in d["experts"].items()}, {int(k): v for k, v in d["hit_rate"].items()},
                   int(d["accelerator_bytes"]), float(d["saved_s"]), str(d.get("profile", "")))


@dataclass(frozen=True)
class Plan:
    model: str
    hardware: str
    batch_size: int
    input_len: int
    output_len: int
    dtype: str  # weights/KV on the GPU and in pinned host buffers
    cpu_dtype: str  # what the CPU computes in (and stores its layers in)
    num_layers: int
    gpu_memory_bytes: int  # budget planned against
    cpu_memory_bytes: int
    prefill: PhaseChoice
    decode: PhaseChoice
    ttft_s: float
    tpot_s: float
    load_s: float  # initial loading of GPU-resident weights (included in E2E, as in the paper)
    switch_s: float  # moving KV/weights between the prefill and decode placements
    e2e_s: float
    reason: str
    candidates: tuple[Candidate, ...] = ()
    baselines: Mapping[str, float | None] = field(default_factory=dict)
    calibration: str = "defaults"  # the factors' source, for people (explain, last_stats print it)
    factors: FactorSource = FactorSource()  # ... as fields: which file, how old, whether state-probed
    notes: tuple[str, ...] = ()
    expert_cache: ExpertCache | None = None  # None: no routed expert cached on the accelerator
    # the weights the CPU holds as blocks, as priced: (operator group, format, parameters); (): the dtypes
    weights: tuple[tuple[str, str, int], ...] = ()
    # both phases' placement as the policies built it (not serialised: a plan read back from JSON
    # has None, and estimator.policies.placement_of builds it again from the policy names)
    placement: "Placement | None" = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "baselines", MappingProxyType(dict(self.baselines)))

    @property
    def phases(self) -> dict[str, PhaseChoice]:
        return {"prefill": self.prefill, "decode": self.decode}

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "placement"}
        d["prefill"] = self.prefill.to_dict()
        d["decode"] = self.decode.to_dict()
        d["candidates"] = [c.to_dict() for c in self.candidates]
        d["baselines"] = {k: _num(v) for k, v in self.baselines.items()}
        d["notes"] = list(self.notes)
        d["factors"] = asdict(self.factors)
        d["expert_cache"] = self.expert_cache.to_dict() if self.expert_cache is not None else None
        d["weights"] = [list(w) for w in self.weights]
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        d = dict(d)
        d["prefill"] = PhaseChoice.from_dict(d["prefill"])
        d["decode"] = PhaseChoice.from_dict(d["decode"])
        d["candidates"] = tuple(
            Candidate(**{**c, "time_s": math.inf if c["time_s"] is None else c["time_s"]}) for c in d.get("candidates", ())
        )
        d["notes"] = tuple(d.get("notes", ()))
        d["factors"] = FactorSource(**d["factors"]) if d.get("factors") else FactorSource()
        d["baselines"] = {k: (math.inf if v is None else v) for k, v in d.get("baselines", {}).items()}
        if d.get("expert_cache") is not None:
            d["expert_cache"] = ExpertCache.from_dict(d["expert_cache"])
        d["weights"] = tuple((str(g), str(f), int(n)) for g, f, n in d.get("weights", ()))
        return cls(**d)
