"""Bytes per weight of each operator group as a plan holds it: the plan's dtype, or the blocks a
GGUF file stores (``ModelSpec.stored_weights``: (group, format, parameters) triples) kept as they
are. Torch-free: the estimator and the memory model read it.

As ``flexplan.quant.gguf_model`` loads a file: a stored format a kernel reads
(``BlockFormat.native_kernel``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is held as its
blocks; any other (the float types F32 / F16 / BF16 of norms and small tensors, the types
dequantised at load) as float32; the embedding is dequantised for its row lookup; routed experts
are held as their blocks too (``flexplan.quant.quant_experts``) where their format has a kernel; a
tied head runs on the embedding's blocks, held beside it.
"""

from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType

from flexplan.quant.formats import BY_NAME

FLOAT32_BYTES = 4  # what a weight no kernel reads as blocks is held in (dequantised at load)
LAYER_GROUPS = ("attention", "norms", "mlp", "router", "experts", "shared_experts")  # ModelSpec.layer_group_params
DEQUANTISED_GROUPS = ("embedding",)  # held in float32 whatever the file stores (see above)


def block_bytes_per_weight(format_name: str, float_bytes: float = FLOAT32_BYTES) -> float:
    """Bytes one weight of ``format_name`` takes as blocks a kernel reads (``float_bytes`` where
    none does: float32 on the CPU, the plan's dtype on the accelerator)."""
    f = BY_NAME.get(format_name)
    return f.bytes_per_weight if f is not None and f.native_kernel else float(float_bytes)


def held_bytes_per_weight(format_name: str, group: str, float_bytes: float = FLOAT32_BYTES) -> float:
    """Bytes one weight of operator ``group`` stored in ``format_name`` takes once loaded (a
    dequantised group: ``float_bytes``)."""
    return float(float_bytes) if group in DEQUANTISED_GROUPS else block_bytes_per_weight(format_name, float_bytes)


Weights = tuple[tuple[str, str, int], ...]  # (operator group, format, parameters)


@lru_cache(maxsize=256)
def group_bytes_per_weight(weights: Weights, float_bytes: float = FLOAT32_BYTES) -> MappingProxyType:
    """{operator group: bytes per weight held}, each group's formats weighted by their parameters
    (the float ones at ``float_bytes``)."""
    n: dict[str, int] = {}
    b: dict[str, float] = {}
    for group, fmt, params in weights:
        n[group] = n.get(group, 0) + params
        b[group] = b.get(group, 0.0) + params * held_bytes_per_weight(fmt, group, float_bytes)
    return MappingProxyType({g: b[g] / n[g] for g in n if n[g] > 0})  # kept: read-only


@lru_cache(maxsize=256)
def layer_bytes_per_weight(weights: Weights, float_bytes: float = FLOAT32_BYTES) -> float:
    """Bytes per weight of the decoder layers, all their groups together, the float ones at
    ``float_bytes`` (float32 on the CPU; the plan's dtype on the accelerator, where the executor
    keeps blocks and casts the rest)."""
    n = sum(p for g, _, p in weights if g in LAYER_GROUPS)
    b = sum(p * held_bytes_per_weight(f, g, float_bytes) for g, f, p in weights if g in LAYER_GROUPS)
    return b / n if n else float(float_bytes)


def head_group(weights: Weights) -> str:
    """The group the LM head reads: "lm_head", or "embedding" where the file has no head of its own."""
    return "lm_head" if any(g == "lm_head" for g, _, _ in weights) else "embedding"


def head_bytes_per_weight(weights: Weights, float_bytes: float = FLOAT32_BYTES) -> float:
    """Bytes per weight of the LM head: its own blocks, or the embedding's where the file has no
    head of its own (tied: the head runs on the embedding's blocks); a float head at ``float_bytes``."""
    group = head_group(weights)
    n = sum(p for g, _, p in weights if g == group)
    b = sum(p * block_bytes_per_weight(f, float_bytes) for g, f, p in weights if g == group)
    return b / n if n else float(float_bytes)


# flexplan.load(folder, weights=...): what a float checkpoint's decoder and head linears are
# quantised to at load (flexplan.quant.at_load), as the GGUF block formats the kernels run
AT_LOAD = {"int4": "Q4_1", "int8": "Q8_0"}  # groups of 32: asymmetric int4 (scale, min), symmetric int8 (scale)
QUANTISED_GROUPS = ("attention", "mlp", "experts", "shared_experts")  # routers and norms stay float32
# the block formats a kernel runs, by name: what a plan may price a float model's linears in
KERNEL_FORMATS = tuple(name for name, f in BY_NAME.items() if f.native_kernel)


def kernel_format(weights: str) -> str | None:
    """The block format ``weights`` names: "int4" / "int8" (AT_LOAD) or a kernel format's name in
    any case ("q4_k" -> "Q4_K"); None for anything else."""
    if weights in AT_LOAD:
        return AT_LOAD[weights]
    name = weights.upper() if isinstance(weights, str) else None
    return name if name in KERNEL_FORMATS else None


def experts_on_kernel_blocks(weights: Weights) -> bool:
    """Whether routed experts are held as blocks a kernel runs (flexplan.quant's QuantExperts, which
    the native decode layer reads): every "experts" entry of ``weights`` in a kernel format."""
    formats = {f for g, f, _ in weights if g == "experts"}
    return bool(formats) and formats <= set(KERNEL_FORMATS)


def at_load_weights(spec, weights: str) -> Weights:
    """The (group, format, parameters) triples of ``spec`` with its decoder and head linears in the
    block format ``weights`` names (:func:`kernel_format`: "int4", "int8", "Q4_K", ...)."""
    fmt = kernel_format(weights)
    if fmt is None:
        raise ValueError(f"{weights!r} names no block format a kernel runs ({', '.join(KERNEL_FORMATS)})")
    params: dict[str, int] = {}
    for i in range(spec.num_layers):
        for group, n in spec.layer_group_params(i).items():
            params[group] = params.get(group, 0) + int(n)
    out = [(g, fmt if g in QUANTISED_GROUPS else "F32", n) for g, n in sorted(params.items()) if n]
    out += [("embedding", "F32", int(spec.embedding_params)),
            ("lm_head", fmt, int(spec.vocab_size * (spec.word_embed_proj_dim or spec.hidden_size)))]
    return tuple(out)


def describe(weights: Weights) -> str:
    """"Q4_1 134.5 M, F32 0.1 M" : each format's parameters, the most first."""
    by_format: dict[str, int] = {}
    for _, fmt, params in weights:
        by_format[fmt] = by_format.get(fmt, 0) + params
    return ", ".join(f"{f} {p / 1e6:.1f} M" for f, p in sorted(by_format.items(), key=lambda x: -x[1]))
