"""Where each layer's weights and KV cache live and compute, per phase, from a :class:`Plan`.

Convention (plan_types): a phase's M GPU layers are the LAST M decoder layers; the first N - M
are computed on the CPU (``cpu``, ``splitgen``) or streamed to the accelerator (``gpu-offload``,
``gpu-offload-partial``). A layer therefore runs in one of three modes per phase:

- ``cpu``: weights and KV in host memory in the CPU compute dtype, computed by the CPU;
- ``streamed``: weights and KV in pinned host memory in the accelerator dtype, copied into one
  of two accelerator double buffers before the layer computes there;
- ``resident``: weights and KV in accelerator memory.

FlexInfer section 5.3: when decode keeps a layer resident and prefill computes it on the
accelerator anyway (e.g. prefill gpu-offload, decode splitgen), the layer is resident during
prefill too, so its weights are not streamed and its KV cache is produced where decode reads it.

Storage places: ``host`` (pageable, CPU dtype), ``pinned`` (page-locked, accelerator dtype) and
``accelerator``. When the CPU computes in the accelerator dtype, one pinned copy serves both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from flexplan.errors import DeviceUnavailableError, DoesNotFitError, InvalidInputError
from flexplan.executor.link import ACCELERATOR, HOST_MEMORY, PINNED
from flexplan.hardware.spec import cpu_weight_dtype
from flexplan.plan_types import PHASES, POLICIES, Plan

CPU, STREAMED, RESIDENT = "cpu", "streamed", "resident"
MODES = (CPU, STREAMED, RESIDENT)
_PLACE_OF_MODE = {CPU: HOST_MEMORY, STREAMED: PINNED, RESIDENT: ACCELERATOR}
GiB = 1 << 30


def layer_modes(policy: str, num_layers: int, gpu_layers: int) -> tuple[str, ...]:
    """Per-layer modes of one phase under ``policy`` with M = ``gpu_layers`` (last M layers)."""
    n, m = num_layers, gpu_layers
    if policy not in POLICIES:
        raise InvalidInputError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    if not 0 <= m <= n:
        raise InvalidInputError(f"gpu_layers must be between 0 and {n} for a {n}-layer model, got {m}")
    if policy == "cpu":
        return (CPU,) * n
    if policy == "gpu":
        return (RESIDENT,) * n
    if policy == "gpu-offload":
        return (STREAMED,) * n
    host = CPU if policy == "splitgen" else STREAMED
    return (host,) * (n - m) + (RESIDENT,) * m


@dataclass(frozen=True)
class Placement:
    num_layers: int
    modes: Mapping[str, tuple[str, ...]]  # phase -> mode of each decoder layer
    dtype: str  # accelerator / pinned dtype (canonical name)
    cpu_dtype: str  # what the CPU stores and computes its layers in
    policies: Mapping[str, str]

    @classmethod
    def from_plan(cls, plan: Plan, num_layers: int) -> "Placement":
        if plan.num_layers != num_layers:
            raise InvalidInputError(
                f"the plan is for a {plan.num_layers}-layer model but this model has {num_layers} decoder layers; "
                f"plan for this model (flexplan.plan(model, ...)) or pass plan='auto'")
        modes = {ph: list(layer_modes(c.policy, num_layers, c.gpu_layers)) for ph, c in plan.phases.items()}
        for i in range(num_layers):  # FlexInfer 5.3: keep decode-resident layers resident during prefill
            if modes["decode"][i] == RESIDENT and modes["prefill"][i] == STREAMED:
                modes["prefill"][i] = RESIDENT
        return cls(num_layers, {ph: tuple(m) for ph, m in modes.items()}, plan.dtype, plan.cpu_dtype,
                   {ph: c.policy for ph, c in plan.phases.items()})

    # ---- questions the executor asks ----------------------------------------------------
    @property
    def uses_accelerator(self) -> bool:
        return any(m != CPU for ph in PHASES for m in self.modes[ph])

    @property
    def same_dtype(self) -> bool:
        return self.dtype == self.cpu_dtype

    def head_mode(self, phase: str) -> str:
        """Final norm + LM head sit with the last layer: on the accelerator whenever it computes there."""
        return CPU if self.modes[phase][-1] == CPU else RESIDENT

    def streamed(self, phase: str) -> list[int]:
        return [i for i, m in enumerate(self.modes[phase]) if m == STREAMED]

    def _raw_places(self, modes: list[str]) -> frozenset[str]:
        raw = {_PLACE_OF_MODE[m] for m in modes}
        if {HOST_MEMORY, PINNED} <= raw and self.same_dtype:
            raw.discard(HOST_MEMORY)  # one pinned copy serves the CPU and the stream
        return frozenset(raw)

    def layer_places(self, i: int) -> frozenset[str]:
        """Where layer i's weights (and KV cache) are stored over the whole request."""
        return self._raw_places([self.modes[ph][i] for ph in PHASES])

    def layer_place(self, i: int, phase: str) -> str:
        """Which of those places the layer computes from (streamed: the pinned home) in ``phase``."""
        p = _PLACE_OF_MODE[self.modes[phase][i]]
        return PINNED if p == HOST_MEMORY and p not in self.layer_places(i) else p

    def head_places(self) -> frozenset[str]:
        return frozenset(_PLACE_OF_MODE[self.head_mode(ph)] for ph in PHASES)

    def head_place(self, phase: str) -> str:
        return _PLACE_OF_MODE[self.head_mode(phase)]

    def place_dtype(self, place: str) -> str:
        return self.cpu_dtype if place == HOST_MEMORY else self.dtype

    @property
    def cpu_weight_dtype(self) -> str:
        """What the CPU's packed linear weights are asked for in (spec.cpu_weight_dtype)."""
        return cpu_weight_dtype(self.dtype, self.cpu_dtype)

    def kv_host_pinned(self, i: int) -> bool:
        """A host KV copy in the CPU dtype is pinned when it crosses the link at the switch."""
        return ACCELERATOR in self.layer_places(i)

    @property
    def streamed_layers(self) -> list[int]:
        """Layers streamed in at least one phase."""
        return sorted({i for ph in PHASES for i in self.streamed(ph)})

    def describe(self) -> str:
        def one(ph):
            modes = self.modes[ph]
            counts = {m: modes.count(m) for m in MODES if modes.count(m)}
            return f"{ph} {self.policies[ph]} (" + ", ".join(f"{v} {k}" for k, v in counts.items()) + ")"
        return "; ".join(one(ph) for ph in PHASES)


