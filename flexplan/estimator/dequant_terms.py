"""Park & Egger's D (section 4.2, Eq. 8): the accelerator dequantising a layer's GGUF blocks.

Weights held as blocks (a GGUF file's, or a float checkpoint's linears quantised at load) sit on
the accelerator and cross the link as blocks; each linear there turns its blocks into weights in the
plan's dtype with ``flexplan.quant.torch_dequant``'s plain torch ops right before its GEMM, every
call, in the compute stream. Those ops are not fused: each is one kernel launch and writes a tensor
the next one reads, so the bytes they move are the sum over the ops, far above the blocks read plus
the weights written that a fused kernel would move (Q4_0: 20.9 + 6 bytes a weight in bfloat16, not
0.56 + 2). Per matrix of p weights in format f:

    D = p (B_f + cast) / (BW_GPU x Eff_GPU,Mem(rows)) + (L_f + [cast]) x t_launch

with B_f, L_f the bytes a weight and the launches :data:`TORCH_DEQUANT_OPS` counts for f, ``cast``
the final float32 -> dtype copy (4 + dtype bytes a weight and one launch; none in float32) and
t_launch ``efficiency.GPU_KERNEL_LAUNCH_S``. Float weights (the embedding, routed experts, norms)
take none. The GEMM itself then reads the dequantised weights at the dtype (``PhaseWork.d_gpu``).
"""

from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType

from flexplan.estimator.efficiency import GPU_KERNEL_LAUNCH_S
from flexplan.workload import weight_formats

# flexplan/quant/torch_dequant.py's ops on one matrix, counted as written (view ops launch nothing):
# (kernel launches, bytes read + written a weight by all of them, in float32 before the final cast).
# tests/test_estimator_compressed.py recounts them under a torch dispatch mode, so the table follows the code.
TORCH_DEQUANT_OPS = MappingProxyType({
    "Q4_0": (9, 20.9375), "Q4_1": (10, 25.375), "Q5_0": (14, 29.0625), "Q5_1": (15, 33.5),
    "Q8_0": (4, 13.4375), "Q4_K": (26, 26.140625), "Q5_K": (31, 34.265625), "Q6_K": (16, 29.8671875),
})
FLOAT32_BYTES = 4  # torch_dequant computes in float32 and casts last


def cast_bytes_per_weight(w_bytes: float) -> tuple[float, int]:
    """(bytes a weight, launches) of torch_dequant's final cast to the plan's dtype: float32 -> a
    16-bit dtype reads 4 and writes 2 in one kernel; to float32 it is no copy at all."""
    return (0.0, 0) if w_bytes == FLOAT32_BYTES else (FLOAT32_BYTES + float(w_bytes), 1)


@lru_cache(maxsize=256)
def group_dequant(weights: weight_formats.Weights) -> MappingProxyType:
    """{operator group: (share of its parameters in blocks, bytes torch_dequant's ops move per weight
    in blocks before the cast, launches per matrix before the cast averaged over the group's matrices
    by parameters)}; every group as stored (the tied head reads "embedding"'s blocks)."""
    total: dict[str, float] = {}
    blocks: dict[str, float] = {}
    moved: dict[str, float] = {}
    launches: dict[str, float] = {}
    for group, fmt, p in weights:
        total[group] = total.get(group, 0.0) + p
        if fmt in TORCH_DEQUANT_OPS:
            n_launch, b = TORCH_DEQUANT_OPS[fmt]
            blocks[group] = blocks.get(group, 0.0) + p
            moved[group] = moved.get(group, 0.0) + p * b
            launches[group] = launches.get(group, 0.0) + p * n_launch
    return MappingProxyType({g: (blocks[g] / total[g], moved[g] / blocks[g], launches[g] / total[g])
                             for g in blocks if total[g] > 0 and blocks[g] > 0})


def t_gpu_dequant_s(weights: weight_formats.Weights, group: str, params: float, matrices: float, w_bytes: float,
                    bandwidth_bytes_per_s: float, eff_memory: float) -> float:
    """D of ``params`` weights in ``matrices`` matrices of ``group`` (module docstring); 0 for a
    group held in float."""
    held = group_dequant(weights).get(group) if weights else None
    if held is None:
        return 0.0
    share, moved, launches = held
    cast_b, cast_n = cast_bytes_per_weight(w_bytes)
    return (params * share * (moved + cast_b) / (bandwidth_bytes_per_s * eff_memory)
            + matrices * (launches + share * cast_n) * GPU_KERNEL_LAUNCH_S)


def _mlp_matrices(m, width: int) -> int:
    return (3 if m.gated_mlp else 2) if width else 0


@lru_cache(maxsize=256)
def layer_matrices(m) -> MappingProxyType:
    """{group: weight matrices of one decoder layer (mean over layers)} of the groups torch_dequant may
    run on: the attention projections (q, k, v, o as ``workload.operators`` lists them; MLA's low-rank
    ones), a dense layer's MLP, an MoE layer's router and shared expert. Routed experts stay float."""
    moe = sum(m.moe_layers) / m.num_layers
    attention = (2 if m.q_lora_rank else 1) + 3 if m.kv_lora_rank else 4  # MLA: q (q_a, q_b), kv_a, kv_b, o
    return MappingProxyType({
        "attention": attention,
        "mlp": (1 - moe) * _mlp_matrices(m, m.intermediate_size),
        "router": moe if m.num_experts else 0.0,
        "shared_experts": moe * _mlp_matrices(m, m.shared_expert_intermediate_size),
    })


def t_gpu_dequant_layer_s(weights: weight_formats.Weights, m, w_bytes: float, bandwidth_bytes_per_s: float,
                          eff_memory: float) -> float:
    """D of one decoder layer (mean over layers): every group it holds in blocks (0 without blocks)."""
    if not weights:
        return 0.0
    params: dict[str, float] = {}
    for group, _, p in weights:
        params[group] = params.get(group, 0.0) + p / m.num_layers
    return sum(t_gpu_dequant_s(weights, g, params.get(g, 0.0), n, w_bytes, bandwidth_bytes_per_s, eff_memory)
               for g, n in layer_matrices(m).items())


def t_gpu_dequant_head_s(weights: weight_formats.Weights, m, w_bytes: float, bandwidth_bytes_per_s: float,
                         eff_memory: float) -> float:
    """D of the LM head, one matrix: its own blocks, or the embedding's a tied head reads."""
    if not weights:
        return 0.0
    params = m.vocab_size * (m.word_embed_proj_dim or m.hidden_size)
    return t_gpu_dequant_s(weights, weight_formats.head_group(weights), params, 1, w_bytes,
                           bandwidth_bytes_per_s, eff_memory)
