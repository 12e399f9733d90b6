"""Bytes per weight of each operator group as a plan holds it: the plan's dtype, or the blocks a
GGUF file stores (``ModelSpec.stored_weights``: (group, format, parameters) triples) kept as they
are. Torch-free: the estimator and the memory model read it.

As ``flexplan.quant.gguf_model`` loads a file: a stored format a kernel reads
(``BlockFormat.native_kernel``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is held as its
blocks; any other (the float types F32 / F16 / BF16 of norms and small tensors, the types
dequantised at load) as float32; the embedding is dequantised for its row lookup and the routed
experts held in one fused tensor per layer too (no kernel runs them yet); a tied head runs on the
embedding's blocks, held beside it.
"""

from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType

from flexplan.quant.formats import BY_NAME

FLOAT32_BYTES = 4  # what a weight no kernel reads as blocks is held in (dequantised at load)
LAYER_GROUPS = ("attention", "norms", "mlp", "router", "experts", "shared_experts")  # ModelSpec.layer_group_params
DEQUANTISED_GROUPS = ("embedding", "experts")  # held in float32 whatever the file stores (see above)


def block_bytes_per_weight(format_name: str) -> float:
    """Bytes one weight of ``format_name`` takes as blocks a kernel reads (float32 where none does)."""
    f = BY_NAME.get(format_name)
    return f.bytes_per_weight if f is not None and f.native_kernel else float(FLOAT32_BYTES)


def held_bytes_per_weight(format_name: str, group: str) -> float:
    """Bytes one weight of operator ``group`` stored in ``format_name`` takes once loaded."""
    return float(FLOAT32_BYTES) if group in DEQUANTISED_GROUPS else block_bytes_per_weight(format_name)


Weights = tuple[tuple[str, str, int], ...]  # (operator group, format, parameters)


@lru_cache(maxsize=256)
def group_bytes_per_weight(weights: Weights) -> MappingProxyType:
    """{operator group: bytes per weight held}, each group's formats weighted by their parameters."""
    n: dict[str, int] = {}
    b: dict[str, float] = {}
    for group, fmt, params in weights:
        n[group] = n.get(group, 0) + params
        b[group] = b.get(group, 0.0) + params * held_bytes_per_weight(fmt, group)
    return MappingProxyType({g: b[g] / n[g] for g in n if n[g] > 0})  # kept: read-only


def layer_bytes_per_weight(weights: Weights) -> float:
    """Bytes per weight of the decoder layers, all their groups together."""
    n = sum(p for g, _, p in weights if g in LAYER_GROUPS)
    b = sum(p * held_bytes_per_weight(f, g) for g, f, p in weights if g in LAYER_GROUPS)
    return b / n if n else float(FLOAT32_BYTES)


def head_bytes_per_weight(weights: Weights) -> float:
    """Bytes per weight of the LM head: its own blocks, or the embedding's where the file has no
    head of its own (tied: the head runs on the embedding's blocks)."""
    group = "lm_head" if any(g == "lm_head" for g, _, _ in weights) else "embedding"
    n = sum(p for g, _, p in weights if g == group)
    b = sum(p * block_bytes_per_weight(f) for g, f, p in weights if g == group)
    return b / n if n else float(FLOAT32_BYTES)


# flexplan.load(folder, weights=...): what a float checkpoint's decoder and head linears are
# quantised to at load (flexplan.quant.at_load), as the GGUF block formats the kernels run
AT_LOAD = {"int4": "Q4_1", "int8": "Q8_0"}  # groups of 32: asymmetric int4 (scale, min), symmetric int8 (scale)
QUANTISED_GROUPS = ("attention", "mlp", "shared_experts")  # routers, norms, fused experts stay float32


def at_load_weights(spec, weights: str) -> Weights:
    """The (group, format, parameters) triples of ``spec`` quantised at load to ``weights``."""
    fmt = AT_LOAD[weights]
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