def require_accelerator(placement: Placement, has_accelerator: bool, cuda_built: bool) -> None:
    """A plan that computes anything on an accelerator needs one."""
    if placement.uses_accelerator and not has_accelerator:
        need = ", ".join(f"{ph} {placement.policies[ph]}" for ph in PHASES if placement.policies[ph] != "cpu")
        why = "torch was built without CUDA" if not cuda_built else "no CUDA device is visible"
        raise DeviceUnavailableError(
            f"the plan uses an accelerator ({need}) but {why}; use plan='auto' (plans for what exists), "
            "the 'cpu' policy for both phases, or accelerator='cpu' to run every path on the CPU stand-in")


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes the executor will allocate, by memory, each with its parts (name -> bytes)."""

    accelerator: Mapping[str, int]
    pinned: Mapping[str, int]
    host: Mapping[str, int]

    @property
    def accelerator_bytes(self) -> int:
        return int(sum(self.accelerator.values()))

    @property
    def pinned_bytes(self) -> int:
        return int(sum(self.pinned.values()))

    @property
    def host_bytes(self) -> int:
        return int(sum(self.host.values()))


def _gib(x: float) -> str:
    return f"{x / GiB:.3f} GiB" if x >= GiB / 100 else f"{x / (1 << 20):.2f} MiB"


def _parts(d: Mapping[str, int]) -> str:
    return " + ".join(f"{k} {_gib(v)}" for k, v in d.items() if v)


def check_fits(need: MemoryNeed, placement: Placement, accelerator_budget_bytes: int | None,
               pinned_budget_bytes: int | None, shape: str) -> None:
    """Refuse (before any allocation) a placement that exceeds the accelerator memory or the
    pinned-memory budget; the message gives the numbers and what would fit instead."""
    what = f"plan ({placement.describe()}) for {shape}"
    if accelerator_budget_bytes is not None and need.accelerator_bytes > accelerator_budget_bytes:
        raise DoesNotFitError(
            f"{what} needs {_gib(need.accelerator_bytes)} of accelerator memory ({_parts(need.accelerator)}) "
            f"but gpu_memory_bytes is {_gib(accelerator_budget_bytes)}; use fewer gpu_layers, a streaming "
            "policy (gpu-offload), a smaller batch or shorter sequences, or plan='auto'")
    if pinned_budget_bytes is not None and need.pinned_bytes > pinned_budget_bytes:
        raise DoesNotFitError(
            f"{what} needs {_gib(need.pinned_bytes)} of pinned host memory ({_parts(need.pinned)}) but "
            f"pinned_memory_budget_bytes is {_gib(pinned_budget_bytes)}; raise the budget, keep more layers "
            "resident (gpu_layers) or compute them on the CPU (splitgen, cpu), or use a smaller batch")


def memory_need(placement: Placement, weight_bytes, head_bytes, embed_bytes: int, kv_bytes=None) -> MemoryNeed:
    """Bytes the executor allocates for ``placement``. ``weight_bytes(i, place)`` and
    ``head_bytes(place)`` give flat-buffer sizes; ``kv_bytes(place)`` one layer's KV cache for the
    request's batch x (input + new tokens) in that place's dtype (None: weights only)."""
    acc = {"resident weights": 0, "head": 0, "weight double buffers": 0, "KV cache": 0, "KV double buffers": 0}
    pinned = {"streamed weights": 0, "KV cache": 0}
    host = {"CPU weights": embed_bytes, "KV cache": 0}
    for i in range(placement.num_layers):
        places = placement.layer_places(i)
        for place in places:
            w = weight_bytes(i, place)
            kv = kv_bytes(place) if kv_bytes is not None else 0
            if place == ACCELERATOR:
                acc["resident weights"] += w
                acc["KV cache"] += kv
            elif place == PINNED:
                pinned["streamed weights"] += w
                pinned["KV cache"] += kv
            else:
                host["CPU weights"] += w
                host["KV cache"] += kv if not placement.kv_host_pinned(i) else 0
                pinned["KV cache"] += kv if placement.kv_host_pinned(i) else 0
    for place in placement.head_places():
        if place == ACCELERATOR:
            acc["head"] += head_bytes(place)
        else:
            host["CPU weights"] += head_bytes(place)
    streamed = placement.streamed_layers
    if streamed:
        acc["weight double buffers"] = 2 * max(weight_bytes(i, PINNED) for i in streamed)
        acc["KV double buffers"] = 2 * (kv_bytes(ACCELERATOR) if kv_bytes is not None else 0)
    return MemoryNeed(acc, pinned, host)
