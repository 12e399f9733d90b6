"""A routing profile: per MoE layer, how often its router picked each routed expert on a few
prompts: the expert cache of the ``cpu-experts`` policy is sized and priced from it
(``flexplan.plan_expert_cache``, ``flexplan.estimator.expert_cache``).

Taken by running the model on the prompts with a forward pre-hook on each MoE layer's routed
experts module (``executor.cpu_experts.find_routed_experts``: transformers 5's fused-experts
module, called with the router's output ``experts(hidden, top_k_index, top_k_weights)``), so the
counts are the router's own choices, whatever the family (Mixtral, Qwen-MoE, DeepSeek, gpt-oss).
Prompts run one at a time, unpadded: no padding row is counted.

Saved as a small JSON file, written atomically, with a format name and version; :func:`load`
refuses a corrupt file, another version, or (``check``) a profile of a model of another shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from flexplan.atomic_file import write_text_atomic
from flexplan.errors import InvalidInputError, MalformedDataError

FORMAT = "flexplan-routing-profile"
VERSION = 1


@dataclass(frozen=True)
class RoutingProfile:
    """``counts[layer][e]``: how many tokens picked expert e in that MoE layer; ``tokens[layer]``:
    how many tokens that layer routed (each picks ``experts_per_token`` experts)."""

    model: str
    num_layers: int
    num_experts: int
    experts_per_token: int
    counts: Mapping[int, tuple[int, ...]]
    tokens: Mapping[int, int]
    prompts: int = 0

    def __post_init__(self):
        object.__setattr__(self, "counts", MappingProxyType({int(k): tuple(int(x) for x in v)
                                                            for k, v in sorted(self.counts.items())}))
        object.__setattr__(self, "tokens", MappingProxyType({int(k): int(v) for k, v in sorted(self.tokens.items())}))
        self._validate()

    def _validate(self) -> None:
        bad = MalformedDataError
        if self.num_layers <= 0 or self.num_experts <= 0 or not 0 < self.experts_per_token <= self.num_experts:
            raise bad(f"routing profile of {self.model!r}: {self.num_layers} layers, {self.num_experts} experts, "
                      f"{self.experts_per_token} per token is not a MoE model's shape")
        if set(self.counts) != set(self.tokens) or not self.counts:
            raise bad(f"routing profile of {self.model!r}: counts and tokens must name the same, non-empty set of layers")
        for layer, c in self.counts.items():
            if not 0 <= layer < self.num_layers:
                raise bad(f"routing profile of {self.model!r}: layer {layer} outside 0..{self.num_layers - 1}")
            if len(c) != self.num_experts:
                raise bad(f"routing profile of {self.model!r}: layer {layer} has {len(c)} expert counts, "
                          f"expected {self.num_experts}")
            t = self.tokens[layer]
            if t <= 0 or min(c) < 0 or max(c) > t or sum(c) > t * self.experts_per_token:
                raise bad(f"routing profile of {self.model!r}: layer {layer}'s counts do not fit its {t} tokens "
                          f"x {self.experts_per_token} choices")

    def selection_probability(self, layer: int) -> np.ndarray:
        """q_e: the fraction of tokens that picked expert e in ``layer`` (sums to k at most)."""
        return np.asarray(self.counts[layer], float) / self.tokens[layer]

    def check(self, spec) -> None:
        """Raise :class:`InvalidInputError` unless this profile is of a model shaped as ``spec``
        (a ModelSpec): same layers, experts, experts per token and MoE layers."""
        moe = {i for i, x in enumerate(spec.moe_layers) if x}
        theirs = (spec.num_layers, spec.num_experts, spec.experts_per_token)
        ours = (self.num_layers, self.num_experts, self.experts_per_token)
        if ours != theirs or set(self.counts) != moe:
            raise InvalidInputError(
                f"the routing profile is of {self.model!r} ({ours[0]} layers, {ours[1]} experts, {ours[2]} per token, "
                f"MoE layers {sorted(self.counts)}) but {spec.name} has {theirs[0]} layers, {theirs[1]} experts, "
                f"{theirs[2]} per token, MoE layers {sorted(moe)}; take one on this model with `flexplan profile-experts`")

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "experts_per_token": self.experts_per_token, "prompts": self.prompts,
                "tokens": {str(k): v for k, v in self.tokens.items()},
                "counts": {str(k): list(v) for k, v in self.counts.items()}}

    @classmethod
    def from_dict(cls, d: Any, source: str = "routing profile") -> "RoutingProfile":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise MalformedDataError(f"{source} is not a flexplan routing profile (no \"format\": \"{FORMAT}\")")
        if d.get("version") != VERSION:
            raise MalformedDataError(f"{source} is routing-profile version {d.get('version')!r}; this flexplan reads "
                                     f"version {VERSION}: take it again with `flexplan profile-experts`")
        try:
            return cls(str(d["model"]), int(d["num_layers"]), int(d["num_experts"]), int(d["experts_per_token"]),
                       {int(k): v for k, v in d["counts"].items()}, {int(k): v for k, v in d["tokens"].items()},
                       int(d.get("prompts", 0)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise MalformedDataError(f"{source} is malformed ({type(e).__name__}: {e}); take it again with "
                                     "`flexplan profile-experts`") from None


def save(profile: RoutingProfile, path) -> Path:
    """Write ``profile`` to ``path`` atomically (``flexplan.atomic_file``)."""
    return write_text_atomic(path, json.dumps(profile.to_dict()))


def load(path, spec=None) -> RoutingProfile:
    """Read a profile written by :func:`save`; with ``spec`` (a ModelSpec), check it is of that model."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidInputError(f"cannot read routing profile {path}: {e.strerror or e}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedDataError(f"routing profile {path} is not valid JSON ({e.msg} at line {e.lineno}); "
                                 "take it again with `flexplan profile-experts`") from None
    profile = RoutingProfile.from_dict(d, f"routing profile {path}")
    if spec is not None:
        profile.check(spec)
    return profile
