"""Resolved hardware description consumed by the estimator and the planner.

Values are whole-machine figures in SI base units (bytes, bytes/s, FLOP/s). They come from
``hwdb/`` (datasheets, paper tables) or from introspection of the local machine; each
:class:`Hardware` carries ``notes`` that say which numbers were assumed rather than known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexplan.errors import InvalidInputError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
}


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16'; raises InvalidInputError for an unknown dtype."""

    try:
        return DTYPE_ALIASES[str(name).replace("torch.", "").lower()]
    except KeyError:
        raise InvalidInputError(
            f"unknown dtype {name!r}; use one of float32, bfloat16, float16"
        ) from None


def cpu_weight_dtype(dtype: str, cpu_dtype: str) -> str:
    """What the CPU holds its layers' linear weights (and a tied LM head) in, for a model whose
    weights are ``dtype`` and a CPU that computes in ``cpu_dtype``: a 16-bit ``dtype`` stays
    16-bit when the CPU computes in float32 (flexplan's blocked GEMV widens each weight as it
    reads it, exactly, so decode reads half the bytes and the host holds half); otherwise the
    CPU dtype. Norms, biases, activations and the KV cache are in ``cpu_dtype`` either way."""
    if cpu_dtype == "float32" and DTYPE_BYTES[dtype] == 2:
        return dtype
    return cpu_dtype


@dataclass(frozen=True)
class CPUSpec:
    """All sockets of the host CPU taken together."""

    name: str
    sockets: int
    cores: int  # physical cores usable by this process (all sockets)
    peak_flops_per_s: dict[str, float]  # keyed by canonical dtype, dense GEMM peak as it really is on this ISA
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    isa: frozenset[str] = frozenset()
    hwdb_id: str | None = None

    @property
    def compute_dtype(self) -> str:
        """The dtype the CPU is fast at: bf16 only with AMX or AVX-512 BF16 (or a hwdb peak
        for bf16 no lower than fp32), else fp32."""
        bf16 = self.peak_flops_per_s.get("bfloat16", 0.0)
        fp32 = self.peak_flops_per_s.get("float32", 0.0)
        if self.isa & {"amx_bf16", "avx512_bf16"} or bf16 >= fp32 > 0:
            return "bfloat16"
        return "float32"


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    peak_flops_per_s: dict[str, float]  # dense tensor-core peak per canonical dtype
    hwdb_id: str | None = None
    runtime_reserved_bytes: int = 1 << 30  # CUDA context + allocator slack, not usable by the plan


@dataclass(frozen=True)
class LinkSpec:
    """CPU-GPU interconnect, per direction."""

    name: str
    h2d_bandwidth_bytes_per_s: float
    d2h_bandwidth_bytes_per_s: float
    hwdb_id: str | None = None


@dataclass(frozen=True)
class Hardware:
    name: str
    cpu: CPUSpec
    gpu: GPUSpec | None = None
    link: LinkSpec | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)  # assumptions and fallbacks, said plainly

    @property
    def has_gpu(self) -> bool:
        return self.gpu is not None and self.link is not None
