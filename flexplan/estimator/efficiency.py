"""Efficiency factors Eff_* (FlexInfer section 5.2): achieved / peak, per component.

The estimator asks an :class:`Efficiency` for each factor *with the shape of the operation*
(tokens per GEMM, KV length, transfer size), so a calibration can make them functions of
shape. :class:`DefaultEfficiency` answers with documented constants until the machine is
calibrated (``flexplan calibrate``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from flexplan.hardware.spec import Hardware


@dataclass(frozen=True)
class FactorSource:
    """Where a set of efficiency factors comes from, as fields a caller reads (``source``, the
    prose beside it, is for people: explain and last_stats print it)."""

    kind: str = "defaults"  # "defaults" (documented constants) | "calibration" (a file of this machine)
    path: str | None = None  # the calibration file
    mode: str | None = None  # its run: "full" | "quick" | "probe"
    written_at_s: float | None = None  # when the file was written (Unix time)
    state_probed: bool = False  # scaled to a memory-state probe taken when the plan was made
    state_note: str = ""  # what that scaling did ("" where none was asked for)

    def age_s(self, now_s: float | None = None) -> float | None:
        """Seconds since the calibration was written (None for the defaults)."""
        if self.written_at_s is None:
            return None
        return (time.time() if now_s is None else now_s) - self.written_at_s


class Efficiency(Protocol):
    source: str
    origin: FactorSource

    # CPU factors depend on the dtype the CPU computes in (PyTorch's bf16 GEMV path can be far
    # slower than its fp32 one on the same CPU, while bf16 GEMMs are faster): `dtype` is canonical.
    def cpu_compute(self, tokens: float, dtype: str) -> float: ...  # Eff_CPU,Comp for a GEMM with `tokens` rows
    def cpu_memory(self, tokens: float, dtype: str) -> float: ...  # Eff_CPU,Mem while streaming weights
    def cpu_attention(self, context_len, dtype: str): ...  # KV read rate factor
    def cpu_attention_for_layout(self, context_len, dtype: str, layout: tuple[int, int, int], batch=None): ...  # a
    # (query heads, KV heads, head dim) layout, where calibration measured it (else cpu_attention)
    def cpu_prefill_attention(self, tokens: float, dtype: str) -> float: ...  # the attention core of a prefill
    # layer (QK^T, softmax, AV over the causal pairs) on `tokens` rows; where not calibrated: cpu_compute
    def cpu_split_linear(self, tokens: float, dtype: str) -> float: ...  # split layers' CPU linear (dense
    # weights) time over the packed kernel's, by rows (1: as fast)
    def cpu_head_compute(self, tokens: float, dtype: str, tied: bool = False) -> float: ...  # the LM head
    # (hidden x vocab GEMV); tied: the embedding's weight, which a 16-bit CPU reads with another kernel
    def cpu_head_memory(self, tokens: float, dtype: str, tied: bool = False) -> float: ...
    def cpu_expert_factors(self, tokens: float, dtype: str): ...  # (Eff_comp, Eff_mem) of the CPU routed-
    # expert path at `tokens` rows per expert, fixed per-expert costs included; None: not calibrated
    def cpu_block_formats(self) -> frozenset[str]: ...  # the GGUF formats whose block kernels were calibrated
    def cpu_block_compute(self, tokens: float, block_format: str) -> float: ...  # the block kernels (quant_gemv.c)
    # on `block_format`'s blocks, float32 activations quantised per block: Eff_comp against the CPU's float32
    # peak, Eff_mem on the blocks' bytes; read through cpu_block_factors (a format not calibrated: float32's)
    def cpu_block_memory(self, tokens: float, block_format: str) -> float: ...
    def gpu_compute(self, tokens: float) -> float: ...
    def gpu_memory(self, tokens: float) -> float: ...
    def h2d(self, transfer_bytes: float) -> float: ...  # Eff_ICN host -> device
    def d2h(self, transfer_bytes: float) -> float: ...  # Eff_ICN device -> host
    def cpu_under_copy(self, tokens: float | None = None) -> float: ...  # CPU slowdown factor (>= 1) while an
    # H2D copy runs, for GEMMs of `tokens` rows (memory-bound GEMVs slow more than compute-bound GEMMs);
    # None: the prefill GEMM's
    def cpu_threads(self) -> int | None: ...  # best thread count found by calibration, None = all cores
    def cpu_layer_overhead_s(self, tokens: float = 1, dtype: str | None = None,
                             layer_bytes: float | None = None) -> float: ...  # cost of one decoder layer on the
    # CPU beyond its GEMMs and KV reads (Python, dispatch, norms, rotary), by tokens per GEMM and layer size
    def cpu_step_overhead_s(self, batch: int = 1, vocab: int = 0) -> float: ...  # generate() loop per step,
    # outside the layers (host side): logits upcast, processors, argmax, stopping criteria
    def cpu_stack_overhead_s(self, batch: int = 1, vocab: int = 0,
                             dtype: str | None = None) -> tuple[float, float] | None: ...  # a decode step whose
    # layers the executor's native stack runs in one call (ModelSpec.native_decode_stack): (seconds per layer
    # beyond its GEMVs and KV reads, seconds per step outside the layers); None: not calibrated
    def gpu_layer_overhead_s(self) -> float: ...  # ... on the GPU (kernel launches of one layer)


# Defaults per CPU compute path. Sources: FlexInfer section 3.2 reports, for OPT-66B with input
# 128 and batch 1, SPR (AMX) TTFT 39% below FlexGen-on-H100 and ICL (AVX-512) TTFT 2x above;
# with FlexGen's prefill bound by streaming ~130 GB over PCIe 5 at ~50 GB/s, that puts achieved
# CPU GEMM throughput near 10 TFLOP/s on 2x 6454S (0.07 of 144.2) and near 3 TFLOP/s on
# 2x 8352Y (0.35 of 9.0). Their TPOT (SPR 63-70% below FlexGen) implies ~40% of the STREAM
# bandwidth of Table 3 for decode. AVX2 numbers are typical oneDNN fp32 results (calibrate!).
CPU_DEFAULTS = {
    "amx": dict(compute=0.07, memory=0.40),
    "avx512": dict(compute=0.35, memory=0.45),
    "avx2": dict(compute=0.60, memory=0.60),
}
GPU_COMPUTE_DEFAULT = 0.60  # large bf16 GEMMs on A100/H100 with PyTorch reach 60-75% of dense peak
GPU_MEMORY_DEFAULT = 0.80  # of STREAM/datasheet bandwidth
ICN_DEFAULT = 0.80  # pinned cudaMemcpyAsync typically reaches 75-90% of the PCIe per-direction rate
# Not in the paper (its layers are large enough to ignore it): eager PyTorch runs ~15-20 ops per
# decoder layer; at ~10 us each on the CPU and ~5 us per kernel launch on the GPU.
GPU_KERNEL_LAUNCH_S = 5e-6  # one kernel launch on the GPU (also prices the dequantisation's: dequant_terms)
CPU_LAYER_OVERHEAD_DEFAULT_S = 150e-6
GPU_LAYER_OVERHEAD_DEFAULT_S = 20 * GPU_KERNEL_LAUNCH_S  # ~20 ops a layer
STEP_OVERHEAD_DEFAULT_S = 1e-3  # transformers generate(): logits processors, stopping criteria, cache bookkeeping


def cpu_path(hw: Hardware) -> str:
    isa = hw.cpu.isa
    if "amx_bf16" in isa:
        return "amx"
    if "avx512f" in isa:
        return "avx512"
    if not isa:  # hwdb entry without flags: infer from the dtype peaks
        return "amx" if hw.cpu.compute_dtype == "bfloat16" else "avx2"
    return "avx2"


@dataclass(frozen=True)
class DefaultEfficiency:
    """Constant factors; see CPU_DEFAULTS for where the CPU numbers come from."""

    cpu_compute_eff: float
    cpu_memory_eff: float
    gpu_compute_eff: float = GPU_COMPUTE_DEFAULT
    gpu_memory_eff: float = GPU_MEMORY_DEFAULT
    icn_eff: float = ICN_DEFAULT
    cpu_overhead_s: float = CPU_LAYER_OVERHEAD_DEFAULT_S
    gpu_overhead_s: float = GPU_LAYER_OVERHEAD_DEFAULT_S
    source: str = "defaults"
    origin: FactorSource = FactorSource()

    @classmethod
    def for_hardware(cls, hw: Hardware) -> "DefaultEfficiency":
        d = CPU_DEFAULTS[cpu_path(hw)]
        return cls(cpu_compute_eff=d["compute"], cpu_memory_eff=d["memory"],
                   source=f"defaults ({cpu_path(hw)} CPU; not calibrated)")

    def cpu_compute(self, tokens, dtype=None):
        return self.cpu_compute_eff

    def cpu_memory(self, tokens, dtype=None):
        return self.cpu_memory_eff

    def cpu_attention(self, context_len, dtype=None):
        return self.cpu_memory_eff

    def cpu_attention_for_layout(self, context_len, dtype=None, layout=None, batch=None):
        return self.cpu_attention(context_len, dtype)

    def cpu_prefill_attention(self, tokens, dtype=None):
        return self.cpu_compute_eff

    def cpu_split_linear(self, tokens, dtype=None):
        return 1.0

    def cpu_head_compute(self, tokens, dtype=None, tied=False):
        return self.cpu_compute_eff

    def cpu_head_memory(self, tokens, dtype=None, tied=False):
        return self.cpu_memory_eff

    def cpu_expert_factors(self, tokens, dtype=None):
        return None  # not measured: expert_terms prices the experts as GEMMs plus a layer overhead

    def cpu_block_formats(self):
        return frozenset()  # none calibrated: blocks are priced at the float factors

    def cpu_block_compute(self, tokens, block_format=None):
        return self.cpu_compute_eff

    def cpu_block_memory(self, tokens, block_format=None):
        return self.cpu_memory_eff

    def gpu_compute(self, tokens):
        return self.gpu_compute_eff

    def gpu_memory(self, tokens):
        return self.gpu_memory_eff

    def h2d(self, transfer_bytes):
        return self.icn_eff

    def d2h(self, transfer_bytes):
        return self.icn_eff

    def cpu_under_copy(self, tokens=None):
        return 1.0

    def cpu_threads(self):
        return None

    def cpu_layer_overhead_s(self, tokens=1, dtype=None, layer_bytes=None):
        return self.cpu_overhead_s

    def cpu_step_overhead_s(self, batch=1, vocab=0):
        return STEP_OVERHEAD_DEFAULT_S

    def cpu_stack_overhead_s(self, batch=1, vocab=0, dtype=None):
        return None  # no default: uncalibrated, the native stack is priced as the layer calls

    def gpu_layer_overhead_s(self):
        return self.gpu_overhead_s


# The classes of time terms that a run can tell apart (what the memory state of now and the online
# correction scale). Each Efficiency method belongs to one; a scale is a TIME multiplier for its class.
TERM_CLASSES = ("cpu_memory", "cpu_compute", "overhead", "link", "accelerator")


@dataclass(frozen=True)
class ScaledEfficiency:
    """``base`` with the time of each term class multiplied by ``scales[class]`` (1 where absent):
    factors are divided by it, fixed overheads multiplied. One wrapper for every reason to scale
    a calibration (the machine's memory state now, corrections learned from runs); ``note`` is
    appended to ``source`` so explain and last_stats say which scaling was used."""

    base: Efficiency
    scales: dict
    note: str = ""
    state: bool = False  # a scaling to the memory state of now (memory_state): origin.state_note says so
    probed: bool = False  # ... read from a probe taken now (not: the probe off, failed or not comparable)

    def __post_init__(self):
        bad = {k: v for k, v in self.scales.items() if k not in TERM_CLASSES or not (np.isfinite(v) and v > 0)}
        if bad:
            raise ValueError(f"term scales must be positive and finite, for classes {TERM_CLASSES}; got {bad}")

    @property
    def source(self) -> str:
        return "; ".join(x for x in (self.base.source, self.note) if x)

    @property
    def origin(self) -> FactorSource:
        base = self.base.origin
        return replace(base, state_probed=self.probed, state_note=self.note) if self.state else base

    def scale(self, term_class: str) -> float:
        return float(self.scales.get(term_class, 1.0))

    def cpu_compute(self, tokens, dtype=None):
        return self.base.cpu_compute(tokens, dtype) / self.scale("cpu_compute")

    def cpu_head_compute(self, tokens, dtype=None, tied=False):
        return self.base.cpu_head_compute(tokens, dtype, tied) / self.scale("cpu_compute")

    def cpu_prefill_attention(self, tokens, dtype=None):
        return cpu_prefill_attention(self.base, tokens, dtype) / self.scale("cpu_compute")

    def cpu_memory(self, tokens, dtype=None):
        return self.base.cpu_memory(tokens, dtype) / self.scale("cpu_memory")

    def cpu_attention(self, context_len, dtype=None):
        return self.base.cpu_attention(context_len, dtype) / self.scale("cpu_memory")

    def cpu_attention_for_layout(self, context_len, dtype=None, layout=None, batch=None):
        return cpu_attention_for_layout(self.base, context_len, dtype, layout, batch) / self.scale("cpu_memory")

    def cpu_head_memory(self, tokens, dtype=None, tied=False):
        return self.base.cpu_head_memory(tokens, dtype, tied) / self.scale("cpu_memory")

    def cpu_expert_factors(self, tokens, dtype=None):
        f = self.base.cpu_expert_factors(tokens, dtype) if hasattr(self.base, "cpu_expert_factors") else None
        return None if f is None else (f[0] / self.scale("cpu_compute"), f[1] / self.scale("cpu_memory"))

    def cpu_block_formats(self):
        return block_formats(self.base)

    def cpu_block_compute(self, tokens, block_format=None):
        return self.base.cpu_block_compute(tokens, block_format) / self.scale("cpu_compute")

    def cpu_block_memory(self, tokens, block_format=None):
        return self.base.cpu_block_memory(tokens, block_format) / self.scale("cpu_memory")

    def gpu_compute(self, tokens):
        return self.base.gpu_compute(tokens) / self.scale("accelerator")

    def gpu_memory(self, tokens):
        return self.base.gpu_memory(tokens) / self.scale("accelerator")

    def h2d(self, transfer_bytes):
        return self.base.h2d(transfer_bytes) / self.scale("link")

    def d2h(self, transfer_bytes):
        return self.base.d2h(transfer_bytes) / self.scale("link")

    def cpu_under_copy(self, tokens=None):
        return self.base.cpu_under_copy(tokens)

    def cpu_threads(self):
        return self.base.cpu_threads()

    def cpu_layer_overhead_s(self, tokens=1, dtype=None, layer_bytes=None):
        return self.base.cpu_layer_overhead_s(tokens, dtype, layer_bytes) * self.scale("overhead")

    def cpu_step_overhead_s(self, batch=1, vocab=0):
        return self.base.cpu_step_overhead_s(batch, vocab) * self.scale("overhead")

    def cpu_stack_overhead_s(self, batch=1, vocab=0, dtype=None):
        got = self.base.cpu_stack_overhead_s(batch, vocab, dtype)
        return None if got is None else tuple(t * self.scale("overhead") for t in got)

    def gpu_layer_overhead_s(self):
        return self.base.gpu_layer_overhead_s() * self.scale("overhead")

    def __getattr__(self, name):  # describe_factors() and the like of the calibrated base
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)


# Rows per GEMM up to which the memory state of now scales the weight-streaming time: decode's
# (the calibration's GEMV rows reach 16). A prefill's GEMMs keep their calibrated factor: they
# stream their weights while they compute, so the memory state moves them little.
STATE_SCALED_TOKENS_MAX = 16


# A probe's spread within one memory state where the calibration holds too few samples to measure
# it (factors.memory_state.probe_band measures it per machine): readings this close to the
# calibration's are the same state
UNMEASURED_PROBE_BAND = 0.06


@dataclass(frozen=True)
class StateScaledEfficiency(ScaledEfficiency):
    """The memory state of now applied to a calibration (``flexplan.measure.state.at_state_now``),
    to decode's weight streaming (GEMMs of at most :data:`STATE_SCALED_TOKENS_MAX` rows), the KV
    cache's reads and the LM head; a prefill's GEMMs keep their calibrated factor.
    Faster now (a ``cpu_memory`` scale below 1): every such factor divided by the scale (streaming
    time follows the bandwidth the probe shows). Slower now (above 1): each op streams at most at
    the state's bandwidth and at least as fast as it did at calibration, ``min(own factor, best /
    scale)`` with ``best`` the calibration's best weight-streaming factor of that dtype
    (``stream_best``): an op held below the stream's best by something else (its size, its
    latencies) is slowed only where the state's bandwidth falls below its own rate (the roofline).
    Either way, the time of these terms is then multiplied by ``state_change(scale) **
    learned_elasticity`` (the ratio beyond the probe's own spread, ``band``): how
    much more (or less) than the probe's ratio this machine's runs moved with the state, which the
    online correction measures on this machine's runs (``flexplan.factors.correction``; 0 until runs
    in different states taught it)."""

    stream_best: dict = field(default_factory=dict)  # CPU dtype (None: the default) -> best cpu_memory factor at calibration
    # learned from runs (flexplan.factors.correction): these terms' time further times state_change(scale) ** this
    learned_elasticity: float = 0.0
    # the memory probe's own spread within a state on the calibrated machine (factors.memory_state.probe_band)
    band: float = UNMEASURED_PROBE_BAND

    def _at_state(self, factor, dtype, best=None):
        s = self.scale("cpu_memory")
        best = self.stream_best.get(dtype) if best is None else best
        if s <= 1.0 or best is None:
            at = factor / s
        else:
            at = np.minimum(factor, best / s)
        return at / state_change(s, self.band) ** self.learned_elasticity if self.learned_elasticity else at

    def cpu_memory(self, tokens, dtype=None):
        f = self.base.cpu_memory(tokens, dtype)
        return np.where(np.asarray(tokens) <= STATE_SCALED_TOKENS_MAX, self._at_state(f, dtype), f)

    def cpu_attention(self, context_len, dtype=None):
        return self._at_state(self.base.cpu_attention(context_len, dtype), dtype)

    def cpu_attention_for_layout(self, context_len, dtype=None, layout=None, batch=None):
        return self._at_state(cpu_attention_for_layout(self.base, context_len, dtype, layout, batch), dtype)

    def cpu_head_memory(self, tokens, dtype=None, tied=False):
        return self._at_state(self.base.cpu_head_memory(tokens, dtype, tied), dtype)

    def cpu_expert_factors(self, tokens, dtype=None):
        f = self.base.cpu_expert_factors(tokens, dtype) if hasattr(self.base, "cpu_expert_factors") else None
        return None if f is None else (f[0] / self.scale("cpu_compute"), self._at_state(f[1], dtype))

    def cpu_block_memory(self, tokens, block_format=None):
        """A block kernel's decode GEMV at the state of now as the float GEMV's, its roofline the
        machine's best weight-streaming factor at calibration (of any CPU dtype): a kernel that
        streams below it (its arithmetic holds it) slows only where the state's bandwidth falls
        below its own rate."""
        f = self.base.cpu_block_memory(tokens, block_format)
        best = max(self.stream_best.values(), default=None)
        return np.where(np.asarray(tokens) <= STATE_SCALED_TOKENS_MAX, self._at_state(f, None, best), f)


def state_change(scale: float, band: float) -> float:
    """The part of a memory-state ``scale`` (time multiplier) beyond the probe's own ``band``
    either way: ``scale / (1 +- band)`` outside it, 1 within (continuous at its edges). The learned
    elasticity acts on this part only: learning from the probe's noise within a state (which decode
    does not follow) would drive the elasticity negative and price the next real change short."""
    if scale > 1.0 + band:
        return scale / (1.0 + band)
    if scale < 1.0 - band:
        return scale / (1.0 - band)
    return 1.0


def with_learned_elasticity(eff: Efficiency, elasticity: float) -> Efficiency:
    """``eff`` with the :class:`StateScaledEfficiency` in its chain of wrappers given
    ``learned_elasticity`` (``eff`` itself where the chain has none: no state scaling to adjust)."""
    if isinstance(eff, StateScaledEfficiency):
        return replace(eff, learned_elasticity=float(elasticity))
    if isinstance(eff, ScaledEfficiency):
        inner = with_learned_elasticity(eff.base, elasticity)
        return eff if inner is eff.base else replace(eff, base=inner)
    return eff


def unwrapped(eff: Efficiency) -> Efficiency:
    """The factors under every :class:`ScaledEfficiency` (memory state, corrections) of ``eff``."""
    while isinstance(eff, ScaledEfficiency):
        eff = eff.base
    return eff


def cpu_attention_for_layout(eff: Efficiency, context_len, dtype: str | None, layout: tuple[int, int, int] | None,
                             batch=None):
    """Eff_attn of ``eff`` for a head layout (and decode batch, where measured per batch), from an
    Efficiency that may not know layouts."""
    per_layout = getattr(type(eff), "cpu_attention_for_layout", None)
    if per_layout is None or layout is None:
        return eff.cpu_attention(context_len, dtype)
    return eff.cpu_attention_for_layout(context_len, dtype, layout, batch)


def cpu_prefill_attention(eff: Efficiency, tokens, dtype: str | None):
    """Eff of the attention core of a CPU prefill layer, from an Efficiency that may not have
    measured it apart (then the GEMMs' factor at those tokens, as before it was priced apart)."""
    own = getattr(eff, "cpu_prefill_attention", None)  # (wrappers forward it by __getattr__)
    return own(tokens, dtype) if own is not None else eff.cpu_compute(tokens, dtype)


def cpu_split_linear(eff: Efficiency, tokens, dtype: str | None) -> float:
    """How much longer a split-points layer's CPU linear takes than the packed kernel, from an
    Efficiency that may not have measured it (then 1: priced as the packed kernel)."""
    own = getattr(eff, "cpu_split_linear", None)  # (wrappers forward it by __getattr__)
    return float(own(tokens, dtype)) if own is not None else 1.0


def block_formats(eff: Efficiency) -> frozenset[str]:
    """The GGUF formats whose block kernels ``eff`` was calibrated on (none for an Efficiency that
    does not know block formats)."""
    own = getattr(eff, "cpu_block_formats", None)  # (wrappers forward it)
    return frozenset(own()) if own is not None else frozenset()


def cpu_block_factors(eff: Efficiency, tokens, block_format: str, dtype: str | None):
    """(Eff_comp, Eff_mem) of the block kernels on ``block_format``'s blocks at ``tokens`` rows,
    where ``eff`` was calibrated on that format; else the float GEMV/GEMM factors of ``dtype`` (the
    CPU's compute dtype: float32 for a GGUF file's layers), as blocks were priced before they were
    timed per format."""
    if block_format not in block_formats(eff):
        return eff.cpu_compute(tokens, dtype), eff.cpu_memory(tokens, dtype)
    return eff.cpu_block_compute(tokens, block_format), eff.cpu_block_memory(tokens, block_format)
